"""`splitrl k8s`: render works offline through the real CLI; apply, scale, status and discovery
are checked against mocked Kubernetes API objects (there is no API server on these machines)."""

from __future__ import annotations

import os
import stat
import subprocess
from types import SimpleNamespace

import pytest
import yaml
from deploy_helpers import WORKLOAD_KINDS, containers, copy_deploy
from kubernetes import client

from splitrl_app import k8s
from splitrl_app.cli import main as splitrl_main


def test_splitrl_k8s_render_prints_the_overlay(kubectl, deploy_root, monkeypatch, capsys):
    monkeypatch.setenv("SPLITRL_DEPLOY_DIR", str(deploy_root))
    assert splitrl_main(["k8s", "render", "cpu"]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Job", "Service", "ConfigMap", "Secret"} <= kinds


def test_render_image_flag_sets_every_container_image(kubectl, deploy_root):
    image = "europe-docker.pkg.dev/p/r/splitrl:abc"
    docs = list(yaml.safe_load_all(k8s.render("gke-tpu", image=image, root=deploy_root)))
    images = {c["image"] for d in docs if d["kind"] in WORKLOAD_KINDS for c in containers(d)}
    assert images == {image}


def test_unknown_overlay_is_an_error_naming_the_choices(deploy_root, monkeypatch, capsys):
    monkeypatch.setenv("SPLITRL_DEPLOY_DIR", str(deploy_root))
    assert k8s.main(["render", "gke-gpu"]) == 1
    err = capsys.readouterr().err
    assert "unknown overlay 'gke-gpu'" in err and "'cpu'" in err and "'gke-tpu'" in err


def test_auth_token_is_created_once_private_and_random(tmp_path):
    root = copy_deploy(tmp_path)
    token = root / "k8s" / "base" / "auth" / "token"
    token.unlink()
    path = k8s.ensure_auth_token(root)
    first = path.read_text()
    assert path == token and len(first.strip()) == 64
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert k8s.ensure_auth_token(root).read_text() == first  # never overwritten


def test_apply_pipes_the_rendered_overlay_to_kubectl_apply(kubectl, deploy_root, monkeypatch):
    calls = []
    real_run = subprocess.run

    def fake_run(cmd, *args, **kwargs):
        if cmd[1] == "apply":
            calls.append((cmd, kwargs["input"]))
            return subprocess.CompletedProcess(cmd, 0)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(k8s.subprocess, "run", fake_run)
    assert k8s.apply("cpu", dry_run="client", root=deploy_root) == 0
    (cmd, manifests), = calls
    assert cmd[1:] == ["apply", "-f", "-", "--dry-run=client"]
    assert "kind: Job" in manifests


def _slices(*items):
    return client.V1EndpointSliceList.from_dict({"items": list(items)})


class FakeDiscovery:
    def __init__(self, slices):
        self.slices = slices
        self.calls = []

    def list_namespaced_endpoint_slice(self, namespace, label_selector=None):
        self.calls.append((namespace, label_selector))
        return self.slices


def test_discover_samplers_returns_ready_endpoints_of_the_headless_service():
    api = FakeDiscovery(
        _slices(
            {
                "addressType": "IPv4",
                "ports": [{"name": "grpc", "port": 50300}],
                "endpoints": [
                    {"addresses": ["10.0.0.2"], "conditions": {"ready": True}},
                    {"addresses": ["10.0.0.3"], "conditions": {"ready": False}},  # starting
                    {"addresses": ["10.0.0.4"], "conditions": {}},  # unknown counts as ready
                    {"addresses": ["10.0.0.5"], "conditions": {"ready": False,
                                                                "terminating": True}},
                ],
            },
            {
                "addressType": "IPv6",
                "ports": [{"name": "grpc", "port": 50300}],
                "endpoints": [{"addresses": ["fd00::7"], "conditions": {"ready": True}}],
            },
            {"addressType": "IPv4", "ports": None, "endpoints": None},  # no ports yet
        )
    )
    found = k8s.discover_samplers("splitrl", api=api)
    assert found == ["10.0.0.2:50300", "10.0.0.4:50300", "[fd00::7]:50300"]
    assert api.calls == [("splitrl", "kubernetes.io/service-name=sampler")]


def test_discover_samplers_uses_the_pods_namespace_in_cluster(tmp_path, monkeypatch):
    ns = tmp_path / "namespace"
    ns.write_text("team-rl\n")
    monkeypatch.setattr(k8s, "SA_NAMESPACE_FILE", ns)
    api = FakeDiscovery(_slices())
    assert k8s.discover_samplers(api=api) == []
    assert api.calls[0][0] == "team-rl"


def test_scale_patches_the_sampler_deployments_scale_subresource():
    calls = []

    class FakeApps:
        def patch_namespaced_deployment_scale(self, name, namespace, body):
            calls.append((name, namespace, body))
            return client.V1Scale.from_dict({"spec": {"replicas": body["spec"]["replicas"]}})

    assert k8s.scale(3, api=FakeApps()) == 3
    assert calls == [("sampler", "splitrl", {"spec": {"replicas": 3}})]
    with pytest.raises(k8s.K8sError, match="--replicas"):
        k8s.scale(-1, api=FakeApps())


def test_status_lists_deployments_jobs_and_pods_of_splitrl():
    selectors = []

    def lister(items):
        def list_(namespace, label_selector=None):
            selectors.append((namespace, label_selector))
            return SimpleNamespace(items=items)

        return list_

    deployment = client.V1Deployment.from_dict(
        {"metadata": {"name": "sampler"}, "spec": {"replicas": 3, "selector": {},
         "template": {}}, "status": {"readyReplicas": 2}}
    )
    job = client.V1Job.from_dict(
        {"metadata": {"name": "trainer"}, "spec": {"completions": 4, "template": {}},
         "status": {"active": 4}}
    )
    pod = client.V1Pod.from_dict(
        {"metadata": {"name": "trainer-0-abc"}, "status": {"phase": "Running",
         "containerStatuses": [{"name": "trainer", "ready": True, "restartCount": 1,
                                "image": "x", "imageID": "y"}]}}
    )
    rows = k8s.status(
        "splitrl",
        apps=SimpleNamespace(list_namespaced_deployment=lister([deployment])),
        batch=SimpleNamespace(list_namespaced_job=lister([job])),
        core=SimpleNamespace(list_namespaced_pod=lister([pod])),
    )
    assert rows == [
        ("deployment", "sampler", "2/3 ready"),
        ("job", "trainer", "4 active, 0 succeeded, 0 failed of 4"),
        ("pod", "trainer-0-abc", "Running, 1/1 ready, 1 restarts"),
    ]
    assert set(selectors) == {("splitrl", "app.kubernetes.io/part-of=splitrl")}


def test_status_selector_matches_the_label_every_rendered_object_carries(rendered):
    key, value = k8s.PART_OF.split("=")
    for docs in rendered.values():
        for doc in docs:
            assert doc["metadata"]["labels"][key] == value, doc["metadata"]["name"]
            if doc["kind"] in WORKLOAD_KINDS:
                assert doc["spec"]["template"]["metadata"]["labels"][key] == value


def test_api_commands_without_a_cluster_fail_with_a_clear_message(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert k8s.main(["scale", "--replicas", "2"]) == 1
    assert "no Kubernetes API server configured" in capsys.readouterr().err
