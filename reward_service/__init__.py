"""SplitRL reward service: scores completions with named reward functions in isolated workers.

Public API::

    from reward_service import RewardScorer, Item, RewardValue, resolve
    scorer = RewardScorer(config.reward)        # starts the worker processes
    results = scorer.score([Item(completion="... \\\\boxed{72}", reference="72")])
    results[0].scores, results[0].total, results[0].reasons

A reward function scores one prompt's group of completions and returns one float (or None) per
completion, in TRL's style (``f(completions, **kwargs)``), EasyDeL's (``f(prompts, completions,
batch, **kwargs)``) or ours (``f(prompts, completions, references, **kwargs)``), detected from
its signature (``conventions.py``; docs/rewards.md). Built-ins: ``math_accuracy``, ``format``,
``length``, ``exact_answer``; anything else is loaded from ``module:function``.
``reward_service.server.main(config)`` runs the gRPC service.
"""

from reward_service.registry import (
    FunctionSpec,
    RewardFunction,
    RewardValue,
    builtin_names,
    register,
    resolve,
)
from reward_service.scoring import Item, ItemResult, RequestError, RewardScorer

__all__ = [
    "FunctionSpec",
    "Item",
    "ItemResult",
    "RequestError",
    "RewardFunction",
    "RewardScorer",
    "RewardValue",
    "builtin_names",
    "register",
    "resolve",
]
