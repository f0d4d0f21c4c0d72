"""A CPU machine with libtpu installed (the test extra, `splitrl[tpu-plan]`) shows no TPU
runtime errors: splitrl picks the CPU when no TPU is attached, and `splitrl plan` tells libtpu
what it compiles for instead of letting it look for a TPU VM."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from splitrl import platforms

NOISE = ("E0000", "INVALID_ARGUMENT", "could not determine TPU")


def test_the_cpu_is_chosen_only_when_nothing_else_could_be_meant(monkeypatch):
    monkeypatch.setattr(platforms, "libtpu_installed", lambda: True)
    monkeypatch.setattr(platforms, "tpu_attached", lambda: False)
    monkeypatch.setattr(platforms, "other_accelerator_plugins", lambda: False)
    env: dict[str, str] = {}
    assert platforms.prefer_cpu_without_tpu(env) and env == {"JAX_PLATFORMS": "cpu"}
    for chosen in ({"JAX_PLATFORMS": "tpu"}, {"JAX_PLATFORMS": ""}, {"JAX_FORCE_TPU_INIT": "1"}):
        env = dict(chosen)
        assert not platforms.prefer_cpu_without_tpu(env) and env == chosen
    monkeypatch.setattr(platforms, "tpu_attached", lambda: True)  # a TPU VM
    assert not platforms.prefer_cpu_without_tpu(env := {}) and env == {}
    monkeypatch.setattr(platforms, "tpu_attached", lambda: False)
    monkeypatch.setattr(platforms, "other_accelerator_plugins", lambda: True)  # jax[cuda]
    assert not platforms.prefer_cpu_without_tpu(env := {}) and env == {}
    monkeypatch.setattr(platforms, "other_accelerator_plugins", lambda: False)
    monkeypatch.setattr(platforms, "libtpu_installed", lambda: False)  # nothing to probe
    assert not platforms.prefer_cpu_without_tpu(env := {}) and env == {}


needs_libtpu_without_tpu = pytest.mark.skipif(
    not platforms.libtpu_installed() or platforms.tpu_attached(),
    reason="shows libtpu's start-up noise on a machine without a TPU: needs libtpu, no TPU")


def _stderr(code: str) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stderr


@needs_libtpu_without_tpu
def test_jax_starts_quietly_after_the_cli_chose_the_cpu():
    err = _stderr("from splitrl.platforms import prefer_cpu_without_tpu\n"
                  "prefer_cpu_without_tpu()\n"
                  "import jax\n"
                  "assert jax.devices()[0].platform == 'cpu'\n")
    assert not [word for word in NOISE if word in err], err


@needs_libtpu_without_tpu
def test_compiling_for_a_tpu_topology_starts_libtpu_quietly():
    err = _stderr("from splitrl_app.planning import tpu_target\n"
                  "assert tpu_target('v5e:2x2').device_kind == 'TPU v5 lite'\n")
    assert not [word for word in NOISE if word in err], err
