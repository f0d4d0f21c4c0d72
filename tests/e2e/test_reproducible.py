"""A synchronous run is a function of its config and seed, bitwise: through a trainer killed
with SIGKILL and resumed from its checkpoint, with two samplers against one, and across steps
that had nothing to train on. (The same for multi-turn tool episodes, with a sampler killed
mid-episode: tests/e2e/test_tools.py.)"""

from __future__ import annotations

import json

import pytest

from splitrl_app.launch.supervisor import Launcher
from tests.e2e.harness import (
    assert_resumed_at,
    export_digest,
    kill_service,
    log_records,
    run_config,
    status_step,
    step_metrics,
    tail,
    trained_records,
    wait_exit,
    wait_for,
)
from trainer_service.orchestration.audit import audit_run

pytestmark = pytest.mark.slow

FAST = ("trainer.eval_before=false", "trainer.eval_after=false")


def run_trainer_again(launcher: Launcher, overrides: tuple[str, ...] = ()) -> list[dict]:
    """Start the stopped trainer again (``overrides``: as `Launcher.start_trainer`) and let it
    finish (exit 0); the "resumed from checkpoint" log records of the launch's trainers."""
    launcher.start_trainer(overrides)
    assert wait_exit(launcher, "trainer", 600) == 0, tail(launcher.log_dir / "trainer.log")
    return [r for r in log_records(launcher.log_dir / "trainer.log")
            if r.get("msg") == "resumed from checkpoint"]


def test_trainer_killed_resumes_from_checkpoint_with_dynamic_sampling(arith_model, tmp_path):
    """kill -9 of the trainer mid-run under DAPO's dynamic sampling: it resumes from its last
    checkpoint, every trained batch is full, the final lineage trains or filters every drawn
    prompt exactly once, and the run is bitwise the run that was never interrupted (with one
    sampler instead of two). 18 steps: the kill follows the first step after the first
    checkpoint (step 7), and 11 steps stay for the poll to see it land mid-run. One launch:
    the uninterrupted run's trainer uses the reward service and sampler-0; sampler-1 starts
    after it, for the interrupted run's trainer (a trainer joining syncs the samplers to its
    own weights)."""
    run_dir = tmp_path / "run"
    steps, per_step, every = 18, 16, 6
    overrides = (f"trainer.steps={steps}", f"trainer.prompts_per_step={per_step}",
                 f"trainer.checkpoint.every={every}", "trainer.checkpoint.async_save=false",
                 "algorithm.filter_zero_variance=true", "algorithm.max_extra_draws=1000", *FAST)
    reference = tmp_path / "uninterrupted"
    launcher = Launcher(run_config(arith_model, reference, *overrides,
                                   "services.num_samplers=2"))
    first, second = launcher.sampler_addresses
    interrupted = (f"trainer.run_dir={run_dir}",)
    try:
        launcher.start("reward", "reward", [])
        launcher.start_sampler(0, first)
        launcher.wait_healthy("reward", launcher.reward_address)
        launcher.wait_healthy("sampler-0", first)
        launcher.start_trainer(("services.num_samplers=1", f"services.sampler_addresses=[{first}]"))
        assert wait_exit(launcher, "trainer", 600) == 0, tail(launcher.log_dir / "trainer.log")
        launcher.start_sampler(1, second)
        launcher.wait_healthy("sampler-1", second)
        launcher.start_trainer(interrupted)
        wait_for(lambda: status_step(launcher) >= every + 1, 300, "a step after a checkpoint",
                 launcher)
        kill_service(launcher, "trainer")
        # Where the kill landed decides where the run resumes: the newest checkpoint.
        saved = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
        before_kill = trained_records(run_dir)
        assert before_kill[-1]["step"] >= saved >= every
        launcher.start_trainer(interrupted)
        code = wait_exit(launcher, "trainer", 600)
        assert code == 0, tail(launcher.log_dir / "trainer.log")
    finally:
        launcher.stop()

    # Resumed from the newest checkpoint; the samplers rolled back to its weights and version.
    assert_resumed_at(launcher, saved)
    # The audit trail holds the final lineage, each step once; the steps the restart repeated
    # are kept apart, marked with the step they were rolled back to.
    records = trained_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    rolled_back = [json.loads(line) for line in
                   (run_dir / "trained_prompts.rolled_back.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rolled_back] == [r["step"] for r in before_kill
                                                if r["step"] > saved]
    assert all(r["rolled_back_to"] == saved for r in rolled_back)
    # Dynamic sampling: flat groups were filtered and replaced, every batch is full, and every
    # prompt drawn (in draw order, across the kill) was trained or filtered exactly once.
    assert all(len(r["uids"]) == per_step for r in records)
    filtered = [u for r in records for u in r["filtered"]]
    assert filtered, "the untrained model scores many groups all 0: some must be filtered"
    done = [u for r in records for u in r["uids"]] + filtered
    assert len(done) == len(set(done))
    assert sorted(int(u.rsplit("#", 1)[1]) for u in done) == list(range(len(done)))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("counts/zero_variance_filtered", 0) for m in metrics) > 0
    # `splitrl audit` reaches the same verdict from the run directory alone.
    report = audit_run(run_dir)
    assert report.ok and report.trained == steps * per_step
    assert report.filtered == len(filtered) and report.rolled_back == len(rolled_back)
    # Reproducible through the kill: the same prompts trained and filtered at every step, the
    # same metrics, the same weights.
    lineage = [(r["step"], r["uids"], r["filtered"]) for r in records]
    assert lineage == [(r["step"], r["uids"], r["filtered"]) for r in trained_records(reference)]
    for a, b in zip(step_metrics(run_dir), step_metrics(reference), strict=True):
        assert a == b, f"step {a['step']} differs from the uninterrupted run"
    assert export_digest(run_dir) == export_digest(reference)


