"""Export the trained policy as a Hugging Face model directory that `transformers` loads, and
LoRA adapters as a PEFT directory that `peft.PeftModel.from_pretrained(base, dir)` loads.

    export_hf(learner.model(), "runs/x/export", source_dir=cfg.model.path)
    export_adapter(learner.lora, learner.params, "runs/x/export/adapter",
                   config=learner.config, base_model=cfg.model.path)
    export_checkpoint("runs/x", "runs/x/step-50")     # splitrl export: any saved step

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

CHECKPOINTS = "checkpoints"

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


def checkpoint_location(path: str | os.PathLike) -> tuple[Path, int | None]:
    """(the checkpoint directory, the step or None for the latest) for a run directory, its
    ``checkpoints`` directory or one step's directory (``runs/x/checkpoints/50``)."""
    path = Path(path)
    if (path / CHECKPOINTS).is_dir():
        return path / CHECKPOINTS, None
    if path.name.isdigit() and path.is_dir() and any(path.iterdir()):
        return path.parent, int(path.name)
    if path.is_dir() and any(p.name.isdigit() for p in path.iterdir()):
        return path, None
    raise FileNotFoundError(f"{path} is not a run directory, a checkpoints directory or a "
                            "checkpoint step directory")


def export_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike, *,
                      step: int | None = None, base_model: str | os.PathLike | None = None,
                      dtype=None):
    """Write the policy of a trainer checkpoint (the latest, or ``step``) as a Hugging Face
    directory. The checkpoint's own config says which model it trains (``model.path``: its
    architecture and tokenizer); ``base_model`` replaces that path when the run was made
    elsewhere. A LoRA run's checkpoint (adapters) gives the merged model and ``adapter/``, a
    PEFT directory. Returns (the directory, the step, the run's config)."""
    import jax
    import numpy as np

    from splitrl.config import Config, validate
    from splitrl.models import from_pretrained
    from trainer_service.learning.checkpoints import Checkpointer
    from trainer_service.learning.learner import Learner

    directory, located = checkpoint_location(path)
    step = located if step is None else step
    with Checkpointer(directory, async_save=False) as checkpointer:
        meta = checkpointer.meta(step)
        if not meta.get("config"):
            raise ValueError(f"the checkpoint in {directory} holds no config: cannot tell which "
                             "model it trains")
        cfg = validate(Config, meta["config"])
        model_path = Path(base_model or cfg.model.path)
        if not (model_path / "config.json").is_file():
            raise FileNotFoundError(
                f"the run's model {model_path} (model.path) is not here: pass the directory of "
                "the model it started from (splitrl export --base-model DIR)")
        cfg.model.path = str(model_path)  # LoRA: the base the adapters apply to
        model = from_pretrained(model_path, dtype=cfg.model.dtype)
        one_device = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
        learner = Learner.from_config(model, cfg, one_device)  # the arrays come to this host
        learner.check_checkpoint_meta(meta.get("learner"), where=f"checkpoint in {directory}")
        restored = checkpointer.restore(learner.abstract_train_state(), int(meta["step"]))
    learner.load_train_state(restored.state, restored.weight_version)
    out = export_hf(learner.model(), out_dir, source_dir=model_path, dtype=dtype)
    if learner.lora is not None:  # and the adapters as PEFT has them, beside the merged model
        export_adapter(learner.lora, learner.params, out / "adapter", config=learner.config,
                       base_model=str(model_path))
    return out, restored.step, cfg
