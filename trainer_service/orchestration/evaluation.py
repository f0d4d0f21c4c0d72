"""Greedy pass@1 on an evaluation split, measured through the training path.

Evaluation prompts are work items of the queue's ``eval`` lane: the same dispatcher, the same
``Rollout`` call (one greedy completion per prompt, scored by the reward service), the same
handling of failed samplers. What is measured is what the samplers serve. The eval lane's
requests are reproducible (fixed composition), so the same weights give the same accuracy.

Accuracy is the mean score of one reward function, named in the config
(``reward.accuracy_function``; by default the first configured function): for a function that
scores 0 or 1, the fraction answered correctly.
"""

from __future__ import annotations

import numpy as np

from splitrl.config import Config
from trainer_service.orchestration.rollouts import EVAL, RolloutGroup, WorkItem


def accuracy_function(cfg: Config) -> str | None:
    """The reward function that measures correctness, as configured (None: no functions)."""
    if cfg.reward.accuracy_function is not None:
        return cfg.reward.accuracy_function
    return cfg.reward.functions[0].name if cfg.reward.functions else None


def eval_items(rows: list[dict]) -> list[WorkItem]:
    """One eval-lane work item per row, in the split's order (greedy: no seed needed)."""
    return [WorkItem(uid=f"eval:{row['prompt_id']}#{i}", row=row, seq=i, lane=EVAL)
            for i, row in enumerate(rows)]


def eval_metrics(groups: list[RolloutGroup], accuracy_fn: str | None,
                 asked: int) -> dict[str, float]:
    """eval/accuracy, eval/reward, eval/count (answered) and eval/dropped (refused prompts)."""
    completions = [g.completions[0] for g in groups]
    if accuracy_fn is None:
        scores = [c.reward for c in completions]
    else:
        scores = [c.rewards.get(accuracy_fn, 0.0) for c in completions]
    return {
        "eval/accuracy": float(np.mean(scores)) if scores else 0.0,
        "eval/reward": float(np.mean([c.reward for c in completions])) if completions else 0.0,
        "eval/count": float(len(groups)),
        "eval/dropped": float(asked - len(groups)),
    }
