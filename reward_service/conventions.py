"""Calling conventions: how a reward function is called with one batch of completions.

The style of a function is detected once, from its signature, when it is loaded:

``splitrl``
    ``f(prompts, completions, references, **kwargs)``: the first three parameters are named so.
    Positional lists of strings (``prompts`` rendered as the model saw them); keyword lists of
    ``completion_tokens``, ``truncated`` and every dataset column / metadata key.
``easydel``
    A parameter named ``batch`` (EasyDeL's ``accuracy_reward(prompts, completions, batch,
    **kwargs)``). Called with keywords ``prompts`` and ``completions`` (one per completion, as
    chat messages for conversational data) and ``batch``: a dict of the columns and
    ``reference``, one value per prompt of the call (a call scores one prompt's group).
``trl``
    Anything else (``f(completions, **kwargs)``, ``f(prompts, completions, ground_truth,
    **kwargs)``). Called with keywords only, as TRL's GRPOTrainer calls them: ``prompts``,
    ``completions`` (strings, or message lists for conversational data), ``completion_ids``
    (also as ``completions_ids``, TRL's documentation's spelling), ``trainer_state``
    (``global_step`` = the weight version that generated the completions), ``reference``,
    ``completion_tokens``, ``truncated`` and every column, one value per completion.

A function without ``**kwargs`` gets only the keywords it names; a parameter it requires that
the call cannot supply is an error naming it and what is available. ``async def`` functions are
run to completion. Every call returns whatever the function returned; ``_worker.check_results``
judges it.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Style = Literal["splitrl", "trl", "easydel"]
NATIVE_POSITIONAL = ("prompts", "completions", "references")


@dataclass(frozen=True)
class TrainerState:
    """What TRL-style functions get as ``trainer_state``: ``global_step`` is the weight version
    (trainer step) of the policy that generated the completions."""

    global_step: int


@dataclass(frozen=True)
class Signature:
    style: Style
    takes_var_keyword: bool  # has **kwargs: gets every keyword
    names: frozenset[str]  # the parameters it can take by keyword
    required: tuple[str, ...]  # keyword parameters without a default
    is_async: bool
    text: str  # "(completions, **kwargs)", for logs

    def describe(self) -> str:
        return f"{self.style} style {self.text}"


def detect(fn: Callable) -> Signature:
    """The calling convention of ``fn``, from its signature (options already bound)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: assume ours
        return Signature("splitrl", True, frozenset(), (), False, "(...)")
    params = list(sig.parameters.values())
    positional = [p.name for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    names = frozenset(p.name for p in params
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    if tuple(positional[:3]) == NATIVE_POSITIONAL:
        style: Style = "splitrl"
        required = tuple(p.name for p in params[3:] if p.default is p.empty
                         and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    else:
        style = "easydel" if "batch" in names else "trl"
        required = tuple(p.name for p in params if p.default is p.empty
                         and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY]
        if positional_only:
            raise ValueError(f"parameters {positional_only} are positional-only; a {style}-style "
                             "reward function is called with keyword arguments")
    is_async = inspect.iscoroutinefunction(fn)  # (an awaitable result is awaited too)
    return Signature(style, var_kw, names, required, is_async, str(sig))


def _chat(items: Sequence[dict]) -> bool:
    return bool(items) and all(item.get("prompt_messages") for item in items)


def _per_completion_columns(items: Sequence[dict]) -> dict[str, list]:
    """Metadata (strings) and columns (typed), one value per completion; a key some items lack
    gets None for them."""
    keys: dict[str, None] = {}
    for item in items:
        keys.update(dict.fromkeys(item.get("metadata") or {}))
        keys.update(dict.fromkeys(item.get("columns") or {}))
    out = {}
    for key in keys:
        out[key] = [(item.get("columns") or {}).get(key, (item.get("metadata") or {}).get(key))
                    for item in items]
    return out


def _completion(item: dict, chat: bool) -> Any:
    """TRL's ``completions`` entry: an episode's conversation (assistant turns, tool calls and
    results) as its message list, else the completion as one assistant message for
    conversational data, else the completion's text."""
    if item.get("completion_messages"):
        return item["completion_messages"]
    return [{"role": "assistant", "content": item["completion"]}] if chat else item["completion"]


def _trl_keywords(items: Sequence[dict]) -> dict[str, Any]:
    chat = _chat(items)
    ids = [list(item.get("completion_ids") or ()) for item in items]
    kwargs: dict[str, Any] = _per_completion_columns(items)
    kwargs.update(
        prompts=[item["prompt_messages"] if chat else item["prompt"] for item in items],
        completions=[_completion(item, chat) for item in items],
        completion_ids=ids,
        completions_ids=ids,
        trainer_state=TrainerState(int(items[0].get("weight_version", 0)) if items else 0),
        reference=[item["reference"] for item in items],
        completion_tokens=[item["completion_tokens"] for item in items],
        truncated=[item["truncated"] for item in items],
    )
    return kwargs


def _easydel_keywords(items: Sequence[dict]) -> dict[str, Any]:
    kwargs = _trl_keywords(items)
    # One entry per prompt of the call: a call holds one prompt's completions (or one item).
    first = items[:1]
    batch = {key: values[:1] for key, values in _per_completion_columns(first).items()}
    batch["reference"] = [item["reference"] for item in first]
    kwargs["batch"] = batch
    return kwargs


def _native_arguments(items: Sequence[dict]) -> tuple[tuple, dict[str, Any]]:
    args = ([item["prompt"] for item in items], [item["completion"] for item in items],
            [item["reference"] for item in items])
    kwargs = _per_completion_columns(items)
    kwargs["completion_tokens"] = [item["completion_tokens"] for item in items]
    kwargs["truncated"] = [item["truncated"] for item in items]
    return args, kwargs


def call(fn: Callable, signature: Signature, items: Sequence[dict]) -> Any:
    """Call ``fn`` once on ``items`` (payload dicts of ``scoring.Item``) in its convention."""
    if signature.style == "splitrl":
        args, kwargs = _native_arguments(items)
    elif signature.style == "easydel":
        args, kwargs = (), _easydel_keywords(items)
    else:
        args, kwargs = (), _trl_keywords(items)
    missing = [name for name in signature.required if name not in kwargs]
    if missing:
        raise TypeError(
            f"the function requires argument {missing[0]!r}, which this data does not have "
            f"(available: {', '.join(sorted(kwargs))}); add the column to the dataset or "
            "give the parameter a default")
    if not signature.takes_var_keyword:
        kwargs = {k: v for k, v in kwargs.items() if k in signature.names}
    out = fn(*args, **kwargs)
    if signature.is_async or inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    return out


async def _await(awaitable):
    return await awaitable
