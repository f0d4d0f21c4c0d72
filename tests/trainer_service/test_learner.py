"""Learner: learning signal, reference allocation, micro-batching, epochs, shardings, metrics.

Tests share one mesh and, where they can, one loss setting, so compiled steps are reused.
"""

import dataclasses
import gc

import jax
import numpy as np
import pytest
from trainer_helpers import make_learner, mesh_of, rollout_batch, tiny_model

from splitrl.config import (
    AlgorithmConfig,
    Config,
    MeshConfig,
    ModelSection,
    OptimizerConfig,
    SamplingConfig,
    TrainerConfig,
)
from trainer_service.learning.learner import Learner, TrainBatch

CONSTANT_LR = OptimizerConfig(lr=1e-2)


def _seq_logprobs(learner, batch):
    return (learner.logprobs(batch) * batch.completion_mask).sum(-1)


def _on_policy(learner, batch):
    return dataclasses.replace(batch, sampler_logprobs=learner.logprobs(batch))


def test_updates_raise_the_rewarded_completion_and_lower_the_others():
    learner = make_learner(mesh_of(2), optimizer=CONSTANT_LR, strategy="fsdp")
    shardings = {k: v.sharding for k, v in learner.params.items()}
    q = "model.layers.self_attn.q_proj.weight"
    assert len(shardings[q].device_set) == 2 and shardings[q].spec != jax.sharding.PartitionSpec()
    batch = rollout_batch(0)  # one completion per group has reward 1
    before = _seq_logprobs(learner, batch)
    for _ in range(4):
        metrics = learner.train_step(_on_policy(learner, batch))
    delta = _seq_logprobs(learner, batch) - before
    winners = batch.rewards == 1
    assert np.all(delta[winners] > 0.1), delta
    assert np.all(delta[~winners] < 0), delta
    assert learner.version == 4 and np.isfinite(metrics["loss"])
    for k, v in learner.params.items():  # the update keeps the trainer's layout
        assert v.sharding.is_equivalent_to(shardings[k], v.ndim), k


def test_gradients_accumulate_sharded_as_the_parameters_are():
    # FSDP: each device sums the gradient of its own shard. Accumulators made without a
    # sharding sat on one device, and every gradient came back whole on every device.
    learner = make_learner(mesh_of(2), optimizer=CONSTANT_LR, strategy="fsdp")
    batch = rollout_batch(0)
    mbs = learner._micro_batches(batch, batch.completion_mask)
    counts = {"num_tokens": float(batch.completion_mask.sum()), "num_sequences": 8.0}
    grads, _, _ = learner._accumulate_gradients(
        mbs, None, [learner._reference_logprobs(mb) for mb in mbs], counts)
    q = "model.layers.self_attn.q_proj.weight"
    assert grads[q].sharding.spec != jax.sharding.PartitionSpec()
    for name, grad in grads.items():
        assert grad.sharding.is_equivalent_to(learner.params[name].sharding, grad.ndim), name


def _live_bytes() -> int:
    # Collect first: the source models are freed only by the cycle collector (nnx graphs hold
    # reference cycles), and earlier tests in the same process leave such garbage too.
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays())


def test_beta_zero_keeps_no_reference_parameters():
    before = _live_bytes()
    no_ref = make_learner(mesh_of(2), algorithm=AlgorithmConfig(beta=0.0))
    mid = _live_bytes()
    with_ref = make_learner(mesh_of(2), algorithm=AlgorithmConfig(beta=0.1))
    after = _live_bytes()
    param_bytes = sum(x.nbytes for x in no_ref.params.values())
    assert no_ref.ref_params is None and with_ref.ref_params is not None
    # A learner is params + Adam's two moments; the reference adds one more copy of the params.
    assert mid - before == pytest.approx(3 * param_bytes, abs=1024)
    assert after - mid == pytest.approx(4 * param_bytes, abs=1024)


def test_micro_batches_accumulate_to_the_full_batch_update():
    full = make_learner(mesh_of(2), optimizer=CONSTANT_LR)
    micro = make_learner(mesh_of(2), optimizer=CONSTANT_LR, micro_batch_size=3)
    batch = rollout_batch(2)  # 8 rows -> micro-batches of 3 + 3 + 2 (padded with empty rows)
    batch = dataclasses.replace(batch, sampler_logprobs=full.logprobs(batch) + 0.1)  # TIS
    m_full, m_micro = full.train_step(batch), micro.train_step(batch)
    # Only summation order differs; Adam's first step (~ lr * sign(g), lr = 1e-2) amplifies
    # that float32 noise where g is near 0, hence 1e-5 rather than 1e-7.
    for name in full.params:
        np.testing.assert_allclose(micro.params[name], full.params[name], atol=1e-5)
    for key in ("loss", "policy_loss", "entropy", "grad_norm", "tis_weight_mean", "ratio_max"):
        assert m_micro[key] == pytest.approx(m_full[key], rel=1e-4, abs=1e-7), key


