"""LoRA: targets by PEFT's rules, the forward with adapters against PEFT on transformers (the
oracle), merges that are bitwise equal on any mesh, PEFT directories written and read, and the
base checkpoint's fingerprint."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_logits, hf_random_model, run, standard_batch
from flax import nnx
from jax.sharding import Mesh

from splitrl.mesh import param_shardings
from splitrl.models import (
    from_pretrained,
    hf_from_state,
    save_pretrained,
    state_from_hf,
)
from splitrl.models import lora as lora_lib
from splitrl.models.hf_io import checkpoint_fingerprint
from splitrl.models.peft_io import load_adapter, save_adapter

PROJECTIONS = lora_lib.ALL_PROJECTIONS


def _random_adapters(config, spec, seed=1):
    """Adapters with B non-zero too (a fresh adapter has B = 0 and changes nothing)."""
    rng = np.random.default_rng(seed)
    return {k: (0.2 * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in lora_lib.init_adapters(config, spec).items()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random untied Llama 3 checkpoint (transformers wrote it), and our model of it."""
    path = tmp_path_factory.mktemp("lora") / "base"
    hf_random_model("llama3_gqa_untied", seed=3).save_pretrained(path)
    return path


def test_targets_follow_peft_rules_and_an_empty_match_names_pattern_and_modules(tiny_config):
    # matched against the per-layer HF names, resolved to the stacked (every-layer) modules
    attn = lora_lib.resolve_targets(tiny_config, ".*self_attn.(q|v)_proj")
    assert attn == ("model.layers.self_attn.q_proj", "model.layers.self_attn.v_proj")
    # EasyDeL's tutorial pattern, over module or parameter names; lists match by suffix.
    easydel = lora_lib.resolve_targets(tiny_config, ".*(gate_proj|up_proj|lm_head|q_proj).*")
    assert "lm_head" in easydel and len(easydel) == 4
    assert lora_lib.resolve_targets(tiny_config, r".*q_proj\.weight") == attn[:1]
    assert lora_lib.resolve_targets(tiny_config, ["q_proj", "v_proj"]) == attn
    assert len(lora_lib.resolve_targets(tiny_config, PROJECTIONS)) == 7
    with pytest.raises(ValueError, match=r"selects layers.self_attn.q_proj in layers \[0\] of 2 "
                                         "only"):
        lora_lib.resolve_targets(tiny_config, r"model\.layers\.0\.self_attn\.q_proj")
    with pytest.raises(ValueError) as e:
        lora_lib.resolve_targets(tiny_config, "q_proj")  # a regex must match the whole name
    assert "'q_proj' matches none" in str(e.value)
    assert "model.layers.0.self_attn.q_proj" in str(e.value) and "lm_head" in str(e.value)
    with pytest.raises(ValueError, match="embed_tokens.*matches none"):
        lora_lib.resolve_targets(tiny_config, ["embed_tokens"])  # not a Linear module


def test_peft_on_transformers_matches_our_forward_and_the_merged_export(checkpoint, tmp_path):
    """The oracle: our adapter directory loaded by peft.PeftModel onto the transformers base
    gives the logits of our forward with adapters and of the merged export (f32, 1e-4)."""
    import peft
    import torch
    import transformers

    model = from_pretrained(checkpoint)
    targets = lora_lib.resolve_targets(model.config, PROJECTIONS[:-1] + "|lm_head)")
    spec = lora_lib.LoraSpec(4, 8.0, targets)
    adapters = _random_adapters(model.config, spec)
    save_adapter(spec, adapters, tmp_path / "adapter", config=model.config,
                 base_model=str(checkpoint))
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["target_modules"] == ["down_proj", "gate_proj", "k_proj", "lm_head",
                                         "o_proj", "q_proj", "up_proj", "v_proj"]
    base = hf_from_state(nnx.state(model, nnx.Param))
    merged_model = from_pretrained(checkpoint)
    nnx.update(merged_model, state_from_hf(model.config, lora_lib.merge(base, adapters, spec)))
    save_pretrained(merged_model, tmp_path / "merged")

    tokens, mask, positions = standard_batch()
    ours = np.asarray(run(lora_lib.attach(model, spec, adapters), tokens, positions, mask))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with_peft = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    peft_logits = hf_logits(with_peft, tokens, mask, positions)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                               dtype=torch.float32).eval()
    merged_logits = hf_logits(merged, tokens, mask, positions)
    real = np.asarray(mask)
    base_logits = np.asarray(run(from_pretrained(checkpoint), tokens, positions, mask))
    assert np.abs(base_logits - ours)[real].max() > 0.1  # the adapters matter
    assert np.abs(peft_logits - ours)[real].max() < 1e-4
    assert np.abs(peft_logits - merged_logits)[real].max() < 1e-4


