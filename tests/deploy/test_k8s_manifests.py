"""Every kustomize overlay renders, every object validates against Kubernetes 1.32, and what the
manifests run in each container is accepted by the real CLI with the config they mount."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from deploy_helpers import (
    CLUSTER_SCOPED,
    FAKE_POD_IP,
    OVERLAYS,
    WORKLOAD_KINDS,
    container,
    container_env,
    containers,
    expand_k8s,
    find,
    host_of,
    mount_dirs,
    mounted_files,
    pod_spec,
    port_of,
    venv_tool,
)

from splitrl import distributed
from splitrl.config import load_config
from splitrl_app import k8s
from splitrl_app.cli import build_parser

SERVICES = ("reward", "sampler", "trainer")


def test_the_overlays_are_the_documented_ones():
    assert OVERLAYS == ["cpu", "cpu-autoscale", "gke-tpu"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_strictly_against_kubernetes_1_32(overlay, rendered, tmp_path):
    exe = venv_tool("kubernetes-validate")
    if exe is None:
        pytest.skip("kubernetes-validate is not installed")
    docs = rendered[overlay]
    assert len(docs) >= 15
    # kubernetes-validate stops at the first error of a file: one object per file.
    files = []
    for i, doc in enumerate(docs):
        path = tmp_path / f"{i:02d}-{doc['kind']}-{doc['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(doc))
        files.append(str(path))
    proc = subprocess.run(
        [exe, "--strict", "-k", "1.32.0", *files], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("passed for resource") + proc.stderr.count(
        "passed for resource"
    ) == len(docs), proc.stdout + proc.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_deploy_into_the_namespace_the_cli_defaults_to(overlay, rendered):
    docs = rendered[overlay]
    assert find(docs, "Namespace", k8s.NAMESPACE)
    for doc in docs:
        if doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"].get("namespace") == k8s.NAMESPACE, doc["metadata"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_command_is_accepted_by_the_cli_with_the_mounted_config(
    overlay, rendered, tmp_path, monkeypatch
):
    docs = rendered[overlay]
    seen = set()
    for kind in WORKLOAD_KINDS:
        for workload in (d for d in docs if d["kind"] == kind):
            for c in containers(workload):
                env = container_env(c, docs)
                args = [expand_k8s(a, env) for a in c.get("command", []) + c.get("args", [])]
                for key in ("SPLITRL_CONFIG", "SPLITRL_AUTH_TOKEN"):
                    monkeypatch.delenv(key, raising=False)
                for key, value in env.items():
                    monkeypatch.setenv(key, value)
                parsed = build_parser().parse_args(args)  # SPLITRL_CONFIG is read here
                seen.add(parsed.command)
                if parsed.command == "init-model":
                    mounts = mount_dirs(workload, c)
                    assert any(parsed.out.startswith(p + "/") for p in mounts), parsed.out
                    continue
                files = mounted_files(workload, c, docs, tmp_path)
                assert parsed.config in files, f"{parsed.config} is not mounted: {sorted(files)}"
                cfg = load_config(files[parsed.config], parsed.overrides)
                assert cfg.services.host == "0.0.0.0"
                if parsed.command == "sampler":
                    assert cfg.services.advertise_host == FAKE_POD_IP
    assert seen == {"init-model", *SERVICES}


def _config_for(docs, tmp_path, kind, name, cname, monkeypatch):
    workload = find(docs, kind, name)
    c = container(workload, cname)
    env = container_env(c, docs)
    monkeypatch.setenv("SPLITRL_CONFIG", env["SPLITRL_CONFIG"])
    args = [expand_k8s(a, env) for a in c["args"]]
    parsed = build_parser().parse_args(args)
    files = mounted_files(workload, c, docs, tmp_path)
    return workload, c, env, load_config(files[parsed.config], parsed.overrides)


def _listen_port(cfg, service: str) -> int:
    return {
        "reward": port_of(cfg.services.reward_address),
        "trainer": port_of(cfg.services.trainer_address),
        "sampler": cfg.services.sampler_port,
    }[service]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_probes_and_ports_match_the_config_addresses(
    overlay, rendered, tmp_path, monkeypatch
):
    docs = rendered[overlay]
    kinds = {"reward": "Deployment", "sampler": "Deployment", "trainer": "Job"}
    for service in SERVICES:
        workload, c, _, cfg = _config_for(
            docs, tmp_path, kinds[service], service, service, monkeypatch
        )
        port = _listen_port(cfg, service)
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert named["grpc"] == port
        assert named["metrics"] == cfg.services.metrics_port
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(cfg.services.metrics_port)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": port}, (service, probe)
        # The Service of that name selects this workload's pods on the same port.
        svc = find(docs, "Service", service)
        labels = workload["spec"]["template"]["metadata"]["labels"]
        selector = dict(svc["spec"]["selector"])
        selector.pop("batch.kubernetes.io/job-completion-index", None)
        assert selector.items() <= labels.items()
        grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert grpc_port["port"] == port and grpc_port["targetPort"] == "grpc"
    # The addresses every service dials are exactly those Services.
    assert host_of(cfg.services.reward_address) == "reward"
    assert host_of(cfg.services.trainer_address) == "trainer"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_samplers_are_found_through_the_headless_service_named_in_sampler_dns(
    overlay, rendered, tmp_path, monkeypatch
):
    docs = rendered[overlay]
    _, _, _, cfg = _config_for(docs, tmp_path, "Job", "trainer", "trainer", monkeypatch)
    assert cfg.services.sampler_addresses == []  # nothing written anywhere
    name, port = cfg.services.sampler_dns.rsplit(":", 1)
    svc = find(docs, "Service", name)
    assert svc["spec"]["clusterIP"] == "None"  # one A record per ready pod
    assert not svc["spec"].get("publishNotReadyAddresses", False)
    assert [p["port"] for p in svc["spec"]["ports"]] == [int(port)]
    # splitrl_app.k8s discovery looks for the same Service and port name.
    assert name == k8s.SAMPLER_SERVICE and svc["spec"]["ports"][0]["name"] == "grpc"
    sampler = find(docs, "Deployment", k8s.SAMPLER_DEPLOYMENT)
    pdb = find(docs, "PodDisruptionBudget", "sampler")
    labels = sampler["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_trainer_is_an_indexed_job_whose_pod_0_is_the_jax_coordinator(
    overlay, rendered, tmp_path, monkeypatch
):
    docs = rendered[overlay]
    job, c, env, cfg = _config_for(docs, tmp_path, "Job", "trainer", "trainer", monkeypatch)
    spec = job["spec"]
    n = spec["completions"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == n
    assert cfg.trainer.distributed.num_processes == n
    host, port = cfg.trainer.distributed.coordinator_address.rsplit(":", 1)
    subdomain = pod_spec(job)["subdomain"]
    assert host == f"{job['metadata']['name']}-0.{subdomain}"
    workers = find(docs, "Service", subdomain)
    assert workers["spec"]["clusterIP"] == "None"
    assert workers["spec"]["publishNotReadyAddresses"] is True
    assert int(port) in [p["port"] for p in workers["spec"]["ports"]]
    assert int(port) in [p["containerPort"] for p in c["ports"]]
    # The trainer API is process 0's.
    assert find(docs, "Service", "trainer")["spec"]["selector"][
        "batch.kubernetes.io/job-completion-index"
    ] == "0"
    # Each pod resolves its rank from the index Kubernetes gives it.
    plans = [distributed.plan(cfg, {**env, "JOB_COMPLETION_INDEX": str(i)}) for i in range(n)]
    if n == 1:
        assert plans[0].mode == "single"
    else:
        assert [p.process_id for p in plans] == list(range(n))
        assert {p.mode for p in plans} == {"explicit"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_model_run_dir_and_checkpoints_live_on_the_right_volumes(
    overlay, rendered, tmp_path, monkeypatch
):
    docs = rendered[overlay]
    job, c, _, cfg = _config_for(docs, tmp_path, "Job", "trainer", "trainer", monkeypatch)
    mounts = mount_dirs(job, c)
    run_mount = next(p for p in mounts if cfg.trainer.run_dir.startswith(p + "/"))
    init = container(job, "init-model")
    assert init["args"][1] == cfg.model.path
    model_mount = next(p for p in mounts if cfg.model.path.startswith(p + "/"))
    assert model_mount in mount_dirs(job, init)
    if overlay == "gke-tpu":
        # Several trainer hosts: checkpoints in GCS, no ReadWriteOnce claim.
        assert cfg.trainer.checkpoint.dir.startswith("gs://")
        assert "PersistentVolumeClaim" not in {d["kind"] for d in docs}
    else:
        claim = mounts[run_mount]["persistentVolumeClaim"]["claimName"]
        assert find(docs, "PersistentVolumeClaim", claim)
        assert cfg.trainer.checkpoint.dir is None  # <run_dir>/checkpoints, on the claim


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_as_the_images_non_root_user(overlay, rendered):
    from test_dockerfile import image_user

    uid, gid = image_user()
    for doc in rendered[overlay]:
        if doc["kind"] in WORKLOAD_KINDS:
            sc = pod_spec(doc)["securityContext"]
            assert sc["runAsNonRoot"] is True
            assert (sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"]) == (uid, gid, gid)


def test_gke_tpu_puts_trainer_and_samplers_on_separate_tpu_node_pools(rendered):
    docs = rendered["gke-tpu"]
    pools = {}
    for kind, name in (("Job", "trainer"), ("Deployment", "sampler")):
        workload = find(docs, kind, name)
        sel = pod_spec(workload)["nodeSelector"]
        assert sel["cloud.google.com/gke-tpu-accelerator"].startswith("tpu-")
        res = container(workload, name)["resources"]
        chips = int(res["limits"]["google.com/tpu"])
        assert int(res["requests"]["google.com/tpu"]) == chips > 0
        topology = sel["cloud.google.com/gke-tpu-topology"]
        total = 1
        for dim in topology.split("x"):
            total *= int(dim)
        hosts = workload["spec"].get("completions", 1) if kind == "Job" else 1
        assert hosts * chips == total, (name, topology, hosts, chips)
        tolerations = pod_spec(workload)["tolerations"]
        assert any(t["key"] == "google.com/tpu" for t in tolerations)
        pools[name] = (sel["cloud.google.com/gke-nodepool"], topology)
    assert pools["trainer"][0] != pools["sampler"][0]
    assert find(docs, "Job", "trainer")["spec"]["completions"] > 1  # multi-host JAX
    # The reward service stays on CPU nodes.
    reward = find(docs, "Deployment", "reward")
    assert "nodeSelector" not in pod_spec(reward)
    images = {c["image"] for d in docs if d["kind"] in WORKLOAD_KINDS for c in containers(d)}
    assert len(images) == 1 and images.pop().endswith(":tpu")


def test_cpu_autoscale_scales_the_sampler_deployment_on_cpu(rendered):
    docs = rendered["cpu-autoscale"]
    hpa = find(docs, "HorizontalPodAutoscaler", "sampler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", k8s.SAMPLER_DEPLOYMENT)
    sampler = find(docs, "Deployment", target["name"])
    assert container(sampler, "sampler")["resources"]["requests"]["cpu"]
    assert hpa["spec"]["minReplicas"] >= 1 and hpa["spec"]["maxReplicas"] > hpa["spec"][
        "minReplicas"
    ]
    assert "HorizontalPodAutoscaler" not in {d["kind"] for d in rendered["cpu"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_referenced_configmap_secret_claim_and_account_exists(overlay, rendered):
    docs = rendered[overlay]
    for doc in (d for d in docs if d["kind"] in WORKLOAD_KINDS):
        spec = pod_spec(doc)
        if "serviceAccountName" in spec:
            find(docs, "ServiceAccount", spec["serviceAccountName"])
        for vol in spec.get("volumes", []):
            if "configMap" in vol:
                find(docs, "ConfigMap", vol["configMap"]["name"])
            if "persistentVolumeClaim" in vol:
                find(docs, "PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
        for c in containers(doc):
            container_env(c, docs)  # resolves every configMapKeyRef / secretKeyRef
    binding = find(docs, "RoleBinding", "splitrl-trainer-discovery")
    role = find(docs, "Role", binding["roleRef"]["name"])
    assert {"list"} <= set(role["rules"][0]["verbs"])
    assert role["rules"][0]["resources"] == ["endpointslices"]
    assert binding["subjects"][0]["namespace"] == k8s.NAMESPACE
