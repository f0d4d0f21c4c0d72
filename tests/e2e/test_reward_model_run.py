"""GRPO against a fixed reward model raises its score: a real run whose only reward is a
sequence classifier (`splitrl init-model --score-labels 1`) served by the reward service; and
the run replays bit for bit: a second trainer started against the same reward service and
sampler (one trainer start, not a launch of all three services) repeats its first steps."""

from __future__ import annotations

import json

import pytest

from splitrl.init_model import init_model
from splitrl_app.launch.supervisor import Launcher
from tests.e2e.harness import (
    log_records,
    run_config,
    step_metrics,
    tail,
    trained_records,
    wait_exit,
)

pytestmark = pytest.mark.slow


def test_grpo_raises_the_mean_score_of_a_fixed_reward_model(arith_model, tmp_path):
    reward_model = init_model(tmp_path / "tiny-rm", preset="tiny", vocab="arithmetic",
                              score_labels=1, seed=7)
    # 20 steps: the fewest whose first and last 10 do not overlap. 4 prompts x 8 completions a
    # step: the batch shapes of test_storage's and test_rewards_and_data's runs, whose sampler
    # and train-step programs are then in the suite's compilation cache.
    run_dir, steps = tmp_path / "run", 20

    def config(run_dir, steps):
        return run_config(arith_model, run_dir, f"trainer.steps={steps}",
                          "trainer.prompts_per_step=4", "algorithm.group_size=8",
                          "trainer.eval_before=false", "trainer.eval_after=false",
                          "reward.workers=1", "services.num_samplers=1",
                          f"reward.models=[{{name: rm, path: '{reward_model}'}}]",
                          "reward.functions=[{name: rm}]", "reward.accuracy_function=rm")

    again, replayed = tmp_path / "again", 6
    launcher = Launcher(config(run_dir, steps))
    try:
        launcher.up()
        assert wait_exit(launcher, "trainer", 900) == 0, tail(launcher.log_dir / "trainer.log")
        # The replay: a second trainer of the same config, for fewer steps in a run directory
        # of its own, against the same reward service and sampler (which the first trainer left
        # at version 20: the new one syncs it back to the model's weights when it joins).
        launcher.start_trainer((f"trainer.run_dir={again}", f"trainer.steps={replayed}"))
        assert wait_exit(launcher, "trainer", 900) == 0, tail(launcher.log_dir / "trainer.log")
    finally:
        launcher.stop()
    curve = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if line.strip()]
    scores = [r["reward/rm/mean"] for r in curve if "reward/rm/mean" in r]
    assert len(scores) == steps
    assert all(r["reward/rm/errors"] == 0 for r in curve if "reward/rm/errors" in r)
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    print(f"mean reward-model score: first 10 steps {first:.4f}, last 10 steps {last:.4f}")
    assert last > first
    assert len(trained_records(run_dir)) == steps
    # A synchronous run with a reward model replays bit for bit (the model's scores do not
    # depend on what shares its forwards, nor on what the services served before): the
    # second, shorter run's steps are the first's.
    assert step_metrics(again) == step_metrics(run_dir)[:replayed]
    synced = [r for r in log_records(launcher.log_dir / "trainer.log")
              if r.get("msg") == "sampler synced" and r.get("ok")]  # both trainers'
    assert [r["version"] for r in synced] == [0, 0], synced
    assert synced[1]["served_before"].startswith(f"weights version {steps} "), synced