def test_a_resume_after_skipped_steps_is_bitwise_the_uninterrupted_run(arith_model, tmp_path):
    """Steps with nothing to train on move the step but not the weights: one prompt a step,
    dynamic sampling without extra draws, and the untrained model scores many groups all 0,
    so many steps have no group left. A trainer killed after such steps resumes with the
    learner's clock where the uninterrupted run has it (the learning-rate warm-up, the LoRA
    dropout keys): the same metrics at every step, the same weights, the same audit trail.
    Both runs' trainers use one reward service and sampler (a trainer joining syncs the
    sampler to its own weights): one launch, not two."""
    run_dir, reference = tmp_path / "run", tmp_path / "uninterrupted"
    steps = 24
    overrides = (f"trainer.steps={steps}", "trainer.prompts_per_step=1",
                 "algorithm.filter_zero_variance=true",
                 "algorithm.max_extra_draws=0", f"trainer.optimizer.warmup_steps={steps}",
                 "model.lora.rank=4", "model.lora.dropout=0.5",
                 "trainer.checkpoint.async_save=false", "services.num_samplers=1", *FAST)
    # The uninterrupted run saves no checkpoint before its last step; the interrupted one
    # saves every step, so that it resumes right after a skipped step.
    launcher = Launcher(run_config(arith_model, reference, *overrides,
                                   "trainer.checkpoint.every=1000"))
    interrupted = (f"trainer.run_dir={run_dir}", "trainer.checkpoint.every=1")
    try:
        launcher.up()
        assert wait_exit(launcher, "trainer", 600) == 0, tail(launcher.log_dir / "trainer.log")
        skipped = [m["step"] for m in step_metrics(reference) if m.get("skipped")]
        assert skipped and skipped[0] <= 4, f"steps without groups: {skipped}"
        launcher.start_trainer(interrupted)
        wait_for(lambda: status_step(launcher) >= skipped[0] + 1, 300,
                 f"a step after the skipped step {skipped[0]}", launcher)
        kill_service(launcher, "trainer")
        resumed = run_trainer_again(launcher, interrupted)
    finally:
        launcher.stop()
    assert resumed and resumed[-1]["step"] > skipped[0], "no resume after a skipped step"
    saved = resumed[-1]["step"]
    assert any(m["step"] > saved and not m.get("skipped") for m in step_metrics(reference)), (
        "no update after the resumed step: nothing compared")
    for a, b in zip(step_metrics(run_dir), step_metrics(reference), strict=True):
        assert a == b, f"step {a['step']} differs from the uninterrupted run"
    assert export_digest(run_dir) == export_digest(reference)
    # The audit trail: each step once; a step's trainer_version is the number of updates
    # before it (a step without groups trains from the same version as the next one).
    records = trained_records(run_dir)
    lineage = [(r["step"], r["trainer_version"], r["uids"], r["filtered"]) for r in records]
    assert lineage == [(r["step"], r["trainer_version"], r["uids"], r["filtered"])
                       for r in trained_records(reference)]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    updates = 0
    for record, metrics in zip(records, step_metrics(reference), strict=True):
        assert record["trainer_version"] == updates, record
        updates += not metrics.get("skipped")
    report = audit_run(run_dir)
    assert report.ok and report.trained + report.filtered == report.drawn - report.unfinished
