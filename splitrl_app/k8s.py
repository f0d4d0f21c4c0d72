"""``splitrl k8s``: render, apply, scale and inspect SplitRL on Kubernetes; sampler discovery.

What needs what:

- ``render OVERLAY`` needs only ``kubectl`` (``kubectl kustomize`` renders offline).
- ``apply OVERLAY`` runs ``kubectl apply`` on the rendered manifests: it needs a cluster
  (``--dry-run client`` does not).
- ``scale``, ``status``, ``discover`` and :func:`discover_samplers` use the ``kubernetes`` Python
  client and need an API server: in a pod they use the pod's service account (the trainer's is
  allowed to read EndpointSlices, ``deploy/k8s/base/rbac.yaml``), elsewhere your kubeconfig.

``OVERLAY`` is a directory name under ``deploy/k8s/overlays`` (``cpu``, ``cpu-autoscale``,
``gke-tpu``) or a path to any kustomization. The deploy directory is found beside the package
(a source checkout) or through ``$SPLITRL_DEPLOY_DIR``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from splitrl.extras import MissingExtra, require

NAMESPACE = "splitrl"  # what the overlays deploy into (deploy/k8s/namespace)
SAMPLER_SERVICE = "sampler"  # the headless Service in front of the samplers
SAMPLER_DEPLOYMENT = "sampler"
PART_OF = "app.kubernetes.io/part-of=splitrl"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
POD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}


class K8sError(RuntimeError):
    """A deploy step failed; the message says which and how to fix it."""


# ----------------------------------------------------------------------------------------------
# Offline: locate, render, apply


def deploy_dir() -> Path:
    """The ``deploy/`` directory: ``$SPLITRL_DEPLOY_DIR``, else beside the package sources."""
    env = os.environ.get("SPLITRL_DEPLOY_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[1] / "deploy"
    if not (path / "k8s" / "base" / "kustomization.yaml").is_file():
        raise K8sError(
            f"no kustomize base under {path}/k8s/base: run from a SplitRL checkout or set "
            "SPLITRL_DEPLOY_DIR to its deploy/ directory"
        )
    return path


def overlays(root: Path | None = None) -> list[str]:
    """Names of the overlays under ``deploy/k8s/overlays``."""
    base = (root or deploy_dir()) / "k8s" / "overlays"
    return sorted(p.name for p in base.iterdir() if (p / "kustomization.yaml").is_file())


def overlay_path(overlay: str, root: Path | None = None) -> Path:
    """An overlay name (``cpu``) or a path to a kustomization directory."""
    candidate = Path(overlay)
    if (candidate / "kustomization.yaml").is_file():
        return candidate
    root = root or deploy_dir()
    named = root / "k8s" / "overlays" / overlay
    if (named / "kustomization.yaml").is_file():
        return named
    raise K8sError(f"unknown overlay {overlay!r}: expected one of {overlays(root)} or a path")


def ensure_auth_token(root: Path | None = None) -> Path:
    """Create ``k8s/base/auth/token`` (random, 0600) if missing; the Secret is generated from it."""
    path = (root or deploy_dir()) / "k8s" / "base" / "auth" / "token"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        print(f"splitrl k8s: wrote a new auth token to {path}", file=sys.stderr)
    return path


def _kubectl() -> str:
    exe = shutil.which("kubectl")
    if exe is None:
        raise K8sError("kubectl not found on PATH (it renders the kustomize overlays)")
    return exe


def set_image(docs: list[dict[str, Any]], image: str) -> list[dict[str, Any]]:
    """Point every container and init container of every workload at ``image``."""
    for doc in docs:
        if doc.get("kind") not in POD_KINDS:
            continue
        pod = doc["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod.get("containers", []):
            container["image"] = image
    return docs


def render(overlay: str, image: str | None = None, root: Path | None = None) -> str:
    """``kubectl kustomize`` the overlay; optionally replace the image. Needs no cluster."""
    root = root or deploy_dir()
    path = overlay_path(overlay, root)
    ensure_auth_token(root)
    proc = subprocess.run(
        [_kubectl(), "kustomize", str(path)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise K8sError(f"kubectl kustomize {path} failed:\n{proc.stderr.strip()}")
    if image is None:
        return proc.stdout
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return yaml.safe_dump_all(set_image(docs, image), sort_keys=False)


def apply(
    overlay: str, image: str | None = None, dry_run: str | None = None, root: Path | None = None
) -> int:
    """Render the overlay and ``kubectl apply`` it (needs a cluster unless ``dry_run='client'``)."""
    manifests = render(overlay, image, root)
    cmd = [_kubectl(), "apply", "-f", "-"]
    if dry_run:
        cmd.append(f"--dry-run={dry_run}")
    return subprocess.run(cmd, input=manifests, text=True, check=False).returncode


# ----------------------------------------------------------------------------------------------
# Needs an API server: the kubernetes client


def _kubernetes(module: str):
    """``kubernetes.<module>``: the client of the ``k8s`` extra."""
    return require(f"kubernetes.{module}", "k8s", "talking to a Kubernetes API server")


def load_kube_config() -> None:
    """In a pod: its service account. Elsewhere: ``$KUBECONFIG`` / ``~/.kube/config``."""
    config = _kubernetes("config")
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, FileNotFoundError, TypeError) as e:
            raise K8sError(
                f"no Kubernetes API server configured (not in a pod, no kubeconfig): {e}"
            ) from None


def current_namespace(default: str = NAMESPACE) -> str:
    """The pod's own namespace when running in a cluster, else ``default``."""
    try:
        return SA_NAMESPACE_FILE.read_text().strip() or default
    except OSError:
        return default


