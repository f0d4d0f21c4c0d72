"""What a train step's rollouts say, as metrics (``metrics.jsonl``, trackers, ``Status``)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from trainer_service.orchestration.episode_metrics import episode_metrics
from trainer_service.prompt_feed import Collected

# The metrics a step's log line shows (every `trainer.log_every` steps); metrics.jsonl has all.
LOGGED = {
    "loss", "reward/mean", "accuracy/mean", "kl", "entropy", "grad_norm",
    "staleness/max", "time/step_s", "time/wait_rollouts_s",
}


def rollout_metrics(collected: Collected, counts: Mapping[str, int], version: int,
                    accuracy_fn: str | None) -> dict[str, float]:
    """The queue's running ``counts``, the step's dynamic sampling, and its groups' rewards,
    staleness against the weight ``version`` and completion lengths; the accuracy is the mean
    of the ``accuracy_fn`` reward, when the run has one; multi-turn episodes add theirs."""
    out = {
        "counts/zero_variance_filtered": float(counts["zero_variance_filtered"]),
        "counts/stale_dropped": float(counts["stale_dropped"]),
        "counts/redispatched": float(counts["redispatched"]),
        "counts/dropped_refused": float(counts["dropped_refused"]),
        "dynamic_sampling/filtered": float(len(collected.filtered)),
        "dynamic_sampling/extra_draws": float(collected.extra_draws),
        "dynamic_sampling/short_step": float(collected.short),
        "groups": float(len(collected.groups)),
    }
    groups = collected.groups
    if not groups:
        return out
    rewards = np.concatenate([g.rewards for g in groups])
    staleness = [version - g.weight_version for g in groups]
    out.update({
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/min": float(rewards.min()),
        "reward/max": float(rewards.max()),
        "staleness/mean": float(np.mean(staleness)),
        "staleness/max": float(np.max(staleness)),
        "completion_len/mean": float(np.mean([len(c.token_ids) for g in groups
                                              for c in g.completions])),
    })
    if accuracy_fn:
        out["accuracy/mean"] = float(np.mean([c.rewards.get(accuracy_fn, 0.0)
                                              for g in groups for c in g.completions]))
    out.update(episode_metrics([c for g in groups for c in g.completions]))
    return out
