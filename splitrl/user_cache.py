"""Where SplitRL keeps what it can recompute but should not have to, across runs.

``$SPLITRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/splitrl``, else ``~/.cache/splitrl``:

- ``xla/``: compiled XLA programs (the default ``JAX_COMPILATION_CACHE_DIR`` of every service
  the launcher starts), and in ``xla/locks/`` one empty lock file per program, by which
  services compiling the same program at once compile it once (`splitrl.compile_lock`).

Deleting the directory is always safe: everything in it is found again, more slowly.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    explicit = os.environ.get("SPLITRL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "splitrl"


# Programs that took longer than this (seconds) to compile are kept: a low bar, because every
# process of a run, and every run of a test suite, compiles the same mostly small programs.
XLA_CACHE_MIN_COMPILE_TIME_SECS = "0.1"


def xla_cache_env() -> dict[str, str]:
    """The environment that points JAX's persistent compilation cache at ``xla/`` here: the
    launcher's default for every service it starts, and the test suite's for itself."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir() / "xla"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": XLA_CACHE_MIN_COMPILE_TIME_SECS,
    }
