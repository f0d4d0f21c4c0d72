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
