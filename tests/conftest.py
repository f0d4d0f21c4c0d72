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

REPO_ROOT = Path(__file__).resolve().parents[1]
# One persistent XLA compilation cache for the test process and every service it starts: the
# e2e tests start many sampler/trainer processes that compile the same programs.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO_ROOT / ".pytest_cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# SplitRL's own cache (splitrl/user_cache.py) stays inside the checkout too, never in ~/.cache.
os.environ.setdefault("SPLITRL_CACHE_DIR", str(REPO_ROOT / ".pytest_cache" / "splitrl"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
SHARED_DATA = (REPO_ROOT.parent / "shared" / "data").resolve()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` beside the repository (GSM8K, MATH-500); skip if it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


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
