"""A synchronous run is a function of its config and seed: the same metrics at every step and
bitwise-equal exported weights, whichever sampler answers first and however many samplers
there are (of the same mesh layout)."""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.e2e.harness import run_config
from trainer_service.launcher import main as launch

pytestmark = pytest.mark.slow

# What legitimately differs between two runs: wall times, and bytes pushed (one push per
# sampler).
VOLATILE = ("time/", "throughput/", "push/", "samplers/")


def _metrics(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def _export_digest(run_dir) -> str:
    files = sorted((run_dir / "export").glob("*.safetensors"))
    assert files, f"no exported weights in {run_dir / 'export'}"
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def test_two_runs_with_one_and_two_samplers_are_bitwise_identical(arith_model, tmp_path):
    runs = {}
    for samplers in (2, 1):
        run_dir = tmp_path / f"samplers-{samplers}"
        cfg = run_config(arith_model, run_dir, "trainer.steps=6", "trainer.eval_before=false",
                         "trainer.eval_after=false", f"services.num_samplers={samplers}")
        assert launch(cfg) == 0
        runs[samplers] = (_metrics(run_dir), _export_digest(run_dir))
    (two, two_weights), (one, one_weights) = runs[2], runs[1]
    assert len(two) == len(one) == 6
    for a, b in zip(two, one, strict=True):
        assert a == b, f"step {a['step']} differs"
    assert {"reward/mean", "loss", "grad_norm"} <= set(two[0])
    assert two_weights == one_weights
