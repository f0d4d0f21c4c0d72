"""LoRA adapters on the models' Linear modules, in PEFT's conventions.

An adapter of the Linear module ``M`` (a model-layout module name such as
``model.layers.self_attn.q_proj``, the q projection of every decoder layer, stacked: see
`stacking.py`; or ``lm_head``) is two tensors, named like PEFT's saved keys without PEFT's
``base_model.model.`` prefix and with the decoder layers stacked like the weights::

    M.lora_A.weight   [L, in, r]    (model layout; PEFT/torch store the transpose [r, in] of
                                     each layer, under model.layers.{i}.<...>.lora_A.weight)
    M.lora_B.weight   [L, r, out]   (PEFT: [out, r] per layer)

(``lm_head``'s have no layer axis.)

and the adapted module computes ``y = x W + scale * dropout(x) A B`` with
``scale = alpha / rank`` (PEFT's default scaling). ``B`` starts at zero and ``A`` as PEFT
initialises it (Kaiming-uniform, bound 1/sqrt(in)), so a fresh adapter changes nothing.

Two ways to use adapters, one forward (``layers.Linear``):

- **in the forward** (:func:`attach`): the adapters become sub-modules of the targeted
  Linear modules of a model (in place), e.g. inside a jitted train step. Gradients reach the
  adapters through ``x A`` and ``(x A) B`` only: no [in, out] weight gradient is formed.
- **merged** (:func:`merge`): ``W + scale * A B`` for every targeted weight, the weights a
  sampler serves and the export holds. The product is summed rank by rank in elementwise
  operations (no matmul), so every element is the same sequence of float32 operations
  whatever the sharding: the trainer and a sampler that merge the same base and adapters
  get bitwise-equal weights.

Targets follow PEFT's ``target_modules``: a string is a regex that must match a whole module
name (``re.fullmatch``; matching ``M.weight``, the parameter's name, counts too, so EasyDeL-style
patterns over parameter paths work), a list names modules exactly or by suffix (``"q_proj"``
matches every ``...q_proj``). Only Linear modules can be targeted (the projections and an untied
``lm_head``). A pattern that matches nothing is an error naming the pattern and the modules.
Patterns are matched against the per-layer HF module names, as PEFT matches them; since the
layers are stacked and scanned, a decoder-layer module is adapted in every layer or in none
(a pattern selecting some layers only is an error saying so, like PEFT's
``layers_to_transform``, which is refused too).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from splitrl.models.config import TransformerConfig
from splitrl.models.layers import LoraFactor, LoraKey
from splitrl.models.params import checkpoint_shapes, is_linear_weight, param_shapes
from splitrl.models.stacking import is_stacked, split_layer
from splitrl.models.transformer import CausalLM

A, B = "lora_A.weight", "lora_B.weight"

# PEFT's own default when target_modules is unset is per architecture; ours is the usual
# "every attention and MLP projection".
ALL_PROJECTIONS = ".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Resolved adapters: rank, alpha, dropout and the exact (sorted) target module names.

    Hashable, so it can be a static argument of a jitted function.
    """

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank: expected >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout: expected 0 <= dropout < 1, got {self.dropout}")
        if not self.targets:
            raise ValueError("LoRA targets: expected at least one module")
        if tuple(sorted(set(self.targets))) != self.targets:
            raise ValueError("LoRA targets must be sorted and unique")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def names(self) -> list[str]:
        """Every adapter tensor's name, sorted."""
        return sorted(f"{t}.{f}" for t in self.targets for f in (A, B))

    def shapes(self, config: TransformerConfig) -> dict[str, tuple[int, int]]:
        """``{adapter name: shape}`` (model layout) for a model of ``config``."""
        base = param_shapes(config)
        out = {}
        for target in self.targets:
            weight = base.get(f"{target}.weight")
            if weight is None or not is_linear_weight(f"{target}.weight"):
                raise ValueError(f"LoRA target {target!r} is not a Linear module of "
                                 f"{config.architecture} (its modules: "
                                 f"{_short(_stacked_linear_modules(config))})")
            *layers, fan_in, fan_out = weight.shape
            out[f"{target}.{A}"] = (*layers, fan_in, self.rank)
            out[f"{target}.{B}"] = (*layers, self.rank, fan_out)
        return dict(sorted(out.items()))


