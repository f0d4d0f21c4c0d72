"""Device meshes from config and per-parameter partition rules (fsdp, tensor parallel).

A service builds its mesh from a :class:`~splitrl.config.MeshConfig`: named axes over a slice of
the host's devices (``device_offset`` and ``device_fraction``), so two services can split one
host the way MaxText splits trainer and sampler devices.

Parameters are named by their Hugging Face names (``splitrl.models``), in the models' layout:
Linear weights ``[in, out]`` (the LM head ``[hidden, vocab]``), embeddings ``[vocab, hidden]``.
Partition rules are a small table from name to *role*; a role says which dimension tensor
parallelism splits (Megatron-style: column-parallel projections split their output features,
row-parallel ones their input features, embeddings and the LM head their vocabulary), and fsdp
splits the largest remaining dimension. A dimension that does not divide by the axis size
stays whole, so any model fits any mesh; ``explain_layout`` shows what landed where. The
decoder layers' parameters are stacked on a leading layer axis (``model.layers.<...>``, see
``splitrl.models.stacking``): the rules apply to the dimensions after it, and the layer axis
itself is never split (the forward scans over it, one layer at a time).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from splitrl.config import ConfigError, MeshConfig
from splitrl.models.stacking import is_stacked, layer_name

FSDP_AXIS = "fsdp"
TENSOR_AXIS = "tensor"
DATA_AXIS = "data"

# Which dimension tensor parallelism splits, for 2-D kernels stored as [in, out].
# "column": output features (dim -1); "row": input features (dim 0); "vocab": the vocabulary
# dim of embeddings ([V, D], dim 0) and of the LM head kernel ([D, V], dim -1); "bias": the
# only dim of a column-parallel bias; "replicated": never split by tensor parallelism.
_ROLE_RULES: list[tuple[str, str]] = [
    (r"embed_tokens\.weight$", "vocab_rows"),
    (r"lm_head\.weight$", "vocab_cols"),
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", "column"),
    (r"(q_proj|k_proj|v_proj)\.bias$", "bias"),
    (r"(o_proj|down_proj)\.weight$", "row"),
    (r"norm\.weight$", "replicated"),
]


def select_devices(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> list:
    """The slice of ``devices`` (default: all local devices) that ``cfg`` selects."""
    devices = list(jax.devices() if devices is None else devices)
    count = max(1, int(math.floor(len(devices) * cfg.device_fraction + 1e-9)))
    if cfg.device_offset + count > len(devices):
        raise ConfigError(
            f"mesh: device_offset {cfg.device_offset} + {count} devices "
            f"(fraction {cfg.device_fraction}) exceeds the {len(devices)} devices available"
        )
    return devices[cfg.device_offset : cfg.device_offset + count]


def build_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A :class:`jax.sharding.Mesh` with ``cfg.axes``; one axis may be -1 (the rest)."""
    chosen = select_devices(cfg, devices)
    sizes = dict(cfg.axes)
    known = math.prod(v for v in sizes.values() if v != -1)
    for name, size in sizes.items():
        if size == -1:
            if len(chosen) % known:
                raise ConfigError(
                    f"mesh.axes: {len(chosen)} devices do not divide by the fixed axes {cfg.axes}"
                )
            sizes[name] = len(chosen) // known
    total = math.prod(sizes.values())
    if total != len(chosen):
        raise ConfigError(
            f"mesh.axes {cfg.axes} need {total} devices but {len(chosen)} are selected "
            f"(offset {cfg.device_offset}, fraction {cfg.device_fraction})"
        )
    grid = np.array(chosen, dtype=object).reshape(tuple(sizes.values()))
    return Mesh(grid, tuple(sizes))


def param_role(name: str) -> str:
    for pattern, role in _ROLE_RULES:
        if re.search(pattern, name):
            return role
    return "replicated"


def _tensor_dim(role: str, ndim: int) -> int | None:
    if ndim == 0:
        return None
    return {
        "vocab_rows": 0,
        "vocab_cols": ndim - 1,
        "column": ndim - 1,
        "bias": 0,
        "row": 0,
    }.get(role)


def partition_spec(
    name: str, shape: Sequence[int], mesh: Mesh, strategy: str | None = None
) -> PartitionSpec:
    """The PartitionSpec for parameter ``name`` of ``shape`` on ``mesh``.

    ``strategy`` restricts which axes are used: "fsdp", "tp" or "replicated"; None uses every
    parameter axis the mesh has ("fsdp" and/or "tensor"; other axes such as "data" replicate).
    """
    if is_stacked(name) and len(shape) >= 1:  # the layer axis stays whole
        one_layer = layer_name(name, 0)  # laid out as one layer is
        return PartitionSpec(None, *partition_spec(one_layer, shape[1:], mesh, strategy))
    axes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    use_tp = TENSOR_AXIS in axes and strategy in (None, "tp") and axes[TENSOR_AXIS] > 1
    use_fsdp = FSDP_AXIS in axes and strategy in (None, "fsdp") and axes[FSDP_AXIS] > 1
    spec: list[str | None] = [None] * len(shape)
    if use_tp:
        dim = _tensor_dim(param_role(name), len(shape))
        if dim is not None and shape[dim] % axes[TENSOR_AXIS] == 0:
            spec[dim] = TENSOR_AXIS
    if use_fsdp and len(shape) >= 2:
        # Largest free dimension that divides evenly; ties go to the first.
        free = [d for d in range(len(shape)) if spec[d] is None]
        free = [d for d in free if shape[d] % axes[FSDP_AXIS] == 0]
        if free:
            dim = max(free, key=lambda d: (shape[d], -d))
            spec[dim] = FSDP_AXIS
    return PartitionSpec(*spec)


def param_shardings(
    mesh: Mesh,
    shapes: Mapping[str, Sequence[int] | jax.ShapeDtypeStruct | jax.Array | np.ndarray],
    strategy: str | None = None
) -> dict[str, NamedSharding]:
    """``{name: NamedSharding}`` for a flat ``{name: shape-or-array}`` mapping."""
    out = {}
    for name, value in shapes.items():
        shape = tuple(value if isinstance(value, Sequence) else value.shape)
        out[name] = NamedSharding(mesh, partition_spec(name, shape, mesh, strategy))
    return out


def spec_to_strings(spec: PartitionSpec, ndim: int) -> list[str]:
    """A PartitionSpec as one string per dimension ("" replicated, "a+b" several axes)."""
    parts = list(spec) + [None] * (ndim - len(spec))
    out = []
    for part in parts:
        if part is None:
            out.append("")
        elif isinstance(part, tuple):
            out.append("+".join(part))
        else:
            out.append(str(part))
    return out


def strings_to_spec(parts: Sequence[str]) -> PartitionSpec:
    """Inverse of :func:`spec_to_strings`."""
    out: list[str | tuple[str, ...] | None] = []
    for part in parts:
        if not part:
            out.append(None)
        elif "+" in part:
            out.append(tuple(part.split("+")))
        else:
            out.append(part)
    return PartitionSpec(*out)


def explain_layout(shardings: Mapping[str, NamedSharding]) -> str:
    """One line per parameter: name and spec, for logs and ``GetInfo`` debugging."""
    return "\n".join(f"{name}: {sharding.spec}" for name, sharding in shardings.items())
