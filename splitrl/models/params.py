"""Parameters by Hugging Face name: flat `{hf_name: array}` views of a model's state.

Trainer, sampler, partition rules and the wire identify every tensor by its HF name. Two
layouts exist under those names (see `layers.py` and `stacking.py`):

- model layout (`hf_from_state` / `state_from_hf` / `param_shapes`): the nnx state as is,
  Linear weights [in, out], decoder layers stacked (`model.layers.mlp.up_proj.weight`
  [L, in, out]). This is what trainer and sampler exchange; no copies.
- torch layout (`hf_state_dict` / `from_hf_state_dict` / `load_hf_state_dict`): exactly the
  tensors of a HF checkpoint, one per layer (`model.layers.3.mlp.up_proj.weight`), Linear
  weights [out, in], for export and checkpoint files.

Conversions check names and shapes, so a bad push or a broken checkpoint fails with a message
naming the tensor instead of producing wrong weights.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from splitrl.models.config import TransformerConfig
from splitrl.models.stacking import per_layer_names, stack_layers, unstack_layers
from splitrl.models.transformer import CausalLM, abstract_model


def is_linear_weight(name: str) -> bool:
    """Whether `name` is a Linear weight (LoRA factors included: `...q_proj.lora_A.weight`),
    stored transposed relative to torch."""
    return (name.endswith(("_proj.weight", ".lora_A.weight", ".lora_B.weight"))
            or name == "lm_head.weight")


def to_torch_layout(name: str, x):
    """Model-layout tensor -> the tensor HF/torch stores under `name`."""
    return x.T if is_linear_weight(name) and x.ndim == 2 else x


def from_torch_layout(name: str, x):
    """HF/torch tensor stored under `name` -> model layout (inverse of `to_torch_layout`)."""
    return x.T if is_linear_weight(name) and x.ndim == 2 else x


def _name(path) -> str:
    return ".".join(str(p) for p in path)


@functools.lru_cache(maxsize=32)
def _abstract_flat(config: TransformerConfig, param_dtype=None) -> tuple:
    """((path, abstract Variable), ...) of the model's parameters; cached (samplers swap often)."""
    state = nnx.split(abstract_model(config, param_dtype=param_dtype))[1]
    return tuple(nnx.to_flat_state(state))


def param_shapes(config: TransformerConfig,
                 param_dtype=jnp.float32) -> dict[str, jax.ShapeDtypeStruct]:
    """{hf_name: ShapeDtypeStruct} of every parameter, in a stable (sorted) order."""
    return {_name(path): var.get_value() for path, var in _abstract_flat(config, param_dtype)}


def param_names(model_or_config: CausalLM | TransformerConfig) -> list[str]:
    """Sorted model-layout names of all parameters (untied models include `lm_head.weight`)."""
    config = model_or_config.config if isinstance(model_or_config, CausalLM) else model_or_config
    return list(param_shapes(config))


@functools.lru_cache(maxsize=32)
def checkpoint_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of every tensor of the model's HF checkpoint (torch layout, one per
    layer), sorted by name."""
    out = {}
    for name, value in param_shapes(config).items():
        shape = tuple(value.shape)
        per_layer = per_layer_names([name], config.num_layers)
        if len(per_layer) > 1 or per_layer[0] != name:
            shape = shape[1:]
        if is_linear_weight(name):
            shape = shape[::-1]
        out.update(dict.fromkeys(per_layer, shape))
    return dict(sorted(out.items()))


def hf_from_state(state: nnx.State) -> dict[str, jax.Array]:
    """Flat `{hf_name: array}` view of a model state (no copies, keeps shardings), in path
    order as `nnx.to_flat_state` gives it.

    Not `nnx.to_flat_state` itself: its flattening closure refers to itself, so every call
    leaves a reference cycle holding a list of every Variable, and with it every array, until
    the next full garbage collection. A sampler calls this on served states (GetInfo, deltas,
    generation); on XLA:CPU those arrays alias the staging buffers pushes land in, which then
    could not be reused and each push faulted in fresh pages (measured: a quarter of the
    sampler's CPU per push). This walk leaves no garbage.
    """
    return {_name(path): var.get_value() for path, var in _flat_variables(state, ())}


def _flat_variables(tree, prefix: tuple) -> list[tuple[tuple, nnx.Variable]]:
    out = []
    for key in sorted(tree):  # State is a Mapping; sorted per level = sorted by path
        value = tree[key]
        if isinstance(value, Mapping):
            out.extend(_flat_variables(value, (*prefix, key)))
        else:
            out.append(((*prefix, key), value))
    return out


def state_from_hf(config: TransformerConfig,
                  flat: Mapping[str, jax.Array | np.ndarray | jax.ShapeDtypeStruct], *,
                  param_dtype=None) -> nnx.State:
    """Builds the `nnx.State` of a `CausalLM(config)` from `{hf_name: array}`.

    Every parameter must be present with its exact shape and no other name may appear;
    otherwise a ValueError names the offending tensors. Arrays keep their placement
    (device/sharding); numpy arrays become jax arrays. With `param_dtype` every array is cast
    to it, otherwise each keeps its dtype. ShapeDtypeStructs stay abstract (a state to lower
    programs with, see `splitrl plan`). Combine with a graphdef via `nnx.merge`.
    """
    treedef, names, shapes = _state_template(config)
    missing = sorted(set(names) - set(flat))
    unexpected = sorted(set(flat) - set(names))
    if missing or unexpected:
        raise ValueError(f"parameter names do not match {config.architecture}: "
                         f"missing {_short(missing)}, unexpected {_short(unexpected)}")
    leaves = []
    for name, want in zip(names, shapes, strict=True):
        value = flat[name]
        if tuple(value.shape) != want:
            raise ValueError(f"parameter {name!r} has shape {tuple(value.shape)}, "
                             f"expected {want}")
        if isinstance(value, jax.ShapeDtypeStruct):  # abstract (AOT compilation): no data
            dtype = value.dtype if param_dtype is None else param_dtype
            value = jax.ShapeDtypeStruct(value.shape, dtype, sharding=value.sharding)
        else:
            value = value if isinstance(value, jax.Array) else jnp.asarray(value)
            value = value if param_dtype is None else value.astype(param_dtype)
        leaves.append(value)
    return jax.tree_util.tree_unflatten(treedef, leaves)


@functools.lru_cache(maxsize=32)
def _state_template(config: TransformerConfig) -> tuple:
    """(treedef, names, shapes) of the model's parameter state, names and shapes in the
    treedef's leaf order: a state is its leaves put back in that tree. Cached: a sampler
    builds one per push, and rebuilding the tree Variable by Variable costs more than the
    rest of a tiny model's push (bench/README.md)."""
    abstract = _abstract_flat(config)
    named = nnx.from_flat_state([(path, var.replace(_name(path))) for path, var in abstract])
    names, treedef = jax.tree_util.tree_flatten(named)
    shapes = {_name(path): tuple(var.get_value().shape) for path, var in abstract}
    return treedef, tuple(names), tuple(shapes[n] for n in names)


def import_tensor(config: TransformerConfig, name: str, tensor, *,
                  param_dtype=None) -> np.ndarray:
    """One HF checkpoint tensor (torch layout) -> a host array in model layout (per layer),
    cast to `param_dtype`. Checks the torch-layout shape of known names (unknown names are
    reported by the caller, all together)."""
    want = checkpoint_shapes(config).get(name)
    if want is not None and tuple(tensor.shape) != want:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}")
    host = from_torch_layout(name, np.asarray(jax.device_get(tensor)))
    return host if param_dtype is None else host.astype(param_dtype)