def test_a_cpu_learner_runs_its_layers_unrolled_and_trains_as_the_scan_does():
    """`model.layer_loop` "auto" unrolls the layers on a CPU mesh (the scan copies every
    layer's weights and activations in and out of stacked buffers there); the update is the
    scan's, to float32 tolerance."""
    batch = rollout_batch(2)
    unrolled = make_learner(mesh_of(2), optimizer=CONSTANT_LR)
    scanned = make_learner(mesh_of(2), optimizer=CONSTANT_LR, layer_loop="scan")
    assert (unrolled.model().layer_loop, scanned.model().layer_loop) == ("unrolled", "scan")
    m_unrolled, m_scanned = unrolled.train_step(batch), scanned.train_step(batch)
    for name in scanned.params:  # Adam's first step amplifies float32 noise where g ~ 0
        np.testing.assert_allclose(unrolled.params[name], scanned.params[name], atol=1e-5)
    for key in ("loss", "policy_loss", "entropy", "grad_norm"):
        assert m_unrolled[key] == pytest.approx(m_scanned[key], rel=1e-5, abs=1e-7), key


def test_a_warm_up_changes_nothing_the_next_step_computes():
    batch = rollout_batch(2)
    plain = make_learner(mesh_of(2), optimizer=CONSTANT_LR)
    warmed = make_learner(mesh_of(2), optimizer=CONSTANT_LR)
    before = jax.device_get(warmed.params)
    warmed.warm_up(*batch.tokens.shape)
    assert warmed.version == 0
    for name, value in jax.device_get(warmed.params).items():
        np.testing.assert_array_equal(value, before[name])
    m_plain, m_warmed = plain.train_step(batch), warmed.train_step(batch)
    assert m_warmed == m_plain
    for name in plain.params:  # bitwise: a synchronous run is reproducible with or without it
        np.testing.assert_array_equal(warmed.params[name], plain.params[name])


def test_later_epochs_measure_the_ratio_against_the_first_epoch_and_report_metrics():
    learner = make_learner(mesh_of(2), epochs_per_batch=3, optimizer=OptimizerConfig(lr=5e-2))
    m = learner.train_step(_on_policy(learner, rollout_batch(4)))
    # Epoch 1 is on-policy (every ratio 1); later epochs have moved away from pi_old.
    assert m["ratio_max"] > 1.0 and m["ratio_min"] < 1.0
    expected = {"loss", "policy_loss", "entropy", "grad_norm", "lr", "clip_frac_low",
                "clip_frac_high", "ratio_mean", "tis_weight_mean", "advantage_mean",
                "advantage_std", "tokens"}
    assert expected <= set(m)
    # Rewards and lengths are the run's reward/* and completion_len/mean: one name each.
    assert not {k for k in m if k.startswith(("reward", "completion"))}
    assert m["tokens"] == 20  # 8 completions of 3 or 2 tokens
    assert m["lr"] == pytest.approx(5e-2) and m["grad_norm"] > 0
    assert int(learner.opt_state[1][0].count) == 3  # one optimizer update per epoch


def test_a_batch_without_completion_tokens_is_skipped_without_an_update():
    learner = make_learner(mesh_of(2), optimizer=CONSTANT_LR)
    batch = _on_policy(learner, rollout_batch(5))
    batch.completion_mask[:] = False
    before = {k: np.asarray(v) for k, v in learner.params.items()}
    m = learner.train_step(batch)
    assert m["skipped"] == 1.0 and learner.version == 0
    for k, v in learner.params.items():
        np.testing.assert_array_equal(v, before[k])


def test_malformed_batches_are_rejected_with_the_field_name():
    b = rollout_batch(6)
    with pytest.raises(ValueError, match="completion_mask: expected shape"):
        TrainBatch(b.tokens, b.attention_mask, b.completion_mask[:, :3], b.sampler_logprobs,
                   b.advantages, b.group_ids)
    with pytest.raises(ValueError, match="advantages: expected shape"):
        TrainBatch(b.tokens, b.attention_mask, b.completion_mask, b.sampler_logprobs,
                   b.advantages[:3], b.group_ids)
    bad = b.completion_mask.copy()
    bad[:, 0] = True
    with pytest.raises(ValueError, match="position 0"):
        TrainBatch(b.tokens, b.attention_mask, bad, b.sampler_logprobs, b.advantages,
                   b.group_ids)


def test_from_config_reads_the_run_config():
    cfg = Config(
        algorithm=AlgorithmConfig(loss="gspo-token", beta=0.0),
        sampling=SamplingConfig(temperature=0.7),
        trainer=TrainerConfig(micro_batch_size=4, epochs_per_batch=2,
                              mesh=MeshConfig(axes={"tensor": 2}, strategy="tp")),
    )
    learner = Learner.from_config(tiny_model(), cfg, mesh_of(2, axes=("tensor",)))
    assert (learner.micro_batch_size, learner.epochs, learner.temperature) == (4, 2, 0.7)
    assert learner.model().layer_loop == "unrolled"  # "auto" on a CPU mesh
    scan = cfg.model_copy(update={"model": ModelSection(layer_loop="scan")})
    assert Learner.from_config(tiny_model(), scan, mesh_of(2)).model().layer_loop == "scan"
    assert learner.loss_settings["loss"] == "gspo-token" and learner.ref_params is None
    q = learner.params["model.layers.self_attn.q_proj.weight"]
    assert "tensor" in tuple(q.sharding.spec)
