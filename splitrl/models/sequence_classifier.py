"""Reward models: a decoder with a score head, Hugging Face's `XForSequenceClassification`.

A checkpoint of `LlamaForSequenceClassification`, `Qwen2ForSequenceClassification` or
`Qwen3ForSequenceClassification` (what TRL's RewardTrainer and most open reward models save)
holds the decoder's tensors (`model.*`) and `score.weight` [num_labels, hidden], no bias and
no LM head. The score of a sequence is the head applied to the final hidden state of its last
token that is not the pad token, as transformers computes it; with one label that is the
reward.

The decoder is the project's one forward (`CausalLM.hidden_states`): the backbone is a
`CausalLM` whose config says its output layer is the embedding (tied), so it holds no LM head
of its own, and its logits are never computed.

    model = load_sequence_classifier("models/tiny-rm")
    scores = model(tokens, lengths)                  # [B, num_labels] float32
    save_sequence_classifier(model, "out/")
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from splitrl.model_path import checkpoint_dir
from splitrl.models.config import TransformerConfig
from splitrl.models.hf_io import read_params, write_config, write_weights
from splitrl.models.params import hf_state_dict, model_from_state, state_from_hf
from splitrl.models.transformer import CausalLM

CLASSIFIER_ARCHITECTURES = {
    "llama": "LlamaForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
}
SCORE = "score.weight"


@dataclasses.dataclass(frozen=True)
class ClassifierConfig:
    """A sequence classifier's decoder (`TransformerConfig`, tied: no LM head) and its head."""

    decoder: TransformerConfig
    num_labels: int
    tie_word_embeddings: bool  # as the checkpoint says; written back unchanged

    @classmethod
    def from_hf_dict(cls, d: dict) -> ClassifierConfig:
        archs = d.get("architectures") or []
        by_arch = {arch: family for family, arch in CLASSIFIER_ARCHITECTURES.items()}
        if len(archs) != 1 or archs[0] not in by_arch:
            raise ValueError(f"architectures={archs!r} is not a sequence classifier "
                             f"(supported: {sorted(by_arch)})")
        # The decoder's fields are those of the family's causal LM.
        causal_lm = archs[0].replace("ForSequenceClassification", "ForCausalLM")
        decoder = TransformerConfig.from_hf_dict({**d, "architectures": [causal_lm]})
        if isinstance(d.get("id2label"), dict) and d["id2label"]:
            num_labels = len(d["id2label"])
        else:
            num_labels = int(d.get("num_labels", 2))  # transformers' default
        if num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {num_labels}")
        return cls(dataclasses.replace(decoder, tie_word_embeddings=True), num_labels,
                   bool(d.get("tie_word_embeddings", False)))

    def to_hf_dict(self, dtype: str | None = None) -> dict:
        d = self.decoder.to_hf_dict(dtype)
        d["architectures"] = [CLASSIFIER_ARCHITECTURES[self.decoder.family]]
        d["tie_word_embeddings"] = self.tie_word_embeddings
        d["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
        d["label2id"] = {f"LABEL_{i}": i for i in range(self.num_labels)}
        d["num_labels"] = self.num_labels
        return d


def is_sequence_classifier(path: str | os.PathLike) -> bool:
    """Whether a checkpoint directory's config.json names a sequence-classification head."""
    config = json.loads((checkpoint_dir(path, weights=False) / "config.json").read_text())
    return any(arch in CLASSIFIER_ARCHITECTURES.values()
               for arch in config.get("architectures") or [])


def load_classifier_config(path: str | os.PathLike) -> ClassifierConfig:
    config_path = checkpoint_dir(path, weights=False) / "config.json"
    return ClassifierConfig.from_hf_dict(json.loads(config_path.read_text()))


class SequenceClassifier(nnx.Module):
    """Scores of whole sequences: `score(h[last non-pad token])` (see the module docstring)."""

    def __init__(self, config: ClassifierConfig, backbone: CausalLM, score: jax.Array):
        if tuple(score.shape) != (config.decoder.hidden_size, config.num_labels):
            raise ValueError(f"score has shape {tuple(score.shape)}, expected "
                             f"{(config.decoder.hidden_size, config.num_labels)} [hidden, labels]")
        self.config = config
        self.backbone = backbone
        self.score = nnx.Param(score)  # [hidden, num_labels]: flax's [in, out]

    def __call__(self, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
        """tokens [B, T] int32, right-padded; lengths [B] (>= 1). Returns [B, num_labels] f32.

        The scored position is the last one before ``lengths`` whose token is not the pad id
        (transformers' rule: a sequence ending in its pad token, e.g. Qwen's
        ``<|endoftext|>``, is scored at the token before it), the last real one if all are."""
        b, t = tokens.shape
        index = jnp.arange(t, dtype=jnp.int32)
        valid = index[None, :] < lengths[:, None]
        positions = jnp.broadcast_to(index, (b, t))
        h = self.backbone.hidden_states(tokens, positions, attention_mask=valid)
        pad = self.config.decoder.pad_token_id
        scored = valid if pad is None else valid & (tokens != pad)
        last = jnp.max(jnp.where(scored, index[None, :], -1), axis=1)
        last = jnp.where(last < 0, lengths - 1, last)
        final = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
        return jnp.einsum("bd,dl->bl", final.astype(jnp.float32),
                          self.score[...].astype(jnp.float32))


def abstract_classifier(config: ClassifierConfig, dtype=jnp.float32) -> SequenceClassifier:
    """The classifier with ShapeDtypeStruct leaves (no memory), for its graphdef and shapes."""
    return nnx.eval_shape(lambda: SequenceClassifier(
        config, CausalLM(config.decoder, dtype=dtype, rngs=nnx.Rngs(0)),
        jnp.zeros((config.decoder.hidden_size, config.num_labels), dtype)))


def load_sequence_classifier(path: str | os.PathLike, dtype=jnp.float32, *,
                             shardings: Mapping[str, jax.sharding.Sharding] | None = None
                             ) -> SequenceClassifier:
    """A sequence-classification checkpoint directory as a `SequenceClassifier` computing in
    ``dtype``; the decoder placed by ``shardings`` (`splitrl.mesh.param_shardings` of its
    model-layout names), the small head replicated. Errors name the tensor or field."""
    path = checkpoint_dir(path)
    config = load_classifier_config(path)
    d = config.decoder
    flat, heads = read_params(path, d, param_dtype=dtype, shardings=shardings,
                              extra={SCORE: (config.num_labels, d.hidden_size)})
    backbone = model_from_state(d, state_from_hf(d, flat), dtype)
    return SequenceClassifier(config, backbone, jnp.asarray(heads[SCORE].T))


def save_sequence_classifier(model: SequenceClassifier, path: str | os.PathLike, *,
                             dtype=None) -> None:
    """config.json and safetensors that transformers' `AutoModelForSequenceClassification`
    loads; ``dtype`` casts the stored tensors (default: the parameters' own)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model.backbone, dtype)
    score = np.asarray(jax.device_get(model.score[...]))
    tensors[SCORE] = np.ascontiguousarray((score if dtype is None else score.astype(dtype)).T)
    stored = jnp.dtype(tensors[SCORE].dtype).name
    write_config(out, model.config.to_hf_dict(stored))
    write_weights(out, tensors)


def random_score_head(config: ClassifierConfig, seed: int, std: float = 0.02) -> jax.Array:
    """A normal(0, std) score head [hidden, num_labels], drawn on the host from ``seed``."""
    rng = np.random.default_rng(seed)
    shape = (config.decoder.hidden_size, config.num_labels)
    return jnp.asarray(std * rng.standard_normal(shape, dtype=np.float32))
