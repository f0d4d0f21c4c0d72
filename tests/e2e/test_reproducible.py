"""A synchronous run is a function of its config and seed: the same metrics at every step and
bitwise-equal exported weights, whichever sampler answers first and however many samplers
there are (of the same mesh layout)."""

from __future__ import annotations

import pytest

from splitrl_app.launch.up import main as launch
from tests.e2e.harness import export_digest, run_config, step_metrics

pytestmark = pytest.mark.slow


def test_two_runs_with_one_and_two_samplers_are_bitwise_identical(arith_model, tmp_path):
    runs = {}
    for samplers in (2, 1):
        run_dir = tmp_path / f"samplers-{samplers}"
        cfg = run_config(arith_model, run_dir, "trainer.steps=6", "trainer.eval_before=false",
                         "trainer.eval_after=false", f"services.num_samplers={samplers}")
        assert launch(cfg) == 0
        runs[samplers] = (step_metrics(run_dir), export_digest(run_dir))
    (two, two_weights), (one, one_weights) = runs[2], runs[1]
    assert len(two) == len(one) == 6
    for a, b in zip(two, one, strict=True):
        assert a == b, f"step {a['step']} differs"
    assert {"reward/mean", "loss", "grad_norm"} <= set(two[0])
    assert two_weights == one_weights
