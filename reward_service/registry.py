"""Reward functions by name: built-ins registered here, user functions from ``module:function``.

A reward function scores a batch of completions and returns one float (or ``None``) per
completion. Three calling conventions are accepted, told apart by the signature (see
``conventions.py``): TRL's (``f(completions, **kwargs)``, keyword arguments, every dataset
column), EasyDeL's (``f(prompts, completions, batch, **kwargs)``) and ours::

    f(prompts: list[str], completions: list[str], references: list[str], **kwargs) -> list[float]

A function may explain a score by returning a :class:`RewardValue` (a ``float`` with a
``reason``), e.g. ``RewardValue.zero("no answer found")``; the reason travels in the reply.

Built-ins are registered as *factories*: ``factory(**options) -> reward function``, so that
options from the config (a pattern, a token budget) are checked once at start-up. For a user
function the configured options are passed as extra keyword arguments. A user module is looked
for beside the config file, then in the current directory (``splitrl/user_code.py``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from reward_service import conventions
from splitrl.user_code import import_user_module

RewardFn = Callable[..., Sequence[float]]
# Item fields a direct call (RewardFunction.__call__) may pass as keyword lists; any other
# keyword is a dataset column.
_ITEM_FIELDS = ("completion_tokens", "truncated", "completion_ids", "prompt_messages",
                "weight_version")


class RewardValue(float):
    """A score that says why it has its value (``float(v)`` is the score, ``v.reason`` why)."""

    reason: str

    def __new__(cls, value: float, reason: str = ""):
        obj = super().__new__(cls, value)
        obj.reason = reason
        return obj

    @classmethod
    def zero(cls, reason: str) -> RewardValue:
        return cls(0.0, reason)

    def __reduce__(self):
        return (RewardValue, (float(self), self.reason))


@dataclass(frozen=True)
class Builtin:
    name: str
    factory: Callable[..., RewardFn]
    description: str


@dataclass(frozen=True)
class FunctionSpec:
    """A configured reward function: what to load, its weight, options and time limit."""

    name: str
    weight: float = 1.0
    timeout_s: float = 5.0
    options: dict[str, Any] = field(default_factory=dict)


_BUILTINS: dict[str, Builtin] = {}


def register(name: str, description: str = "") -> Callable:
    """Register ``factory(**options) -> reward function`` under ``name``."""

    def wrap(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        if name in _BUILTINS:
            raise ValueError(f"reward function {name!r} is already registered")
        doc = description or (inspect.getdoc(factory) or "").split("\n\n")[0]
        _BUILTINS[name] = Builtin(name, factory, " ".join(doc.split()))
        return factory

    return wrap


def builtin_names() -> list[str]:
    _load_builtins()
    return sorted(_BUILTINS)


def builtin_options(name: str) -> dict[str, Any]:
    """A built-in's options and their defaults (``inspect.Parameter.empty`` if required)."""
    _load_builtins()
    params = inspect.signature(_BUILTINS[name].factory).parameters.values()
    return {p.name: p.default for p in params}


def _load_builtins() -> None:
    # The built-in modules register themselves on import.
    from reward_service import functions, math_accuracy  # noqa: F401


def _import_target(target: str) -> Callable:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward function {target!r}: expected a built-in name "
                         f"({', '.join(builtin_names())}) or 'module:function'")
    try:
        module = import_user_module(module_name)
    except Exception as e:  # noqa: BLE001 - a user module may fail to import in any way
        raise ValueError(f"reward function {target!r}: cannot import module "
                         f"{module_name!r}: {type(e).__name__}: {e}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward function {target!r}: module {module_name!r} has no "
                             f"attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward function {target!r}: {attr!r} is not callable")
    return obj


class RewardFunction:
    """A loaded reward function: the callable (options bound) and its calling convention.

    ``score_batch(items)`` calls it once on a batch of item payloads (``scoring.Item``) the way
    its convention wants. Calling the object itself takes our convention whatever the
    function's (``f(prompts, completions, references, **columns)`` with one value per
    completion), which is handy in tests and notebooks.
    """

    def __init__(self, name: str, fn: Callable, signature: conventions.Signature):
        self.name = name
        self.fn = fn
        self.signature = signature

    @property
    def style(self) -> conventions.Style:
        return self.signature.style

    def score_batch(self, items: Sequence[dict[str, Any]]) -> Any:
        return conventions.call(self.fn, self.signature, items)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 references: Sequence[str], **kwargs: Sequence[Any]) -> Any:
        items = []
        for i, completion in enumerate(completions):
            item: dict[str, Any] = {
                "prompt": prompts[i], "completion": completion, "reference": references[i],
                "completion_tokens": 0, "truncated": False, "metadata": {}, "columns": {}}
            for key, values in kwargs.items():
                if key in _ITEM_FIELDS:
                    item[key] = values[i]
                else:
                    item["columns"][key] = values[i]
            items.append(item)
        return self.score_batch(items)

    def __repr__(self) -> str:
        return f"RewardFunction({self.name!r}, {self.signature.describe()})"


def _load(name: str, fn: Callable, options: dict[str, Any]) -> RewardFunction:
    try:
        signature = conventions.detect(fn)
    except ValueError as e:
        raise ValueError(f"reward function {name!r}: {e}") from None
    if options:
        unknown = sorted(set(options) - signature.names)
        if unknown and not signature.takes_var_keyword:
            raise ValueError(f"reward function {name!r}: bad options {options}: it takes no "
                             f"argument {unknown[0]!r} (signature {signature.text})")
        fn = functools.partial(fn, **options)
        signature = conventions.detect(fn)
    return RewardFunction(name, fn, signature)


def resolve(name: str, options: dict[str, Any] | None = None) -> RewardFunction:
    """The loaded function for a configured name; raises ValueError naming what is wrong."""
    _load_builtins()
    options = dict(options or {})
    if name in _BUILTINS:
        try:
            fn = _BUILTINS[name].factory(**options)
        except TypeError as e:
            raise ValueError(f"reward function {name!r}: bad options {options}: {e}") from None
        return _load(name, fn, {})
    return _load(name, _import_target(name), options)


def describe(name: str) -> str:
    _load_builtins()
    if name in _BUILTINS:
        return _BUILTINS[name].description
    try:
        doc = inspect.getdoc(_import_target(name)) or ""
    except ValueError:
        return ""
    return " ".join(doc.split("\n\n")[0].split())
