"""Processes sharing one persistent compilation cache compile each program once.

JAX's persistent cache is read before a compile and written after it, with nothing in between:
processes that need the same program at the same time (a launch's samplers, started together,
compile the same prefill, admit and decode on their first rollouts; every service resharding
the same checkpoint at start-up) all miss and all compile it. On a machine whose services share
its cores, each duplicate costs the others its CPU.

``install()`` puts a lock file around JAX's compile-and-write of a cache miss, keyed by the
program's cache key: the first process compiles and writes the entry; the others wait on the
lock, then read the entry instead of compiling. Locks are ``flock`` locks, released by the
kernel when their holder dies (a sampler killed mid-compile holds up no one). Programs of
different keys never wait for each other. Only processes that write their compiles to the
cache take the lock (JAX writes none from the other processes of a multi-controller job, nor
programs with host callbacks). Without a local cache directory it does nothing, and a JAX
whose compiler module no longer has the function it wraps is left as it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_INSTALLED = "_splitrl_compile_lock"


def install() -> bool:
    """Wrap JAX's compile-and-write of a cache miss with the cross-process lock (once per
    process). Returns whether the lock is in place."""
    try:
        from jax._src import compiler
    except ImportError:
        return False
    original = getattr(compiler, "_compile_and_write_cache", None)
    read = getattr(compiler, "_cache_read", None)
    if original is None or read is None:
        return False
    if getattr(original, _INSTALLED, False):
        return True

    @functools.wraps(original)
    def compile_and_write_once(backend, computation, executable_devices, compile_options,
                               host_callbacks, module_name, cache_key):
        directory = _cache_dir()
        if directory is None or host_callbacks or not _writes_cache_entries():
            return original(backend, computation, executable_devices, compile_options,
                            host_callbacks, module_name, cache_key)
        with _locked(directory / "locks" / f"{cache_key}.lock"):
            # Compiled and written by another process while this one waited?
            executable, _ = read(module_name, cache_key, compile_options, backend,
                                 executable_devices)
            if executable is not None:
                log.debug("compiled by another process: %s", module_name)
                return executable
            return original(backend, computation, executable_devices, compile_options,
                            host_callbacks, module_name, cache_key)

    setattr(compile_and_write_once, _INSTALLED, True)
    compiler._compile_and_write_cache = compile_and_write_once
    return True


def _writes_cache_entries() -> bool:
    """Whether this process writes what it compiles to the cache: JAX writes from process 0 of
    a multi-controller job only (and from every single process). A process that would not
    write has nothing to share, and must not make others wait for it."""
    from jax._src import distributed

    return not distributed.global_state.process_id


def _cache_dir() -> Path | None:
    import jax

    configured = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    if not configured or "://" in configured:  # none, or a bucket: no local lock files
        return None
    return Path(configured)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created with its directory) for a ``with`` block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
