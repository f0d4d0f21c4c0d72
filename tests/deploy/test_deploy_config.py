"""deploy/config/splitrl.yaml is the `make demo` run with container paths and addresses, and each
container's emulated device count fits the mesh its config asks for."""

from __future__ import annotations

import math
import re

import pytest
from deploy_helpers import DEPLOY
from test_compose import _service_config, argv, compose

from splitrl.config import load_config, to_dict
from splitrl_app.cli import build_parser

DEPLOYMENT_KEYS = {
    "model.path",
    "trainer.run_dir",
    "services.host",
    "services.reward_address",
    "services.trainer_address",
    "services.sampler_dns",
    "services.metrics_port",
}


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and key != "axes":
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_container_config_is_the_demo_config_plus_deployment_keys():
    from splitrl_app.launch import demo as demo_launcher

    deployed = _flatten(to_dict(load_config(DEPLOY / "config" / "splitrl.yaml")))
    demo = _flatten(to_dict(load_config(demo_launcher.demo_config_path())))
    differ = {k for k in deployed if deployed[k] != demo.get(k)}
    assert differ == DEPLOYMENT_KEYS


def test_init_model_makes_the_model_demo_would_make(monkeypatch):
    cfg = load_config(DEPLOY / "config" / "splitrl.yaml")
    args = build_parser().parse_args(argv(compose()["services"]["init-model"]))
    assert (args.out, args.family, args.preset, args.vocab, args.seed) == (
        cfg.model.path, "qwen2", "tiny", "arithmetic", cfg.trainer.seed
    )


def _devices(env: dict) -> int:
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", env.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else 1


def _mesh_size(axes: dict) -> int:
    return -1 if -1 in axes.values() else math.prod(axes.values())


@pytest.mark.parametrize("name", ["sampler", "trainer"])
def test_compose_emulates_as_many_devices_as_the_mesh_needs(name, monkeypatch):
    svc, _, cfg = _service_config(name, monkeypatch)
    mesh = cfg.sampler.mesh if name == "sampler" else cfg.trainer.mesh
    assert _mesh_size(mesh.axes) in (-1, _devices(svc["environment"]))


@pytest.mark.parametrize("overlay", ["cpu", "gke-tpu"])
@pytest.mark.parametrize(("kind", "name"), [("Deployment", "sampler"), ("Job", "trainer")])
def test_k8s_meshes_fit_the_devices_of_the_pods(overlay, kind, name, rendered, tmp_path,
                                                monkeypatch):
    from test_k8s_manifests import _config_for

    docs = rendered[overlay]
    workload, c, env, cfg = _config_for(docs, tmp_path, kind, name, name, monkeypatch)
    mesh = cfg.sampler.mesh if name == "sampler" else cfg.trainer.mesh
    tpu = c.get("resources", {}).get("limits", {}).get("google.com/tpu")
    if tpu is None:
        devices = _devices(env)
    else:
        devices = int(tpu) * (workload["spec"].get("completions", 1) if kind == "Job" else 1)
    assert _mesh_size(mesh.axes) in (-1, devices), (mesh.axes, devices)
