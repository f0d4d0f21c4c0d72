"""Where a plan compiles for: TPU topologies through libtpu (no TPU needed), or this host's CPU.

A target is named like the node pool that would run it:

- a topology, as GKE's ``cloud.google.com/gke-tpu-topology`` with the generation in front:
  ``v5e:2x2``, ``v5p:2x2x1``, ``v6e:2x4``, ``v4:2x2x1`` (what
  ``jax.experimental.topologies.get_topology_desc`` accepts);
- or a Cloud TPU accelerator type: ``v5p-8`` (v4 and v5p count TensorCores, two per chip),
  ``v5litepod-4`` / ``v5e-4``, ``v6e-8`` (v5e and v6e count chips), turned into the standard
  slice shape for that many chips.

The devices come back as `jax.Device` objects of the TPU generation asked for, on this CPU
machine: they can build a `jax.sharding.Mesh` and compile for it, never run anything. Their HBM
is not queryable (`memory_stats` needs an addressable device), so it comes from the published
per-chip figures below, or ``--hbm-gib``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import jax

from splitrl.platforms import libtpu_installed, tpu_attached

GIB = 1024**3

# Per-chip HBM by `jax.Device.device_kind` (Cloud TPU system architecture pages).
HBM_BYTES = {
    "TPU v4": 32 * GIB,
    "TPU v5 lite": 16 * GIB,  # v5e
    "TPU v5": 95 * GIB,  # v5p
    "TPU v6 lite": 32 * GIB,  # v6e (Trillium)
}

LIBTPU_MISSING = (
    "compiling for a TPU topology needs libtpu, the TPU compiler (no TPU is needed). Install the "
    "version pinned for this jax with:  pip install 'splitrl[tpu-plan]'  (from a source tree: "
    "pip install -e '.[tpu-plan]'), or plan for this machine's CPU with --platform cpu."
)

# Accelerator-type prefixes: (topology generation, TensorCores per counted unit per chip).
_ACCELERATOR_TYPES = {
    "v4": ("v4", 2),
    "v5p": ("v5p", 2),
    "v5litepod": ("v5e", 1),
    "v5e": ("v5e", 1),
    "v6e": ("v6e", 1),
}
_TOPOLOGY = re.compile(r"^[a-zA-Z0-9_ ]+[=_:][0-9x]+(_twisted|_untwisted)?$")
_ACCELERATOR = re.compile(r"^(v4|v5p|v5litepod|v5e|v6e)-(\d+)$")


class PlanError(ValueError):
    """A plan that cannot be made as asked (unknown topology, libtpu missing, bad shape)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """The devices one service compiles for, and each one's memory."""

    name: str  # as given, e.g. "v5p:2x2x1" or "cpu"
    devices: tuple
    hbm_bytes: int

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind

    def describe(self) -> str:
        return f"{self.name} ({len(self.devices)} x {self.device_kind}, " \
               f"{self.hbm_bytes / GIB:.1f} GiB each)"


def topology_name(name: str) -> str:
    """A topology name for `get_topology_desc` from a topology or an accelerator type."""
    name = name.strip()
    match = _ACCELERATOR.match(name)
    if match:
        kind, count = match.group(1), int(match.group(2))
        generation, cores_per_chip = _ACCELERATOR_TYPES[kind]
        chips = count // cores_per_chip
        if chips < 1 or count % cores_per_chip or chips & (chips - 1):
            raise PlanError(f"topology {name!r}: {count} must be a power of two number of "
                            f"{'TensorCores (2 per chip)' if cores_per_chip == 2 else 'chips'}")
        return f"{generation}:{slice_shape(chips, three_d=generation in ('v4', 'v5p'))}"
    if _TOPOLOGY.match(name):
        return name
    raise PlanError(f"topology {name!r}: expected a topology such as v5e:2x2 or v5p:2x2x1, or "
                    f"an accelerator type such as v5p-8, v5litepod-4 or v6e-8")


# GKE's `cloud.google.com/gke-tpu-accelerator` node label -> the topology's generation.
GKE_ACCELERATORS = {
    "tpu-v4-podslice": "v4",
    "tpu-v5-lite-podslice": "v5e",
    "tpu-v5-lite-device": "v5e",
    "tpu-v5p-slice": "v5p",
    "tpu-v6e-slice": "v6e",
}


