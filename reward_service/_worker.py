"""The scoring loop that runs inside each worker process (the parent side is ``pool.py``).

Protocol on the worker's pipe:
    parent -> worker: a chunk ``[(task_id, function_index, item), ...]`` or ``None`` to exit;
    worker -> parent: ``("ready", pid)`` once, or ``("init_error", message)``; then lists
    of ``(task_id, score, reason, status, seconds)`` in task order: results are flushed at the
    end of each chunk and at least every ``FLUSH_S`` (a message per result would wake the
    parent for every item, which costs more than the scoring on a busy machine).

Each call runs under a soft time limit: ``setitimer`` raises :class:`ItemTimeout` (a
``BaseException``, so ``except Exception`` in user code or math-verify cannot swallow it). Code
that never returns to the interpreter (a huge integer power in C) or ignores the signal is
killed by the parent at the hard deadline.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import time
from collections.abc import Sequence
from typing import Any

from reward_service.registry import FunctionSpec, resolve

MAX_REASON_CHARS = 300
FLUSH_S = 0.02


class ItemTimeout(BaseException):
    """Raised in a worker when the current item exceeds its time limit."""


def _on_alarm(signum, frame):
    raise ItemTimeout()


def short(text: str, limit: int = MAX_REASON_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def call_one(fn, item: dict[str, Any]) -> Any:
    """Call a reward function on one item, with metadata as one-element lists (TRL style)."""
    kwargs = {key: [value] for key, value in item["metadata"].items()}
    kwargs["completion_tokens"] = [item["completion_tokens"]]
    kwargs["truncated"] = [item["truncated"]]
    return fn([item["prompt"]], [item["completion"]], [item["reference"]], **kwargs)


def check_result(out: Any) -> tuple[float, str, str]:
    """(score, reason, status) from what a function returned for one completion."""
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence) and not hasattr(
        out, "__len__"
    ):
        return 0.0, f"error: expected a list with one score, got {type(out).__name__}", "error"
    if len(out) != 1:
        return 0.0, f"error: returned {len(out)} scores for 1 completion", "error"
    value = out[0]
    if value is None:
        return 0.0, "no score (None)", "ok"
    try:
        score = float(value)
    except (TypeError, ValueError):
        return 0.0, f"error: score is not a number: {type(value).__name__}", "error"
    if not math.isfinite(score):
        return 0.0, f"non-finite score: {score}", "nonfinite"
    return score, str(getattr(value, "reason", "") or ""), "ok"


def score_task(fn, item: dict[str, Any], timeout_s: float) -> tuple[float, str, str]:
    """Score one item with one function under a soft time limit; never raises."""
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            out = call_one(fn, item)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        return check_result(out)
    except ItemTimeout:
        return 0.0, "timeout", "timeout"
    except RecursionError:
        return 0.0, "error: RecursionError: input nested too deeply", "error"
    except MemoryError:
        return 0.0, "error: MemoryError: worker memory limit reached", "error"
    except BaseException as e:  # noqa: BLE001 - user code may raise anything, even SystemExit
        try:
            message = short(f"error: {type(e).__name__}: {e}")
        except BaseException:  # noqa: BLE001 - str() of an exception can fail too
            message = f"error: {type(e).__name__}"
        return 0.0, message, "error"


def worker_main(conn, specs: Sequence[FunctionSpec], memory_mb: int | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    signal.signal(signal.SIGALRM, _on_alarm)
    if memory_mb:
        limit = memory_mb * 1024 * 1024
        try:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ValueError, OSError):
            pass
    try:
        fns = [resolve(spec.name, spec.options) for spec in specs]
    except BaseException as e:  # noqa: BLE001
        conn.send(("init_error", short(f"{type(e).__name__}: {e}")))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        results, flushed = [], time.perf_counter()
        for task_id, index, item in chunk:
            start = time.perf_counter()
            # A function may reset SIGALRM's handler (math-verify does); restore ours.
            signal.signal(signal.SIGALRM, _on_alarm)
            score, reason, status = score_task(fns[index], item, specs[index].timeout_s)
            end = time.perf_counter()
            results.append((task_id, score, reason, status, end - start))
            if end - flushed >= FLUSH_S:
                conn.send(results)
                results, flushed = [], end
        if results:
            conn.send(results)