def linear_modules(config: TransformerConfig) -> list[str]:
    """HF names of the model's Linear modules, one per layer (what PEFT patterns match),
    sorted."""
    return sorted(n[: -len(".weight")] for n in checkpoint_shapes(config)
                  if n.endswith(".weight") and is_linear_weight(n))


def _stacked_linear_modules(config: TransformerConfig) -> list[str]:
    """Model-layout names of the Linear modules (what adapters attach to), sorted."""
    return sorted(n[: -len(".weight")] for n in param_shapes(config)
                  if n.endswith(".weight") and is_linear_weight(n))


def resolve_targets(config: TransformerConfig, target_modules: str | Sequence[str]) -> tuple:
    """The Linear modules ``target_modules`` selects (PEFT's matching rules over the per-layer
    HF module names, see the module docstring), as model-layout module names; ValueError
    naming the pattern and the modules when it selects none, or some layers of a module only."""
    modules = linear_modules(config)
    if isinstance(target_modules, str):
        try:
            pattern = re.compile(target_modules)
        except re.error as e:
            raise ValueError(f"LoRA target_modules {target_modules!r} is not a valid regex: "
                             f"{e}") from None
        chosen = [m for m in modules
                  if pattern.fullmatch(m) or pattern.fullmatch(f"{m}.weight")]
    else:
        wanted = list(target_modules)
        chosen = [m for m in modules if any(m == t or m.endswith("." + t) for t in wanted)]
    if not chosen:
        raise ValueError(
            f"LoRA target_modules {target_modules!r} matches none of the Linear modules of "
            f"{config.architecture}: {_short(modules, 12)} (a regex must match a whole module "
            "name, as in PEFT, e.g. '.*(q_proj|v_proj)'; a list names modules or their last "
            "part, e.g. ['q_proj', 'v_proj'])")
    layers: dict[str, set] = {}
    for module in chosen:
        stacked, layer = split_layer(module)
        layers.setdefault(stacked, set()).add(layer)
    for stacked, chosen_layers in sorted(layers.items()):
        if is_stacked(stacked) and len(chosen_layers) != config.num_layers:
            raise ValueError(
                f"LoRA target_modules {target_modules!r} selects {stacked[len('model.'):]} in "
                f"layers {sorted(chosen_layers)} of {config.num_layers} only: the decoder "
                "layers are stacked and scanned, so a layer module is adapted in every layer "
                "or in none")
    return tuple(sorted(layers))


def init_adapters(config: TransformerConfig, spec: LoraSpec, seed: int = 0
                  ) -> dict[str, np.ndarray]:
    """Fresh float32 adapters (host arrays): A as PEFT initialises it (uniform in
    +-1/sqrt(in), i.e. Kaiming-uniform with a=sqrt(5)), B zeros. Deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in spec.shapes(config).items():
        if name.endswith(A):
            bound = 1.0 / np.sqrt(shape[-2])
            out[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
        else:
            out[name] = np.zeros(shape, np.float32)
    return out


def check_adapters(config: TransformerConfig, spec: LoraSpec,
                   adapters: Mapping[str, jax.Array | np.ndarray]) -> None:
    """ValueError unless ``adapters`` has exactly the spec's tensors in their shapes."""
    want = spec.shapes(config)
    missing = sorted(set(want) - set(adapters))
    extra = sorted(set(adapters) - set(want))
    if missing or extra:
        raise ValueError(f"adapters do not match the LoRA targets: missing {_short(missing)}, "
                         f"unexpected {_short(extra)}")
    for name, shape in want.items():
        got = tuple(adapters[name].shape)
        if got != shape:
            raise ValueError(f"adapter {name!r} has shape {list(got)}, expected {list(shape)} "
                             f"(rank {spec.rank})")


