"""The scoring loop that runs inside each worker process (the parent side is ``pool.py``).

Protocol on the worker's pipe:
    parent -> worker: a chunk ``[(task_id, function_index, items), ...]`` or ``None`` to exit,
    where ``items`` is one batch (a prompt's group of completions, or a single item);
    worker -> parent: ``("ready", pid)`` once, or ``("init_error", message)``; then lists
    of ``(task_id, [(score, reason, status), ...], seconds)`` in task order: results are
    flushed at the end of each chunk and at least every ``FLUSH_S`` (a message per result
    would wake the parent for every batch, which costs more than the scoring on a busy machine).

Each call (one function on one batch) runs under a soft time limit
(``splitrl.isolation.soft_time_limit``: a ``BaseException``, so ``except Exception`` in user
code or math-verify cannot swallow it). Code that never returns to the interpreter (a huge
integer power in C) or ignores the signal is killed by the parent at the hard deadline. A call
that fails (raises, times out, returns the wrong number of scores) fails for every item of its
batch.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

from reward_service import math_accuracy
from reward_service.registry import FunctionSpec, resolve
from splitrl.isolation import (
    SoftTimeout,
    ignore_interrupts,
    install_alarm_handler,
    limit_memory,
    soft_time_limit,
)
from splitrl.reward_protocol import ERROR_PREFIX, NO_SCORE, NONFINITE_PREFIX, TIMEOUT

MAX_REASON_CHARS = 300
FLUSH_S = 0.02


def short(text: str, limit: int = MAX_REASON_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_results(out: Any, n: int) -> list[tuple[float, str, str]]:
    """(score, reason, status) per completion from what a function returned for ``n``."""
    if isinstance(out, (str, bytes, dict)) or not isinstance(out, Sequence) and not hasattr(
        out, "__len__"
    ):
        wanted = "a list with one score" if n == 1 else f"a list of {n} scores"
        reason = f"{ERROR_PREFIX}expected {wanted}, got {type(out).__name__}"
        return [(0.0, reason, "error")] * n
    if len(out) != n:
        noun = "completion" if n == 1 else "completions"
        return [(0.0, f"{ERROR_PREFIX}returned {len(out)} scores for {n} {noun}", "error")] * n
    return [check_value(out[i]) for i in range(n)]


def check_value(value: Any) -> tuple[float, str, str]:
    """(score, reason, status) of one returned value."""
    if value is None:
        return 0.0, NO_SCORE, "none"
    if isinstance(value, (str, bytes)):  # float("1") works, but a string is not a score
        return 0.0, f"{ERROR_PREFIX}score is not a number: {type(value).__name__}", "error"
    try:
        score = float(value)
    except (TypeError, ValueError):
        return 0.0, f"{ERROR_PREFIX}score is not a number: {type(value).__name__}", "error"
    if not math.isfinite(score):
        return 0.0, f"{NONFINITE_PREFIX}{score}", "nonfinite"
    return score, str(getattr(value, "reason", "") or ""), "ok"


def check_result(out: Any) -> tuple[float, str, str]:
    """(score, reason, status) from what a function returned for one completion."""
    return check_results(out, 1)[0]


def score_batch(fn, items: list[dict[str, Any]],
                timeout_s: float) -> list[tuple[float, str, str]]:
    """Score one batch with one function under a soft time limit; never raises."""
    n = len(items)
    try:
        with soft_time_limit(timeout_s):
            out = fn.score_batch(items)
        return check_results(out, n)
    except SoftTimeout:
        return [(0.0, TIMEOUT, "timeout")] * n
    except RecursionError:
        return [(0.0, f"{ERROR_PREFIX}RecursionError: input nested too deeply", "error")] * n
    except MemoryError:
        return [(0.0, f"{ERROR_PREFIX}MemoryError: worker memory limit reached", "error")] * n
    except BaseException as e:  # noqa: BLE001 - user code may raise anything, even SystemExit
        try:
            message = short(f"{ERROR_PREFIX}{type(e).__name__}: {e}")
        except BaseException:  # noqa: BLE001 - str() of an exception can fail too
            message = f"{ERROR_PREFIX}{type(e).__name__}"
        return [(0.0, message, "error")] * n


def worker_main(conn, specs: Sequence[FunctionSpec], memory_mb: int | None) -> None:
    ignore_interrupts()
    install_alarm_handler()
    limit_memory(memory_mb)
    try:
        fns = [resolve(spec.name, spec.options) for spec in specs]
        if math_accuracy.configured(specs):
            math_accuracy.warm_up()  # untimed, before the first batch's limit starts
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
        for task_id, index, items in chunk:
            start = time.perf_counter()
            # (soft_time_limit reinstalls the SIGALRM handler a function may have reset.)
            outcomes = score_batch(fns[index], items, specs[index].timeout_s)
            end = time.perf_counter()
            results.append((task_id, outcomes, end - start))
            if end - flushed >= FLUSH_S:
                conn.send(results)
                results, flushed = [], end
        if results:
            conn.send(results)
