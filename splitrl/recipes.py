"""Named algorithm presets: ``algorithm.recipe: grpo | dr_grpo | dapo | gspo | gspo_token``.

A recipe fills the ``algorithm.*`` keys a paper fixes; every key the config sets itself wins
(``algorithm: {recipe: dapo, eps_high: 0.3}`` is DAPO with a wider upper clip). The values and
where each comes from:

``grpo``: Shao et al. 2024, *DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
  Language Models* (arXiv:2402.03300), section 4.1: advantages normalised by the group's mean and
  std, PPO clip eps = 0.2, each sequence's token losses averaged and then averaged over the group
  ("seq-mean-token-mean"), KL to the reference with the unbiased k3 estimator and beta = 0.04.
``dr_grpo``: Liu et al. 2025, *Understanding R1-Zero-Like Training: A Critical Perspective*
  (arXiv:2503.20783), section 3.2 ("GRPO Done Right"): no division by the group std
  (``advantage: drgrpo``) and no per-sequence length normalisation: token losses summed and
  divided by a constant, the generation budget (``aggregation: constant``; the normaliser is
  ``sampling.max_new_tokens`` unless ``algorithm.constant_normalizer`` is set); eps = 0.2, no KL.
``dapo``: Yu et al. 2025, *DAPO: An Open-Source LLM Reinforcement Learning System at Scale*
  (arXiv:2503.14476): clip-higher (eps_low = 0.2, eps_high = 0.28), dynamic sampling (groups
  whose rewards are all equal are replaced by new draws: ``filter_zero_variance``), token-level
  loss ("token-mean"), no KL. Its fourth part, overlong reward shaping, is a reward: add the
  built-in ``overlong_penalty`` function to ``reward.functions`` (docs/rewards.md).
``gspo``: Zheng et al. 2025, *Group Sequence Policy Optimization* (arXiv:2507.18071): the
  length-normalised sequence-level importance ratio, clipped to [1 - 3e-4, 1 + 4e-4], group-
  normalised advantages, one loss per sequence averaged over the group, no KL.
``gspo_token``: the same paper's GSPO-token (section 4.3): GSPO's ratio at every token, so
  advantages could differ per token; with one advantage per sequence it has GSPO's gradient.
"""

from __future__ import annotations

from typing import Any

RECIPES: dict[str, dict[str, Any]] = {
    "grpo": {
        "loss": "grpo", "advantage": "grpo", "advantage_std": "group",
        "aggregation": "seq-mean-token-mean", "eps_low": 0.2, "eps_high": 0.2,
        "beta": 0.04, "kl_estimator": "k3",
    },
    "dr_grpo": {
        "loss": "grpo", "advantage": "drgrpo", "aggregation": "constant",
        "eps_low": 0.2, "eps_high": 0.2, "beta": 0.0,
    },
    "dapo": {
        "loss": "grpo", "advantage": "grpo", "advantage_std": "group",
        "aggregation": "token-mean", "eps_low": 0.2, "eps_high": 0.28, "beta": 0.0,
        "filter_zero_variance": True,
    },
    "gspo": {
        "loss": "gspo", "advantage": "grpo", "advantage_std": "group",
        "aggregation": "seq-mean-token-mean", "eps_low": 3e-4, "eps_high": 4e-4, "beta": 0.0,
    },
    "gspo_token": {
        "loss": "gspo-token", "advantage": "grpo", "advantage_std": "group",
        "aggregation": "seq-mean-token-mean", "eps_low": 3e-4, "eps_high": 4e-4, "beta": 0.0,
    },
}


def apply_recipe(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (the keys an ``algorithm`` section sets) over its recipe's presets."""
    name = values.get("recipe")
    if name is None or name not in RECIPES:  # no recipe, or an unknown one the schema refuses
        return values
    return {**RECIPES[name], **values}
