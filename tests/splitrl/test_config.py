"""The typed config: strict keys and types, validators, YAML + dotted overrides."""

from __future__ import annotations

import pytest

from splitrl.config import Config, ConfigError, dump_config, load_config, parse_override


def test_defaults_load_without_a_file():
    cfg = load_config(None)
    assert isinstance(cfg, Config)
    assert cfg.algorithm.loss == "grpo"
    assert cfg.trainer.mesh.axes == {"fsdp": -1}


def test_yaml_and_overrides_compose(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  steps: 7\n  optimizer:\n    lr: 0.01\nalgorithm:\n  loss: gspo\n")
    cfg = load_config(path, ["trainer.steps=9", "sampling.top_k=5", "trainer.mesh.axes={fsdp: 4}"])
    assert cfg.trainer.steps == 9
    assert cfg.trainer.optimizer.lr == 0.01
    assert cfg.algorithm.loss == "gspo"
    assert cfg.sampling.top_k == 5
    assert cfg.trainer.mesh.axes == {"fsdp": 4}


def test_unknown_key_names_the_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  stpes: 7\n")
    with pytest.raises(ConfigError, match=r"unknown key 'trainer\.stpes'"):
        load_config(path)


def test_unknown_override_names_the_key():
    with pytest.raises(ConfigError, match=r"unknown key 'trainer\.optimizer\.learning_rate'"):
        load_config(None, ["trainer.optimizer.learning_rate=1e-3"])


def test_wrong_type_names_the_key_and_expectation():
    with pytest.raises(ConfigError, match=r"trainer\.steps: expected int, got str 'ten'"):
        load_config(None, ["trainer.steps=ten"])
    with pytest.raises(ConfigError, match=r"sampling\.temperature: expected float, got bool"):
        load_config(None, ["sampling.temperature=true"])
    with pytest.raises(ConfigError, match=r"algorithm\.loss: expected one of"):
        load_config(None, ["algorithm.loss=ppo"])


def test_range_validators_name_the_nested_key():
    with pytest.raises(ConfigError, match=r"trainer\.optimizer\.lr: expected a value > 0"):
        load_config(None, ["trainer.optimizer.lr=-1.0"])
    with pytest.raises(ConfigError, match=r"sampling\.top_p"):
        load_config(None, ["sampling.top_p=1.5"])


def test_list_of_sections_is_typed():
    cfg = load_config(None, ["reward.functions=[{name: exact_answer, weight: 2}]"])
    assert cfg.reward.functions[0].name == "exact_answer"
    assert cfg.reward.functions[0].weight == 2.0
    with pytest.raises(ConfigError, match=r"reward\.functions\[0\]\.wieght"):
        load_config(None, ["reward.functions=[{name: x, wieght: 2}]"])


def test_override_syntax_errors_are_clear():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_override("trainer.steps")
    with pytest.raises(ConfigError, match=r"trainer\.steps: expected int, got dict"):
        load_config(None, ["trainer.steps.x=1"])
    with pytest.raises(ConfigError, match="'steps' is not a section"):
        load_config(None, ["trainer.steps=1", "trainer.steps.x=1"])


def test_dump_and_reload_round_trips(tmp_path):
    cfg = load_config(None, ["trainer.steps=3", "services.sampler_addresses=[a:1, b:2]"])
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_weight_sync_keys_are_typed_and_checked():
    cfg = load_config(None, ["sampler.dtype=bfloat16", "sampler.data_port=null",
                             "trainer.push.transport=grpc", "trainer.push.delta=false"])
    assert cfg.sampler.dtype == "bfloat16" and cfg.sampler.data_port is None
    assert cfg.trainer.push.transport == "grpc" and not cfg.trainer.push.delta
    assert load_config(None, []).trainer.push.transport == "bulk"
    with pytest.raises(ConfigError, match=r"sampler\.data_port: expected a TCP port <= 65535"):
        load_config(None, ["sampler.data_port=70000"])
    with pytest.raises(ConfigError, match=r"sampler\.push_idle_timeout_s: expected a value > 0"):
        load_config(None, ["sampler.push_idle_timeout_s=0"])
    with pytest.raises(ConfigError, match=r"trainer\.push\.transport"):
        load_config(None, ["trainer.push.transport=carrier-pigeon"])
    with pytest.raises(ConfigError, match=r"sampler\.dtype"):
        load_config(None, ["sampler.dtype=float16"])
