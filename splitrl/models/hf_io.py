"""Reading and writing Hugging Face checkpoint directories (config.json + safetensors).

Reads `model.safetensors` or a sharded `model.safetensors.index.json` with safetensors' flax
backend (no torch needed, reads bf16) and writes the same layout back, sharded above a size
limit like `transformers`, so `transformers.AutoModelForCausalLM.from_pretrained` loads what
we save and we load what it saves.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import crc32c
import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from splitrl.model_path import checkpoint_dir
from splitrl.models.config import TransformerConfig
from splitrl.models.params import (
    check_checkpoint_names,
    hf_state_dict,
    import_tensor,
    model_from_state,
    param_shapes,
    place,
    state_from_hf,
)
from splitrl.models.stacking import per_layer_names
from splitrl.models.transformer import CausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def load_config(path: str | os.PathLike) -> TransformerConfig:
    """The `TransformerConfig` of a HF checkpoint directory (or hub id: its cached snapshot)."""
    config_path = checkpoint_dir(path, weights=False) / "config.json"
    return TransformerConfig.from_hf_dict(json.loads(config_path.read_text()))


def generation_eos_ids(path: str | os.PathLike) -> list[int]:
    """The ids that end generation for a checkpoint directory, as `transformers.generate` takes
    them: `eos_token_id` of `generation_config.json` (one id or a list, e.g. Qwen2.5-Instruct's
    `<|im_end|>` and `<|endoftext|>`), else of `config.json`; [] when neither names one."""
    for name in ("generation_config.json", "config.json"):
        file = Path(path) / name
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(i) for i in (eos if isinstance(eos, list) else [eos])]
    return []


def from_pretrained(path: str | os.PathLike, dtype=jnp.float32, *, param_dtype=None,
                    shardings: Mapping[str, jax.sharding.Sharding] | None = None) -> CausalLM:
    """Loads a local HF checkpoint directory as a `CausalLM` computing in `dtype`.

    Parameters are stored in `param_dtype` (default: `dtype`), the decoder layers' tensors
    stacked (see `stacking.py`). With `shardings` (`{name: Sharding}` for the model-layout
    shapes, e.g. `splitrl.mesh.param_shardings`) each parameter is placed as it is read, so
    the full model never sits on one device, nor in host memory (one stacked parameter at a
    time). Rotary `inv_freq` buffers and a redundant `lm_head.weight` of a tied model are
    ignored, as transformers does; any other missing or unknown tensor, or a wrong shape,
    raises a ValueError naming it. A hub id is read from the hub's snapshot (its cache when
    offline); a path that names no checkpoint raises `splitrl.model_path.ModelPathError`
    saying what is missing where.
    """
    path = checkpoint_dir(path)
    config = load_config(path)
    param_dtype = dtype if param_dtype is None else param_dtype
    flat, _ = read_params(path, config, param_dtype=param_dtype, shardings=shardings)
    try:
        state = state_from_hf(config, flat)
    except ValueError as e:
        raise ValueError(f"checkpoint {path}: {e}") from None
    return model_from_state(config, state, dtype)


def read_params(path: Path, config: TransformerConfig, *, param_dtype,
                shardings: Mapping[str, jax.sharding.Sharding] | None = None,
                extra: Mapping[str, tuple[int, ...]] | None = None
                ) -> tuple[dict[str, jax.Array], dict[str, np.ndarray]]:
    """The decoder parameters of a checkpoint directory in model layout, placed by
    ``shardings``, and the ``extra`` tensors beside them (a task head such as a sequence
    classifier's ``score.weight``) as stored, each checked against its torch-layout shape.
    Any other missing or unknown tensor raises a ValueError naming it."""
    shardings = shardings or {}
    extra = dict(extra or {})
    try:
        files = {}  # HF name -> its file
        for file, names in _weight_files(Path(path)).items():
            if names is None:
                with safe_open(str(file), framework="numpy") as f:
                    names = list(f.keys())
            files.update({name: file for name in names if not _ignored(config, name)})
        missing_extra = sorted(set(extra) - set(files))
        if missing_extra:
            raise ValueError(f"missing {missing_extra} (a {config.family} model with a task "
                             "head has them beside the decoder's tensors)")
        check_checkpoint_names(config, [name for name in files if name not in extra])
        with contextlib.ExitStack() as stack:
            handles = {file: stack.enter_context(safe_open(str(file), framework="numpy"))
                       for file in set(files.values())}

            def read(name):
                return import_tensor(config, name, handles[files[name]].get_tensor(name),
                                     param_dtype=param_dtype)

            flat = {}
            for name in param_shapes(config):
                layers = per_layer_names([name], config.num_layers)
                host = (read(name) if layers == [name]
                        else np.stack([read(layer) for layer in layers]))
                flat[name] = place(host, shardings.get(name))
            heads = {}
            for name, shape in extra.items():
                tensor = handles[files[name]].get_tensor(name)
                if tuple(tensor.shape) != tuple(shape):
                    raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(shape)}")
                heads[name] = np.asarray(tensor).astype(param_dtype)
    except ValueError as e:
        raise ValueError(f"checkpoint {path}: {e}") from None
    return flat, heads


def save_pretrained(model: CausalLM, path: str | os.PathLike, *, dtype=None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Writes config.json, generation_config.json and safetensors weights to `path`.

    `dtype` (e.g. jnp.bfloat16) casts the stored tensors; by default they keep the model's
    parameter dtype. Above `max_shard_bytes` the weights are split into
    `model-0000i-of-0000n.safetensors` files plus `model.safetensors.index.json`.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model, dtype)  # host arrays: written from the host anyway
    stored = jnp.dtype(next(iter(tensors.values())).dtype).name
    config = model.config
    write_config(out, config.to_hf_dict(stored))
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.to_hf_dict()["eos_token_id"],
           "pad_token_id": config.pad_token_id}
    gen = {k: v for k, v in gen.items() if v is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_weights(out, tensors, max_shard_bytes)


def write_config(out: Path, config: dict) -> None:
    """``config.json`` of a checkpoint directory."""
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_weights(out: Path, tensors: dict, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
                  ) -> None:
    """Torch-layout host tensors as ``model.safetensors``, or as shards of at most
    ``max_shard_bytes`` with ``model.safetensors.index.json``; stale weight files go first."""
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    metadata = {"format": "pt"}
    for stale in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata=metadata)
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def checkpoint_fingerprint(path: str | os.PathLike) -> str:
    """A fingerprint of a checkpoint directory's weights: SHA-256 over every tensor's name,
    stored dtype, shape and CRC-32C of its bytes, in name order.

    Equal fingerprints mean the same tensors whatever the file layout (one file or shards,
    tensor order, metadata); tensors `from_pretrained` ignores are left out. Reads the files
    once through mmap (CRC-32C runs at memory speed), so a sampler and a trainer can check
    cheaply that they start from the same base weights (LoRA adapter pushes need it).
    """
    path = checkpoint_dir(path)
    config = load_config(path)
    entries = []
    for file, names in _weight_files(Path(path)).items():
        with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            (header_len,) = struct.unpack("<Q", mm[:8])
            header = json.loads(mm[8 : 8 + header_len])
            data = memoryview(mm)[8 + header_len :]
            try:
                for name, meta in header.items():
                    if name == "__metadata__" or _ignored(config, name):
                        continue
                    if names is not None and name not in names:
                        continue
                    start, end = meta["data_offsets"]
                    entries.append([name, meta["dtype"], list(meta["shape"]),
                                    crc32c.crc32c(data[start:end])])
            finally:
                data.release()
    entries.sort()
    return "sha256:" + hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def _weight_files(path: Path) -> Mapping[Path, list[str] | None]:
    """{file: tensor names to read from it (None = all)} for a single-file or sharded checkpoint."""
    if (path / SINGLE_FILE).is_file():
        return {path / SINGLE_FILE: None}
    index_path = path / INDEX_FILE
    if not index_path.is_file():
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    weight_map = json.loads(index_path.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index_path} has no 'weight_map' dict")
    files: dict[Path, list[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(path / file, []).append(name)
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{index_path} refers to missing shard {file.name}")
    return files


def _ignored(config: TransformerConfig, name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (
        config.tie_word_embeddings and name == "lm_head.weight")
