"""Storage faults and the stops a run decides on, in real runs: the reward error policy stops
a run after checkpointing the step it is at; a checkpoint disk that fills up stops the run at
the save that failed, saying why; a run directory whose checkpoints do not read says so and
never shows an earlier attempt's success; a run directory whose disk fills mid-run leaves
every file readable, and the restart without a checkpoint keeps the audit exact.
`splitrl audit` stays exact after each.

(A corrupt latest checkpoint with an intact older one, and a restart with no checkpoint at
all, are faults of the chaos run: tests/e2e/test_chaos.py.)"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from splitrl.jsonl import read_jsonl
from splitrl_app.launch import up
from splitrl_app.launch.supervisor import Launcher
from tests.e2e.harness import run_config, status_step, tail, wait_exit, wait_for
from trainer_service.orchestration.audit import audit_run

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SHORT = ("trainer.eval_before=false", "trainer.eval_after=false", "trainer.prompts_per_step=4",
         "algorithm.group_size=8", "reward.workers=1", "services.num_samplers=1")


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def checkpoint_steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_the_reward_policy_stops_after_checkpointing_and_loses_nothing(arith_model, tmp_path,
                                                                       capsys, monkeypatch):
    """Issue 36, 4: a stop at step 4 with checkpoint.every=50 used to save nothing."""
    monkeypatch.setenv("PYTHONPATH", str(HERE))  # the services import e2e_rewards
    run_dir = tmp_path / "run"
    functions = "[{name: exact_answer}, {name: 'e2e_rewards:fails_on_3_plus_3'}]"
    cfg = run_config(arith_model, run_dir, "trainer.steps=8", "trainer.checkpoint.every=50",
                     f"reward.functions={functions}", *SHORT)
    assert up.main(cfg) == 3  # the documented exit code of the reward error policy
    out = capsys.readouterr().out
    ended = summary(run_dir)
    assert ended["state"] == "stopped" and ended["step"] == 4.0
    assert ended["reason"].startswith("stopping the run: reward function "
                                      "'e2e_rewards:fails_on_3_plus_3' failed on 8")
    assert checkpoint_steps(run_dir / "checkpoints") == [4]  # saved before stopping
    assert "stopped at step 4 of 8" in out and "To continue from there" in out
    report = audit_run(run_dir)
    assert report.ok and report.checkpoint_step == 4, report.lines()
    assert (report.trained, report.unfinished) == (16, 4)  # step 5's prompts: resumed first


def test_a_full_checkpoint_disk_stops_the_run_at_the_save_that_failed(arith_model, tmp_path,
                                                                      small_disk, capsys):
    """Issue 36, 3: the step-10 save failed in the background and the run trained on; now it
    stops at once, the console naming the cause. Then the run's only checkpoint is damaged:
    the next attempt says so (not asyncio's teardown) and shows no earlier success."""
    run_dir = tmp_path / "run"
    checkpoints = small_disk("2m") / "checkpoints"  # one checkpoint of the tiny model fits
    cfg = run_config(arith_model, run_dir, "trainer.steps=20", "trainer.checkpoint.every=5",
                     f"trainer.checkpoint.dir={checkpoints}", *SHORT)
    assert up.main(cfg) == 1
    err = capsys.readouterr().err
    assert "could not be written" in err and "disk full (no space left on device)" in err
    assert "Task exception was never retrieved" not in err
    assert "RESOURCE_EXHAUSTED" not in err  # orbax's own lines, one per thread: in the log only
    ended = summary(run_dir)
    assert ended["state"] == "failed" and "disk full" in ended["reason"]
    saves = checkpoint_steps(checkpoints)
    failed_at = int(ended["step"])
    assert saves == [5] and failed_at < 15, (saves, failed_at)  # stopped before the next save
    report = audit_run(run_dir)
    assert report.ok and report.checkpoint_step == 5, report.lines()

    # The only checkpoint's metadata garbled, and a summary of an earlier success beside it.
    (checkpoints / "5" / "meta" / "metadata").write_text('{"step": 5, "weight_')
    (run_dir / "summary.json").write_text(json.dumps({
        "state": "done", "step": 20.0, "total_steps": 20.0, "eval_before/accuracy": 0.0,
        "eval_after/accuracy": 0.24, "eval_before/step": 0.0}))
    old = time.time() - 3600
    os.utime(run_dir / "summary.json", (old, old))
    assert up.main(cfg) == 2
    captured = capsys.readouterr()
    assert f"no checkpoint in {checkpoints} reads: step 5" in captured.err
    assert "another trainer.run_dir" in captured.err
    assert "Event loop is closed" not in captured.err
    assert "greedy accuracy" not in captured.out


def fill(directory: Path) -> Path:
    """Write a file into ``directory`` until its filesystem has no space left."""
    filler = directory / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    return filler


def test_a_run_directory_that_fills_up_stays_readable_and_the_restart_loses_nothing(
        arith_model, small_disk):
    """Issue 36, 2: the run directory's disk filled at step 15: the console showed a half
    line, metrics.jsonl kept a torn line (plots broken for good), and the restart, with no
    checkpoint, began at step 0 without rolling back the audit trail (256 prompts "trained
    twice"). Here the disk is filled by hand after step 3, with the checkpoints on it too."""
    disk = small_disk("64m")
    run_dir = disk / "run"
    options = (arith_model, run_dir, "trainer.checkpoint.every=50", *SHORT)
    # The first run has more steps than it can take before the disk fills (it stops at the
    # first write after the fill); with 8, a run at step 3 when polled could end before the
    # fill and exit 0.
    first = Launcher(run_config(*options, "trainer.steps=1000"))
    try:
        first.up()
        wait_for(lambda: status_step(first) >= 3, 300, "step 3", first)
        trainer = first.procs["trainer"]
        trainer.send_signal(signal.SIGSTOP)  # the run cannot end while the disk fills
        try:
            filler = fill(disk)
        finally:
            trainer.send_signal(signal.SIGCONT)
        assert wait_exit(first, "trainer", 300) == 1
        report = first.exit_report("trainer")
    finally:
        first.stop()
    assert "the run directory's filesystem is full" in report, report
    assert not (run_dir / "checkpoints").exists() or not [
        p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    records = read_jsonl(run_dir / "metrics.jsonl")  # readable: no torn line breaks it
    assert records and (run_dir / "metrics.jsonl").read_bytes().endswith(b"\n")

    filler.unlink()  # space again: the command, now for 8 steps, starts over from step 0
    again = Launcher(run_config(*options, "trainer.steps=8"))
    try:
        again.up()
        assert wait_exit(again, "trainer", 600) == 0, tail(run_dir / "logs" / "trainer.log")
    finally:
        again.stop()
    assert "no checkpoint: training from step 0" in (run_dir / "logs" / "trainer.log").read_text()
    report = audit_run(run_dir)
    assert report.ok and report.steps == list(range(1, 9)), report.lines()
    assert report.trained == 8 * 4 and report.rolled_back >= 3
