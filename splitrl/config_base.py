"""The machinery under ``splitrl/config.py``: strict pydantic sections, errors a person can act
on, and dotted overrides.

Validation is pydantic v2's (``strict=True``: no "3" -> 3 or true -> 1.0 coercion;
``extra="forbid"``: a misspelt key is an error; ``Field`` constraints for ranges). What this
module adds is the wording: pydantic's errors are turned into one line that names the dotted
key, the expectation and the value::

    unknown key 'trainer.stpes' (known: checkpoint, data, ...)
    trainer.steps: expected int, got str 'ten'
    trainer.optimizer.lr: expected a value > 0, got -1.0
    algorithm.loss: expected one of ['grpo', 'gspo', 'gspo-token'], got 'ppo'

Cross-field checks live in each section's ``model_post_init`` and raise :class:`ConfigError`
naming the key relative to their section (``mesh.axes: ...``); the section's place in the whole
config is prefixed here (``trainer.mesh.axes: ...``).
"""

from __future__ import annotations

import re
import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or holds a value out of range."""


# ----------------------------------------------------------------------------------------------
# YAML, with numbers as people write them


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: ``1e-6``, ``3E-4`` and ``5e3`` are floats.

    PyYAML implements YAML 1.1, whose float pattern needs a dot and a signed exponent
    (``1.0e-6``), so ``lr: 1e-6`` -- how every TRL, verl or optax user writes a learning rate --
    loaded as the string ``'1e-6'`` and failed strict validation.
    """


_FLOAT_1_2 = re.compile(r"""^(?:
     [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.VERBOSE)

# The implicit resolvers are a class-level dict shared with SafeLoader: copy before adding.
ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_1_2,
                                   list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """``text`` parsed as YAML the way a config's author means it (see :class:`ConfigLoader`)."""
    return yaml.load(text, Loader=ConfigLoader)  # a SafeLoader: no arbitrary objects


class Section(BaseModel):
    """A typed config section: strict types, no unknown keys, errors as :class:`ConfigError`.

    Sections build from keyword arguments (``MeshConfig(axes={"fsdp": 2})``) and compare by
    value.
    """

    # A docstring under each field is its description: `splitrl config --schema` shows it.
    model_config = ConfigDict(strict=True, extra="forbid", validate_default=False,
                              use_attribute_docstrings=True)

    def __init__(self, **kwargs: Any):
        try:
            super().__init__(**kwargs)
        except ValidationError as e:
            raise ConfigError(explain(e, type(self))) from None

    # Nested sections are validated by pydantic-core directly, not through this __init__ (so
    # their errors keep their location and are worded once, by the outermost section).
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]


def validate(cls: type[Section], data: dict[str, Any]) -> Any:
    """``cls`` built from plain data (YAML), every problem reported as one :class:`ConfigError`."""
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping for {cls.__name__}, got "
                          f"{type(data).__name__} {data!r}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(explain(e, cls)) from None


# ----------------------------------------------------------------------------------------------
# pydantic's errors, in our words

_TYPES = {
    "int_type": "int", "float_type": "float", "bool_type": "bool", "string_type": "str",
    "list_type": "a list", "dict_type": "a mapping", "none_required": "null",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
           "less_than_equal": "<="}


def dotted(loc: tuple) -> str:
    """``("reward", "functions", 0, "name")`` -> ``reward.functions[0].name``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _section(annotation: Any) -> type[Section] | None:
    """The section class inside ``annotation`` (through Optional, list[...], dict[str, ...])."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section(arg)
        if found is not None:
            return found
    return None


def _annotation_at(cls: type[Section], loc: tuple) -> Any:
    """The annotation of the key at ``loc`` (None where ``loc`` leaves the sections)."""
    annotation: Any = cls
    for part in loc:
        section = _section(annotation)
        if section is not None and not isinstance(part, int):
            field = section.model_fields.get(part)
            annotation = field.annotation if field is not None else None
            continue
        while typing.get_origin(annotation) not in (list, dict):  # an Optional around it
            inner = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(inner) != 1:
                return None
            annotation = inner[0]
        annotation = typing.get_args(annotation)[-1]  # list[X] / dict[str, X]: X
    return annotation


def _choices(annotation: Any) -> list | None:
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    for arg in typing.get_args(annotation):
        found = _choices(arg)
        if found is not None:
            return found
    return None


def _got(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _one(cls: type, error: ErrorDetails) -> str:
    loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and "[" in p))
    key, kind, value = dotted(loc), error["type"], error.get("input")
    ctx = error.get("ctx") or {}
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        holder = _section(_annotation_at(cls, loc[:-1]))
        known = ", ".join(sorted(holder.model_fields)) if holder is not None else "?"
        return f"unknown key '{key}' (known: {known})"
    if kind == "value_error":  # a section's own check: its message names the key in the section
        message = str(ctx.get("error", error["msg"]))
        if not loc or message.startswith(key):
            return message
        head = f"{loc[-1]}."
        return key + "." + message[len(head):] if message.startswith(head) else f"{key}: {message}"
    if kind == "literal_error":
        choices = _choices(_annotation_at(cls, loc))
        return f"{key}: expected one of {choices or ctx.get('expected')}, got {value!r}"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        return f"{key}: expected a value {_BOUNDS[kind]} {bound:g}, got {value!r}"
    if kind == "model_type":
        return f"{key}: expected a mapping for {ctx.get('class_name')}, got {_got(value)}"
    if kind in _TYPES:
        return f"{key}: expected {_TYPES[kind]}, got {_got(value)}"
    return f"{key}: {error['msg']}, got {_got(value)}"


def explain(error: ValidationError, cls: type) -> str:
    """Each problem of ``error`` (validating ``cls``) as one line."""
    problems = [_one(cls, p) for p in error.errors(include_url=False)]
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n  " + "\n  ".join(problems)


# ----------------------------------------------------------------------------------------------
# Dotted overrides


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{key}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b.c=value`` -> (``"a.b.c"``, YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected KEY=VALUE, e.g. trainer.steps=50")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}': empty key")
    try:
        value = load_yaml(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML: {e}") from None
    return key, value


def merge_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``data`` (not modified) with each ``a.b.c=value`` of ``overrides`` applied in order."""
    data = _copy_tree(data)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    return data


def _copy_tree(tree: dict[str, Any]) -> dict[str, Any]:
    return {k: _copy_tree(v) if isinstance(v, dict) else v for k, v in tree.items()}
