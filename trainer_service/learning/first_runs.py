"""A multi-host trainer compiles each collective program before its first run, then lines up.

On a trainer that spans several processes every jitted step is a collective over devices of
all of them. XLA's CPU collectives (Gloo) connect a group of devices at the first collective
that uses it, and give every process a fixed 30 s (Gloo's default; JAX offers no setting) to
arrive: past it the early process fails with "Connect timeout" or "GetKeyValue() timed out",
and the other one with "Connection closed by peer". A jitted function compiles at its first
call, just before it runs; a big program can compile for longer than 30 s on a busy host, and
two processes seldom finish compiling together. So the first call of each program (function,
static arguments, argument shapes, dtypes and shardings) is split: compile it (jit keeps the
executable, and the call below finds it), wait until every process has compiled it (``wait``:
``HostGroup.barrier``, which waits as long as the slowest process needs), then run it. Later
calls run at once: their groups are connected, and a collective that has started waits for
the others for ``--xla_cpu_collective_timeout_seconds`` (30 minutes by default).

With one process there is no group to line up: ``FirstRuns()`` calls straight through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


class FirstRuns:
    """Calls jitted programs; with ``wait`` set, each program's first call compiles it, then
    calls ``wait(name)`` before running it."""

    def __init__(self, wait: Callable[[str], None] | None = None):
        self.wait = wait
        self._seen: set = set()

    def call(self, fn: Any, static: int, *args):
        """``fn(*args)``, ``fn`` a ``jax.jit`` function whose first ``static`` arguments are
        static (hashable, part of the program)."""
        if self.wait is not None:
            key = (fn, args[:static], _signature(args[static:]))
            if key not in self._seen:
                fn.lower(*args).compile()
                self.wait(getattr(fn, "__name__", "program"))
                self._seen.add(key)
        return fn(*args)


def _signature(args) -> tuple:
    """What selects the compiled program among a jitted function's dynamic arguments: the tree
    structure and each array's shape, dtype and sharding (a Python scalar: its type only)."""
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple(
        (x.shape, x.dtype, getattr(x, "sharding", None)) if hasattr(x, "dtype") else type(x)
        for x in leaves)
