"""A wrong ``model.path`` is reported as what it is (which path, what is missing there), not as
a network, repo-id or sentencepiece error; a hub id still goes to the hub (its cache offline)."""

from __future__ import annotations

import shutil

import huggingface_hub.constants
import pytest

from splitrl.model_path import ModelPathError, checkpoint_dir, looks_like_hub_id, model_problem
from splitrl.models import from_pretrained
from splitrl.tokenizer import load_tokenizer


def test_hub_ids_and_paths_are_told_apart():
    assert looks_like_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and looks_like_hub_id("gpt2")
    for path in ("/abs/model", "./model", "../model", "~/model", "runs/x/export", "a/../b"):
        assert not looks_like_hub_id(path), path


def test_a_missing_absolute_path_is_named(tmp_path):
    missing = tmp_path / "no-model"
    for load in (load_tokenizer, from_pretrained):
        with pytest.raises(ModelPathError, match=f"model path '{missing}': no such directory"):
            load(missing)
    assert "no such directory" in model_problem(missing)


def test_a_missing_relative_path_names_the_directory_and_the_hub_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    expected = (f"model path 'models/tiny': no such directory \\({tmp_path}/models/tiny\\), and "
                "not in the hub's local cache \\(HF_HUB_OFFLINE is set\\) as a model id either")
    assert pytest.raises(ModelPathError, load_tokenizer, "models/tiny").match(expected)
    assert pytest.raises(ModelPathError, from_pretrained, "models/tiny").match(expected)
    assert "no cached config.json" in model_problem("models/tiny")


def test_an_empty_or_incomplete_directory_says_what_is_missing(tmp_path, arith_model):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelPathError, match="'.*empty' has no tokenizer files \\(tokenizer.json"):
        load_tokenizer(empty)
    with pytest.raises(ModelPathError, match="'.*empty' has no config.json, no weights"):
        from_pretrained(empty)
    problem = model_problem(empty)
    assert "no config.json, no weights" in problem and "no tokenizer files" in problem

    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(arith_model / name, weights_only / name)
    assert from_pretrained(weights_only).config.vocab_size > 0
    with pytest.raises(ModelPathError, match="has no tokenizer files"):
        load_tokenizer(weights_only)
    assert model_problem(arith_model) is None


def test_a_hub_id_is_read_from_the_hub_cache(tmp_path, monkeypatch, arith_model):
    """An offline hub cache laid out as huggingface_hub writes it (refs/main -> snapshot)."""
    cache = tmp_path / "hub"
    repo = cache / "models--someone--tiny-arith"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(arith_model, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    assert model_problem("someone/tiny-arith") is None
    assert checkpoint_dir("someone/tiny-arith") == snapshot
    assert from_pretrained("someone/tiny-arith").config == from_pretrained(arith_model).config
