"""docs/deploy.md: every command in its ```bash blocks names files, overlays, services, node
pools and ports that exist, and every `splitrl` command parses with the real CLI."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml
from deploy_helpers import DEPLOY, REPO, WORKLOAD_KINDS, containers, find, pod_spec
from test_compose import compose

from splitrl import k8s
from splitrl.cli import build_parser
from splitrl.config import load_config

GUIDE = REPO / "docs" / "deploy.md"


def commands() -> list[list[str]]:
    """Every command of the guide's ```bash blocks, split into words (``&&`` splits too)."""
    blocks = re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), flags=re.S)
    out = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            for part in line.split("&&"):
                words = shlex.split(part)
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value cmd
                    words = words[1:]
                if words:
                    out.append(words)
    return out


def by_tool(*prefix: str) -> list[list[str]]:
    return [c for c in commands() if c[: len(prefix)] == list(prefix)]


def option(words: list[str], name: str) -> str | None:
    for i, w in enumerate(words):
        if w == name:
            return words[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return None


def test_the_guide_has_commands_for_every_path():
    tools = {c[0] for c in commands()}
    assert {"make", "splitrl", "docker", "kubectl", "gcloud", "kind"} <= tools


def test_every_splitrl_command_parses_and_names_real_overlays():
    cmds = by_tool("splitrl")
    assert len(cmds) >= 10
    actions = set()
    for words in cmds:
        args = build_parser().parse_args(words[1:])
        if args.command == "k8s":
            sub = k8s.build_parser().parse_args(args.k8s_args)
            actions.add(sub.action)
            if sub.action in ("render", "apply"):
                assert sub.overlay in k8s.overlays(DEPLOY), sub.overlay
            if sub.action == "scale":
                assert sub.deployment == k8s.SAMPLER_DEPLOYMENT
    assert actions == {"render", "apply", "scale", "status", "discover"}


def test_docker_build_commands_use_the_dockerfile_and_its_build_args():
    builds = by_tool("docker", "build")
    assert builds
    allowed = {"cpu", "tpu"}
    for words in builds:
        assert option(words, "-f") == "deploy/Dockerfile" and words[-1] == "."
        arg = option(words, "--build-arg")
        if arg is not None:
            name, value = arg.split("=")
            assert name == "ACCELERATOR" and value in allowed
        context = option(words, "--build-context")
        if context is not None:
            assert context.split("=")[0] == "data"
    assert any(option(w, "--build-arg") == "ACCELERATOR=tpu" for w in builds)


def test_compose_commands_use_the_compose_file_and_its_services():
    cmds = by_tool("docker", "compose")
    assert cmds
    services = compose()["services"]
    scaled = False
    for words in cmds:
        assert option(words, "-f") == "deploy/compose.yaml"
        verb = words[3]
        if verb in ("logs", "exec", "run"):
            name = next(w for w in words[4:] if not w.startswith("-"))
            assert name in services, name
        scale = option(words, "--scale")
        if scale:
            name, n = scale.split("=")
            assert name == "sampler" and int(n) > services[name]["deploy"]["replicas"]
            scaled = True
        if verb == "exec":
            rest = words[words.index(name) + 1 :]
            assert rest[0] == "splitrl"
            build_parser().parse_args(rest[1:])
        if verb == "run":  # args after the service go to the image's `splitrl` entrypoint
            args = build_parser().parse_args(words[words.index(name) + 1 :])
            load_config(DEPLOY / "config" / "splitrl.yaml", args.overrides)
    assert scaled


def test_kubectl_commands_name_real_overlays_objects_and_ports(rendered):
    cmds = by_tool("kubectl")
    assert cmds
    checked = set()
    for words in cmds:
        if "-k" in words:
            path = REPO / option(words, "-k")
            assert (path / "kustomization.yaml").is_file(), path
            assert path.parent == DEPLOY / "k8s" / "overlays"
        ns = option(words, "-n")
        if ns is not None:
            assert ns == k8s.NAMESPACE
            i = words.index("-n")
            words = words[:i] + words[i + 2 :]
        overlay = "gke-tpu" if "gke-tpu" in " ".join(words) else "cpu"
        docs = rendered[overlay]
        for w in words:
            m = re.fullmatch(r"(deployment|job|svc|hpa)/([a-z0-9-]+)", w)
            if m:
                kind = {"deployment": "Deployment", "job": "Job", "svc": "Service",
                        "hpa": "HorizontalPodAutoscaler"}[m.group(1)]
                find(docs, kind, m.group(2))
        if words[1] == "scale":
            assert "deployment/sampler" in words
        if "port-forward" in words:
            svc = find(docs, "Service", option(words, "port-forward").split("/")[1])
            ports = {p["port"] for p in svc["spec"]["ports"]}
            forwards = [w for w in words if re.fullmatch(r"\d+:\d+", w)]
            assert forwards and {int(f.split(":")[1]) for f in forwards} <= ports
        if words[1:3] == ["delete", "job"]:
            find(docs, "Job", words[3])
        if words[1:3] == ["get", "hpa"]:
            find(rendered["cpu-autoscale"], "HorizontalPodAutoscaler", words[3])
        checked.add(words[1])
    assert {"apply", "scale", "port-forward", "delete", "get", "logs"} <= checked


def test_gke_node_pools_match_the_overlays_node_selectors(rendered):
    pools = {}
    for words in by_tool("gcloud", "container", "node-pools", "create"):
        pools[words[4]] = {
            "topology": option(words, "--tpu-topology"),
            "machine": option(words, "--machine-type"),
            "nodes": int(option(words, "--num-nodes")),
        }
    docs = rendered["gke-tpu"]
    for kind, name in (("Job", "trainer"), ("Deployment", "sampler")):
        workload = find(docs, kind, name)
        sel = pod_spec(workload)["nodeSelector"]
        pool = pools[sel["cloud.google.com/gke-nodepool"]]
        assert pool["topology"] == sel["cloud.google.com/gke-tpu-topology"]
        assert pool["machine"].startswith("ct5lp-")  # TPU v5e = tpu-v5-lite-podslice
        assert sel["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5-lite-podslice"
        chips = int(pool["machine"].split("-")[-1].rstrip("t"))
        tpu = containers(workload)[-1]["resources"]["limits"]["google.com/tpu"]
        assert int(tpu) == chips
        if kind == "Job":
            assert pool["nodes"] == workload["spec"]["completions"]


def test_image_pushed_is_the_image_applied(rendered):
    exports = " ".join(" ".join(c) for c in by_tool("export"))
    image = re.search(r"IMAGE=(\S+)", exports).group(1)
    assert image.endswith(":tpu")
    pushes = [c[2] for c in by_tool("docker", "push")]
    assert pushes == ["$IMAGE"]
    for words in by_tool("splitrl", "k8s"):
        if words[2] in ("render", "apply") and words[3] == "gke-tpu":
            assert option(words, "--image") == "$IMAGE"
    builds = [c for c in by_tool("docker", "build") if option(c, "-t") == "$IMAGE"]
    assert builds and option(builds[0], "--build-arg") == "ACCELERATOR=tpu"
    # The cpu overlay runs the image the guide builds and loads into kind.
    loaded = {c[3] for c in by_tool("kind", "load", "docker-image")}
    cpu_images = {
        c["image"] for d in rendered["cpu"] if d["kind"] in WORKLOAD_KINDS for c in containers(d)
    }
    assert cpu_images == loaded


def test_the_checkpoint_bucket_step_edits_the_generator_that_exists():
    text = GUIDE.read_text()
    kust = yaml.safe_load((DEPLOY / "k8s" / "overlays" / "gke-tpu" / "kustomization.yaml")
                          .read_text())
    gen = next(g for g in kust["configMapGenerator"] if g["name"] == "splitrl-gke")
    assert gen["literals"][0].startswith("checkpoint_dir=gs://")
    assert "`splitrl-gke` generator" in text and "checkpoint_dir=gs://$BUCKET" in text


@pytest.mark.parametrize("path", ["deploy/config/splitrl.yaml", "deploy/k8s/base/auth/token",
                                  "deploy/k8s/components/sampler-hpa"])
def test_paths_the_guide_mentions_exist_or_are_generated(path):
    assert path in GUIDE.read_text()
    if path.endswith("token"):
        assert (REPO / "deploy/k8s/base/auth/.gitignore").read_text().split() == ["token"]
    else:
        assert (REPO / path).exists()
