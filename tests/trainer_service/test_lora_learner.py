"""The learner with LoRA: only the adapters train (sharded on the mesh, optimizer state for them
alone), the base stays frozen and is the KL reference, the policy is the merged base, and
checkpoints resume exactly and refuse a train state of another kind."""

import dataclasses
import gc

import jax
import numpy as np
import pytest
from trainer_helpers import make_learner, mesh_of, rollout_batch, tiny_config

from splitrl.config import AlgorithmConfig, OptimizerConfig
from splitrl.models import lora as lora_lib
from trainer_service.learning.checkpoints import Checkpointer

CONSTANT_LR = OptimizerConfig(lr=2e-2)


def _spec(dropout=0.0, rank=4):
    targets = lora_lib.resolve_targets(tiny_config(), lora_lib.ALL_PROJECTIONS)
    return lora_lib.LoraSpec(rank, 2.0 * rank, targets, dropout)


def _on_policy(learner, batch):
    return dataclasses.replace(batch, sampler_logprobs=learner.logprobs(batch))


def _host(tree):
    return {k: np.asarray(v) for k, v in tree.items()}


def test_only_the_adapters_train_and_the_policy_is_the_merged_base():
    learner = make_learner(mesh_of(2), optimizer=CONSTANT_LR, lora=_spec())
    assert set(learner.params) == set(_spec().names())
    b = "model.layers.mlp.up_proj.lora_B.weight"  # [L, r, 64]: fsdp splits the 64
    assert len(learner.params[b].sharding.device_set) == 2
    base_before = _host(learner.base_params)
    batch = rollout_batch(0)
    before = (learner.logprobs(batch) * batch.completion_mask).sum(-1)
    for _ in range(4):
        metrics = learner.train_step(_on_policy(learner, batch))
    delta = (learner.logprobs(batch) * batch.completion_mask).sum(-1) - before
    winners = batch.rewards == 1
    assert np.all(delta[winners] > 0.05), delta
    assert np.all(delta[~winners] < 0), delta
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    for name, value in _host(learner.base_params).items():  # frozen, bitwise
        np.testing.assert_array_equal(value, base_before[name], err_msg=name)
    assert np.abs(np.asarray(learner.params[b])).max() > 0  # B left zero
    # The policy the samplers get: the merged base. Its logprobs are the in-forward ones.
    merged = learner.policy_params()
    assert set(merged) == set(base_before)
    q = "model.layers.self_attn.q_proj.weight"
    assert not np.array_equal(np.asarray(merged[q]), base_before[q])
    assert merged["model.norm.weight"] is learner.base_params["model.norm.weight"]
    plain = make_learner(mesh_of(2), optimizer=CONSTANT_LR)
    plain.params = jax.device_put(merged, plain.param_shardings)
    np.testing.assert_allclose(plain.logprobs(batch), learner.logprobs(batch), atol=2e-5)


def _live_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays())


def test_optimizer_state_is_the_adapters_and_beta_costs_no_second_model():
    start = _live_bytes()
    full = make_learner(mesh_of(2))
    full_bytes = _live_bytes() - start
    param_bytes = sum(x.nbytes for x in full.params.values())
    del full
    start = _live_bytes()
    lora = make_learner(mesh_of(2), lora=_spec(), algorithm=AlgorithmConfig(beta=0.1))
    lora_bytes = _live_bytes() - start
    adapter_bytes = sum(x.nbytes for x in lora.params.values())
    sizes = lora.state_bytes()
    assert sizes["trained_params"] == adapter_bytes and sizes["reference_params"] == 0
    assert sizes["frozen_params"] == param_bytes
    # Adam's two moments mirror the adapters (plus scalar counts), not the model.
    assert adapter_bytes * 2 <= sizes["opt_state"] < adapter_bytes * 2 + 64
    assert full_bytes == pytest.approx(3 * param_bytes, abs=1024)
    assert lora_bytes == pytest.approx(param_bytes + 3 * adapter_bytes, abs=1024)
    # beta > 0: the reference is the base with the adapters off; at the start (B = 0) the
    # policy is the base, so the KL is 0 exactly (the first step's lr is 0: warmup).
    kl = [lora.train_step(_on_policy(lora, rollout_batch(1)))["kl"] for _ in range(3)]
    assert kl[0] == kl[1] == 0.0 and kl[2] > 0


def test_dropout_masks_are_a_function_of_seed_and_step():
    batch = rollout_batch(2)
    runs = []
    for dropout, seed in ((0.3, 0), (0.3, 0), (0.3, 5), (0.0, 0)):
        learner = make_learner(mesh_of(2), optimizer=CONSTANT_LR, lora=_spec(dropout),
                               seed=seed)
        for _ in range(2):
            learner.train_step(_on_policy(learner, batch))
        runs.append(_host(learner.params))
    name = "model.layers.self_attn.v_proj.lora_B.weight"
    np.testing.assert_array_equal(runs[0][name], runs[1][name])
    assert not np.allclose(runs[0][name], runs[2][name])  # another seed: other masks
    assert not np.allclose(runs[0][name], runs[3][name])  # dropout does something


def test_checkpoints_resume_exactly_and_refuse_another_kind_of_train_state(tmp_path):
    def learner(**kw):
        return make_learner(mesh_of(4), epochs_per_batch=2, lora=_spec(0.1),
                            algorithm=AlgorithmConfig(loss="gspo", beta=0.05, tis_cap=2.0),
                            base_fingerprint="sha256:base", **kw)

    first = learner()
    with Checkpointer(tmp_path, every=2, keep=1, async_save=False) as ckpt:
        for step in range(1, 5):
            first.train_step(_on_policy(first, rollout_batch(10 + step)))
            ckpt.save(step, first.train_state(), weight_version=step,
                      learner_meta=first.checkpoint_meta())
    again = learner()
    with Checkpointer(tmp_path, every=2, keep=1, async_save=False) as ckpt:
        again.check_checkpoint_meta(ckpt.meta()["learner"])
        restored = ckpt.restore(again.abstract_train_state())
    assert restored.step == 4 and restored.learner_meta["lora"]["rank"] == 4
    again.load_train_state(restored.state, restored.weight_version)
    for step in (5, 6):
        batch = rollout_batch(10 + step)
        first.train_step(_on_policy(first, batch))
        again.train_step(_on_policy(again, batch))
    for name, value in _host(first.params).items():
        np.testing.assert_array_equal(np.asarray(again.params[name]), value, err_msg=name)

    meta = restored.learner_meta
    with pytest.raises(ValueError, match="saved with LoRA rank 4, but model.lora is unset"):
        make_learner(mesh_of(4)).check_checkpoint_meta(meta)
    with pytest.raises(ValueError, match="saved without LoRA, but model.lora has rank 4"):
        again.check_checkpoint_meta({"lora": None})
    with pytest.raises(ValueError, match="LoRA rank 4, but model.lora gives 8"):
        make_learner(mesh_of(4), lora=_spec(rank=8),
                     base_fingerprint="sha256:base").check_checkpoint_meta(meta)
    with pytest.raises(ValueError, match="trained on the base checkpoint sha256:base, but "
                                         "model.path now holds sha256:other"):
        make_learner(mesh_of(4), lora=_spec(),
                     base_fingerprint="sha256:other").check_checkpoint_meta(meta)
