"""init_model writes tiny random checkpoints that transformers and SplitRL load identically."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from splitrl import tokenizer as tk
from splitrl.init_model import init_model
from splitrl.models import from_pretrained


def transformers_logits(path, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits.numpy()


def splitrl_logits(path, ids):
    model = from_pretrained(path)
    logits, _ = model(jnp.asarray([ids], jnp.int32), jnp.arange(len(ids))[None])
    return np.asarray(logits)


@pytest.fixture(scope="module")
def arith_dir(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("m") / "tiny-arith", vocab="arithmetic", seed=1)


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory, shared_data):
    """The default vocabulary, written over a directory holding a stale shard and a note."""
    out = tmp_path_factory.mktemp("m") / "tiny-llama"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "model-00001-of-00002.safetensors").write_text("stale shard")
    return init_model(out, family="llama", data_dir=shared_data, overwrite=True)


def test_arithmetic_model_loads_in_transformers_and_splitrl_with_equal_logits(arith_dir):
    tok = tk.load_tokenizer(arith_dir)
    ids = tk.encode_prompt(tok, "3+4=") + tok.encode("7", add_special_tokens=False)
    ours, theirs = splitrl_logits(arith_dir, ids), transformers_logits(arith_dir, ids)
    assert ours.shape == theirs.shape == (1, 5, 16)
    assert np.abs(ours - theirs).max() <= 1e-4


def test_arithmetic_model_is_tiny_with_a_small_vocabulary(arith_dir):
    config = json.loads((arith_dir / "config.json").read_text())
    info = json.loads((arith_dir / "splitrl_init.json").read_text())
    assert config["vocab_size"] == info["tokenizer_size"] == 16 < 32
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 2
    assert config["hidden_size"] == 64 and config["num_key_value_heads"] == 2
    assert 90_000 < info["num_parameters"] < 150_000
    tok = tk.load_tokenizer(arith_dir)
    assert config["eos_token_id"] == tk.eos_token_ids(tok) == [tok.eos_token_id, 2]
    assert config["pad_token_id"] == tok.pad_token_id


def test_default_vocab_model_round_trips_gsm8k_and_matches_transformers(default_dir,
                                                                         shared_data):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_dir))
    assert len(tok) == 512
    lines = (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()[:50]
    for row in map(json.loads, lines):
        text = row["question"] + "\n" + row["answer"]
        assert tk.decode(tok, tok.encode(text, add_special_tokens=False)) == text
    ids = tk.encode_prompt(tok, json.loads(lines[0])["question"], use_chat_template=True)
    assert tk.decode(tok, ids, skip_special_tokens=False).startswith("<|im_start|>user\nJanet")
    assert np.abs(splitrl_logits(default_dir, ids) - transformers_logits(default_dir, ids)).max() \
        <= 1e-4


def test_refuses_a_non_empty_directory_without_overwrite(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        init_model(tmp_path, vocab="arithmetic")


def test_overwrite_replaces_only_checkpoint_files(default_dir):
    assert (default_dir / "notes.txt").read_text() == "keep me"
    assert not (default_dir / "model-00001-of-00002.safetensors").exists()
    assert (default_dir / "model.safetensors").is_file()


@pytest.mark.parametrize("kwargs, match", [
    ({"preset": "huge"}, "preset"),
    ({"dtype": "int8"}, "dtype"),
    ({"vocab": "arithmetic", "vocab_size": 64}, "vocab_size"),
    ({"vocab": "/no/such/file.txt"}, "no such file"),
])
def test_bad_arguments_are_named(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        init_model(tmp_path / "m", **kwargs)
