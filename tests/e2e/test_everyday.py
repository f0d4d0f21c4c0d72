"""Everyday use, as a person at a terminal: ``splitrl up`` stopped with Ctrl-C, started again
with a changed config (refused) and unchanged (resumed, before -> after), trackers and
per-process Prometheus ports, then ``splitrl export`` of a checkpoint into transformers and
``splitrl eval`` reproducing the run's own after-accuracy."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from splitrl_app.launch.demo import demo_config_path
from tests.e2e.harness import tail, wait_for

pytestmark = pytest.mark.slow

# The interrupted run is asked for LONG steps, so Ctrl-C always lands mid-run however late the
# poll below sees step 2 (8 steps take ~2 s here: a run of 8 could finish first); the resumed
# run is asked for 4 steps past where it stopped.
LONG = 1000
MORE = 4


class _Command:
    """``python -m splitrl ARGS`` with its output in files (a progress bar would fill a pipe)."""

    def __init__(self, *args: str, sigint_ignored: bool = False):
        import tempfile

        self.out = tempfile.TemporaryFile("w+")
        self.err = tempfile.TemporaryFile("w+")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "splitrl", *args]
        if sigint_ignored:  # as a background job of a script starts (exec keeps an ignored signal)
            command = ["sh", "-c", "trap '' INT; exec \"$0\" \"$@\"", *command]
        self.proc = subprocess.Popen(command, stdout=self.out, stderr=self.err, text=True,
                                     env=env)

    def finish(self, timeout_s: float = 600) -> tuple[int, str, str]:
        self.proc.wait(timeout=timeout_s)
        self.out.seek(0)
        self.err.seek(0)
        return self.proc.returncode, self.out.read(), self.err.read()


def _splitrl(*args: str, sigint_ignored: bool = False) -> _Command:
    return _Command(*args, sigint_ignored=sigint_ignored)


def _finish(command: _Command, timeout_s: float = 600) -> tuple[int, str, str]:
    return command.finish(timeout_s)


def _in_process(*args: str) -> tuple[int, str, str]:
    """``splitrl ARGS`` run by this process (`splitrl_app.cli.main`, what the executable calls)
    for a command that starts no service: its code without a process start of its own."""
    from splitrl_app.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines()
            if '"loss"' in line]


@pytest.fixture(scope="module")
def run(arith_model, tmp_path_factory):
    """A run stopped with SIGINT after two steps (started with SIGINT ignored, as a background
    job of a script is: Ctrl-C must stop it all the same), refused once, then resumed for MORE
    steps."""
    run_dir = tmp_path_factory.mktemp("everyday") / "run"
    args = ["up", "--config", str(demo_config_path()),
            f"model.path={arith_model}", f"trainer.run_dir={run_dir}",
            "trainer.checkpoint.every=4", "trainer.checkpoint.keep=100",
            "services.num_samplers=1", "services.metrics_port=0",
            "trainer.report_to=[tensorboard]", "trainer.completions_every=2"]
    first = _splitrl(*args, f"trainer.steps={LONG}", sigint_ignored=True)
    wait_for(lambda: max(_steps(run_dir), default=0) >= 2 or first.proc.poll() is not None,
             600, "two steps")
    targets = json.loads((run_dir / "prometheus.json").read_text())
    scraped = {}
    for target in targets:  # every process answers on its own port while the run is up
        with urllib.request.urlopen(f"http://{target['targets'][0]}/metrics", timeout=10) as r:
            scraped[target["labels"]["instance_name"]] = r.read().decode()
    first.proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
    interrupted = _finish(first)
    stopped_summary = json.loads((run_dir / "summary.json").read_text())
    stopped = int(stopped_summary["step"])
    # Refused before any service starts: run in this process.
    refused = _in_process(*args, f"trainer.steps={LONG}", "algorithm.loss=gspo",
                          "trainer.optimizer.lr=0.002")
    # More steps than the interrupted run was asked for is no change a resume refuses.
    resumed = _finish(_splitrl(*args, f"trainer.steps={stopped + MORE}"))
    return {"dir": run_dir, "interrupted": interrupted, "refused": refused, "resumed": resumed,
            "stopped_summary": stopped_summary,
            "scraped": scraped, "stopped": stopped, "steps": stopped + MORE}


def test_ctrl_c_exits_0_saying_where_it_stopped_and_how_to_continue(run):
    code, out, err = run["interrupted"]
    assert code == 0, err + tail(run["dir"] / "logs" / "trainer.log")
    summary_line = next(line for line in out.splitlines() if line.startswith("stopped at step"))
    step = int(summary_line.split()[3])
    assert 2 <= step == run["stopped"] < LONG
    assert f"of {LONG}; checkpoint in {run['dir']}. To continue from there: splitrl up " in (
        summary_line)
    assert "exited with code" not in err and "failed" not in err
    # Why it stopped, in summary.json: the launcher passes Ctrl-C on to the trainer as SIGTERM.
    assert run["stopped_summary"]["state"] == "stopped"
    assert run["stopped_summary"]["reason"] == "SIGTERM received"


def test_a_changed_config_refuses_to_resume_and_names_the_keys(run):
    code, out, err = run["refused"]
    assert code == 2
    assert "will not resume:" in err and "of a run with a different config:" in err
    assert "  algorithm.loss: 'grpo' -> 'gspo'" in err
    assert "  trainer.optimizer.lr: 0.001 -> 0.002" in err
    assert "--resume force" in err
    assert "starting the reward service" not in out  # refused before any service started


def test_the_resumed_run_finishes_and_prints_its_start_and_final_accuracy(run):
    code, out, err = run["resumed"]
    assert code == 0, err
    summary = json.loads((run["dir"] / "summary.json").read_text())
    start, steps = int(summary["resumed_from"]), run["steps"]
    assert summary["state"] == "done" and summary["step"] == steps and start == run["stopped"]
    assert (f"greedy accuracy on the evaluation prompts: {summary['eval_before/accuracy']:.3f} "
            f"(resumed at step {start}) -> {summary['eval_after/accuracy']:.3f} (step {steps})"
            ) in out
    trained = sorted(_steps(run["dir"]))
    assert trained == list(range(1, steps + 1))  # every step once, none twice
    # The phase lines name the resumed step (they said step 0 until the first new step). The
    # launcher polls once a second, so a phase shorter than that (a few tiny steps) may have no
    # line; every line there is names the resumed step.
    phase_steps = re.findall(r"trainer: (?:training from|greedy evaluation at) step (\d+)", out)
    assert all(int(n) >= start for n in phase_steps), phase_steps
    assert all(int(n) == start for n in re.findall(r"training from step (\d+)", out)), out


def test_the_compose_smoke_check_reads_what_this_trainer_wrote(run):
    """deploy/smoke_check.py, run as `deploy/smoke.sh` runs it on a compose run's files, on this
    real run's: a trainer that renames a summary field or a log message fails here, not only
    on a Docker engine."""
    summary = json.loads((run["dir"] / "summary.json").read_text())
    check = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[2] / "deploy" / "smoke_check.py"),
         "--trained", str(run["dir"] / "trained_prompts.jsonl"),
         "--summary", str(run["dir"] / "summary.json"),
         "--log", str(run["dir"] / "logs" / "trainer.log"),
         "--steps", str(run["steps"]), "--prompts-per-step", "16", "--expect-resume"],
        capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert (f"greedy accuracy: {summary['eval_before/accuracy']:.3f} (measured at step "
            f"{run['stopped']}) -> {summary['eval_after/accuracy']:.3f}") in check.stdout
    assert (f"(stopped at step, resumed from step): [({run['stopped']}, {run['stopped']})]"
            in check.stdout)


def test_trackers_and_prometheus_ports_of_a_real_run(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scraped = run["scraped"]
    assert set(scraped) == {"reward", "sampler-0", "trainer"}
    assert "splitrl_trainer_step" in scraped["trainer"]
    reader = EventAccumulator(str(run["dir"] / "tensorboard"),
                              size_guidance={"scalars": 0, "tensors": 0})
    reader.Reload()
    assert [e.step for e in reader.Scalars("loss")] == list(range(1, run["steps"] + 1))
    assert reader.Scalars("reward/exact_answer/mean")
    last_even = run["steps"] // 2 * 2  # completions_every=2
    assert {e.step for e in reader.Tensors("completions/text_summary")} >= {last_even}


def test_export_of_a_checkpoint_loads_in_transformers(run, tmp_path):
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    mid = tmp_path / "step-4"
    code, out, err = _in_process("export", str(run["dir"] / "checkpoints" / "4"), str(mid))
    assert code == 0 and "exported the policy of step 4" in out, err
    model = AutoModelForCausalLM.from_pretrained(mid)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 6]])).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()
    last = tmp_path / "last"
    code, _, err = _in_process("export", str(run["dir"]), str(last))
    assert code == 0, err
    [exported] = list(last.glob("*.safetensors"))
    [in_run] = list((run["dir"] / "export").glob("*.safetensors"))
    a, b = load_file(exported), load_file(in_run)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    [step4] = list(mid.glob("*.safetensors"))
    assert not all(np.array_equal(v, a[k]) for k, v in load_file(step4).items())


def test_eval_reproduces_the_runs_after_accuracy_and_prints_pass_at_k(run, tmp_path):
    code, out, err = _finish(_splitrl("eval", str(run["dir"] / "export"),
                                      "services.num_samplers=1", "--k", "1,4",
                                      "--out", str(tmp_path)))
    assert code == 0, err
    summary = json.loads((run["dir"] / "summary.json").read_text())
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["eval/accuracy"] == summary["eval_after/accuracy"]
    assert result["eval/count"] == summary["eval_after/count"]
    assert f"greedy accuracy: {summary['eval_after/accuracy']:.3f} on 25 prompts" in out
    assert "pass@k from 4 samples per prompt" in out and "pass@4" in out
    assert 0 <= result["eval/pass@1"] <= result["eval/pass@4"] <= 1
    # What the model answered: per prompt, as the run's own final evaluation recorded it
    records = [json.loads(line) for line in
               (tmp_path / "eval_completions.jsonl").read_text().splitlines()]
    assert len(records) == 25
    assert np.mean([r["completions"][0]["score"] for r in records]) == pytest.approx(
        result["eval/accuracy"])
    first = records[0]
    assert first["prompt_id"].removeprefix("arith-") + "=" in first["prompt"]
    assert first["reference"] and set(first["completions"][0]) >= {
        "text", "finish_reason", "score", "rewards", "reasons"}
    [in_run] = (run["dir"] / "evaluations").glob("eval_after-step*.jsonl")
    assert [json.loads(line) for line in in_run.read_text().splitlines()] == records
    sampled = (tmp_path / "sampled_completions.jsonl").read_text().splitlines()
    assert len(sampled) == 25 and all(len(json.loads(s)["completions"]) == 4 for s in sampled)
