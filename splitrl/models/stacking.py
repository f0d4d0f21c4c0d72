"""The decoder layers' parameters stacked on a leading layer axis, and their names.

The model keeps its L decoder layers as ONE `DecoderLayer` whose every parameter has a leading
axis of size L, and applies them with a scan (`transformer.py`), so a program holds one layer
body whatever the depth. The name of a stacked parameter is its Hugging Face name with the
layer index taken out, which is also its nnx path:

    model.layers.self_attn.q_proj.weight   [L, in, out]   (HF: model.layers.{i}.self_attn...)

Everything inside SplitRL (trainer and sampler state, partition rules, the weight wire,
deltas, LoRA adapters, orbax checkpoints) uses these model-layout names; the per-layer HF
names appear only where a Hugging Face file is read or written (`hf_io`, `peft_io`), through
`stack_layers` / `unstack_layers` below.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

LAYERS = "model.layers."
_PER_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def is_stacked(name: str) -> bool:
    """Whether the parameter (or module) ``name`` is a stacked decoder-layer one."""
    return name.startswith(LAYERS) and _PER_LAYER.match(name) is None


def split_layer(hf_name: str) -> tuple[str, int | None]:
    """A per-layer HF name -> (stacked name, layer index); other names -> (name, None)."""
    m = _PER_LAYER.match(hf_name)
    if m is None:
        return hf_name, None
    return LAYERS + m.group(2), int(m.group(1))


def layer_name(stacked: str, layer: int) -> str:
    """The HF name of layer ``layer`` of the stacked parameter ``stacked``."""
    return f"{LAYERS}{layer}.{stacked[len(LAYERS):]}"


def per_layer_names(names, num_layers: int) -> list[str]:
    """HF names of ``names`` (model-layout), every stacked one expanded into its layers."""
    out: list[str] = []
    for name in names:
        if is_stacked(name):
            out.extend(layer_name(name, i) for i in range(num_layers))
        else:
            out.append(name)
    return out


def stack_layers(flat: Mapping[str, np.ndarray | jax.Array], num_layers: int) -> dict:
    """``{HF name: tensor}`` -> ``{model-layout name: tensor}``: each decoder-layer parameter's
    L tensors stacked on a new leading axis (numpy stays numpy, anything else becomes a jax
    array). Other names pass through. A layer missing or out of range is a ValueError naming it.
    """
    out: dict[str, np.ndarray | jax.Array] = {}
    layers: dict[str, dict[int, np.ndarray | jax.Array]] = {}
    for name, value in flat.items():
        stacked, layer = split_layer(name)
        if layer is None:
            out[name] = value
            continue
        if layer >= num_layers:
            raise ValueError(f"tensor {name!r}: layer {layer} of a {num_layers}-layer model")
        layers.setdefault(stacked, {})[layer] = value
    for stacked, parts in layers.items():
        missing = [layer_name(stacked, i) for i in range(num_layers) if i not in parts]
        if missing:
            raise ValueError(f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        values = [parts[i] for i in range(num_layers)]
        if all(isinstance(v, np.ndarray) for v in values):
            out[stacked] = np.stack(values)
        else:
            out[stacked] = jnp.stack([jnp.asarray(v) for v in values])
    return out


def unstack_layers(flat: Mapping[str, np.ndarray | jax.Array]) -> dict:
    """``{model-layout name: tensor}`` -> ``{HF name: tensor}`` (inverse of `stack_layers`):
    each stacked tensor split along its leading axis into per-layer HF names."""
    out = {}
    for name, value in flat.items():
        if is_stacked(name):
            for i in range(value.shape[0]):
                out[layer_name(name, i)] = value[i]
        else:
            out[name] = value
    return out


def layer_views(stacked, num_layers: int) -> list:
    """The stacked decoder layers' parameters ``stacked`` (a pytree such as
    ``nnx.state(model.model.layers)``, every leaf [L, ...]) as one pytree per layer, for
    `CausalLM.forward_with`'s ``layers``.

    A layer's array on a CPU device is a view of the stacked array's memory, no copy
    (XLA:CPU holds arrays in host memory and aliases a host buffer rather than copy it when
    it is 64-byte aligned, as a layer is whose bytes are a multiple of 64; a view also keeps
    the stacked buffer alive): the sampler's CPU programs
    read each layer's weights as a whole buffer of its own, which a slice inside a program
    is not (it is copied before every matmul that reads it), without holding the weights
    twice. Off CPU, or with the layer axis sharded, each layer is sliced (a copy).
    ``jax.ShapeDtypeStruct`` leaves (a plan's abstract weights) give one layer's struct.

    The CPU views of every parameter and layer are placed by one batched `jax.device_put`:
    one call per view cost several times as much host work, paid once per weight version on
    the sampler (bench/README.md, "The sampler's weights served once per version")."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(stacked)
    per_leaf: list = [None] * len(leaves)
    hosts, devices, views = [], [], []  # the CPU views' host memory, their devices, their leaf
    for j, (path, x) in enumerate(leaves):
        layout = _layer_sharding(x)
        if isinstance(x, jax.ShapeDtypeStruct):
            per_leaf[j] = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=layout)] * num_layers
        elif layout is None or not all(d.platform == "cpu" for d in x.sharding.device_set):
            per_leaf[j] = [x[i] for i in range(num_layers)]
        else:
            shards = [(s.device, np.asarray(s.data)) for s in x.addressable_shards]
            _check_shards(jax.tree_util.keystr(path), x, [d for d, _ in shards], layout)
            hosts.append([[host[i] for _, host in shards] for i in range(num_layers)])
            devices.append([[device for device, _ in shards]] * num_layers)
            views.append((j, x.shape[1:], layout))
    for (j, shape, layout), layers in zip(views, jax.device_put(hosts, devices), strict=True):
        per_leaf[j] = [jax.make_array_from_single_device_arrays(shape, layout, shards)
                       for shards in layers]
    return [jax.tree.unflatten(treedef, [p[i] for p in per_leaf]) for i in range(num_layers)]


def _check_shards(name: str, x: jax.Array, devices: list,
                  layout: jax.sharding.Sharding) -> None:
    """A ValueError naming the parameter, its sharding and both sets of devices when the
    stacked array's shards are not one per device its layer's sharding addresses (which
    ``make_array_from_single_device_arrays`` would refuse saying only how many it expected).
    A sampler once failed so on every generation step from one weight version on (two threads
    had built an array's shard list at once), with only "Expected 2 per-device arrays ... got
    4" to go by; this names the array and the devices."""
    wanted = layout.addressable_devices
    if len(devices) == len(wanted) and set(devices) == wanted:
        return
    def ids(of) -> list[int]:
        return sorted(d.id for d in of)

    raise ValueError(
        f"layer_views: {name} (shape {tuple(x.shape)}, {x.dtype}) has {len(devices)} "
        f"shards on devices {ids(devices)}, but its sharding {x.sharding} addresses devices "
        f"{ids(x.sharding.addressable_devices)} and one layer's, {layout}, "
        f"{ids(wanted)}: the array's shards do not match its sharding "
        f"(committed={x.committed}, backend devices {len(jax.devices())})")


def _layer_sharding(x) -> NamedSharding | None:
    """One layer's sharding of the stacked ``x`` (its own without the layer axis), or None
    when the layer axis is split over devices (a layer is then not one shard's slice)."""
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
        if spec[0] is not None:
            return None
        return NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]),
                             memory_kind=sharding.memory_kind)
    if sharding is not None and len(sharding.device_set) == 1:
        return sharding  # one device (not a mesh's): the layer's array on it
    return None
