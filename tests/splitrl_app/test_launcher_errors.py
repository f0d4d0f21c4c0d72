"""`splitrl up` puts mistakes on the console early: bad data before any service starts, a
service that exits with its last error lines, error log lines as they are written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from splitrl.config import load_config
from splitrl.v1 import trainer_pb2
from splitrl_app.launch import console, demo, preflight, up
from splitrl_app.launch.service_logs import LogFollower, error_lines


def config(arith_model, run_dir, *overrides):
    return load_config(demo.demo_config_path(), [
        f"model.path={arith_model}", f"trainer.run_dir={run_dir}", *overrides])


def jsonl(*entries):
    return "".join(json.dumps(e) + "\n" for e in entries)


def test_error_lines_are_the_logs_errors_and_tracebacks(tmp_path):
    log = tmp_path / "trainer.log"
    log.write_text(jsonl({"level": "info", "msg": "step"},
                         {"level": "error", "msg": "reward function 'f' failed",
                          "exc": "Traceback...\nValueError: bad"})
                   + "Traceback (most recent call last):\nKeyError: 'x'\n"
                   + jsonl({"level": "warning", "msg": "slow"}))
    assert error_lines(log) == ["reward function 'f' failed: ValueError: bad",
                                "Traceback (most recent call last):", "KeyError: 'x'"]
    quiet = tmp_path / "quiet.log"
    quiet.write_text(jsonl({"level": "info", "msg": "a"}, {"level": "info", "msg": "b"}))
    assert len(error_lines(quiet)) == 2  # no errors: the last lines
    assert "does not exist" in error_lines(tmp_path / "none.log")[0]


def test_the_root_cause_is_shown_not_the_teardown_noise_after_it(tmp_path):
    """A service that gives up logs its cause once at critical level; what its interpreter
    prints while tearing down (asyncio's "Event loop is closed"...) is not the reason."""
    log = tmp_path / "trainer.log"
    log.write_text(jsonl({"level": "error", "msg": "weight push failed"},
                         {"level": "critical", "msg": "trainer failed: ValueError: OUT_OF_RANGE",
                          "exc": "Traceback...\nValueError: OUT_OF_RANGE"})
                   + "Exception ignored in: <function _Loop.__del__>\n"
                   + "RuntimeError: Event loop is closed\n")
    assert error_lines(log) == ["trainer failed: ValueError: OUT_OF_RANGE: ValueError: "
                                "OUT_OF_RANGE"]


def test_an_earlier_attempts_errors_are_not_this_ones(tmp_path):
    """Logs append across attempts in a reused run directory; the console reads each from
    where this attempt's process started writing it."""
    log = tmp_path / "reward.log"
    log.write_text(jsonl({"level": "error", "msg": "the first attempt's error"}))
    start = log.stat().st_size
    with log.open("a") as f:
        f.write(jsonl({"level": "info", "msg": "started"}, {"level": "error", "msg": "this one"},
                      {"level": "warning", "msg": "resumed from step 10, not 15",
                       "console": True}))
    assert error_lines(log, start=start) == ["this one", "resumed from step 10, not 15"]
    follower = LogFollower({"reward": log}, {"reward": start})
    assert follower.new_errors() == ["[reward] this one",
                                     "[reward] resumed from step 10, not 15"]


def test_the_bar_counts_the_trainers_samplers_ready_of_known():
    """Issue 31's "samplers=3/2": the count came from the trainer's pool over the launcher's
    own processes; both numbers are the trainer's now."""
    status = trainer_pb2.StatusReply(samplers=[trainer_pb2.SamplerStatus(healthy=h)
                                               for h in (True, True, False)])
    assert console.sampler_count(status) == "2/3"


def test_the_follower_reports_each_new_error_line_once(tmp_path):
    log = tmp_path / "reward.log"
    log.write_text(jsonl({"level": "error", "msg": "first"}))
    follower = LogFollower({"reward": log})
    assert follower.new_errors() == ["[reward] first"]
    with log.open("a") as f:
        f.write(jsonl({"level": "info", "msg": "fine"}) + '{"level": "error", "msg": "sec')
    assert follower.new_errors() == []  # the line is not complete yet
    with log.open("a") as f:
        f.write('ond"}\n')
    assert follower.new_errors() == ["[reward] second"]


@pytest.mark.parametrize("overrides,fragment", [
    (["trainer.data.task=files", "trainer.data.path=/no/such/dir"],
     "dataset path '/no/such/dir' is neither a local file/directory nor a hub name"),
    (["trainer.data.task=files", "trainer.data.path={data}", "trainer.data.prompt_field=q"],
     "prompt_field='q' is not a column"),
    (["trainer.data.task=files", "trainer.data.path={data}", "trainer.data.eval_split=dev"],
     "data.eval_split: task 'files' has no split 'dev'"),
    (["trainer.data.task=files", "trainer.data.path={data}",
      "trainer.data.long_prompt_policy=error"],
     "1 of 3 train prompts are longer than 30 tokens"),
])
def test_bad_data_fails_before_any_service_starts(arith_model, tmp_path, capsys, overrides,
                                                  fragment):
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"question": "1+2=", "answer": "3"}, {"question": "2+2=", "answer": "4"},
            {"question": "1+" * 20 + "1=", "answer": "21"}]
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text(jsonl(*rows))
    cfg = config(arith_model, tmp_path / "run", *(o.format(data=data) for o in overrides))
    start = time.monotonic()
    assert up.main(cfg) == 2
    assert time.monotonic() - start < 60  # no service was started or waited on
    err = capsys.readouterr().err
    assert "splitrl up: the data cannot be used" in err and fragment in err
    assert not (tmp_path / "run" / "logs").exists()