def from_section(section, config: TransformerConfig, seed: int = 0,
                 base: Mapping[str, jax.Array] | None = None
                 ) -> tuple[LoraSpec, dict[str, np.ndarray]]:
    """The spec and starting adapters of a run's ``model.lora`` section
    (:class:`splitrl.config.LoraConfig`): the PEFT adapter at ``section.path`` (whose rank,
    alpha and targets must agree with any the section sets; ``base``: the model's parameters,
    see ``peft_io.load_adapter``), else fresh adapters."""
    if section.path is None:
        rank = section.rank or 16
        alpha = section.alpha if section.alpha is not None else 2.0 * rank
        targets = resolve_targets(config, section.target_modules or ALL_PROJECTIONS)
        spec = LoraSpec(rank, float(alpha), targets, section.dropout)
        return spec, init_adapters(config, spec, seed)
    from splitrl.models.peft_io import load_adapter

    spec, adapters = load_adapter(section.path, config, dropout=section.dropout, base=base)
    wanted = {"rank": section.rank, "alpha": section.alpha,
              "target_modules": (None if section.target_modules is None
                                 else resolve_targets(config, section.target_modules))}
    have = {"rank": spec.rank, "alpha": spec.alpha, "target_modules": spec.targets}
    for key, value in wanted.items():
        if value is not None and value != have[key]:
            raise ValueError(f"model.lora.{key}: {value!r} differs from the adapter at "
                             f"{section.path} ({have[key]!r}); leave it unset to use the "
                             "adapter's")
    return spec, adapters


def _module(model: CausalLM, name: str):
    node: Any = model  # a module, a layer list or a Linear, as the path walks down
    for part in name.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def attach(model: CausalLM, spec: LoraSpec, adapters: Mapping[str, jax.Array],
           dropout_key: jax.Array | None = None) -> CausalLM:
    """Adds ``adapters`` to the targeted Linear modules of ``model`` (in place; returns it).

    ``dropout_key``: a PRNG key for the adapters' input dropout (``spec.dropout``; training
    only, each module draws from its own fold of the key). None: no dropout (inference).
    """
    use_dropout = dropout_key is not None and spec.dropout > 0
    for i, target in enumerate(spec.targets):
        linear = _module(model, target)
        linear.lora_A = LoraFactor(adapters[f"{target}.{A}"])
        linear.lora_B = LoraFactor(adapters[f"{target}.{B}"])
        linear.lora_scale = spec.scale
        if use_dropout:
            assert dropout_key is not None
            linear.lora_dropout = spec.dropout
            key = jax.random.fold_in(dropout_key, i)
            if is_stacked(target):  # one key per layer, stacked like the module's weights
                key = jax.random.split(key, model.config.num_layers)
            linear.lora_key = LoraKey(key)
    return model


def merged_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``w + scale * a @ b`` in float32, cast back to ``w``'s dtype (any leading layer axes
    are batch axes: ``w`` [..., in, out], ``a`` [..., in, r], ``b`` [..., r, out]).

    The product is summed over the rank one outer product at a time (elementwise ops only):
    each element is then the same sequence of IEEE operations on any sharding and any device
    count, which is what makes a sampler's merge bitwise equal to the trainer's.
    """
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    acc = a[..., :, 0:1] * b[..., 0:1, :]
    for k in range(1, a.shape[-1]):
        acc = acc + a[..., :, k : k + 1] * b[..., k : k + 1, :]
    return (w.astype(jnp.float32) + jnp.float32(scale) * acc).astype(w.dtype)


def merge(base: Mapping[str, jax.Array], adapters: Mapping[str, jax.Array | np.ndarray],
          spec: LoraSpec) -> dict[str, jax.Array]:
    """The full parameters with the adapters merged: every targeted ``M.weight`` becomes
    :func:`merged_weight`, everything else is ``base``'s array itself (no copy). Jitted; the
    merged weights keep their base weight's sharding."""
    targeted = {f"{t}.weight" for t in spec.targets}
    sharding = getattr(base[next(iter(sorted(targeted)))], "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):  # adapters whole on every device
        replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        adapters = jax.device_put(dict(adapters), replicated)
    merged = _merge_jit(spec, {n: base[n] for n in sorted(targeted)}, dict(adapters))
    return {n: merged[n] if n in targeted else a for n, a in base.items()}


@functools.partial(jax.jit, static_argnums=0)
def _merge_jit(spec: LoraSpec, weights, adapters):
    out = {}
    for target in spec.targets:
        w = weights[f"{target}.weight"]
        merged = merged_weight(w, adapters[f"{target}.{A}"], adapters[f"{target}.{B}"],
                               spec.scale)
        sharding = getattr(w, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            merged = jax.lax.with_sharding_constraint(merged, sharding)
        out[f"{target}.weight"] = merged
    return out


def _short(names: list[str], limit: int = 8) -> str:
    if not names:
        return "[]"
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return "[" + ", ".join(names[:limit]) + more + "]"