def check_checkpoint_names(config: TransformerConfig, names) -> None:
    """ValueError naming the missing and unexpected tensors unless ``names`` (HF names) are
    exactly the model's checkpoint tensors."""
    want = checkpoint_shapes(config)
    missing = sorted(set(want) - set(names))
    unexpected = sorted(set(names) - set(want))
    if missing or unexpected:
        raise ValueError(f"parameter names do not match {config.architecture}: "
                         f"missing {_short(missing)}, unexpected {_short(unexpected)}")


def place(host: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
    """A host array onto its devices. On CPU (host memory) numpy does the layout work without
    compiling one small program per tensor shape in every process that loads the model."""
    return jax.device_put(np.ascontiguousarray(host), sharding, may_alias=False)


def from_hf_state_dict(config: TransformerConfig, flat: Mapping[str, jax.Array | np.ndarray],
                       dtype=jnp.float32, *, param_dtype=None,
                       shardings: Mapping[str, jax.sharding.Sharding] | None = None
                       ) -> CausalLM:
    """A `CausalLM` computing in `dtype` from HF checkpoint tensors (torch layout).

    Parameters are cast to `param_dtype` (default: `dtype`), decoder layers stacked, and
    placed by `shardings` (`{model-layout name: Sharding}`, optional). Names and
    (torch-layout) shapes are checked; errors name the tensor.
    """
    param_dtype = dtype if param_dtype is None else param_dtype
    shardings = shardings or {}
    check_checkpoint_names(config, flat)
    host = stack_layers({k: import_tensor(config, k, v, param_dtype=param_dtype)
                         for k, v in flat.items()}, config.num_layers)
    placed = {k: place(v, shardings.get(k)) for k, v in host.items()}
    return model_from_state(config, state_from_hf(config, placed), dtype)


def model_from_state(config: TransformerConfig, state: nnx.State, dtype=jnp.float32, *,
                     remat: str = "none") -> CausalLM:
    """`nnx.merge` of the model's graphdef (compute `dtype`) with a parameter state."""
    return nnx.merge(_graphdef(config, dtype, remat), state)


@functools.lru_cache(maxsize=32)
def _graphdef(config, dtype, remat):
    return nnx.split(abstract_model(config, dtype, remat=remat))[0]


def hf_state_dict(model: CausalLM, dtype=None) -> dict[str, np.ndarray]:
    """HF checkpoint tensors (torch layout, one per layer) as host numpy arrays (bf16 via
    ml_dtypes).

    `dtype` casts them (default: keep each parameter's dtype).
    """
    host: dict[str, np.ndarray | jax.Array] = {}
    for name, value in hf_from_state(nnx.state(model, nnx.Param)).items():
        array = np.asarray(jax.device_get(value))
        host[name] = array if dtype is None else array.astype(dtype)
    return {name: np.ascontiguousarray(to_torch_layout(name, value))
            for name, value in unstack_layers(host).items()}


def load_hf_state_dict(model: CausalLM, flat: Mapping[str, jax.Array | np.ndarray]) -> None:
    """Replaces the model's parameters in place by HF checkpoint tensors (torch layout).

    Each parameter keeps its current dtype.
    """
    config = model.config
    check_checkpoint_names(config, flat)
    current = hf_from_state(nnx.state(model, nnx.Param))
    stacked = stack_layers({k: import_tensor(config, k, v) for k, v in flat.items()},
                           config.num_layers)
    cast = {k: jnp.asarray(v).astype(current[k].dtype) for k, v in stacked.items()}
    nnx.update(model, state_from_hf(config, cast))


def _short(names: list[str], limit: int = 8) -> str:
    if not names:
        return "[]"
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return "[" + ", ".join(names[:limit]) + more + "]"