def test_a_model_path_without_a_model_fails_before_any_service_starts(arith_model, tmp_path,
                                                                       capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, fragment in [(tmp_path / "nope", "no such directory"),
                           (empty, "has no config.json, no weights")]:
        assert up.main(config(arith_model, tmp_path / "run", f"model.path={path}")) == 2
        err = capsys.readouterr().err
        assert "splitrl up: the model cannot be used: model " in err and str(path) in err
        assert fragment in err
    assert not (tmp_path / "run" / "logs").exists()


def test_the_length_check_reports_long_prompts_and_follows_the_policy(arith_model, tmp_path,
                                                                     capsys):
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"question": "1+2=", "answer": "3"}, {"question": "1+" * 20 + "1=", "answer": "21"}]
    (data / "train.jsonl").write_text(jsonl(*rows))
    (data / "test.jsonl").write_text(jsonl(rows[0]))
    overrides = ["trainer.data.task=files", f"trainer.data.path={data}",
                 "trainer.data.long_prompt_policy=drop"]
    assert preflight.check_data(config(arith_model, tmp_path / "run", *overrides)) is None
    assert "1 of 2 train prompts are longer than 30 tokens" in capsys.readouterr().out
    # The error policy refuses the long one before any service starts.
    rows.append({"question": "2+2=", "answer": "4"})
    (data / "train.jsonl").write_text(jsonl(*rows))
    error = ["trainer.data.long_prompt_policy=error"]
    problem = preflight.check_data(config(arith_model, tmp_path / "run", *overrides, *error))
    assert "1 of 3 train prompts are longer than 30 tokens" in problem


def test_a_typo_in_a_reward_module_is_on_the_console_before_any_step(arith_model, tmp_path,
                                                                     capsys):
    """Twice in one run directory that an earlier run finished in: each attempt reports its
    own errors once, and never the earlier run's success (its summary, plots, accuracy)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({  # what a finished run left
        "state": "done", "step": 20.0, "total_steps": 20.0, "eval_before/accuracy": 0.0,
        "eval_after/accuracy": 0.24, "eval_before/step": 0.0}))
    old = time.time() - 3600
    os.utime(run_dir / "summary.json", (old, old))
    cfg = config(arith_model, run_dir, "reward.functions=[{name: 'my_rewardz:think'}]",
                 "reward.accuracy_function=null")
    for attempt in (1, 2):
        assert up.main(cfg) != 0
        captured = capsys.readouterr()
        assert "reward exited with code 2" in captured.err
        assert captured.err.count("cannot import module 'my_rewardz': ModuleNotFoundError") \
            == 1, (attempt, captured.err)
        # The trainer started beside the reward service and was stopped with the launch: no
        # step, and nothing said about it that could hide the reward service's error.
        assert not (run_dir / "metrics.jsonl").exists()
        assert "trainer exited" not in captured.err and "To continue" not in captured.out
        assert "greedy accuracy" not in captured.out and not (run_dir / "plots").exists()


LAUNCHER_THEN_SLEEP = """
import sys, time
from splitrl.config import load_config
from splitrl.v1 import trainer_pb2
from splitrl_app.launch import demo, supervisor
cfg = load_config(demo.demo_config_path(), sys.argv[1:])
up = supervisor.Launcher(cfg)
up.start("reward", "reward", [])
up.wait_healthy("reward", up.reward_address)
print(up.procs["reward"].pid, flush=True)
time.sleep(600)
"""


def test_services_stop_when_their_launcher_is_killed(arith_model, tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER_THEN_SLEEP, f"model.path={arith_model}",
         f"trainer.run_dir={tmp_path / 'run'}"], stdout=subprocess.PIPE, text=True)
    try:
        reward_pid = int(parent.stdout.readline())
        os.kill(reward_pid, 0)  # running
        parent.kill()  # kill -9: no cleanup in the launcher
        parent.wait()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                os.kill(reward_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.kill(reward_pid, signal.SIGKILL)
            pytest.fail("the reward service outlived its launcher by 120 s")
    finally:
        parent.kill()
    log = (tmp_path / "run" / "logs" / "reward.log").read_text()
    assert "the launcher that started this service is gone; stopping" in log
    assert "server stopped" in log  # the graceful path, not the hard exit


def test_the_phase_lines_name_the_step_a_resumed_run_starts_at():
    said = []
    phases = console.PhaseReporter(said.append)
    for state, step in [("starting", 50), ("evaluating", 50), ("training", 52),
                        ("evaluating", 60), ("training", 60)]:
        phases.observe(state, step)  # polled once a second: steps 50 and 51 ended unseen
    assert [line.split(" (")[0] for line in said] == [
        "trainer: loading the model, restoring a checkpoint if there is one, waiting for the "
        "samplers", "trainer: greedy evaluation at step 50", "trainer: training from step 50",
        "trainer: greedy evaluation at step 60"]
