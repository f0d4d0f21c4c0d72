"""Shared fixtures for the deploy tests: a scratch copy of deploy/, rendered overlays, and how
to turn what compose or a manifest gives a container (args, env, mounts) into a CLI call."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir() if p.is_dir())
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume"}
FAKE_POD_IP = "10.8.0.7"


def copy_deploy(dest: Path) -> Path:
    """deploy/ copied to ``dest`` with an auth token, so rendering never writes into the repo."""
    root = dest / "deploy"
    shutil.copytree(DEPLOY, root, ignore=shutil.ignore_patterns("token"))
    (root / "k8s" / "base" / "auth" / "token").write_text("test-token\n")
    return root


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def find(docs: list[dict], kind: str, name: str) -> dict:
    objs = by_kind(docs, kind)
    assert name in objs, f"no {kind} {name!r} in {sorted(objs)}"
    return objs[name]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict) -> list[dict]:
    spec = pod_spec(workload)
    return spec.get("initContainers", []) + spec["containers"]


def container(workload: dict, name: str) -> dict:
    for c in containers(workload):
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name!r} in {workload['metadata']['name']}")


def container_env(c: dict, docs: list[dict]) -> dict[str, str]:
    """The container's environment as the kubelet would set it (refs resolved in ``docs``)."""
    env: dict[str, str] = {}
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
            continue
        ref = var["valueFrom"]
        if "fieldRef" in ref:
            assert ref["fieldRef"]["fieldPath"] == "status.podIP", ref
            env[var["name"]] = FAKE_POD_IP
        elif "configMapKeyRef" in ref:
            r = ref["configMapKeyRef"]
            env[var["name"]] = find(docs, "ConfigMap", r["name"])["data"][r["key"]]
        elif "secretKeyRef" in ref:
            r = ref["secretKeyRef"]
            secret = find(docs, "Secret", r["name"])
            assert r["key"] in secret.get("data", {}) or r["key"] in secret.get("stringData", {})
            env[var["name"]] = "secret"
        else:
            raise AssertionError(f"unsupported env source {ref}")
    return env


def expand_k8s(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command/args; an undefined variable stays as written."""
    out = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)
    assert "$(" not in out, f"{arg!r}: references a variable the container does not define"
    return out


def mounted_files(workload: dict, c: dict, docs: list[dict], tmp: Path) -> dict[str, Path]:
    """Container path -> local file for every ConfigMap key mounted into ``c``."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    files: dict[str, Path] = {}
    for m in c.get("volumeMounts", []):
        vol = volumes[m["name"]]
        if "configMap" not in vol:
            continue
        cm = find(docs, "ConfigMap", vol["configMap"]["name"])
        for key, text in cm["data"].items():
            local = tmp / cm["metadata"]["name"] / key
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(text)
            files[f"{m['mountPath'].rstrip('/')}/{key}"] = local
    return files


def mount_dirs(workload: dict, c: dict) -> dict[str, dict[str, Any]]:
    """Mount path -> volume source for ``c``."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0]


def interpolate_compose(text: str, env: dict[str, str] | None = None) -> str:
    """Compose's ${VAR:-default} / ${VAR} interpolation against ``env`` (default: empty)."""
    env = env or {}

    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(3)
        return env.get(name) or (default if default is not None else "")

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}", sub, text)


def venv_tool(name: str) -> str | None:
    """A console script from this interpreter's environment, else from PATH."""
    import shutil
    import sys

    local = Path(sys.executable).parent / name
    return str(local) if local.is_file() else shutil.which(name)
