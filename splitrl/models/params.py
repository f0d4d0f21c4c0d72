"""Parameters by Hugging Face name: flat `{hf_name: array}` views of a model's state.

Trainer, sampler, partition rules and the wire identify every tensor by its HF name. Two
layouts exist under those names (see `layers.py`):

- model layout (`hf_from_state` / `state_from_hf` / `param_shapes`): the nnx state as is,
  Linear weights [in, out]. This is what trainer and sampler exchange; no copies.
- torch layout (`hf_state_dict` / `from_hf_state_dict` / `load_hf_state_dict`): exactly the
  tensors of a HF checkpoint, Linear weights [out, in], for export and checkpoint files.

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
    """Sorted HF names of all parameters (untied models include `lm_head.weight`)."""
    config = getattr(model_or_config, "config", model_or_config)
    return list(param_shapes(config))


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


def state_from_hf(config: TransformerConfig, flat: Mapping[str, jax.Array | np.ndarray], *,
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
    builds one per push, and rebuilding the tree Variable by Variable cost ~0.8 ms for even
    a tiny model, against ~0.06 ms."""
    abstract = _abstract_flat(config)
    named = nnx.from_flat_state([(path, var.replace(_name(path))) for path, var in abstract])
    names, treedef = jax.tree_util.tree_flatten(named)
    shapes = {_name(path): tuple(var.get_value().shape) for path, var in abstract}
    return treedef, tuple(names), tuple(shapes[n] for n in names)


def import_tensor(config: TransformerConfig, name: str, tensor, *, param_dtype=None,
                  sharding: jax.sharding.Sharding | None = None) -> jax.Array:
    """One HF checkpoint tensor (torch layout) -> model layout, cast and optionally placed.

    Checks the torch-layout shape of known names (unknown names are reported later, all
    together, by `state_from_hf`).
    """
    expected = param_shapes(config).get(name)
    if expected is not None:
        want = tuple(expected.shape)[::-1] if is_linear_weight(name) else tuple(expected.shape)
        if tuple(tensor.shape) != want:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {want}")
    if isinstance(tensor, np.ndarray) and jax.default_backend() == "cpu":
        # CPU devices are host memory: a numpy transpose and cast cost the same copy as XLA's,
        # without compiling one small program per tensor shape (`jnp.asarray` stages the array
        # through a program, and so does `.T`) in every process that loads the model.
        host = from_torch_layout(name, tensor)
        if param_dtype is not None:
            host = host.astype(param_dtype)
        return jax.device_put(np.ascontiguousarray(host), sharding, may_alias=False)
    tensor = from_torch_layout(name, jax.device_put(tensor))
    if param_dtype is not None:
        tensor = tensor.astype(param_dtype)
    return tensor if sharding is None else jax.device_put(tensor, sharding)


def from_hf_state_dict(config: TransformerConfig, flat: Mapping[str, jax.Array | np.ndarray],
                       dtype=jnp.float32, *, param_dtype=None,
                       shardings: Mapping[str, jax.sharding.Sharding] | None = None
                       ) -> CausalLM:
    """A `CausalLM` computing in `dtype` from HF checkpoint tensors (torch layout).

    Parameters are cast to `param_dtype` (default: `dtype`) and placed by `shardings`
    (`{hf_name: Sharding}`, optional). Names and (torch-layout) shapes are checked; errors
    name the tensor.
    """
    param_dtype = dtype if param_dtype is None else param_dtype
    shardings = shardings or {}
    model_layout = {k: import_tensor(config, k, v, param_dtype=param_dtype,
                                     sharding=shardings.get(k)) for k, v in flat.items()}
    return model_from_state(config, state_from_hf(config, model_layout), dtype)


def model_from_state(config: TransformerConfig, state: nnx.State, dtype=jnp.float32, *,
                     remat: bool = False) -> CausalLM:
    """`nnx.merge` of the model's graphdef (compute `dtype`) with a parameter state."""
    return nnx.merge(_graphdef(config, dtype, remat), state)


@functools.lru_cache(maxsize=32)
def _graphdef(config, dtype, remat):
    return nnx.split(abstract_model(config, dtype, remat=remat))[0]


def hf_state_dict(model: CausalLM, dtype=None) -> dict[str, np.ndarray]:
    """HF checkpoint tensors (torch layout) as host numpy arrays (bf16 via ml_dtypes).

    `dtype` casts them (default: keep each parameter's dtype).
    """
    out = {}
    for name, value in hf_from_state(nnx.state(model, nnx.Param)).items():
        if dtype is not None:
            value = value.astype(dtype)
        out[name] = np.ascontiguousarray(to_torch_layout(name, np.asarray(jax.device_get(value))))
    return out


def load_hf_state_dict(model: CausalLM, flat: Mapping[str, jax.Array | np.ndarray]) -> None:
    """Replaces the model's parameters in place by HF checkpoint tensors (torch layout).

    Each parameter keeps its current dtype.
    """
    current = hf_from_state(nnx.state(model, nnx.Param))
    cast = {k: from_torch_layout(k, jnp.asarray(v)).astype(current[k].dtype)
            if k in current else v for k, v in flat.items()}
    nnx.update(model, state_from_hf(model.config, cast))


def _short(names: list[str], limit: int = 8) -> str:
    if not names:
        return "[]"
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return "[" + ", ".join(names[:limit]) + more + "]"
