"""Advantage estimators for GRPO-family losses: pure functions, registered by name.

Every estimator maps the scalar rewards of a batch of completions, and the id of the prompt
group each completion belongs to, to one advantage per completion:

    advantages = ADVANTAGES[name](rewards[N], group_ids[N], std="group" | "batch", eps=1e-6)

Statistics are computed in float64 on the host (rewards arrive as float32 from the wire): in
float32 the mean of three equal rewards of 0.9 is not 0.9, and dividing that rounding error by
a tiny std gave every completion of an all-equal group an advantage of ~0.06. A group with a
single completion, or whose completions all have exactly the same reward, gets advantage
exactly 0 (nothing to compare against) from every estimator; `zero_variance_mask` flags those
groups so the trainer can drop them (DAPO's dynamic sampling).

Group ids may be any integers (e.g. the prompt index); they do not need to be contiguous.
These run eagerly on the host before the batch is sharded (they are tiny), so the number of
groups does not have to be static. Results are float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from splitrl.registry import Registry

AdvantageFn = Callable[..., np.ndarray]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
register = ADVANTAGES.register
get_advantage_fn = ADVANTAGES.get


class GroupStats(NamedTuple):
    """Per-completion statistics of its group (float64 [N])."""

    rewards: np.ndarray  # the rewards, float64
    mean: np.ndarray  # group mean
    std: np.ndarray  # group population std (ddof = 0)
    size: np.ndarray  # group size
    constant: np.ndarray  # bool: every reward of the group is exactly equal (or size 1)


def group_stats(rewards, group_ids) -> GroupStats:
    """Group mean, population std, size and "all equal" of each completion's group."""
    rewards = np.asarray(rewards, np.float64)
    group_ids = np.asarray(group_ids)
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [N]; got {rewards.shape} and {group_ids.shape}"
        )
    _, inverse, counts = np.unique(group_ids, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    sums = np.bincount(inverse, weights=rewards, minlength=counts.size)
    mean = sums / counts
    centered = rewards - mean[inverse]
    var = np.bincount(inverse, weights=centered**2, minlength=counts.size) / counts
    high = np.full(counts.size, -np.inf)
    low = np.full(counts.size, np.inf)
    np.maximum.at(high, inverse, rewards)
    np.minimum.at(low, inverse, rewards)
    return GroupStats(rewards, mean[inverse], np.sqrt(var)[inverse],
                      counts[inverse].astype(np.float64), (high == low)[inverse])


def _scale(stats: GroupStats, std: str) -> np.ndarray | float:
    if std == "group":
        return stats.std
    if std == "batch":
        return float(np.std(stats.rewards))
    raise ValueError(f"advantage std must be 'group' or 'batch', got {std!r}")


def _finish(stats: GroupStats, advantages: np.ndarray) -> np.ndarray:
    """float32 advantages, exactly 0 for groups with nothing to compare."""
    return np.where(stats.constant, 0.0, advantages).astype(np.float32)


@register("grpo")
def grpo_advantages(rewards, group_ids, *, std: str = "group", eps: float = 1e-6) -> np.ndarray:
    """GRPO (Shao et al., 2024): A_i = (r_i - mean_g(r)) / (std + eps).

    std = "group": std_g(r), the population std of the rewards in i's group g (the paper).
    std = "batch": std(r) over the whole batch (one scale for every group, as in
    REINFORCE++ / TRL's scale_rewards="batch"); still centred on the group mean.
    """
    stats = group_stats(rewards, group_ids)
    scale = _scale(stats, std)  # checked even when every group is constant
    return _finish(stats, (stats.rewards - stats.mean) / (scale + eps))


@register("drgrpo")
def drgrpo_advantages(
    rewards, group_ids, *, std: str = "group", eps: float = 1e-6
) -> np.ndarray:
    """Dr.GRPO (Liu et al., 2025): A_i = r_i - mean_g(r), no division by a std.

    `std` and `eps` are accepted (and ignored) so every estimator has one signature.
    """
    del std, eps
    stats = group_stats(rewards, group_ids)
    return _finish(stats, stats.rewards - stats.mean)


@register("rloo")
def rloo_advantages(rewards, group_ids, *, std: str = "group", eps: float = 1e-6) -> np.ndarray:
    """RLOO (Ahmadian et al., 2024; Kool et al., 2019): each completion's baseline is the mean
    reward of the *other* completions of its group,

        A_i = r_i - (sum_g(r) - r_i) / (G - 1) = G / (G - 1) * (r_i - mean_g(r)),

    an unbiased baseline (it does not depend on r_i). A single-completion group has none: 0.
    No division by a std; `std` and `eps` are accepted (and ignored) like Dr.GRPO's.
    """
    del std, eps
    stats = group_stats(rewards, group_ids)
    size = stats.size
    scale = np.where(size > 1, size / np.maximum(size - 1, 1), 0.0)
    return _finish(stats, scale * (stats.rewards - stats.mean))


def zero_variance_mask(rewards, group_ids) -> np.ndarray:
    """bool[N]: True where completion i's group has rewards that are all exactly equal.

    Such groups (including single-completion groups) carry no learning signal: every
    advantage in them is 0. DAPO's dynamic sampling drops them and samples again.
    """
    return group_stats(rewards, group_ids).constant


def compute_advantages(
    name: str, rewards, group_ids, *, std: str = "group", eps: float = 1e-6
) -> np.ndarray:
    """Look up estimator `name` and apply it (the entry point the trainer uses)."""
    return get_advantage_fn(name)(rewards, group_ids, std=std, eps=eps)
