"""Reward models (sequence classifiers) score as transformers' AutoModelForSequenceClassification.

Both directions: a reward model `splitrl init-model --score-labels` writes loads in transformers
with the same scores, and a classifier transformers writes loads here with the same scores.
One right-padded batch of different lengths, one row ending in the pad token (transformers
scores the last token that is not the pad id).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import HF_CONFIGS, hf_config

from splitrl.init_model import init_model
from splitrl.models.sequence_classifier import (
    is_sequence_classifier,
    load_classifier_config,
    load_sequence_classifier,
)

TOL = 1e-4
LENGTHS = (5, 9, 12)


def _batch(vocab: int, pad: int):
    rng = np.random.default_rng(0)
    tokens = np.full((len(LENGTHS), max(LENGTHS)), pad, np.int32)
    for row, n in enumerate(LENGTHS):
        tokens[row, :n] = rng.integers(pad + 1, vocab, size=n)
    tokens[1, LENGTHS[1] - 1] = pad  # a sequence that ends in its pad token
    return tokens, np.asarray(LENGTHS, np.int32)


def _transformers_scores(path, tokens, lengths) -> np.ndarray:
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    mask = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(tokens, dtype=torch.long),
                 attention_mask=torch.tensor(mask.astype(np.int64)))
    return out.logits.numpy()


@pytest.mark.parametrize("family,labels", [("qwen2", 1), ("llama", 2)])
def test_init_model_reward_model_scores_as_transformers(family, labels, tmp_path):
    path = init_model(tmp_path / "rm", family=family, preset="tiny", vocab="arithmetic",
                      score_labels=labels)
    assert is_sequence_classifier(path)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [f"{family.capitalize()}ForSequenceClassification"]
    model = load_sequence_classifier(path)
    pad = model.config.decoder.pad_token_id
    tokens, lengths = _batch(model.config.decoder.vocab_size, pad)
    ours = np.asarray(model(jnp.asarray(tokens), jnp.asarray(lengths)))
    ref = _transformers_scores(path, tokens, lengths)
    assert ours.shape == ref.shape == (len(LENGTHS), labels)
    assert np.abs(ours - ref).max() <= TOL, np.abs(ours - ref).max()
    assert len(set(np.round(ref[:, 0], 6))) == len(LENGTHS)  # rows differ: not vacuous


def test_transformers_classifier_loads_with_same_scores(tmp_path):
    import transformers

    name = "llama3_gqa_untied"  # untied: its LM head is not part of the classifier
    config = hf_config(name)
    config.num_labels = 3
    config.pad_token_id = 0
    config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(0)
    hf = transformers.LlamaForSequenceClassification(config).eval()
    with torch.no_grad():
        hf.score.weight.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path)
    assert load_classifier_config(tmp_path).num_labels == 3
    model = load_sequence_classifier(tmp_path)
    tokens, lengths = _batch(HF_CONFIGS[name]["vocab_size"], 0)
    ours = np.asarray(model(jnp.asarray(tokens), jnp.asarray(lengths)))
    ref = _transformers_scores(tmp_path, tokens, lengths)
    assert np.abs(ours - ref).max() <= TOL, np.abs(ours - ref).max()
    assert np.abs(ref).max() > 0.1


def test_causal_lm_checkpoint_is_not_a_reward_model(tmp_path):
    path = init_model(tmp_path / "lm", preset="tiny", vocab="arithmetic")
    assert not is_sequence_classifier(path)
    with pytest.raises(ValueError, match="is not a sequence classifier"):
        load_sequence_classifier(path)