def _host_port(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def discover_samplers(
    namespace: str | None = None,
    service: str = SAMPLER_SERVICE,
    port_name: str = "grpc",
    api: Any = None,
) -> list[str]:
    """Ready sampler addresses (``ip:port``) from the EndpointSlices of ``service``.

    Needs an API server (``api`` defaults to a ``DiscoveryV1Api`` from :func:`load_kube_config`).
    An endpoint counts when its ``ready`` condition is true or unknown (the EndpointSlice API
    says consumers should treat unknown as ready); terminating and not-ready pods are left out,
    which is what the headless Service's DNS answers too.
    """
    if api is None:
        client = _kubernetes("client")
        load_kube_config()
        api = client.DiscoveryV1Api()
    namespace = namespace or current_namespace()
    slices = api.list_namespaced_endpoint_slice(
        namespace, label_selector=f"{SERVICE_NAME_LABEL}={service}"
    )
    found: set[str] = set()
    for eps in slices.items or []:
        ports = eps.ports or []
        port = next((p.port for p in ports if p.name == port_name), None)
        if port is None and len(ports) == 1:
            port = ports[0].port
        if port is None:
            continue
        for endpoint in eps.endpoints or []:
            cond = endpoint.conditions
            if cond is not None and cond.ready is False:
                continue
            for address in endpoint.addresses or []:
                found.add(_host_port(address, port))
    return sorted(found)


def scale(
    replicas: int,
    deployment: str = SAMPLER_DEPLOYMENT,
    namespace: str = NAMESPACE,
    api: Any = None,
) -> int:
    """Set a Deployment's replica count (the samplers by default). Needs an API server."""
    if replicas < 0:
        raise K8sError(f"--replicas: expected a count >= 0, got {replicas}")
    if api is None:
        client = _kubernetes("client")
        load_kube_config()
        api = client.AppsV1Api()
    result = api.patch_namespaced_deployment_scale(
        deployment, namespace, {"spec": {"replicas": replicas}}
    )
    return int(result.spec.replicas)


def status(namespace: str = NAMESPACE, apps: Any = None, batch: Any = None, core: Any = None):
    """Rows (kind, name, state) for SplitRL's Deployments, Jobs and Pods. Needs an API server."""
    if apps is None or batch is None or core is None:
        client = _kubernetes("client")
        load_kube_config()
        apps = apps or client.AppsV1Api()
        batch = batch or client.BatchV1Api()
        core = core or client.CoreV1Api()
    rows: list[tuple[str, str, str]] = []
    for d in apps.list_namespaced_deployment(namespace, label_selector=PART_OF).items:
        ready = d.status.ready_replicas or 0
        rows.append(("deployment", d.metadata.name, f"{ready}/{d.spec.replicas} ready"))
    for j in batch.list_namespaced_job(namespace, label_selector=PART_OF).items:
        s = j.status
        state = (
            f"{s.active or 0} active, {s.succeeded or 0} succeeded, {s.failed or 0} failed "
            f"of {j.spec.completions}"
        )
        rows.append(("job", j.metadata.name, state))
    for p in core.list_namespaced_pod(namespace, label_selector=PART_OF).items:
        statuses = p.status.container_statuses or []
        ready = sum(1 for c in statuses if c.ready)
        restarts = sum(c.restart_count or 0 for c in statuses)
        state = f"{p.status.phase}, {ready}/{len(statuses)} ready, {restarts} restarts"
        rows.append(("pod", p.metadata.name, state))
    return rows


# ----------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitrl k8s", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    p = sub.add_parser("render", help="print the manifests of an overlay (kubectl kustomize)")
    p.add_argument("overlay", help="cpu | cpu-autoscale | gke-tpu | a kustomization directory")
    p.add_argument("--image", help="use this image for every container (REPO/NAME:TAG)")

    p = sub.add_parser("apply", help="render an overlay and kubectl apply it")
    p.add_argument("overlay")
    p.add_argument("--image", help="use this image for every container (REPO/NAME:TAG)")
    p.add_argument("--dry-run", choices=["client", "server"], default=None)

    p = sub.add_parser("scale", help="set the number of samplers (needs an API server)")
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--deployment", default=SAMPLER_DEPLOYMENT)
    p.add_argument("-n", "--namespace", default=NAMESPACE)

    p = sub.add_parser("status", help="deployments, jobs and pods (needs an API server)")
    p.add_argument("-n", "--namespace", default=NAMESPACE)

    p = sub.add_parser("discover", help="ready sampler addresses from EndpointSlices")
    p.add_argument("service", nargs="?", default=SAMPLER_SERVICE)
    p.add_argument("-n", "--namespace", default=None, help="default: the pod's, else splitrl")
    p.add_argument("--port-name", default="grpc")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    try:
        if args.action == "render":
            sys.stdout.write(render(args.overlay, args.image))
            return 0
        if args.action == "apply":
            return apply(args.overlay, args.image, args.dry_run)
        if args.action == "scale":
            n = scale(args.replicas, args.deployment, args.namespace)
            print(f"deployment/{args.deployment} scaled to {n} replicas in {args.namespace}")
            return 0
        if args.action == "status":
            for kind, name, state in status(args.namespace):
                print(f"{kind:<11} {name:<32} {state}")
            return 0
        if args.action == "discover":
            for address in discover_samplers(args.namespace, args.service, args.port_name):
                print(address)
            return 0
    except (K8sError, MissingExtra) as e:
        print(f"splitrl k8s: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if not isinstance(e, _kubernetes("client.exceptions").ApiException):
            raise
        print(f"splitrl k8s: API server said {e.status} {e.reason}: {e.body}", file=sys.stderr)
        return 1
    return 2
