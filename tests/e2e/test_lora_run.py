"""LoRA end to end: the demo's services (two tensor-parallel samplers, fsdp trainer) train only
rank-16 adapters on every attention and MLP projection of the random tiny model, pushes carry
the adapters, the trainer is killed with SIGKILL and resumes the adapter run at its checkpoint,
greedy accuracy reaches 0.8, and the exported adapter loads in PEFT onto the transformers base.

Settings (docs/lora.md): LoRA leaves the embedding and norms frozen, and the random model's
output embedding is small (std 0.02), so at temperature 1 no adapter can make a token much more
likely than the rest; the run samples at temperature 0.5, lr 2e-3.

120 steps: the same run without the kill, evaluated every 10 steps (the learning rate is
constant, so a shorter run is the first steps of a longer one; the resume is bitwise), has
greedy accuracy 0.80 at step 100 and 0.84 at every evaluation from step 110 to 150. 120 keeps
an evaluation of that plateau before it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from splitrl_app.launch.supervisor import Launcher
from tests.e2e.harness import (
    adapter_logits,
    assert_resumed_at,
    kill_service,
    run_config,
    status_step,
    tail,
    trained_records,
    wait_exit,
    wait_for,
)
from trainer_service.orchestration.audit import audit_run

pytestmark = pytest.mark.slow

LORA = ("model.lora.rank=16", "model.lora.alpha=32", "trainer.optimizer.lr=0.002",
        "sampling.temperature=0.5")


def test_lora_grpo_learns_survives_kill_9_and_exports_a_peft_adapter(arith_model, tmp_path):
    run_dir = tmp_path / "run"
    steps, every = 120, 50
    cfg = run_config(arith_model, run_dir, *LORA, f"trainer.steps={steps}",
                     f"trainer.checkpoint.every={every}", "trainer.checkpoint.async_save=false")
    launcher = Launcher(cfg)
    try:
        launcher.up()
        wait_for(lambda: status_step(launcher) >= every + 2, 600, "a step after a checkpoint",
                 launcher)
        kill_service(launcher, "trainer")
        saved = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
        assert saved >= every
        launcher.start_trainer()
        assert wait_exit(launcher, "trainer", 900) == 0, tail(launcher.log_dir / "trainer.log")
    finally:
        launcher.stop()

    assert_resumed_at(launcher, saved)  # and the samplers rolled back to its adapters
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    before = next(r["eval_before/accuracy"] for r in curve if "eval_before/accuracy" in r)
    trained = {r["step"]: r["reward/mean"] for r in curve if "reward/mean" in r}  # last lineage
    rewards = [trained[s] for s in sorted(trained)]
    by_25 = [round(float(np.mean(rewards[i:i + 25])), 3) for i in range(0, len(rewards), 25)]
    print(f"\nLoRA: greedy accuracy {before:.3f} -> {summary['eval_after/accuracy']:.3f}; "
          f"mean reward per 25 steps: {by_25}")
    assert before < 0.8
    assert summary["eval_after/accuracy"] >= 0.8
    # Both samplers did work; every push carried the adapters only.
    records = trained_records(run_dir)
    assert len({s for r in records for s in r["samplers"]}) == 2
    assert audit_run(run_dir).ok
    from splitrl.models import load_config
    from splitrl.models.lora import ALL_PROJECTIONS, LoraSpec, resolve_targets

    config = load_config(arith_model)
    spec = LoraSpec(16, 32.0, resolve_targets(config, ALL_PROJECTIONS))
    adapter_bytes = sum(4 * int(np.prod(s)) for s in spec.shapes(config).values())
    pushed = [round(r["push/mb"] * 2**20) for r in curve if r.get("push/mb")]
    assert len(pushed) >= steps - every and all(b % adapter_bytes == 0 for b in pushed)

    _peft_matches_the_export(arith_model, run_dir / "export")
    # `splitrl export` of the final checkpoint gives the same adapter.
    from safetensors.numpy import load_file

    from trainer_service.learning.export import export_checkpoint

    again, step, _ = export_checkpoint(run_dir, tmp_path / "again")
    assert step == steps
    ours = load_file(run_dir / "export" / "adapter" / "adapter_model.safetensors")
    theirs = load_file(again / "adapter" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(np.array_equal(ours[k], theirs[k]) for k in ours)


def _peft_matches_the_export(base_dir, export):
    """The oracle: PEFT's adapter on the transformers base = the merged export = our forward
    with the adapters (float32, 1e-4)."""
    tokens = np.array([[3, 4, 5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 10, 11, 12]])
    peft_logits, merged_logits, own = adapter_logits(base_dir, export, tokens)
    assert np.abs(peft_logits - merged_logits).max() < 1e-4
    assert np.abs(peft_logits - own).max() < 1e-4
    print(f"PEFT vs merged export: {np.abs(peft_logits - merged_logits).max():.2e}; "
          f"PEFT vs SplitRL with adapters: {np.abs(peft_logits - own).max():.2e}")
