"""Processes sharing a compilation cache compile a program they both need once
(`splitrl.compile_lock`): two real processes jit the same program at the same moment."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.conftest import REPO_ROOT

# Imports JAX, says it is ready, and once the go file exists compiles one program of 40
# matmuls and cumulative sums (a second or two of XLA:CPU's time: two processes' compiles
# overlap). Logs JAX's cache hits, and compile_lock's "compiled by another process" (the
# entry read after waiting for the lock).
WORKER = r"""
import logging, sys, time
from pathlib import Path

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")
for name in ("jax._src.compiler", "splitrl.compile_lock"):  # their cache hits
    logging.getLogger(name).setLevel(logging.DEBUG)
from splitrl import compile_lock

assert compile_lock.install()
import jax
import jax.numpy as jnp

def program(x):
    for i in range(40):
        x = jnp.cumsum(jnp.tanh(x @ x.T + i), axis=i % 2)
    return x


ready, go = Path(sys.argv[1]), Path(sys.argv[2])
ready.touch()
while not go.exists():
    time.sleep(0.01)
jax.jit(program)(jnp.ones((17, 17))).block_until_ready()
"""


def test_two_processes_compiling_one_program_compile_it_once(tmp_path):
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
           "PYTHONPATH": str(REPO_ROOT)}
    go = tmp_path / "go"
    ready = [tmp_path / f"ready-{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in ready]
    deadline = time.monotonic() + 300
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs

    def how(out: str) -> str:
        if "compiled by another process: jit_program" in out:
            return "waited"  # JAX missed, the lock waited, then read the other's entry
        if "Persistent compilation cache hit for 'jit_program'" in out:
            return "cache hit"  # the entry was there when JAX looked
        return "compiled"

    # One process compiled the program; the other waited for it and read its entry (or, had
    # it come after the entry was written, found it by JAX's own lookup): never both compiled.
    assert sorted(map(how, outputs)) in (["compiled", "waited"], ["cache hit", "compiled"]), (
        outputs)
