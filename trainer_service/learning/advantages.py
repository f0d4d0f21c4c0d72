"""Advantage estimators for GRPO-family losses: pure functions, registered by name.

Every estimator maps the scalar rewards of a batch of completions, and the id of the prompt
group each completion belongs to, to one advantage per completion:

    advantages = ADVANTAGES[name](rewards[N], group_ids[N], std="group" | "batch", eps=1e-6)

Group statistics use the population standard deviation (ddof = 0), so a group with a single
completion, or whose completions all have the same reward, has advantage exactly 0 (nothing to
compare against). `zero_variance_mask` flags those groups so the trainer can drop them.

Group ids may be any integers (e.g. the prompt index); they do not need to be contiguous.
These run eagerly on the host before the batch is sharded (they are tiny), so the number of
groups does not have to be static.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from splitrl.registry import Registry

AdvantageFn = Callable[..., jnp.ndarray]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
register = ADVANTAGES.register
get_advantage_fn = ADVANTAGES.get


def _group_stats(rewards, group_ids):
    """Per-completion (group mean, group population std) of the rewards."""
    rewards = jnp.asarray(rewards, jnp.float32)
    group_ids = np.asarray(group_ids)
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [N]; got {rewards.shape} and {group_ids.shape}"
        )
    _, inverse, counts = np.unique(group_ids, return_inverse=True, return_counts=True)
    inverse = jnp.asarray(inverse.reshape(-1))
    num_groups = counts.shape[0]
    counts = jnp.asarray(counts, jnp.float32)
    mean = jnp.zeros(num_groups).at[inverse].add(rewards) / counts
    centered = rewards - mean[inverse]
    var = jnp.zeros(num_groups).at[inverse].add(centered**2) / counts
    return mean[inverse], jnp.sqrt(var)[inverse]


def _scale(rewards, group_std, std: str):
    if std == "group":
        return group_std
    if std == "batch":
        return jnp.std(jnp.asarray(rewards, jnp.float32))
    raise ValueError(f"advantage std must be 'group' or 'batch', got {std!r}")


@register("grpo")
def grpo_advantages(rewards, group_ids, *, std: str = "group", eps: float = 1e-6) -> jnp.ndarray:
    """GRPO (Shao et al., 2024): A_i = (r_i - mean_g(r)) / (std + eps).

    std = "group": std_g(r), the population std of the rewards in i's group g (the paper).
    std = "batch": std(r) over the whole batch (one scale for every group, as in
    REINFORCE++ / TRL's scale_rewards="batch"); still centred on the group mean.
    """
    mean, group_std = _group_stats(rewards, group_ids)
    rewards = jnp.asarray(rewards, jnp.float32)
    return (rewards - mean) / (_scale(rewards, group_std, std) + eps)


@register("drgrpo")
def drgrpo_advantages(
    rewards, group_ids, *, std: str = "group", eps: float = 1e-6
) -> jnp.ndarray:
    """Dr.GRPO (Liu et al., 2025): A_i = r_i - mean_g(r), no division by a std.

    `std` and `eps` are accepted (and ignored) so every estimator has one signature.
    """
    del std, eps
    mean, _ = _group_stats(rewards, group_ids)
    return jnp.asarray(rewards, jnp.float32) - mean


def zero_variance_mask(rewards, group_ids, *, atol: float = 0.0) -> jnp.ndarray:
    """bool[N]: True where completion i's group has std_g(r) <= atol.

    Such groups (including single-completion groups) carry no learning signal: every
    advantage in them is 0. DAPO's dynamic sampling drops them and samples again.
    """
    _, group_std = _group_stats(rewards, group_ids)
    return group_std <= atol


def compute_advantages(
    name: str, rewards, group_ids, *, std: str = "group", eps: float = 1e-6
) -> jnp.ndarray:
    """Look up estimator `name` and apply it (the entry point the trainer uses)."""
    return get_advantage_fn(name)(rewards, group_ids, std=std, eps=eps)
