"""Reward functions the end-to-end runs load as ``e2e_rewards:NAME`` (TRL style, as a TRL user
writes them: keyword arguments, dataset columns by name, one value per completion)."""

from __future__ import annotations


def think_format(completions, **kwargs):
    """Raises: the kind of bug that used to score silent zeros."""
    raise RuntimeError("think_format cannot parse the completion")


def too_few(completions, **kwargs):
    """Returns one score fewer than there are completions."""
    return [1.0] * (len(completions) - 1)


def not_a_number(completions, **kwargs):
    return ["high" for _ in completions]


def sum_of_columns(completions, a, b, **kwargs):
    """1 if the completion is a + b, computed from the typed dataset columns (ints)."""
    return [1.0 if c.strip() == str(x + y) else 0.0 for c, x, y in zip(completions, a, b,
                                                                          strict=True)]


def fails_on_3_plus_3(completions, a, b, **kwargs):
    """Raises on the prompt 3+3= only: a bug that shows up mid-run (the demo data draws it at
    step 5 with 4 prompts per step), not on the first batch."""
    if any((x, y) == (3, 3) for x, y in zip(a, b, strict=True)):
        raise ValueError("cannot score 3+3")
    return [0.0] * len(completions)
