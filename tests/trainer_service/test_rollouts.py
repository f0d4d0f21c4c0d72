"""The rollout buffer (staleness bound, dynamic sampling, duplicates) and batch building."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from splitrl.config import AlgorithmConfig
from trainer_service.learning.batching import bucket, build_train_batch
from trainer_service.orchestration.membership import resolve_dns
from trainer_service.orchestration.rollouts import Completion, RolloutBuffer, RolloutGroup, WorkItem


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


def test_stale_groups_are_dropped_and_requeued_not_lost():
    requeued = []
    buffer = RolloutBuffer(on_requeue=requeued.append)
    buffer.put(group("a", version=3))
    buffer.put(group("b", version=5))
    buffer.put(group("c", version=4))
    taken = buffer.take(2, current_version=5, max_staleness=1, timeout_s=1)
    assert [g.item.uid for g in taken] == ["c", "b"]  # oldest usable first
    assert [i.uid for i in requeued] == ["a"]
    assert buffer.counts["stale_dropped"] == 1


def test_zero_variance_groups_are_filtered_when_asked():
    buffer = RolloutBuffer(on_requeue=lambda item: None)
    buffer.put(group("flat", 0, rewards=(1.0, 1.0)))
    buffer.put(group("useful", 0, rewards=(1.0, 0.0)))
    taken = buffer.take(1, 0, 0, filter_zero_variance=True, timeout_s=1)
    assert [g.item.uid for g in taken] == ["useful"]
    assert buffer.counts["zero_variance_filtered"] == 1


def test_a_group_already_trained_on_is_a_duplicate():
    buffer = RolloutBuffer(on_requeue=lambda item: None)
    buffer.put(group("a", 0))
    buffer.take(1, 0, 0, timeout_s=1)
    buffer.put(group("a", 0))  # a late answer from a sampler the prompt was taken away from
    assert len(buffer) == 0 and buffer.counts["duplicate"] == 1


def test_take_waits_for_groups_and_tops_up_while_waiting():
    buffer = RolloutBuffer(on_requeue=lambda item: None)
    calls = []

    def feed():
        calls.append(1)
        if len(calls) == 1:
            threading.Timer(0.05, lambda: buffer.put(group("late", 0))).start()

    taken = buffer.take(1, 0, 0, timeout_s=10, while_waiting=feed)
    assert [g.item.uid for g in taken] == ["late"] and calls
    with pytest.raises(TimeoutError, match="waited"):
        buffer.take(1, 0, 0, timeout_s=0.2)


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


def test_bucket_rounds_up_to_powers_of_two():
    assert [bucket(n) for n in (1, 8, 9, 17, 64)] == [8, 8, 16, 32, 64]


def test_dns_names_resolve_to_every_address():
    assert resolve_dns("localhost:50300")[0].endswith(":50300")
    assert resolve_dns("no-such-host.invalid:1") == []
    with pytest.raises(ValueError, match="NAME:PORT"):
        resolve_dns("localhost")
