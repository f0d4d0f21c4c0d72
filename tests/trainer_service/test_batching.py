"""Scored groups -> the learner's padded batch, and sampler addresses from DNS."""

from __future__ import annotations

import numpy as np
import pytest

from splitrl.config import AlgorithmConfig
from trainer_service.learning.batching import batch_length, bucket, build_train_batch
from trainer_service.orchestration.membership import resolve_dns
from trainer_service.orchestration.rollouts import Completion, RolloutGroup, WorkItem


def group(uid: str, version: int, rewards=(1.0, 0.0), prompt=(5, 6, 7), completion=(8, 9)):
    return RolloutGroup(
        item=WorkItem(uid=uid, row={"prompt_id": uid}),
        prompt_token_ids=list(prompt),
        completions=[
            Completion(token_ids=list(completion), logprobs=[-0.5] * len(completion), reward=r,
                       rewards={"exact_answer": r}, finish_reason="stop")
            for r in rewards
        ],
        weight_version=version,
        sampler_id="s0",
    )


def test_train_batch_layout_masks_and_advantages():
    groups = [group("a", 0, rewards=(1.0, 0.0), prompt=(5, 6)),
              group("b", 0, rewards=(0.0, 0.0), prompt=(5, 6, 7, 8), completion=(9,))]
    batch = build_train_batch(groups, AlgorithmConfig(), pad_id=0)
    assert batch.tokens.shape == (4, bucket(4 + 2))
    # Prompts are left-padded to the longest prompt (4); completions start at column 4.
    np.testing.assert_array_equal(batch.tokens[0, :6], [0, 0, 5, 6, 8, 9])
    np.testing.assert_array_equal(batch.completion_mask[0, :6], [0, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(batch.attention_mask[2, :6], [1, 1, 1, 1, 1, 0])
    np.testing.assert_allclose(batch.sampler_logprobs[0, 4:6], [-0.5, -0.5])
    np.testing.assert_array_equal(batch.group_ids, [0, 0, 1, 1])
    # GRPO: (r - mean) / std within the group; a zero-variance group gets 0.
    np.testing.assert_allclose(batch.advantages, [1.0, -1.0, 0.0, 0.0], atol=1e-4)


def test_bucket_rounds_up_to_quarter_octaves():
    assert [bucket(n) for n in (1, 8, 9, 17, 44, 64, 65)] == [8, 8, 10, 20, 48, 64, 80]
    for n in range(1, 3000):  # never short, never more than 25% (or the minimum) padding
        assert n <= bucket(n) <= max(8, 1.25 * n)
    assert len({bucket(n) for n in range(1, 4097)}) == 37  # a few programs per run


def test_batches_are_not_padded_past_the_longest_row_the_run_can_have():
    # Prompts of at most 12 tokens and 32 new tokens: no row is longer than 44, so a full
    # batch is 44 long (not bucket(44) = 48) and a shorter one keeps its bucket.
    assert [batch_length(n, 44) for n in (30, 41, 44)] == [bucket(30), 44, 44]
    assert batch_length(45, 44) == bucket(45)  # longer than "possible": never cut, bucketed
    assert batch_length(44) == bucket(44)
    groups = [group("a", 0, prompt=(5,) * 12, completion=(8,) * 32),
              group("b", 0, prompt=(5,) * 9, completion=(9,) * 3)]
    batch = build_train_batch(groups, AlgorithmConfig(), pad_id=0, longest=44)
    assert batch.tokens.shape == (4, 44)
    np.testing.assert_array_equal(batch.attention_mask.sum(-1), [44, 44, 12, 12])


def test_dns_names_resolve_to_addresses_without_a_name_server():
    # Numeric hosts resolve locally: the test does not depend on this machine's DNS.
    assert resolve_dns("127.0.0.1:50300") == ["127.0.0.1:50300"]
    with pytest.raises(ValueError, match="NAME:PORT"):
        resolve_dns("localhost")


def test_episode_observation_tokens_are_masked_out_of_the_loss():
    """A trajectory's completion_mask covers exactly the model's tokens; every policy loss and
    aggregation then gives the loss of the same batch with the observation tokens left out."""
    import jax.numpy as jnp

    from trainer_service.learning import losses

    mask = [True, True, False, False, True, True]  # call, observation "=7", answer
    episode = group("e", 0, completion=(4, 2, 15, 12, 4, 2))
    for c in episode.completions:
        c.model_token_mask = list(mask)
        c.logprobs = [-0.5, -0.4, 0.0, 0.0, -0.3, -0.2]
    batch = build_train_batch([episode], AlgorithmConfig(), pad_id=0)
    np.testing.assert_array_equal(batch.completion_mask[0, :9], [0, 0, 0, *map(int, mask)])
    np.testing.assert_array_equal(batch.tokens[0, 3:9], [4, 2, 15, 12, 4, 2])
    # The loss over a masked trajectory equals the loss over its model tokens alone.
    rng = np.random.default_rng(0)
    cols = np.flatnonzero(batch.completion_mask[0])
    logp = jnp.asarray(rng.normal(-1.0, 0.3, batch.tokens.shape), jnp.float32)
    old = jnp.asarray(np.asarray(logp) + rng.normal(0, 0.05, logp.shape), jnp.float32)
    m = jnp.asarray(batch.completion_mask, jnp.float32)
    kept = np.zeros_like(batch.completion_mask)
    kept[:, : len(cols)] = True
    for loss in sorted(losses.POLICY_LOSSES):
        for agg in losses.AGGREGATIONS:
            kw = dict(loss=loss, aggregation=agg, constant_normalizer=8, beta=0.1,
                      ref=old - 0.1, entropy=jnp.ones_like(logp), entropy_coef=0.01)
            full, _ = losses.compute_loss(logp, old, batch.advantages, m, **kw)
            compact = lambda x: jnp.zeros_like(x).at[:, : len(cols)].set(x[:, cols])  # noqa: E731
            alone, _ = losses.compute_loss(
                compact(logp), compact(old), batch.advantages, jnp.asarray(kept, jnp.float32),
                **{**kw, "ref": compact(old - 0.1), "entropy": compact(jnp.ones_like(logp))})
            np.testing.assert_allclose(float(full), float(alone), rtol=1e-6,
                                       err_msg=f"{loss}/{agg}")
