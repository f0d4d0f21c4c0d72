"""The typed config: strict keys and types, validators, YAML + dotted overrides, recipes,
the JSON schema."""

from __future__ import annotations

import json

import pytest

from splitrl.config import (
    AlgorithmConfig,
    Config,
    ConfigError,
    MeshConfig,
    OptimizerConfig,
    RewardFunctionConfig,
    dump_config,
    load_config,
    load_yaml,
    parse_override,
)


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


def test_numbers_parse_as_written_in_yaml_and_overrides(tmp_path):
    """``lr: 1e-6`` is a float (YAML 1.2), though PyYAML's YAML 1.1 reads it as a string."""
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  optimizer:\n    lr: 1e-6\n    weight_decay: 1E-5\n")
    cfg = load_config(path, ["sampling.temperature=7e-1"])
    assert cfg.trainer.optimizer.lr == 1e-6
    assert cfg.trainer.optimizer.weight_decay == 1e-5
    assert cfg.sampling.temperature == 0.7
    assert load_config(None, ["trainer.optimizer.lr=3e-4"]).trainer.optimizer.lr == 3e-4
    for text, value in [("-2.5e3", -2500.0), ("+1e3", 1000.0), ("-.5", -0.5), ("1.", 1.0),
                        (".inf", float("inf")), ("12", 12), ("1e", "1e"), ("e5", "e5"),
                        ("v1e3", "v1e3")]:
        assert load_yaml(text) == value and type(load_yaml(text)) is type(value), text


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
    with pytest.raises(ConfigError, match=r"sampling\.temperature: expected 0 \(greedy\) or "
                                          r">= 1e-05"):
        load_config(None, ["sampling.temperature=1.0e-38"])
    with pytest.raises(ConfigError, match=r"sampler\.batching: expected one of \['continuous', "
                                          r"'static'\], got 'dynamic'"):
        load_config(None, ["sampler.batching=dynamic"])


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


def test_every_problem_is_named_on_its_own_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.steps=1.5", "sampling.top_k=-1", "trainer.report_to=[tb]"])
    lines = str(e.value).splitlines()
    assert lines[0] == "3 problems:"
    assert set(lines[1:]) == {
        "  sampling.top_k: expected a value >= 0, got -1",
        "  trainer.steps: expected int, got float 1.5",
        "  trainer.report_to[0]: expected one of ['tensorboard', 'wandb'], got 'tb'",
    }


def test_section_checks_name_the_key_where_the_section_is():
    with pytest.raises(ConfigError, match=r"^trainer\.mesh\.axes: expected at least one axis"):
        load_config(None, ["trainer.mesh.axes={}"])
    with pytest.raises(ConfigError, match=r"^sampler\.mesh: expected a mapping for MeshConfig, "
                                          r"got int 3"):
        load_config(None, ["sampler.mesh=3"])
    with pytest.raises(ConfigError, match=r"unknown key 'trainer\.mesh\.axis' \(known: axes, "):
        load_config(None, ["trainer.mesh.axis={fsdp: 2}"])


def test_sections_build_from_keywords_and_check_what_they_are_given():
    assert RewardFunctionConfig(name="format", weight=0.5).weight == 0.5
    assert OptimizerConfig(lr=0.1) == OptimizerConfig(lr=0.1, b1=0.9)
    with pytest.raises(TypeError):
        OptimizerConfig(0.1)  # type: ignore[misc]  (keywords only: a field order is no API)
    with pytest.raises(ConfigError, match=r"^lr: expected a value > 0, got 0"):
        OptimizerConfig(lr=0)
    with pytest.raises(ConfigError, match=r"^mesh\.axes: expected at least one axis"):
        MeshConfig(axes={})


def test_recipes_set_the_papers_values_and_keys_set_beside_them_win(tmp_path):
    dapo = load_config(None, ["algorithm.recipe=dapo"]).algorithm
    assert (dapo.eps_low, dapo.eps_high, dapo.aggregation, dapo.filter_zero_variance) == (
        0.2, 0.28, "token-mean", True)
    assert load_config(None, ["algorithm.recipe=gspo"]).algorithm.loss == "gspo"
    assert load_config(None, ["algorithm.recipe=dr_grpo"]).algorithm.advantage == "drgrpo"
    custom = load_config(None, ["algorithm.recipe=dapo", "algorithm.eps_high=0.3"]).algorithm
    assert (custom.eps_high, custom.eps_low) == (0.3, 0.2)
    assert AlgorithmConfig(recipe="grpo", beta=0.0).beta == 0.0
    assert AlgorithmConfig(recipe="grpo").beta == 0.04
    cfg = load_config(None, ["algorithm.recipe=gspo_token", "algorithm.group_size=4"])
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg  # the resolved values, recipe and all
    with pytest.raises(ConfigError, match=r"algorithm\.recipe: expected one of \['grpo', "):
        load_config(None, ["algorithm.recipe=ppo"])


def test_the_json_schema_describes_every_section(capsys):
    from splitrl_app.cli import main

    assert main(["config", "--schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    trainer = schema["$defs"]["TrainerConfig"]
    assert trainer["additionalProperties"] is False
    assert trainer["properties"]["steps"]["minimum"] == 0
    assert schema["$defs"]["OptimizerConfig"]["properties"]["lr"]["exclusiveMinimum"] == 0
    assert set(schema["properties"]) == {"run_name", "model", "sampling", "reward", "algorithm",
                                         "trainer", "sampler", "services", "environment"}
    # Every key of every section says what it is (a docstring under the field).
    sections = [schema, *schema["$defs"].values()]
    undescribed = [f"{section.get('title')}.{key}" for section in sections
                   for key, prop in section.get("properties", {}).items()
                   if not prop.get("description")]
    assert undescribed == []
    assert len([k for section in sections for k in section.get("properties", {})]) > 140
    assert schema["$defs"]["SamplingConfig"]["properties"]["temperature"]["description"] == (
        "Sampling temperature: 0 is greedy; otherwise at least 1e-5.")


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
    with pytest.raises(ConfigError,
                       match=r"trainer\.push\.straggler_wait_s: expected a value > 0, got -1"):
        load_config(None, ["trainer.push.straggler_wait_s=-1.0"])
    with pytest.raises(ConfigError, match=r"trainer\.push\.transport"):
        load_config(None, ["trainer.push.transport=carrier-pigeon"])
    with pytest.raises(ConfigError, match=r"sampler\.dtype"):
        load_config(None, ["sampler.dtype=float16"])


def test_the_rollout_timeout_is_a_setting_that_outlasts_scoring():
    assert load_config(None, []).trainer.rollout_timeout_s == 600.0
    assert load_config(None, ["trainer.rollout_timeout_s=1800"]).trainer.rollout_timeout_s == 1800
    with pytest.raises(ConfigError, match=r"trainer\.rollout_timeout_s: expected a value > 0"):
        load_config(None, ["trainer.rollout_timeout_s=0"])
    with pytest.raises(ConfigError, match=r"trainer\.rollout_timeout_s: a Rollout call includes "
                                          r"scoring, so it must exceed "
                                          r"sampler\.reward_timeout_s=120; got 60"):
        load_config(None, ["trainer.rollout_timeout_s=60"])
    cfg = load_config(None, ["trainer.rollout_timeout_s=60", "sampler.reward_timeout_s=30"])
    assert cfg.trainer.rollout_timeout_s == 60
