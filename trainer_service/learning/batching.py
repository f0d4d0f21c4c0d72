"""Scored rollout groups -> the learner's padded :class:`TrainBatch`.

Each completion becomes one row: the prompt left-padded to the batch's longest prompt, then the
completion right-padded. A multi-turn episode's completion holds its observation tokens too; its
``model_token_mask`` keeps them out of ``completion_mask``, so logprobs, KL, entropy and the loss
see the model's tokens only (docs/environments.md).

Lengths are rounded up to buckets so that a run compiles a few train programs, not one per
batch shape: four per doubling of the length, so padding costs at most 25% more tokens (a
power-of-two bucket cost up to 100%: 44 tokens trained as 64).
"""

from __future__ import annotations

import numpy as np

from splitrl.config import AlgorithmConfig
from trainer_service.learning.advantages import compute_advantages
from trainer_service.learning.learner import TrainBatch
from trainer_service.orchestration.rollouts import RolloutGroup


def bucket(n: int, minimum: int = 8) -> int:
    """Round ``n`` up to the next of ``minimum`` * 2^k * {1, 1.25, 1.5, 1.75} (at least
    ``minimum``): 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, ... for ``minimum`` 8."""
    size = minimum
    while size < n:
        size *= 2
    if size == minimum:
        return size
    half = size // 2
    step = max(half // 4, 1)
    return half + -(-(n - half) // step) * step


def batch_length(n: int, longest: int | None = None) -> int:
    """The padded length of a batch whose longest row has ``n`` tokens: its `bucket`, but not
    past ``longest``, the most tokens a row of the run can have (its longest prompt plus the
    generation budget), when that is known. Padding past it would only be work, and a run's
    full-length batches keep one shape all the same."""
    size = bucket(n)
    return min(size, longest) if longest is not None and n <= longest else size


def build_train_batch(
    groups: list[RolloutGroup], algorithm: AlgorithmConfig, *, pad_id: int = 0,
    longest: int | None = None,
) -> TrainBatch:
    """The batch of ``groups`` (rows left-padded to the longest prompt, then right-padded to
    `batch_length`; ``longest``: see there)."""
    rows = [(g, c) for g in groups for c in g.completions]
    if not rows:
        raise ValueError("build_train_batch: no completions in the groups")
    prompt_len = max(len(g.prompt_token_ids) for g in groups)
    completion_len = max(len(c.token_ids) for _, c in rows)
    length = batch_length(prompt_len + completion_len, longest)
    n = len(rows)
    tokens = np.full((n, length), pad_id, np.int32)
    attention = np.zeros((n, length), bool)
    completion = np.zeros((n, length), bool)
    sampler_lp = np.zeros((n, length), np.float32)
    group_ids = np.zeros(n, np.int32)
    rewards = np.zeros(n, np.float32)
    for i, (g, c) in enumerate(rows):
        p = len(g.prompt_token_ids)
        start = prompt_len - p
        end = prompt_len + len(c.token_ids)
        tokens[i, start:prompt_len] = g.prompt_token_ids
        tokens[i, prompt_len:end] = c.token_ids
        attention[i, start:end] = True
        completion[i, prompt_len:end] = True if c.model_token_mask is None else np.asarray(
            c.model_token_mask[: len(c.token_ids)], bool)  # observation tokens: not the model's
        sampler_lp[i, prompt_len:end] = c.logprobs[: len(c.token_ids)]
        rewards[i] = c.reward
    index = {id(g): k for k, g in enumerate(groups)}
    for i, (g, _) in enumerate(rows):
        group_ids[i] = index[id(g)]
    advantages = np.asarray(
        compute_advantages(
            algorithm.advantage, rewards, group_ids, std=algorithm.advantage_std
        ),
        np.float32,
    )
    return TrainBatch(
        tokens=tokens,
        attention_mask=attention,
        completion_mask=completion,
        sampler_logprobs=sampler_lp,
        advantages=advantages,
        group_ids=group_ids,
        rewards=rewards,
    )
