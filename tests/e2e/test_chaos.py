"""Chaos: an asynchronous run (max_staleness 1, three samplers) during which a seeded schedule
kill -9s and restarts samplers, the reward service and the trainer, several times each. The run
completes and `splitrl audit` finds every drawn prompt of the final lineage trained or filtered
exactly once: nothing lost, nothing trained twice."""

from __future__ import annotations

import os
import random
import signal
from collections import Counter

import pytest

from tests.e2e.harness import run_config, status_step, tail, wait_exit, wait_for
from trainer_service.launcher import Launcher
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
    launcher = Launcher(cfg)
    try:
        launcher.up()
        for at_step, victim in plan:
            seen = wait_for(lambda s=at_step: (step := status_step(launcher)) >= s and step,
                            600, f"step {at_step} (before killing {victim})", launcher)
            kill(launcher, victim)
            restart(launcher, victim)
            done.append((at_step, victim, seen))
        code = wait_exit(launcher, "trainer", 900)
        assert code == 0, tail(launcher.log_dir / "trainer.log")
    finally:
        launcher.stop()

    report = audit_run(run_dir)
    kills = Counter(victim.split("-")[0] for _, victim, _ in done)
    print(f"\nchaos (seed {SEED}): kills {dict(kills)} at steps "
          f"{[(seen, v) for _, v, seen in done]}; " + "; ".join(report.lines()))
    assert kills == {"sampler": 3, "reward": 2, "trainer": 2}
    assert report.steps == list(range(1, STEPS + 1))
    assert report.ok, report.lines()
    assert report.trained == STEPS * PER_STEP