def test_the_adapter_names_its_base_so_peft_finds_it_from_any_directory(checkpoint, tmp_path,
                                                                       monkeypatch):
    """A relative model.path is written as an absolute one (AutoPeftModelForCausalLM, run
    elsewhere, went to the hub for a repo named like the relative path); a hub id stays."""
    import peft

    model = from_pretrained(checkpoint)
    spec = lora_lib.LoraSpec(2, 4.0, lora_lib.resolve_targets(model.config, PROJECTIONS))
    adapters = _random_adapters(model.config, spec)
    monkeypatch.chdir(checkpoint.parent)
    save_adapter(spec, adapters, tmp_path / "adapter", config=model.config, base_model="base")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == str(checkpoint.resolve())
    monkeypatch.chdir(tmp_path)
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
    assert loaded.base_model.model.config.hidden_size == model.config.hidden_size
    save_adapter(spec, adapters, tmp_path / "hub", config=model.config,
                 base_model="Qwen/Qwen2.5-0.5B-Instruct")
    written = json.loads((tmp_path / "hub" / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == "Qwen/Qwen2.5-0.5B-Instruct"


def test_an_adapter_peft_saved_loads_as_the_starting_point(checkpoint, tmp_path):
    import peft
    import torch
    import transformers

    hf_base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    cfg = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "down_proj", "lm_head"],
                          init_lora_weights=False)  # random A and B
    peft_model = peft.get_peft_model(hf_base, cfg).eval()
    peft_model.save_pretrained(tmp_path / "peft")  # also saves its copy of lm_head's weight
    model = from_pretrained(checkpoint)
    base = hf_from_state(nnx.state(model, nnx.Param))
    spec, adapters = load_adapter(tmp_path / "peft", model.config, base=base)
    assert (spec.rank, spec.alpha, spec.scale) == (4, 16.0, 4.0) and len(spec.targets) == 3
    tokens, mask, positions = standard_batch()
    ours = np.asarray(run(lora_lib.attach(model, spec, adapters), tokens, positions, mask))
    theirs = hf_logits(peft_model, tokens, mask, positions)
    assert np.abs(ours - theirs)[np.asarray(mask)].max() < 1e-4

    other = dict(base)
    other["lm_head.weight"] = base["lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match="copy of 'lm_head.weight'.*differs"):
        load_adapter(tmp_path / "peft", model.config, base=other)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({**config,
                                                                       "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        load_adapter(tmp_path / "peft", model.config)


def test_the_model_lora_section_starts_fresh_or_from_a_peft_adapter(checkpoint, tmp_path):
    """``model.lora`` as a run gives it: defaults, a PEFT adapter as the starting point (the
    learner trains from exactly its tensors), and settings that contradict the adapter."""
    import peft
    import torch
    import transformers
    from jax.sharding import Mesh

    from splitrl.config import ConfigError, LoraConfig, load_config
    from splitrl_app.launch.demo import demo_config_path
    from trainer_service.learning.learner import Learner

    model = from_pretrained(checkpoint)
    fresh, adapters = lora_lib.from_section(LoraConfig(), model.config)
    assert (fresh.rank, fresh.alpha) == (16, 32.0)
    assert fresh.targets == lora_lib.resolve_targets(model.config, PROJECTIONS)
    assert all(not adapters[n].any() for n in fresh.names() if n.endswith("lora_B.weight"))

    hf_base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    peft.get_peft_model(hf_base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
    )).save_pretrained(tmp_path / "start")
    spec, saved = load_adapter(tmp_path / "start", model.config)
    cfg = load_config(demo_config_path(), [f"model.path={checkpoint}",
                                           f"model.lora.path={tmp_path / 'start'}",
                                           "model.lora.rank=4"])
    learner = Learner.from_config(model, cfg, Mesh(np.array(jax.devices()[:2]), ("fsdp",)))
    assert learner.lora == spec and learner.lora.scale == 2.0
    assert learner.base_fingerprint == checkpoint_fingerprint(checkpoint)
    for name, value in saved.items():
        np.testing.assert_array_equal(np.asarray(learner.params[name]), value, err_msg=name)

    with pytest.raises(ValueError, match="model.lora.rank: 8 differs from the adapter"):
        lora_lib.from_section(LoraConfig(path=str(tmp_path / "start"), rank=8), model.config)
    with pytest.raises(ValueError, match="model.lora.target_modules: .* differs"):
        lora_lib.from_section(LoraConfig(path=str(tmp_path / "start"),
                                         target_modules=["q_proj"]), model.config)
    with pytest.raises(ValueError, match="'.*nothing' matches none of the Linear modules"):
        lora_lib.from_section(LoraConfig(target_modules=".*nothing"), model.config)
    for bad, message in ((dict(target_modules="(q_proj"), "not a valid regex"),
                         (dict(target_modules=[]), "non-empty list"),
                         (dict(dropout=1.0), "dropout: expected a value < 1"),
                         (dict(rank=0), "rank: expected a value > 0")):
        with pytest.raises(ConfigError, match=message):
            LoraConfig(**bad)


def test_merge_is_bitwise_equal_on_every_mesh_and_matches_the_forward(tiny_config):
    """Trainer (fsdp over 4) and sampler (tensor parallel over 2) merge to the same bits."""
    from splitrl.models import init_random

    model = init_random(tiny_config, seed=0, std=0.2)
    spec = lora_lib.LoraSpec(8, 16.0, lora_lib.resolve_targets(tiny_config, PROJECTIONS))
    adapters = _random_adapters(tiny_config, spec)
    base = hf_from_state(nnx.state(model, nnx.Param))
    results = []
    for axes, n, strategy in ((("fsdp",), 4, "fsdp"), (("tensor",), 2, "tp"), (("x",), 1, None)):
        mesh = Mesh(np.array(jax.devices()[:n]), axes)
        placed = jax.device_put(base, param_shardings(mesh, base, strategy))
        placed_adapters = jax.device_put(adapters, param_shardings(mesh, adapters, strategy))
        merged = lora_lib.merge(placed, placed_adapters, spec)
        q = "model.layers.self_attn.q_proj.weight"
        assert merged[q].sharding.is_equivalent_to(placed[q].sharding, 3)
        assert merged["model.norm.weight"] is placed["model.norm.weight"]  # untouched: no copy
        results.append({k: np.asarray(v) for k, v in merged.items()})
    for other in results[1:]:
        for name, value in results[0].items():
            np.testing.assert_array_equal(other[name], value, err_msg=name)
    w, a, b = (base["model.layers.mlp.up_proj.weight"],
               adapters["model.layers.mlp.up_proj.lora_A.weight"],
               adapters["model.layers.mlp.up_proj.lora_B.weight"])
    np.testing.assert_allclose(results[0]["model.layers.mlp.up_proj.weight"],
                               w + spec.scale * (a @ b), atol=1e-5)
    tokens, mask, positions = standard_batch()
    merged_model = init_random(tiny_config, seed=0, std=0.2)
    nnx.update(merged_model, state_from_hf(tiny_config, results[0]))
    attached = lora_lib.attach(model, spec, adapters)
    np.testing.assert_allclose(run(attached, tokens, positions, mask),
                               run(merged_model, tokens, positions, mask), atol=1e-4)


def test_dropout_is_a_function_of_its_key_and_off_without_one(tiny_config):
    from splitrl.models import abstract_model, init_random

    base = hf_from_state(nnx.state(init_random(tiny_config, seed=0, std=0.2), nnx.Param))
    spec = lora_lib.LoraSpec(4, 8.0, lora_lib.resolve_targets(tiny_config, PROJECTIONS), 0.5)
    adapters = _random_adapters(tiny_config, spec)
    graphdef = nnx.split(abstract_model(tiny_config))[0]
    tokens = jnp.arange(1, 9, dtype=jnp.int32)[None]

    @jax.jit
    def logits(adapters, key):
        model = nnx.merge(graphdef, state_from_hf(tiny_config, base))
        return lora_lib.attach(model, spec, adapters, key)(tokens)[0]

    @jax.jit
    def no_dropout(adapters):
        model = nnx.merge(graphdef, state_from_hf(tiny_config, base))
        return lora_lib.attach(model, spec, adapters)(tokens)[0]

    k0, k1 = jax.random.key(0), jax.random.key(1)
    np.testing.assert_array_equal(logits(adapters, k0), logits(adapters, k0))
    assert not np.allclose(logits(adapters, k0), logits(adapters, k1))
    assert not np.allclose(logits(adapters, k0), no_dropout(adapters))


def test_adapters_are_checked_by_name_and_shape(tiny_config):
    spec = lora_lib.LoraSpec(4, 8.0, ("model.layers.self_attn.q_proj",))
    good = lora_lib.init_adapters(tiny_config, spec)
    assert set(good) == {"model.layers.self_attn.q_proj.lora_A.weight",
                         "model.layers.self_attn.q_proj.lora_B.weight"}
    assert not good["model.layers.self_attn.q_proj.lora_B.weight"].any()  # B starts at 0
    bad = dict(good)
    bad["model.layers.self_attn.q_proj.lora_A.weight"] = np.zeros((2, 32, 8), np.float32)
    with pytest.raises(ValueError, match=r"lora_A.weight' has shape \[2, 32, 8\], expected "
                                         r"\[2, 32, 4\] \(rank 4\)"):
        lora_lib.check_adapters(tiny_config, spec, bad)
    with pytest.raises(ValueError, match="missing"):
        lora_lib.check_adapters(tiny_config, spec, {})
    with pytest.raises(ValueError, match="'model.norm' is not a Linear module"):
        lora_lib.LoraSpec(4, 8.0, ("model.norm",)).shapes(tiny_config)


def test_checkpoint_fingerprint_is_about_the_tensors_not_the_files(checkpoint, tmp_path):
    model = from_pretrained(checkpoint)
    save_pretrained(model, tmp_path / "one")
    save_pretrained(model, tmp_path / "sharded", max_shard_bytes=20_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    fingerprint = checkpoint_fingerprint(tmp_path / "one")
    assert fingerprint.startswith("sha256:")
    assert checkpoint_fingerprint(tmp_path / "sharded") == fingerprint
    assert checkpoint_fingerprint(checkpoint) == fingerprint  # transformers' own file
    state = hf_from_state(nnx.state(model, nnx.Param))
    state["model.norm.weight"] = state["model.norm.weight"].at[0].add(1e-6)
    nnx.update(model, state_from_hf(model.config, state))
    save_pretrained(model, tmp_path / "other")
    assert checkpoint_fingerprint(tmp_path / "other") != fingerprint


def test_lora_factors_transpose_at_the_checkpoint_boundary():
    from splitrl.models.params import to_torch_layout

    a = np.zeros((32, 4))
    assert to_torch_layout("model.layers.0.self_attn.q_proj.lora_A.weight", a).shape == (4, 32)
    assert to_torch_layout("lm_head.lora_B.weight", np.zeros((4, 97))).shape == (97, 4)
