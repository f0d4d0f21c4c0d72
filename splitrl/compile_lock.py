"""Processes sharing one persistent compilation cache compile each program once, and compiles
whose executables it cannot give back stay out of it.

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

``without_cache()`` keeps the compiles of a block out of the cache, neither read nor written:
``splitrl plan``'s, whose executables are measured and never run. Those for a TPU topology come
from libtpu's compile-only client, which can serialize an executable but not deserialize one:
written to the cache, every later read of the entry failed ("PjRtCompiler must be constructed
with a Client to call DeserializeLoadedExecutable"), warned, and compiled again. Turning the
cache off around the compile (``jax_enable_compilation_cache``) is no way out: JAX decides once
per process whether the cache is used, so where that compile came first, the cache stayed off
for everything the process compiled after it, and elsewhere the flag changed nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_INSTALLED = "_splitrl_compile_lock"
_SKIPS = "_splitrl_without_cache"
_uncached = threading.local()  # .depth: this thread is inside that many without_cache() blocks


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
        if (directory is None or host_callbacks or not _writes_cache_entries()
                or _bypassed()):
            return original(backend, computation, executable_devices, compile_options,
                            host_callbacks, module_name, cache_key)
        with _locked(directory / "locks" / f"{cache_key}.lock"):
            # Compiled and written by another process while this one waited?
            executable, _ = compiler._cache_read(module_name, cache_key, compile_options,
                                                 backend, executable_devices)
            if executable is not None:
                log.debug("compiled by another process: %s", module_name)
                return executable
            return original(backend, computation, executable_devices, compile_options,
                            host_callbacks, module_name, cache_key)

    setattr(compile_and_write_once, _INSTALLED, True)
    compiler._compile_and_write_cache = compile_and_write_once
    return True


@contextlib.contextmanager
def without_cache() -> Iterator[None]:
    """This thread's compiles inside the block neither read nor write the persistent cache
    (other threads' are not affected). Where JAX's compiler module no longer has the functions
    wrapped, they go through the cache as before."""
    _skip_when_bypassed()
    _uncached.depth = getattr(_uncached, "depth", 0) + 1
    try:
        yield
    finally:
        _uncached.depth -= 1


def _bypassed() -> bool:
    return getattr(_uncached, "depth", 0) > 0


def _skip_when_bypassed() -> None:
    """Wrap JAX's cache read and write to do nothing inside :func:`without_cache` (once per
    process)."""
    try:
        from jax._src import compiler
    except ImportError:
        return
    read = getattr(compiler, "_cache_read", None)
    write = getattr(compiler, "_cache_write", None)
    if read is None or write is None or getattr(read, _SKIPS, False):
        return

    @functools.wraps(read)
    def read_unless_bypassed(module_name, cache_key, compile_options, backend,
                             executable_devices):
        if _bypassed():
            return None, None  # a miss, as JAX takes one
        return read(module_name, cache_key, compile_options, backend, executable_devices)

    @functools.wraps(write)
    def write_unless_bypassed(cache_key, compile_time_secs, module_name, backend, executable,
                              host_callbacks):
        if not _bypassed():
            write(cache_key, compile_time_secs, module_name, backend, executable,
                  host_callbacks)

    setattr(read_unless_bypassed, _SKIPS, True)
    compiler._cache_read = read_unless_bypassed
    compiler._cache_write = write_unless_bypassed


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
