"""Export the trained policy as a Hugging Face model directory that `transformers` loads, and
LoRA adapters as a PEFT directory that `peft.PeftModel.from_pretrained(base, dir)` loads.

    export_hf(learner.model(), "runs/x/export", source_dir=cfg.model.path)
    export_adapter(learner.lora, learner.params, "runs/x/export/adapter",
                   config=learner.config, base_model=cfg.model.path)

writes config.json, generation_config.json and safetensors weights (`splitrl.models.
save_pretrained`, gathered from the trainer's mesh to the host) and, when `source_dir` (the
checkpoint the run started from) is given, copies its tokenizer files and chat template, so the
directory is a complete drop-in replacement of the source model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from splitrl.models import CausalLM, TransformerConfig, save_pretrained
from splitrl.models.lora import LoraSpec
from splitrl.models.peft_io import save_adapter

# Everything a tokenizer (fast or slow) and its chat template may live in; weights and the
# model config never come from the source.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def export_hf(
    model: CausalLM,
    out_dir: str | os.PathLike,
    *,
    source_dir: str | os.PathLike | None = None,
    dtype=None,
) -> Path:
    """Write `model` to `out_dir` as a HF checkpoint (weights cast to `dtype` if given) and
    copy the tokenizer files of `source_dir` that exist. Returns the directory."""
    out = Path(out_dir)
    save_pretrained(model, out, dtype=dtype)
    if source_dir is not None:
        source = Path(source_dir)
        if not source.is_dir():
            raise FileNotFoundError(f"export: source model directory {source} does not exist")
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
        if (source / "additional_chat_templates").is_dir():
            shutil.copytree(source / "additional_chat_templates",
                            out / "additional_chat_templates", dirs_exist_ok=True)
    return out


def export_adapter(spec: LoraSpec, adapters, out_dir: str | os.PathLike, *,
                   config: TransformerConfig, base_model: str | None) -> Path:
    """Write the adapters (any placement; gathered to the host) as a PEFT LoRA directory
    (adapter_config.json + adapter_model.safetensors) for the base checkpoint `base_model`."""
    return save_adapter(spec, adapters, out_dir, config=config, base_model=base_model)
