"""Keep the TPU runtime's start-up errors off a CPU machine's console.

libtpu (in the ``test`` and ``tpu-plan`` extras) makes JAX probe for TPU chips when it starts.
On a machine without one, libtpu prints ``Failed to find host bounds ...`` and ``E0000 ...
INVALID_ARGUMENT: ... TPU_WORKER_HOSTNAMES`` lines, which a newcomer reads as a crash, before JAX
falls back to the CPU. So every ``splitrl`` command, before anything imports JAX, picks the CPU
when nothing else could be meant: ``JAX_PLATFORMS`` is unset, libtpu is installed, no TPU chip
is attached (no Google PCI device) and no other accelerator plugin is installed. The processes
the command starts (``splitrl up``'s services) inherit the choice. On a TPU VM, or with a GPU
plugin, nothing changes. ``splitrl plan`` still compiles for TPU topologies: libtpu's
compile-only client does not go through ``JAX_PLATFORMS``.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import MutableMapping
from importlib.metadata import entry_points
from pathlib import Path

GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips are PCI devices of Google's vendor id


def libtpu_installed() -> bool:
    """Whether libtpu, the TPU runtime and compiler, is installed."""
    return importlib.util.find_spec("libtpu") is not None


def tpu_attached() -> bool:
    """Whether a Google PCI device (a TPU chip) is attached to this machine."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if Path(vendor).read_text().strip() == GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


def other_accelerator_plugins() -> bool:
    """Whether a JAX plugin other than libtpu (CUDA, ROCm...) is installed."""
    return bool(entry_points(group="jax_plugins")) or (
        importlib.util.find_spec("jax_plugins") is not None)


def prefer_cpu_without_tpu(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``JAX_PLATFORMS=cpu`` in ``environ`` when JAX would only probe for a TPU that is not
    there (see the module docstring); True when it did."""
    if "JAX_PLATFORMS" in environ or "JAX_FORCE_TPU_INIT" in environ:
        return False
    if not libtpu_installed() or tpu_attached():
        return False
    if other_accelerator_plugins():
        return False
    environ["JAX_PLATFORMS"] = "cpu"
    return True
