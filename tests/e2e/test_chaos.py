"""Chaos: an asynchronous run (max_staleness 1, three samplers) during which a seeded schedule
kill -9s and restarts samplers, the reward service and the trainer, several times each, and
storage fails under the trainer: before its first restart its checkpoints are gone (a disk
that never kept one: it starts again from step 0), before its second the newest checkpoint is
truncated (it falls back to the one before). The run completes and `splitrl audit` finds every
drawn prompt of the final lineage trained or filtered exactly once: nothing lost, nothing
trained twice."""

from __future__ import annotations

import os
import random
import shutil
import signal
from collections import Counter
from pathlib import Path

import pytest

from splitrl_app.launch.supervisor import Launcher
from tests.e2e.harness import run_config, status_step, tail, wait_exit, wait_for
from trainer_service.orchestration.audit import audit_run

pytestmark = pytest.mark.slow

SEED = 20261125
STEPS, PER_STEP, EVERY = 36, 8, 5


def schedule(seed: int) -> list[tuple[int, str]]:
    """(step to wait for, victim) in order: one kill per sampler slot, two of the reward
    service, two of the trainer, shuffled by the seed, one every few steps."""
    rng = random.Random(seed)
    victims = ["sampler-0", "sampler-1", "sampler-2"] + ["reward"] * 2 + ["trainer"] * 2
    rng.shuffle(victims)
    steps = sorted(rng.sample(range(3, STEPS - 8), len(victims)))
    return list(zip(steps, victims, strict=True))


def kill(launcher: Launcher, name: str) -> None:
    proc = launcher.procs[name]
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def storage_fault(checkpoints: Path, nth: int) -> str:
    """Damage the stopped trainer's checkpoints: the first time remove them all, after that
    truncate the newest step's largest data file (when an older step is there to fall back
    to). Returns what was done."""
    if nth == 0:
        shutil.rmtree(checkpoints, ignore_errors=True)
        return "no checkpoint"
    steps = sorted(int(p.name) for p in checkpoints.glob("*") if p.name.isdigit())
    if len(steps) < 2:
        return "none"
    files = [p for p in (checkpoints / str(steps[-1]) / "state").rglob("*") if p.is_file()]
    data = max(files, key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    return f"step {steps[-1]} truncated"


def restart(launcher: Launcher, name: str) -> None:
    if name == "trainer":
        launcher.start_trainer()
    elif name == "reward":
        launcher.start("reward", "reward", [])
        launcher.wait_healthy("reward", launcher.reward_address)
    else:
        index = int(name.split("-")[1])
        launcher.start_sampler(index, launcher.sampler_addresses[index])


def test_kills_and_restarts_of_every_service_lose_nothing(arith_model, tmp_path):
    run_dir = tmp_path / "run"
    cfg = run_config(arith_model, run_dir, f"trainer.steps={STEPS}",
                     f"trainer.prompts_per_step={PER_STEP}", "trainer.max_staleness=1",
                     f"trainer.checkpoint.every={EVERY}", "trainer.checkpoint.async_save=false",
                     "services.num_samplers=3", "services.sampler_timeout_s=5",
                     "trainer.eval_before=false", "trainer.eval_after=false")
    plan = schedule(SEED)
    done: list[tuple[int, str, int]] = []
    faults: list[str] = []
    launcher = Launcher(cfg)
    try:
        launcher.up()
        for at_step, victim in plan:
            seen = wait_for(lambda s=at_step: (step := status_step(launcher)) >= s and step,
                            600, f"step {at_step} (before killing {victim})", launcher)
            kill(launcher, victim)
            if victim == "trainer":
                faults.append(storage_fault(run_dir / "checkpoints", len(faults)))
            restart(launcher, victim)
            done.append((at_step, victim, seen))
        code = wait_exit(launcher, "trainer", 900)
        assert code == 0, tail(launcher.log_dir / "trainer.log")
    finally:
        launcher.stop()

    report = audit_run(run_dir)
    kills = Counter(victim.split("-")[0] for _, victim, _ in done)
    print(f"\nchaos (seed {SEED}): kills {dict(kills)} at steps "
          f"{[(seen, v) for _, v, seen in done]}; storage faults {faults}; "
          + "; ".join(report.lines()))
    assert kills == {"sampler": 3, "reward": 2, "trainer": 2}
    assert faults[0] == "no checkpoint" and faults[1].endswith("truncated"), faults
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "no checkpoint: training from step 0" in log
    assert f"checkpoint {faults[1].replace(' truncated', '')} is unreadable" in log
    assert report.steps == list(range(1, STEPS + 1))
    assert report.ok, report.lines()
    assert report.trained == STEPS * PER_STEP
