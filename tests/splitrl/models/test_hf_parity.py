"""Logits match transformers' PyTorch models in both directions, and checkpoints round-trip.

All comparisons use one left-padded batch shape (row 0 unpadded) so each config compiles once.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    HF_CONFIGS,
    VOCAB,
    hf_config,
    hf_logits,
    hf_random_model,
    randomize,
    run,
    standard_batch,
)
from flax import nnx

from splitrl import models

TOL = 1e-4


def _assert_matches_hf(model, hf):
    tokens, mask, positions = standard_batch()
    ours = np.asarray(run(model, tokens, positions, mask))
    ref = hf_logits(hf, tokens, mask, positions)
    m = np.asarray(mask)
    assert ours.shape == (3, 11, VOCAB)
    assert np.abs(ours[m] - ref[m]).max() <= TOL, np.abs(ours[m] - ref[m]).max()
    assert np.abs(ref[m]).max() > 1.0  # the comparison is not vacuous


def _config(name):
    return models.TransformerConfig.from_hf_dict(hf_config(name).to_dict())


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_transformers_checkpoint_loads_with_same_logits(name, tmp_path):
    hf = hf_random_model(name)
    hf.save_pretrained(tmp_path)
    model = models.from_pretrained(tmp_path)
    assert model.config == _config(name)
    _assert_matches_hf(model, hf)


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_saved_checkpoint_loads_in_transformers_with_same_logits(name, tmp_path):
    import transformers

    config = _config(name)
    model = models.init_random(config, seed=3, std=0.2)
    randomize(model, seed=4)
    models.save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == config.architecture
    _assert_matches_hf(model, hf)


def test_unpadded_call_with_default_positions_matches_hf(tmp_path):
    hf = hf_random_model("qwen2_bias_tied_mha")
    hf.save_pretrained(tmp_path)
    model = models.from_pretrained(tmp_path)
    tokens = standard_batch()[0][:1]  # the unpadded row
    logits, cache = model(tokens)
    assert cache is None and logits.dtype == jnp.float32
    assert np.abs(np.asarray(logits) - hf_logits(hf, tokens)).max() <= TOL


def test_param_names_are_the_transformers_state_dict_keys():
    for name in HF_CONFIGS:
        hf = hf_random_model(name)
        expected = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            del expected["lm_head.weight"]
        assert models.checkpoint_shapes(_config(name)) == expected
        # the model layout: Linear weights [in, out], decoder layers stacked
        shapes = models.param_shapes(_config(name))
        layers = hf.config.num_hidden_layers
        for k, v in shapes.items():
            one = (expected[k] if not k.startswith("model.layers.")
                   else expected[k.replace("model.layers.", "model.layers.0.")])
            want = one[::-1] if k.endswith("proj.weight") or k == "lm_head.weight" else one
            assert v.shape == ((layers, *want) if k.startswith("model.layers.") else want), k


def test_legacy_top_level_rope_theta_loads_like_rope_parameters(tmp_path):
    hf = hf_random_model("qwen2_bias_tied_mha")
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in cfg  # transformers 5 layout
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    model = models.from_pretrained(tmp_path)
    assert model.config == _config("qwen2_bias_tied_mha")
    _assert_matches_hf(model, hf)


def test_sharded_checkpoints_round_trip_both_ways(tmp_path):
    import transformers

    hf = hf_random_model("qwen3_qknorm_gqa_untied")
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model = models.from_pretrained(tmp_path / "hf")
    _assert_matches_hf(model, hf)

    models.save_pretrained(model, tmp_path / "ours", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "ours" / "model.safetensors").exists()
    again = models.from_pretrained(tmp_path / "ours")
    for k, v in models.hf_from_state(nnx.state(again)).items():
        np.testing.assert_array_equal(v, models.hf_from_state(nnx.state(model))[k])
    _assert_matches_hf(model, transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours"))


def test_bfloat16_checkpoint_round_trips(tmp_path):
    model = models.init_random(_config("qwen2_bias_tied_mha"), seed=0, std=0.2)
    models.save_pretrained(model, tmp_path, dtype=jnp.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = models.from_pretrained(tmp_path, jnp.bfloat16)
    weights = models.hf_from_state(nnx.state(loaded))
    assert all(w.dtype == jnp.bfloat16 for w in weights.values())
    tokens, mask, positions = standard_batch()
    logits = run(loaded, tokens, positions, mask)
    assert logits.dtype == jnp.float32
    ref = run(model, tokens, positions, mask)
    assert np.abs(np.asarray(logits) - np.asarray(ref)).max() < 0.1
    # f32 params stored as bf16 load back exactly as the bf16-rounded values
    f32 = models.from_pretrained(tmp_path)
    for k, v in models.hf_from_state(nnx.state(f32)).items():
        np.testing.assert_array_equal(v, np.asarray(weights[k], np.float32))
