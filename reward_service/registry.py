"""Reward functions by name: built-ins registered here, user functions from ``module:function``.

A reward function has the shape TRL and EasyDeL users know::

    f(prompts: list[str], completions: list[str], references: list[str], **metadata) -> list[float]

one float per completion. Metadata arrives as keyword arguments holding one value per
completion (``completion_tokens``, ``truncated`` and every key of the item's ``metadata`` map);
a function that does not take ``**kwargs`` only receives the keywords it names.

A function may explain a score by returning a :class:`RewardValue` (a ``float`` with a
``reason``), e.g. ``RewardValue.zero("no answer found")``; the reason travels in the reply.

Built-ins are registered as *factories*: ``factory(**options) -> reward function``, so that
options from the config (a pattern, a token budget) are checked once at start-up. For a user
function the configured options are passed as extra keyword arguments.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

RewardFn = Callable[..., Sequence[float]]

# Keyword arguments the service itself passes; item metadata may not use these names.
RESERVED_KEYWORDS = frozenset(
    {"prompts", "completions", "references", "completion_tokens", "truncated"}
)


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


def _load_builtins() -> None:
    # The built-in modules register themselves on import.
    from reward_service import functions, math_accuracy  # noqa: F401


def _import_target(target: str) -> Callable:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward function {target!r}: expected a built-in name "
                         f"({', '.join(builtin_names())}) or 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward function {target!r}: cannot import module "
                         f"{module_name!r}: {e}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward function {target!r}: module {module_name!r} has no "
                             f"attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward function {target!r}: {attr!r} is not callable")
    return obj


def _accepting_keywords(fn: Callable) -> Callable:
    """Wrap ``fn`` so that it only receives the keyword arguments its signature accepts."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return fn
    names = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}

    @functools.wraps(fn)
    def call(prompts, completions, references, **kwargs):
        return fn(prompts, completions, references,
                  **{k: v for k, v in kwargs.items() if k in names})

    return call


def resolve(name: str, options: dict[str, Any] | None = None) -> RewardFn:
    """The callable for a configured function; raises ValueError naming what is wrong."""
    _load_builtins()
    options = dict(options or {})
    if name in _BUILTINS:
        try:
            return _accepting_keywords(_BUILTINS[name].factory(**options))
        except TypeError as e:
            raise ValueError(f"reward function {name!r}: bad options {options}: {e}") from None
    fn = _import_target(name)
    if options:
        fn = functools.partial(fn, **options)
    return _accepting_keywords(fn)


def describe(name: str) -> str:
    _load_builtins()
    if name in _BUILTINS:
        return _BUILTINS[name].description
    try:
        doc = inspect.getdoc(_import_target(name)) or ""
    except ValueError:
        return ""
    return " ".join(doc.split("\n\n")[0].split())
