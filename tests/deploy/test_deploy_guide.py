"""docs/deploy.md: every command in its ```bash blocks names files, overlays, services, node
pools and ports that exist, and every `splitrl` command parses with the real CLI."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml
from deploy_helpers import DEPLOY, REPO, WORKLOAD_KINDS, containers, find, pod_spec
from test_compose import compose

from splitrl.config import load_config
from splitrl_app import k8s
from splitrl_app.cli import build_parser

GUIDE = REPO / "docs" / "deploy.md"


def commands() -> list[list[str]]:
    """Every command of the guide's ```bash blocks, split into words (``&&`` and ``|`` split
    too)."""
    blocks = re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), flags=re.S)
    out = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            for part in line.split("&&"):
                for words in _pipeline(shlex.split(part)):
                    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value cmd
                        words = words[1:]
                    if words:
                        out.append(words)
    return out


def _pipeline(words: list[str]) -> list[list[str]]:
    """``a x | b y`` -> [[a, x], [b, y]]."""
    out: list[list[str]] = [[]]
    for w in words:
        if w == "|":
            out.append([])
        else:
            out[-1].append(w)
    return out


def by_tool(*prefix: str) -> list[list[str]]:
    return [c for c in commands() if c[: len(prefix)] == list(prefix)]


def options(words: list[str], name: str) -> list[str]:
    """Every value of a repeatable option (``--build-arg A=1 --build-arg B=2``)."""
    out = []
    for i, w in enumerate(words):
        if w == name:
            out.append(words[i + 1])
        elif w.startswith(name + "="):
            out.append(w.split("=", 1)[1])
    return out


def option(words: list[str], name: str) -> str | None:
    found = options(words, name)
    return found[0] if found else None


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
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    imported = {c[-1] for c in by_tool("docker", "import")}  # images the guide makes locally
    for words in builds:
        assert option(words, "-f") == "deploy/Dockerfile" and words[-1] == "."
        for arg in options(words, "--build-arg"):
            name, value = arg.split("=")
            assert f"ARG {name}=" in dockerfile, name
            if name == "ACCELERATOR":
                assert value in {"cpu", "tpu"}
            if name in ("BASE_IMAGE", "CA_IMAGE"):
                assert value in imported, f"{name}={value}: no `docker import` makes it"
        context = option(words, "--build-context")
        if context is not None:
            assert context.split("=")[0] == "data"
    assert any(option(w, "--build-arg") == "ACCELERATOR=tpu" for w in builds)
    # The offline path: a base from Debian's packages, the CA bundle for the build stage only.
    offline = [w for w in builds if "BASE_IMAGE=splitrl-base:bookworm" in options(w, "--build-arg")]
    assert offline and option(offline[0], "--network") == "host"
    assert "CA_IMAGE=splitrl-build-ca:local" in options(offline[0], "--build-arg")
    debootstrap = by_tool("mmdebstrap")
    assert debootstrap and debootstrap[0][-1] == by_tool("docker", "import")[0][-2]  # base.tar


def compose_commands() -> list[list[str]]:
    """`docker compose ...` and `docker-compose ...`, as ``compose -f FILE VERB ...``."""
    v2 = [["compose", *c[2:]] for c in by_tool("docker", "compose")]
    v1 = [["compose", *c[1:]] for c in by_tool("docker-compose")]
    return v2 + v1


def service_argument(args: list[str]) -> str:
    """The first argument of a compose verb that is not an option or an option's value."""
    takes_value = {"-t", "--timeout", "--index", "-e", "-u", "-w"}
    skip = False
    for w in args:
        if skip:
            skip = False
        elif w in takes_value:
            skip = True
        elif not w.startswith("-"):
            return w
    raise AssertionError(f"no service in {args}")


def test_compose_commands_use_the_compose_file_and_its_services():
    cmds = compose_commands()
    assert cmds
    services = compose()["services"]
    scaled = False
    verbs = set()
    for words in cmds:
        assert option(words, "-f") == "deploy/compose.yaml"
        verb = words[words.index("-f") + 2]
        verbs.add(verb)
        if verb in ("logs", "exec", "run", "restart"):
            name = service_argument(words[words.index(verb) + 1 :])
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
        if verb == "restart":
            assert name == "trainer" and int(option(words, "-t")) >= 60
    assert scaled
    assert {"up", "logs", "ps", "exec", "run", "restart", "down"} <= verbs


def test_the_smoke_check_commands_are_the_scripts_and_their_options():
    smoke = (DEPLOY / "smoke.sh").read_text()
    runs = [c for c in commands() if c[0] in ("deploy/smoke.sh", "deploy/engine-setup.sh")]
    assert {c[0] for c in runs} == {"deploy/smoke.sh", "deploy/engine-setup.sh"}
    for words in runs:
        for w in words[1:]:
            if w.startswith("--"):
                assert f"    {w})" in smoke, f"{w}: not an option of deploy/smoke.sh"
        if option(words, "--compose"):
            assert option(words, "--compose") in ("docker-compose", "docker compose")


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


def test_plan_commands_plan_the_overlays_node_pools(rendered):
    """`splitrl plan` in the guide compiles for the slices the gke-tpu node selectors request,
    with the meshes the containers set (tests/deploy/test_gke_tpu_plan.py runs the plan)."""
    from splitrl_app.planning.targets import gke_topology

    plans = by_tool("splitrl", "plan")
    assert plans
    docs = rendered["gke-tpu"]
    for words in plans:
        args = build_parser().parse_args(words[1:])
        assert args.config == "deploy/config/splitrl.yaml"
        for kind, name in (("Job", "trainer"), ("Deployment", "sampler")):
            workload = find(docs, kind, name)
            assert getattr(args, f"{name}_topology") == gke_topology(
                pod_spec(workload)["nodeSelector"])
            mesh = [a for a in containers(workload)[-1]["args"] if a.startswith(f"{name}.mesh.")]
            assert mesh and set(mesh) <= set(args.overrides), (name, mesh)
