"""The loop inside an environment worker process (the parent side is ``runner.py``).

The worker holds the episodes the parent started on it (``{episode id: environment object}``)
and answers one request at a time on its pipe:

    (at start, unasked)               -> ("ready", pid, [tool JSON schemas]) or ("init_error", why)
    ("start", [(episode, columns)...]) -> [(status, text)...]: each reset(**columns)'s text
    ("call", episode, name, args)     -> (status, text, done, reward, seconds)
    ("end", [episode...])             -> ("ok", [reward...])
    None                              -> exit

Starts and ends come in lists: a sampler starts a request's episodes, and ends those that
finished together, in one round trip per worker rather than one per episode (each round trip
is a pipe write and read and a thread woken on both sides).

``status`` is ok, unknown (no such tool), malformed (arguments that do not fit), error (the
tool raised; ``text`` says what), or timeout (the soft limit interrupted it). Every call runs
under `splitrl.isolation.soft_time_limit`; the parent kills the process at a hard deadline.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from splitrl.environments.api import BadArguments, bind_arguments, make_environment, tool_methods
from splitrl.environments.api import tool_schemas as _schemas
from splitrl.isolation import (
    SoftTimeout,
    ignore_interrupts,
    install_alarm_handler,
    limit_memory,
    soft_time_limit,
)


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def _described(e: BaseException) -> str:
    try:
        return f"{type(e).__name__}: {e}"
    except BaseException:  # noqa: BLE001 - str() of an exception can fail too
        return type(e).__name__


def _reward(env: Any) -> float | None:
    value = getattr(env, "reward", None)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class _Episodes:
    def __init__(self, name: str, options: dict, timeout_s: float, max_chars: int):
        self.name, self.options = name, options
        self.timeout_s, self.max_chars = timeout_s, max_chars
        self.envs: dict[str, Any] = {}

    def start(self, episode: str, columns: dict) -> tuple:
        try:
            with soft_time_limit(self.timeout_s):
                env = make_environment(self.name, self.options)
                text = env.reset(**columns) if hasattr(env, "reset") else None
        except SoftTimeout:
            return ("timeout", f"reset took longer than {self.timeout_s:g} s")
        except BaseException as e:  # noqa: BLE001 - user code may raise anything
            return ("error", _short(_described(e), self.max_chars))
        self.envs[episode] = env
        return ("ok", "" if text is None else _short(str(text), self.max_chars))

    def call(self, episode: str, name: str, arguments) -> tuple:
        env = self.envs.get(episode)
        if env is None:
            return ("error", "the episode's environment is gone", True, None, 0.0)
        tools = tool_methods(env)
        if not name and len(tools) == 1:
            name = next(iter(tools))
        if name not in tools:
            return ("unknown", f"unknown tool {name!r}; the tools are: "
                    f"{', '.join(sorted(tools))}", False, None, 0.0)
        start = time.perf_counter()
        try:
            kwargs = bind_arguments(tools[name], arguments)
            with soft_time_limit(self.timeout_s):
                result = tools[name](**kwargs)
            status, text = "ok", "" if result is None else str(result)
        except BadArguments as e:
            status, text = "malformed", f"bad arguments for {name!r}: {e}"
        except SoftTimeout:
            status, text = "timeout", f"tool {name!r} timed out after {self.timeout_s:g} s"
        except MemoryError:
            status, text = "error", f"tool {name!r}: MemoryError: memory limit reached"
        except BaseException as e:  # noqa: BLE001 - user code may raise anything, even SystemExit
            status, text = "error", f"tool {name!r} raised {_described(e)}"
        seconds = time.perf_counter() - start
        done = bool(getattr(env, "done", False))
        return (status, _short(text, self.max_chars), done, _reward(env), seconds)

    def end(self, episode: str) -> float | None:
        env = self.envs.pop(episode, None)
        return None if env is None else _reward(env)


def worker_main(conn, name: str, options: dict, timeout_s: float, memory_mb: int | None,
                max_chars: int) -> None:
    ignore_interrupts()
    install_alarm_handler()
    limit_memory(memory_mb)
    episodes = _Episodes(name, options, timeout_s, max_chars)
    try:
        schemas = _schemas(make_environment(name, options))
    except BaseException as e:  # noqa: BLE001
        conn.send(("init_error", _short(_described(e), 500)))
        return
    conn.send(("ready", os.getpid(), schemas))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        op = request[0]
        reply: object
        if op == "start":
            reply = [episodes.start(episode, columns) for episode, columns in request[1]]
        elif op == "call":
            reply = episodes.call(request[1], request[2], request[3])
        elif op == "end":
            reply = ("ok", [episodes.end(episode) for episode in request[1]])
        else:
            reply = ("error", f"unknown request {op!r}")
        conn.send(reply)
