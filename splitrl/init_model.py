"""`init_model`: a tiny random Hugging Face checkpoint plus its own tokenizer.

No hub is reachable here, so the demo and the tests start from a checkpoint made locally:
config.json + model.safetensors written by `splitrl.models.save_pretrained` and a tokenizer
trained with `tokenizers` (see `splitrl.tokenizer`), loadable by transformers and by
`splitrl.models.from_pretrained` alike.

    init_model("models/tiny-arith", vocab="arithmetic")   # ~16-token character vocabulary
    init_model("models/tiny-tools", vocab="lookup")       # the tool task's, its chat template
    init_model("models/tiny", preset="tiny")               # 512-token BPE, arithmetic + GSM8K

Vocabularies: "arithmetic" is the character vocabulary of the arithmetic task (what a random
model can learn from, see ENVIRONMENT.md), "lookup" that of the tool task, with its tiny chat
template (splitrl.tasks.lookup); "default" a byte-level BPE trained on the arithmetic
task's text plus the GSM8K train questions; a path to a text file trains the BPE on its lines;
a path to a directory with a tokenizer.json reuses that tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from splitrl import tokenizer as tk

VOCAB_MULTIPLE = 8
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
INFO_FILE = "splitrl_init.json"
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Tasks whose text a character vocabulary is made of (vocab=NAME).
CHAR_VOCABULARIES = ("arithmetic", "lookup")


@dataclasses.dataclass(frozen=True)
class Preset:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    bpe_vocab_size: int  # BPE size when `vocab` is not "arithmetic"
    tie_word_embeddings: bool
    max_position_embeddings: int = 4096


PRESETS = {
    # ~125k parameters with the arithmetic vocabulary: learns the arithmetic task on CPU.
    "tiny": Preset(2, 64, 4, 2, 256, 512, True),
    # ~3.7M parameters with a 2048-token BPE.
    "small": Preset(4, 256, 8, 4, 1024, 2048, True),
    # ~24M parameters (untied 8192-token embeddings): for throughput and weight-push benchmarks.
    "bench": Preset(4, 512, 8, 4, 2048, 8192, False),
}


def init_model(out_dir: str | os.PathLike, *, family: str = "qwen2", preset: str = "tiny",
               vocab: str = "default", vocab_size: int | None = None, seed: int = 0,
               dtype: str = "float32", overwrite: bool = False,
               data_dir: str | os.PathLike | None = None, score_labels: int = 0) -> Path:
    """Writes a random `family` model of size `preset` and its tokenizer to `out_dir`.

    `vocab_size` sets the BPE size (default: the preset's); the model's vocabulary is the
    tokenizer's size rounded up to a multiple of 8. eos/pad ids in config.json come from the
    tokenizer (`<|endoftext|>`, and `<|im_end|>` also stops generation). `data_dir` holds
    `gsm8k/` for the default vocabulary (default: `$SPLITRL_DATA_DIR`, else the hub's
    `openai/gsm8k`, see `splitrl.tasks.math_data`).
    An existing non-empty `out_dir` is refused unless `overwrite`. Returns `out_dir`.

    `score_labels` > 0 writes a reward model instead: the family's sequence classifier
    (`Qwen2ForSequenceClassification`...) with a random score head of that many labels
    (1: a scalar reward), as `AutoModelForSequenceClassification` loads it.
    """
    from splitrl.models import TransformerConfig, init_random, save_pretrained

    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    if score_labels < 0:
        raise ValueError(f"score_labels: expected >= 0 (0: a causal LM), got {score_labels}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    _prepare_dir(out, overwrite)
    spec = PRESETS[preset]

    with tempfile.TemporaryDirectory(prefix="splitrl-tok-") as tmp:
        tok_dir = _make_tokenizer(Path(tmp), vocab, vocab_size or spec.bpe_vocab_size,
                                  vocab_size_given=vocab_size is not None, data_dir=data_dir)
        tokenizer = tk.load_tokenizer(tok_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if (tok_dir / name).is_file():
                shutil.copy2(tok_dir / name, out / name)

    eos_ids = tk.eos_token_ids(tokenizer)
    config = TransformerConfig(
        family=family,
        vocab_size=_round_up(len(tokenizer), VOCAB_MULTIPLE),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        tie_word_embeddings=spec.tie_word_embeddings,
        attention_bias=family == "qwen2",
        attention_out_bias=False,
        qk_norm=family == "qwen3",
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else tuple(eos_ids),
        pad_token_id=tokenizer.pad_token_id,
        dtype=dtype,
    )
    model = init_random(config, seed=seed, dtype=jnp.float32)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(_params(model)))
    if score_labels:
        _save_reward_model(model, out, score_labels, seed, _DTYPES[dtype])
        n_params += config.hidden_size * score_labels - (
            0 if config.tie_word_embeddings else config.hidden_size * config.vocab_size)
    else:
        save_pretrained(model, out, dtype=_DTYPES[dtype])
    info = {"family": family, "preset": preset, "vocab": str(vocab), "seed": seed,
            "dtype": dtype, "tokenizer_size": len(tokenizer), "vocab_size": config.vocab_size,
            "num_parameters": n_params, "score_labels": score_labels}
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return out


def _save_reward_model(model, out: Path, labels: int, seed: int, dtype) -> None:
    """``model``'s decoder under a random score head of ``labels`` outputs (drawn from
    ``seed + 1``, apart from the decoder's draws), saved as a sequence classifier."""
    from splitrl.models.params import hf_from_state, model_from_state, state_from_hf
    from splitrl.models.sequence_classifier import (
        ClassifierConfig,
        SequenceClassifier,
        random_score_head,
        save_sequence_classifier,
    )

    decoder = dataclasses.replace(model.config, tie_word_embeddings=True)
    config = ClassifierConfig(decoder, labels, model.config.tie_word_embeddings)
    # The decoder's tensors; an untied LM head has no place in a classifier.
    flat = {k: v for k, v in hf_from_state(_params(model)).items() if k != "lm_head.weight"}
    backbone = model_from_state(decoder, state_from_hf(decoder, flat))
    classifier = SequenceClassifier(config, backbone, random_score_head(config, seed + 1))
    save_sequence_classifier(classifier, out, dtype=dtype)


def _params(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _prepare_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(f"{out} is not empty; pass overwrite=True (--overwrite) to replace "
                              "the checkpoint in it")
    # Remove only what a checkpoint consists of: never a whole directory the user pointed at.
    for path in out.iterdir():
        if path.is_file() and (path.name in (*TOKENIZER_FILES, INFO_FILE, "config.json",
                                             "generation_config.json")
                               or path.name.startswith("model") and ".safetensors" in path.name):
            path.unlink()


def _make_tokenizer(tmp: Path, vocab: str, bpe_size: int, *, vocab_size_given: bool,
                    data_dir: str | os.PathLike | None) -> Path:
    from splitrl.tasks import default_data_dir, get_task

    arithmetic = get_task("arithmetic")
    if vocab in CHAR_VOCABULARIES:
        if vocab_size_given:
            raise ValueError(f"vocab_size does not apply to vocab={vocab!r} (a character "
                             "vocabulary of the task's text)")
        task = get_task(vocab)
        return tk.train_char_tokenizer(
            task.corpus(), tmp, chat_template=getattr(task, "chat_template", tk.CHAT_TEMPLATE))
    if vocab == "default":
        root = Path(data_dir) if data_dir is not None else default_data_dir()
        gsm8k = get_task("gsm8k", path=None if root is None else root / "gsm8k")
        texts = [*arithmetic.corpus(), *(row["prompt"] for row in gsm8k.rows("train"))]
        return tk.train_bpe_tokenizer(texts, tmp, vocab_size=bpe_size)
    path = Path(vocab)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"vocab={vocab!r}: directory has no tokenizer.json")
        if vocab_size_given:
            raise ValueError("vocab_size does not apply when reusing an existing tokenizer")
        for name in TOKENIZER_FILES:
            if (path / name).is_file():
                shutil.copy2(path / name, tmp / name)
        return tmp
    if path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        return tk.train_bpe_tokenizer(lines, tmp, vocab_size=bpe_size)
    raise ValueError(f"vocab: expected 'default', 'arithmetic', 'lookup', a text file or a "
                     f"tokenizer directory, got {vocab!r} (no such file)")
