"""What a trainer and a sampler must agree on: computed from real checkpoints and tokenizers."""

from __future__ import annotations

import json
import shutil

from splitrl.agreement import agreed_settings, differences, tokenizer_identity
from splitrl.config import load_config
from splitrl.init_model import init_model
from splitrl.models import load_config as load_model_config
from splitrl.tokenizer import load_tokenizer


def _settings(model_dir, *overrides):
    cfg = load_config(None, [f"model.path={model_dir}", *overrides])
    return agreed_settings(cfg, load_model_config(model_dir), load_tokenizer(model_dir))


def test_other_weights_of_the_same_model_agree(arith_model, tmp_path):
    reseeded = init_model(tmp_path / "reseeded", family="qwen2", preset="tiny",
                          vocab="arithmetic", seed=1)
    assert differences(_settings(arith_model), _settings(reseeded)) == []


def test_another_architecture_tokenizer_or_config_is_named_by_key(arith_model, tmp_path):
    ours = _settings(arith_model, "trainer.steps=10")
    llama = init_model(tmp_path / "llama", family="llama", preset="tiny", vocab="arithmetic")
    keys = {key for key, _, _ in differences(ours, _settings(llama, "trainer.steps=10"))}
    assert "model.architectures" in keys and "model.model_type" in keys

    other_template = tmp_path / "template"
    shutil.copytree(arith_model, other_template)
    config_path = other_template / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = "{{ messages[0]['content'] }}"
    config_path.write_text(json.dumps(tokenizer_config))
    assert differences(ours, _settings(other_template, "trainer.steps=10")) == [
        ("tokenizer", ours["tokenizer"], tokenizer_identity(load_tokenizer(other_template)))]

    # The run's length is not agreed: a run resumed with more steps keeps its samplers.
    assert differences(ours, _settings(arith_model, "trainer.steps=30")) == []
    assert differences(ours, _settings(arith_model, "sampling.stop_token_ids=[5]")) == [
        ("sampling.stop_token_ids", "[]", "[5]")]
    assert differences(ours, {}) and all(theirs == "(not reported)"
                                         for _, _, theirs in differences(ours, {}))
