"""LoRA adapters as PEFT directories (``adapter_config.json`` + ``adapter_model.safetensors``).

    save_adapter(spec, adapters, "runs/x/export/adapter", config=cfg, base_model="models/m")
    spec, adapters = load_adapter("path/to/peft_adapter", config)

What we write, ``peft.PeftModel.from_pretrained(base, path)`` loads onto the transformers model
of the same checkpoint: keys ``base_model.model.<module>.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r] (torch layout, one per decoder layer: the stacked adapters of
`splitrl.models.lora` are split on write and stacked on read), a ``LORA`` config with ``r``,
``lora_alpha``, ``lora_dropout`` and ``target_modules`` (the short names, e.g.
``["q_proj", "v_proj"]``, when they select exactly our targets, else the full module names,
one per layer). What we read is what PEFT saves
for a plain LoRA adapter of a causal LM; variants that change the math (DoRA, rsLoRA, per-module
rank or alpha patterns, trained biases, extra saved modules, embedding adapters) are refused with
the field that asks for them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from splitrl.models.config import TransformerConfig
from splitrl.models.lora import LoraSpec, check_adapters, linear_modules, resolve_targets
from splitrl.models.params import from_torch_layout, to_torch_layout
from splitrl.models.stacking import per_layer_names, split_layer, stack_layers, unstack_layers

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."

# adapter_config.json fields whose non-default values change what an adapter computes.
_UNSUPPORTED: dict[str, tuple[object, object]] = {
    "use_dora": (False, None),
    "use_rslora": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "layers_to_transform": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "fan_in_fan_out": (False, None),
}


def peft_target_modules(config: TransformerConfig, spec: LoraSpec) -> list[str]:
    """``target_modules`` for adapter_config.json: the last parts of the targets' names when
    those select exactly the targets among the model's Linear modules (PEFT's list matching),
    else the full per-layer HF names."""
    short = sorted({t.rsplit(".", 1)[-1] for t in spec.targets})
    if resolve_targets(config, short) == spec.targets:
        return short
    return per_layer_names(spec.targets, config.num_layers)


def base_model_reference(base_model: str | os.PathLike | None) -> str | None:
    """``base_model_name_or_path`` for an adapter: a local directory's absolute path, else the
    name as given (a hub id). A relative path would send ``AutoPeftModelForCausalLM``, run
    from any other directory, to the hub for a repo of that name."""
    if base_model is None:
        return None
    local = Path(base_model).expanduser()
    return str(local.resolve()) if local.is_dir() else str(base_model)


def save_adapter(spec: LoraSpec, adapters: Mapping[str, jax.Array | np.ndarray],
                 out_dir: str | os.PathLike, *, config: TransformerConfig,
                 base_model: str | None = None) -> Path:
    """Write ``adapters`` (model layout, any placement) as a PEFT LoRA directory."""
    check_adapters(config, spec, adapters)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    host = {name: np.asarray(jax.device_get(adapters[name]), np.float32) for name in spec.names()}
    tensors = {PREFIX + name: np.ascontiguousarray(to_torch_layout(name, value))
               for name, value in unstack_layers(host).items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_reference(base_model),
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": peft_target_modules(config, spec),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out


def read_adapter_config(path: str | os.PathLike) -> dict:
    """adapter_config.json of a PEFT directory, checked to be a plain LoRA adapter."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"LoRA adapter {path}: no {CONFIG_FILE}")
    cfg = json.loads(file.read_text())
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type is {cfg.get('peft_type')!r}, "
                         "expected 'LORA'")
    for key, accepted in _UNSUPPORTED.items():
        if key in cfg and cfg[key] not in accepted:
            raise ValueError(f"LoRA adapter {path}: {key}={cfg[key]!r} is not supported "
                             f"(expected {accepted[0]!r}): only plain LoRA adapters load")
    for key in ("r", "lora_alpha", "target_modules"):
        if cfg.get(key) is None:
            raise ValueError(f"LoRA adapter {path}: {CONFIG_FILE} has no {key!r}")
    return cfg


def load_adapter(path: str | os.PathLike, config: TransformerConfig, *,
                 dropout: float = 0.0, base: Mapping[str, jax.Array] | None = None
                 ) -> tuple[LoraSpec, dict[str, np.ndarray]]:
    """A PEFT LoRA directory as ``(spec, {adapter name: float32 array [model layout]})``.

    The adapter's targets must be Linear modules of ``config``'s model and its tensors exactly
    theirs, in the adapter's rank; errors name the file and the tensor. PEFT also saves its own
    copy of an adapted ``lm_head``'s weight (``lm_head.base_layer.weight``); with ``base`` (the
    model's parameters, model layout) such a copy must equal the base's (else the adapter was
    trained on other weights, e.g. a resized vocabulary, and is refused); it is never loaded.
    """
    cfg = read_adapter_config(path)
    try:
        targets = resolve_targets(config, cfg["target_modules"])
        spec = LoraSpec(int(cfg["r"]), float(cfg["lora_alpha"]), targets, dropout)
    except ValueError as e:
        raise ValueError(f"LoRA adapter {path}: {e}") from None
    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"LoRA adapter {path}: no {WEIGHTS_FILE}")
    adapters = {}
    with safe_open(str(file), framework="flax") as f:
        for key in f.keys():
            name = key[len(PREFIX):] if key.startswith(PREFIX) else key
            name = name.replace(".lora_A.default.", ".lora_A.").replace(
                ".lora_B.default.", ".lora_B.")
            if name.endswith(".base_layer.weight"):
                _check_saved_base(file, key, name.replace(".base_layer", ""), f, base)
                continue
            if not name.endswith((".lora_A.weight", ".lora_B.weight")):
                raise ValueError(f"LoRA adapter {file}: tensor {key!r} is not a LoRA factor "
                                 "(only lora_A/lora_B weights of Linear modules load; "
                                 f"modules: {linear_modules(config)[:4]} ...)")
            tensor = np.asarray(jax.device_get(f.get_tensor(key)), np.float32)
            adapters[name] = from_torch_layout(name, tensor)
    try:
        adapters = stack_layers(adapters, config.num_layers)
        check_adapters(config, spec, adapters)
    except ValueError as e:
        raise ValueError(f"LoRA adapter {file}: {e}") from None
    return spec, adapters


def _check_saved_base(file, key: str, name: str, f, base) -> None:
    """A base weight PEFT saved beside the adapter must be the base checkpoint's own."""
    if base is None:
        return
    stacked, layer = split_layer(name)
    if stacked not in base:
        raise ValueError(f"LoRA adapter {file}: tensor {key!r} is a saved copy of {name!r}, "
                         "which the base model does not have")
    saved = from_torch_layout(name, np.asarray(jax.device_get(f.get_tensor(key))))
    mine = np.asarray(jax.device_get(base[stacked] if layer is None else base[stacked][layer]))
    if saved.shape != mine.shape or not np.array_equal(saved.astype(mine.dtype), mine):
        raise ValueError(f"LoRA adapter {file}: its saved copy of {name!r} "
                         f"({list(saved.shape)}) differs from the base checkpoint's "
                         f"({list(mine.shape)}): the adapter was trained on other weights "
                         "(e.g. a resized vocabulary), which is not supported")
