"""Tool calls in the model's own format, per chat template.

- ``qwen`` (Qwen2.5 / Qwen3 / Hermes templates): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, one block per call, text around them allowed.
- ``llama3`` (Llama 3.1 / 3.2 JSON tool calling): the whole turn is one JSON object
  ``{"name": ..., "parameters": {...}}`` (``arguments`` accepted too), optionally after
  ``<|python_tag|>``.
- ``tiny`` (the tiny models' own, short enough for a random model to hit): a turn starting with
  ``!`` is a call, ``!name arg1 arg2`` with positional, whitespace-separated arguments; a bare
  ``!`` calls the environment's only tool.

`detect_format` picks one from the tokenizer's chat template. A turn with no call is the
model's answer and ends the episode; a call that cannot be read is a `ToolCall` with an
``error``, which the episode turns into an observation (status ``malformed``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("qwen", "llama3", "tiny")

_QWEN_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's ``name`` ("" = the only tool), its ``arguments`` (a JSON object, or
    positional strings in the tiny format) and, when it could not be read, ``error``."""

    name: str
    arguments: dict[str, Any] | list[str] = field(default_factory=dict)
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        """The OpenAI-style ``tool_calls`` entry of an assistant message."""
        return {"type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def detect_format(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches: qwen if it mentions ``<tool_call>``,
    llama3 if it has Llama's ``<|python_tag|>`` / ``ipython`` role, else tiny."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "qwen"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "tiny"


def parse_tool_calls(text: str, fmt: str) -> list[ToolCall]:
    """The calls in one model turn (none: the turn is an answer)."""
    if fmt == "qwen":
        return _qwen(text)
    if fmt == "llama3":
        return _llama3(text)
    if fmt == "tiny":
        return _tiny(text)
    raise ValueError(f"tool-call format: expected one of {FORMATS}, got {fmt!r}")


def _from_json(raw: str, argument_keys: tuple[str, ...]) -> ToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"not valid JSON ({e.msg} at {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", error='expected a JSON object with a "name" string')
    args: Any = {}
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(obj["name"], error="arguments: not valid JSON")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error="arguments: expected a JSON object")
    return ToolCall(obj["name"], args)


def _qwen(text: str) -> list[ToolCall]:
    calls = []
    for match in _QWEN_BLOCK.finditer(text):
        if not match.group(0).endswith("</tool_call>"):
            calls.append(ToolCall("", error="<tool_call> without </tool_call>"))
            continue
        calls.append(_from_json(match.group(1).strip(), ("arguments", "parameters")))
    return calls


def _llama3(text: str) -> list[ToolCall]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    elif not body.startswith("{"):
        return []
    return [_from_json(body, ("parameters", "arguments"))]


def _tiny(text: str) -> list[ToolCall]:
    body = text.strip()
    if not body.startswith("!"):
        return []
    parts = body[1:].split()
    if not parts:
        return [ToolCall("")]
    return [ToolCall(parts[0], list(parts[1:]))]
