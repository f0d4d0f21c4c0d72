"""Evaluation helpers: the unbiased pass@k, pass@k over groups, the before -> after line, when
a run's periodic evaluation is due, and `splitrl eval` refusing pass@k samples no sampler
batch holds."""

import threading

import pytest

from splitrl.config import load_config
from splitrl_app.cli import main as splitrl
from splitrl_app.evaluate import evaluate
from tests.trainer_service.scripted_sampler import Script, ScriptedSampler
from trainer_service.orchestration.evaluation import (
    RunEvaluation,
    accuracy_line,
    pass_at_k,
    pass_at_k_metrics,
    sampled_items,
)
from trainer_service.orchestration.rollouts import Completion, RolloutGroup, WorkItem


def test_pass_at_k_is_the_unbiased_estimator():
    # 1 - C(n - c, k) / C(n, k), by hand.
    assert pass_at_k(4, 1, 1) == pytest.approx(1 - 3 / 4)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # fewer wrong samples than k: some draw is right
    with pytest.raises(ValueError, match="expected 0 < k <= n = 4, got k = 5"):
        pass_at_k(4, 1, 5)


def _group(scores):
    completions = [Completion([1], [0.0], s, {"acc": s}, "stop") for s in scores]
    return RolloutGroup(WorkItem("u", {}), [1], completions, 0, "s")


def test_pass_at_k_metrics_average_over_prompts_and_count_full_marks_only():
    groups = [_group([1.0, 0.0, 0.0, 0.0]), _group([0.5, 0.0, 0.0, 0.0]), _group([1.0] * 4)]
    metrics = pass_at_k_metrics(groups, "acc", [1, 2])
    assert metrics["pass@1"] == pytest.approx((0.25 + 0.0 + 1.0) / 3)
    assert metrics["pass@2"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert metrics["sampled_accuracy"] == pytest.approx((1 + 0.5 + 4) / 12)
    assert metrics["samples_per_prompt"] == 4 and metrics["prompts"] == 3


def test_sampled_items_have_seeds_that_depend_on_the_seed_and_uid_only():
    rows = [{"prompt_id": "a"}, {"prompt_id": "b"}]
    first, again, other = sampled_items(rows, 0), sampled_items(rows, 0), sampled_items(rows, 1)
    assert [i.seed for i in first] == [i.seed for i in again]
    assert first[0].seed != first[1].seed and first[0].seed != other[0].seed
    assert {i.lane for i in first} == {"sampled"}


def test_the_accuracy_line_names_where_a_resumed_run_started():
    assert accuracy_line({"eval_before/accuracy": 0.25, "eval_after/accuracy": 0.875,
                          "step": 150.0}) == (
        "greedy accuracy on the evaluation prompts: 0.250 -> 0.875 (step 150)")
    assert accuracy_line({"eval_before/accuracy": 0.5, "eval_before/step": 50.0,
                          "eval_after/accuracy": 0.9, "step": 100.0}) == (
        "greedy accuracy on the evaluation prompts: 0.500 (resumed at step 50) -> 0.900 "
        "(step 100)")
    assert accuracy_line({"eval_after/accuracy": 0.9, "step": 150.0}) == (
        "greedy accuracy on the evaluation prompts: 0.900 (step 150)")  # a finished run re-run
    assert accuracy_line({"step": 3.0}) is None


def _periodic(tmp_path, stop, **trainer):
    cfg = load_config(None, [f"trainer.run_dir={tmp_path}",
                             *(f"trainer.{k}={v}" for k, v in trainer.items())])
    return RunEvaluation(cfg, data=None, queue=None, tokenizer=None, run_dir=tmp_path,
                         accuracy_fn=None, stop=stop)


def test_a_periodic_evaluation_is_due_every_n_steps_and_leaves_the_last_to_eval_after(tmp_path):
    stop = threading.Event()
    with_after = _periodic(tmp_path, stop, steps=10, eval_every=5, eval_after=True)
    assert [s for s in range(1, 11) if with_after.due(s)] == [5]  # step 10 is eval_after's
    without_after = _periodic(tmp_path, stop, steps=10, eval_every=5, eval_after=False)
    assert [s for s in range(1, 11) if without_after.due(s)] == [5, 10]
    never = _periodic(tmp_path, stop, steps=10)  # eval_every unset
    assert not any(never.due(s) for s in range(1, 11))
    stop.set()  # a run that is stopping does not start one
    assert not without_after.due(5)


def test_eval_refuses_more_samples_than_the_configured_sampler_batch(arith_model, tmp_path,
                                                                     capsys):
    # A prompt's pass@k samples are decoded in one sampler batch: a sampler refuses more, and
    # pass@k went on without those prompts. Refused before any service starts.
    assert splitrl(["eval", str(arith_model), "--k", "1,8", "sampler.max_batch_size=4",
                    "--out", str(tmp_path)]) == 2
    assert ("--samples 8: pass@k decodes a prompt's samples together, in one sampler batch, but "
            "sampler.max_batch_size is 4. Use --samples (and --k) of at most 4, or "
            "sampler.max_batch_size=8") in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_eval_refuses_more_samples_than_a_running_samplers_batch(arith_model, tmp_path):
    # The batch a sampler advertises (GetInfo) can be smaller than configured: a KV cache
    # budget (sampler.kv_cache_bytes) holds fewer rows.
    sampler = ScriptedSampler("small", Script(capacity=4)).start()
    cfg = load_config(None, [f"model.path={arith_model}", f"trainer.run_dir={tmp_path}",
                             "trainer.data.eval_size=2"])
    try:
        with pytest.raises(ValueError, match=(
                rf"--samples 8: .* sampler\.max_batch_size is 4 at the sampler "
                rf"{sampler.address} \(its GetInfo\)\. Use --samples \(and --k\) of at most 4")):
            evaluate(cfg, [sampler.address], samples=8, ks=[1, 8], timeout_s=60)
    finally:
        sampler.stop()
    assert sampler.requests == []  # refused before any prompt was sent
