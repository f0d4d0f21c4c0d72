"""Processes sharing a compilation cache compile a program they both need once
(`splitrl.compile_lock`): two real processes jit the same program at the same moment."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from splitrl.platforms import libtpu_installed
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


# Compiles a `splitrl plan` program for a TPU topology (libtpu's compile-only client) and one
# program it runs on the CPU, in the order argv[1] says ("plan-first" or "run-first"), as a test
# session may; logs JAX's cache hits and prints its warnings.
PLAN_AND_RUN = r"""
import logging, sys, warnings
warnings.simplefilter("always")
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")
logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from splitrl_app.planning import tpu_target
from splitrl_app.planning.memory import compile_program

def planned(x):
    return jnp.tanh(x @ x.T)

def plan():
    sharding = NamedSharding(Mesh(np.array(tpu_target("v5e:2x2").devices[:2]), ("x",)),
                             PartitionSpec("x"))
    compile_program("planned", jax.jit(planned).lower(
        jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=sharding)))

def run(x):
    return jnp.cumsum(jnp.tanh(x @ x.T), axis=0)

if sys.argv[1] == "plan-first":
    plan()
jax.jit(run)(jnp.ones((17, 17))).block_until_ready()
if sys.argv[1] == "run-first":
    plan()
"""


@pytest.mark.skipif(not libtpu_installed(), reason="libtpu (the TPU compiler) is not "
                    "installed: pip install -e '.[tpu-plan]'")
def test_a_plans_tpu_compile_stays_out_of_the_cache_and_leaves_it_on_for_the_rest(tmp_path):
    """A plan's TPU executable cannot be read back from the persistent cache (the
    compile-only client cannot deserialize it): it is neither written nor looked up, so no
    later session fails a read of it, warns and compiles again. And a plan compiled first
    leaves the cache on for the rest of the process (turning the cache off around the plan's
    compile had left it off for everything after)."""
    cache = tmp_path / "xla"
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
           "PYTHONPATH": str(REPO_ROOT)}

    def session(order: str) -> str:
        done = subprocess.run([sys.executable, "-c", PLAN_AND_RUN, order], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout + done.stderr

    def entries() -> set[str]:
        return {p.name.split("-")[0] for p in cache.glob("jit_*-cache")}

    outputs = [session("plan-first")]
    assert "jit_run" in entries()  # the program run after the plan is cached
    outputs += [session("run-first"), session("run-first")]
    assert "jit_planned" not in entries()  # the plan's never is
    assert "Persistent compilation cache hit for 'jit_run'" in outputs[-1]
    assert not [o for o in outputs if "Error reading persistent compilation cache" in o]
