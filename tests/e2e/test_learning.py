"""The product, end to end: separate reward, sampler and trainer processes on 127.0.0.1,
real gRPC, emulated meshes (trainer fsdp on 4 devices, each sampler tensor parallel on 2),
and a random tiny model that measurably learns single-digit addition."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitrl_app.launch.up import main as launch
from tests.e2e.harness import gsm8k_train_lines_by, run_config, trained_records

pytestmark = pytest.mark.slow


# GSPO runs two epochs per batch with the paper's sequence-level aggregation, so its
# sequence-level clipping (3e-4 / 4e-4) is exercised: with one on-policy epoch every ratio is 1.
# GRPO runs the demo's 150 steps (`make demo`); GSPO learns faster here and runs 70: evaluated
# every 10 steps of an 80-step run with the suite's XLA settings (trainer.eval_every=10), its
# greedy accuracy is 0.84 from step 40 on and 0.92 at steps 70 and 80. (The learning rate is
# constant: a shorter run is the first steps of a longer one.) GRPO runs the demo's two
# samplers and checks both did work; GSPO changes only the trainer's loss, so one sampler (one
# process fewer to start and compile) serves it.
VARIANTS = {
    "grpo": ["algorithm.loss=grpo"],
    "gspo": ["algorithm.loss=gspo", "trainer.epochs_per_batch=2",
             "algorithm.aggregation=seq-mean-token-mean", "trainer.steps=70",
             "services.num_samplers=1"],
}
SAMPLERS = {"grpo": 2, "gspo": 1}


@pytest.mark.parametrize("loss", sorted(VARIANTS))
def test_arithmetic_accuracy_rises_to_0_8(loss, arith_model, tmp_path):
    run_dir = tmp_path / f"run-{loss}"
    cfg = run_config(arith_model, run_dir, *VARIANTS[loss], "trainer.checkpoint.every=100")
    assert cfg.trainer.mesh.axes == {"fsdp": 4} and cfg.sampler.mesh.axes == {"tensor": 2}
    assert cfg.services.num_samplers == SAMPLERS[loss]
    assert cfg.trainer.steps == (150 if loss == "grpo" else 70)

    assert launch(cfg) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in curve if "reward/mean" in r]
    by_20 = [round(sum(rewards[i : i + 20]) / len(rewards[i : i + 20]), 3)
             for i in range(0, len(rewards), 20)]
    print(f"{loss}: accuracy {summary['eval_before/accuracy']:.3f} -> "
          f"{summary['eval_after/accuracy']:.3f}; mean reward per 20 steps: {by_20}")
    assert summary["eval_before/accuracy"] < 0.8
    assert summary["eval_after/accuracy"] >= 0.8
    if loss == "gspo":  # the second epoch's sequence ratios leave the clip range sometimes
        assert max(r.get("clip_frac_high", 0) + r.get("clip_frac_low", 0) for r in curve) > 0
    # Every sampler did work (GRPO: both), and every step trained on on-policy groups.
    records = trained_records(run_dir)
    assert len({s for r in records for s in r["samplers"]}) == SAMPLERS[loss]
    assert all(v == r["trainer_version"] for r in records for v in r["versions"])
    # The exported model is a Hugging Face directory.
    assert (run_dir / "export" / "config.json").exists()
    assert (run_dir / "plots" / "overview.png").exists()


# The smoke run's data: TRAIN_ROWS questions of the shipped GSM8K train split (two steps draw 8)
# and the first TEST_ROWS of its test split (the evaluation reads the first EVAL_SIZE: more stay
# to show that eval_size is what bounds it). The full splits (8,792 rows) would be tokenized
# by the run's data check and again by the trainer's prompt-length check, seconds of CPU in
# each process for a run of 8 prompts; loading them is tests/trainer_service/test_data.py's.
TRAIN_ROWS, TEST_ROWS, EVAL_SIZE = 16, 32, 16
SCANNED = 200  # GSM8K training rows searched for TRAIN_ROWS of one batch shape
GSM8K_SMOKE = ("trainer.steps=2", "trainer.prompts_per_step=4", "algorithm.group_size=4",
               "trainer.data.task=gsm8k", f"trainer.data.eval_size={EVAL_SIZE}",
               "trainer.eval_before=false", "sampling.max_new_tokens=24",
               "sampler.max_sequence_length=512", "services.num_samplers=1",
               "reward.functions=[{name: math_accuracy, weight: 1.0}]",
               "reward.accuracy_function=math_accuracy")


def one_shape_gsm8k(model: Path, gsm8k: Path, folder: Path) -> Path:
    """``folder`` with a train.jsonl of TRAIN_ROWS shipped GSM8K training questions whose
    prompts plus the generation budget round up to one length bucket, so that every train batch
    is padded to the split's longest row, the shape the trainer warms up (one compile of the
    train step, as with the full split), and a test.jsonl of the split's first TEST_ROWS."""
    from splitrl.tokenizer import load_tokenizer
    from trainer_service.learning.batching import bucket

    cfg = run_config(model, folder / "unused-run", *GSM8K_SMOKE)
    budget = cfg.sampling.max_new_tokens
    by_bucket = gsm8k_train_lines_by(lambda n: bucket(n + budget), load_tokenizer(model),
                                     cfg.trainer.data, gsm8k, SCANNED)
    chosen = max(by_bucket.values(), key=len)
    assert len(chosen) >= TRAIN_ROWS, {b: len(lines) for b, lines in by_bucket.items()}
    test = (gsm8k / "test.jsonl").read_text().splitlines()[:TEST_ROWS]
    folder.mkdir()
    for split, lines in (("train", chosen[:TRAIN_ROWS]), ("test", test)):
        (folder / f"{split}.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


def test_gsm8k_smoke_two_steps_and_eval(gsm8k_model, tmp_path, shared_data):
    """The GSM8K task and math_accuracy through a real run, with one sampler and only the
    final evaluation: a second sampler (one more process compiling this model's programs) and
    the evaluation before training run the same code as in the arithmetic runs above, which
    check both. The data are shipped GSM8K rows (``one_shape_gsm8k``): the evaluation reads the
    same first 16 test rows as from the full split."""
    run_dir = tmp_path / "gsm8k"
    data = one_shape_gsm8k(gsm8k_model, shared_data / "gsm8k", tmp_path / "gsm8k-data")
    cfg = run_config(gsm8k_model, run_dir, *GSM8K_SMOKE, f"trainer.data.path={data}")
    assert launch(cfg) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 2
    assert summary["eval_after/count"] == EVAL_SIZE < TEST_ROWS
    assert 0.0 <= summary["eval_after/accuracy"] <= 1.0
    records = trained_records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    assert all(uid.startswith("gsm8k-train-") for r in records for uid in r["uids"])
