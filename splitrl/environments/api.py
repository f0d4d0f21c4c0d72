"""What an environment is, and how its tools are found, described and called.

An environment is a class (or any factory callable) whose instances are *episodes*, written the
way TRL's ``environment_factory`` takes them:

    class Lookup:
        def reset(self, **columns) -> str | None:   # the dataset row's columns; optional text
            self.secret = columns["secret"]            # appended to the prompt
        def lookup(self) -> str:                       # a public method is a tool
            \"\"\"The value stored for this episode's key.\"\"\"
            return str(self.secret)

- every public method other than ``reset`` is a tool; its JSON schema (what the chat template
  shows the model) comes from its type hints and Google-style docstring, as transformers'
  ``get_json_schema`` reads them;
- a tool's return value becomes the observation (``str()`` of it; None is empty);
- an attribute ``done`` set true ends the episode after the current tool call, and an attribute
  ``reward`` (a number) at the episode's end is reported as the reward ``environment``.

Environments are named like reward functions: a built-in name (`ENVIRONMENTS`) or
``module:Class`` (imported as `splitrl.user_code` imports reward modules), with ``options``
passed to the factory as keyword arguments.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from splitrl.registry import Registry

ENVIRONMENTS: Registry[Callable[..., Any]] = Registry("environment")

RESERVED = frozenset({"reset"})


def register_environment(name: str, description: str):
    """Decorator registering a built-in environment factory under ``name``."""

    def deco(factory):
        factory.description = description
        return ENVIRONMENTS.register(name)(factory)

    return deco


def resolve_factory(name: str) -> Callable[..., Any]:
    """The factory a config names: a built-in, or ``module:Class`` from the user's code."""
    if ":" in name:
        from splitrl.user_code import import_user_module

        module_name, _, attr = name.partition(":")
        module = import_user_module(module_name)
        try:
            return getattr(module, attr)
        except AttributeError:
            raise ValueError(f"environment {name!r}: module {module_name!r} has no "
                             f"attribute {attr!r}") from None
    from splitrl.environments import builtin  # noqa: F401  (registers the built-ins)

    return ENVIRONMENTS.get(name)


def make_environment(name: str, options: dict[str, Any] | None = None) -> Any:
    """A new episode object of environment ``name``."""
    return resolve_factory(name)(**(options or {}))


def tool_methods(env: Any) -> dict[str, Callable[..., Any]]:
    """{name: bound method} of the environment's tools: its public methods but ``reset``."""
    out: dict[str, Callable[..., Any]] = {}
    for name in dir(type(env)):
        if name.startswith("_") or name in RESERVED:
            continue
        attr = getattr(env, name, None)
        if inspect.ismethod(attr):
            out[name] = attr
    return out


def tool_schemas(env: Any) -> list[dict[str, Any]]:
    """The tools' JSON schemas, in name order, as chat templates take them (``tools=``)."""
    from transformers.utils import get_json_schema

    schemas = []
    for name, method in sorted(tool_methods(env).items()):
        try:
            schemas.append(get_json_schema(method))
        except Exception as e:  # transformers' DocstringParsingException, TypeHintParsingException
            raise ValueError(f"tool {name!r} of {type(env).__name__}: its JSON schema comes from "
                             f"its type hints and docstring (Google style, an 'Args:' entry per "
                             f"parameter): {e}") from None
    return schemas


class BadArguments(ValueError):
    """A tool call's arguments do not fit the tool's parameters."""


def bind_arguments(method: Callable[..., Any], arguments: dict[str, Any] | list[Any]
                   ) -> dict[str, Any]:
    """Keyword arguments for ``method`` from a call's arguments: a JSON object as is, or
    positional strings (the tiny format) converted to the parameters' annotated types
    (int, float, bool, str)."""
    sig = inspect.signature(method)
    if isinstance(arguments, dict):
        try:
            sig.bind(**arguments)
        except TypeError as e:
            raise BadArguments(str(e)) from None
        return dict(arguments)
    params = list(sig.parameters.values())
    if len(arguments) > len(params):
        raise BadArguments(f"takes {len(params)} arguments, got {len(arguments)}")
    hints = typing.get_type_hints(method)
    out = {}
    for param, raw in zip(params, arguments, strict=False):
        out[param.name] = _convert(raw, hints.get(param.name, str), param.name)
    try:
        sig.bind(**out)
    except TypeError as e:
        raise BadArguments(str(e)) from None
    return out


def _convert(raw: str, kind: Any, name: str) -> Any:
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if kind in (int, float):
            return kind(raw)
        if kind in (dict, list) or typing.get_origin(kind) in (dict, list):
            return json.loads(raw)
    except (ValueError, json.JSONDecodeError):
        raise BadArguments(f"argument {name!r}: expected {getattr(kind, '__name__', kind)}, "
                           f"got {raw!r}") from None
    return raw


@dataclass(frozen=True)
class EnvironmentInfo:
    """What `splitrl list environments` shows of one environment."""

    name: str
    description: str
    tools: list[dict[str, Any]]


def describe(name: str, options: dict[str, Any] | None = None) -> EnvironmentInfo:
    factory = resolve_factory(name)
    env = factory(**(options or {}))
    doc = getattr(factory, "description", None) or inspect.getdoc(factory) or ""
    return EnvironmentInfo(name, doc.strip().split("\n\n")[0].replace("\n", " "),
                           tool_schemas(env))
