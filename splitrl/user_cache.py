"""Where SplitRL keeps what it can recompute but should not have to, across runs.

``$SPLITRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/splitrl``, else ``~/.cache/splitrl``:

- ``xla/``: compiled XLA programs (the default ``JAX_COMPILATION_CACHE_DIR`` of every service
  the launcher starts);
- ``tokenizer-classes.json``: the tokenizer class `AutoTokenizer` chose for a checkpoint
  (:func:`splitrl.tokenizer.remembered_tokenizer_class`).

Deleting the directory is always safe: everything in it is found again, more slowly.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


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


def read_json(name: str) -> dict[str, Any]:
    """The cache file ``name`` as a dict; empty when missing or unreadable (a cache)."""
    try:
        data = json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def update_json(name: str, key: str, value: Any) -> None:
    """Sets ``key`` in the cache file ``name``, replacing the file atomically (two launchers
    may write at once; the last one wins, each file is whole). A cache that cannot be written
    (read-only home) is skipped."""
    data = read_json(name)
    data[key] = value
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, directory / name)
    except OSError:  # e.g. the disk is full: leave no half-written temporary file behind
        Path(tmp).unlink(missing_ok=True)
