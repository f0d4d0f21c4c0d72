"""Environments for multi-turn, tool-using rollouts (docs/environments.md).

    from splitrl.environments import ToolRunner, parse_tool_calls, detect_format
    runner = ToolRunner("calculator", workers=2, timeout_s=5.0)   # isolated worker processes
    calls = parse_tool_calls(turn_text, detect_format(tokenizer.chat_template))

An environment is a class whose public methods are its tools (TRL's ``environment_factory``
convention, `api`); built-ins are registered by name in `ENVIRONMENTS`, user ones are named
``module:Class``.
"""

from splitrl.environments import builtin  # noqa: F401  (registers the built-ins)
from splitrl.environments.api import (
    ENVIRONMENTS,
    EnvironmentInfo,
    describe,
    make_environment,
    register_environment,
    resolve_factory,
    tool_methods,
    tool_schemas,
)
from splitrl.environments.parsing import FORMATS, ToolCall, detect_format, parse_tool_calls
from splitrl.environments.runner import CallResult, Started, ToolRunner

__all__ = ["ENVIRONMENTS", "FORMATS", "CallResult", "EnvironmentInfo", "Started", "ToolCall",
           "ToolRunner", "describe", "detect_format", "make_environment", "parse_tool_calls",
           "register_environment", "resolve_factory", "tool_methods", "tool_schemas"]