def gke_topology(node_selector: dict) -> str:
    """The topology a GKE pod's nodeSelector asks for, e.g. ``{"cloud.google.com/gke-tpu-
    accelerator": "tpu-v5-lite-podslice", "cloud.google.com/gke-tpu-topology": "2x2"}`` ->
    ``v5e:2x2`` (the slice, not the host: a multi-host Job's pods together compile one program
    over all of its chips)."""
    accelerator = node_selector.get("cloud.google.com/gke-tpu-accelerator")
    shape = node_selector.get("cloud.google.com/gke-tpu-topology")
    if accelerator not in GKE_ACCELERATORS or not shape:
        raise PlanError(f"nodeSelector {node_selector!r}: expected "
                        f"cloud.google.com/gke-tpu-accelerator (one of "
                        f"{sorted(GKE_ACCELERATORS)}) and cloud.google.com/gke-tpu-topology")
    return topology_name(f"{GKE_ACCELERATORS[accelerator]}:{shape}")


def slice_shape(chips: int, *, three_d: bool) -> str:
    """The standard slice shape of `chips` chips: 2-D (v5e, v6e: 2x2, 2x4, 4x4, ...) or 3-D
    (v4, v5p: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...); smallest dimension doubles first."""
    if three_d:
        if chips < 4:
            return f"1x1x{chips}"
        dims = [2, 2, 1]
        while dims[0] * dims[1] * dims[2] < chips:
            dims[max(k for k in range(3) if dims[k] == min(dims))] *= 2
        return "x".join(str(d) for d in dims)
    dims = [1, 1]
    while dims[0] * dims[1] < chips:
        dims[1 if dims[1] <= dims[0] else 0] *= 2
    return "x".join(str(d) for d in sorted(dims))


def tpu_target(name: str, hbm_bytes: int | None = None) -> Target:
    """The TPU devices of topology `name` (via libtpu, no TPU needed)."""
    if not libtpu_installed():
        raise PlanError(LIBTPU_MISSING)
    # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) meant for processes sharing
    # real chips; compiling uses none, so two plans (or a plan and a test) may run at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    topology = topology_name(name)
    _compile_only_environment(topology)
    try:
        devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    except Exception as e:  # libtpu names the problem (unknown generation, bad shape)
        raise PlanError(f"topology {name!r} ({topology}): libtpu refused it: {e}") from e
    kind = devices[0].device_kind  # type: ignore[attr-defined]  # jax stubs: Device unresolved
    if hbm_bytes is None:
        if kind not in HBM_BYTES:
            raise PlanError(f"topology {name!r}: HBM of {kind!r} is not known here; give it "
                            f"with --hbm-gib")
        hbm_bytes = HBM_BYTES[kind]
    return Target(name=name, devices=tuple(devices), hbm_bytes=int(hbm_bytes))


def accelerator_type(topology: str) -> str | None:
    """The Cloud TPU accelerator type of a topology (``v5e:2x2`` -> ``v5litepod-4``), None if
    it is not one of the known generations. The inverse of :func:`topology_name`."""
    generation, _, shape = topology.partition(":")
    prefixes = [(prefix, cores_per_chip) for prefix, (gen, cores_per_chip)
                in _ACCELERATOR_TYPES.items() if gen == generation]  # v5e: v5litepod first
    if not prefixes or not re.fullmatch(r"\d+(x\d+)*", shape):
        return None
    prefix, cores_per_chip = prefixes[0]
    return f"{prefix}-{math.prod(int(d) for d in shape.split('x')) * cores_per_chip}"


def _compile_only_environment(topology: str) -> None:
    """On a machine without TPU chips, tell libtpu which slice it is (the first one planned)
    and that its only worker is this host: looking for them in the metadata server of a TPU
    VM, it prints ``E0000 ... INVALID_ARGUMENT`` and "could not determine TPU accelerator
    type" lines that read like a failure. Compiling for a topology needs neither."""
    if tpu_attached():
        return
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    kind = accelerator_type(topology)
    if kind is not None:
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", kind)


def cpu_target(memory_bytes: int | None = None) -> Target:
    """This process's CPU devices (``--xla_force_host_platform_device_count`` of them), each
    given `memory_bytes` (default: the host's RAM shared equally)."""
    devices = jax.devices("cpu")
    if memory_bytes is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory_bytes = total // len(devices)
    return Target(name="cpu", devices=tuple(devices), hbm_bytes=int(memory_bytes))
