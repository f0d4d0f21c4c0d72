"""What a worker process running user code (reward functions, environment tools) sets up.

User code hangs, loops and allocates without bound. The process that runs it applies two
limits, and its parent a third:

- :func:`limit_memory`: an address-space limit (``RLIMIT_AS``), so a runaway allocation raises
  MemoryError in the worker instead of taking the machine's memory;
- :func:`soft_time_limit`: an interval timer raising :class:`SoftTimeout` (a BaseException,
  so ``except Exception`` in user code cannot swallow it) when a call overruns;
- the parent kills the worker (SIGKILL) at a hard deadline a grace period later, for code stuck
  in C that never returns to the interpreter (the owners of the worker processes do that:
  ``reward_service.pool``, ``splitrl.environments.runner``).

The timer uses SIGALRM, so it works in the worker's main thread only: run user code there.
"""

from __future__ import annotations

import contextlib
import resource
import signal
from collections.abc import Iterator


class SoftTimeout(BaseException):
    """Raised in a worker when the current call exceeds its time limit."""


def _on_alarm(signum, frame):
    raise SoftTimeout()


def install_alarm_handler() -> None:
    """(Re)install the SIGALRM handler behind `soft_time_limit` (user code may replace it:
    math-verify does)."""
    signal.signal(signal.SIGALRM, _on_alarm)


@contextlib.contextmanager
def soft_time_limit(seconds: float) -> Iterator[None]:
    """Raise `SoftTimeout` in the body after ``seconds`` (main thread of the process only)."""
    install_alarm_handler()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def limit_memory(memory_mb: int | None) -> None:
    """Cap this process's address space at ``memory_mb`` MiB (None or 0: no cap). Where the
    platform refuses, the process runs uncapped: the parent's hard deadline still holds."""
    if not memory_mb:
        return
    limit = memory_mb * 1024 * 1024
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ValueError, OSError):
        pass


def ignore_interrupts() -> None:
    """Ctrl-C reaches the whole process group; the parent decides when workers stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
