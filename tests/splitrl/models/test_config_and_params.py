"""Config parsing, HF-name parameter views, and clear errors for bad configs and checkpoints."""

from __future__ import annotations

import dataclasses
import gc
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_CONFIGS, VOCAB
from flax import nnx
from safetensors.numpy import load_file, save_file

from splitrl import models


def _hf_dict(name, **overrides):
    d = dict(HF_CONFIGS[name])
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[d["model_type"]]
    return {"architectures": [arch], **d, **overrides}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_config_round_trips_through_hf_dict(name):
    config = models.TransformerConfig.from_hf_dict(_hf_dict(name))
    assert models.TransformerConfig.from_hf_dict(config.to_hf_dict()) == config
    assert hash(config) == hash(models.TransformerConfig.from_hf_dict(config.to_hf_dict()))


def test_legacy_rope_fields_parse_like_v5_rope_parameters():
    v5 = _hf_dict("llama3_gqa_untied")
    legacy = dict(v5)
    params = dict(legacy.pop("rope_parameters"))
    legacy["rope_theta"] = params.pop("rope_theta")
    legacy["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in params.items()}
    a = models.TransformerConfig.from_hf_dict(v5)
    assert a == models.TransformerConfig.from_hf_dict(legacy)
    assert a.rope_scaling == models.RopeScaling(4.0, 1.0, 4.0, 8)
    assert a.rope_theta == 500000.0 and a.head_dim == 8 and a.num_kv_heads == 2


def test_family_switches():
    qwen2 = models.TransformerConfig.from_hf_dict(_hf_dict("qwen2_bias_tied_mha"))
    assert (qwen2.attention_bias, qwen2.attention_out_bias, qwen2.qk_norm) == (True, False, False)
    qwen3 = models.TransformerConfig.from_hf_dict(_hf_dict("qwen3_qknorm_gqa_untied"))
    assert qwen3.qk_norm and qwen3.head_dim == 16 and qwen3.hidden_size == 32
    llama = models.TransformerConfig.from_hf_dict(
        _hf_dict("llama3_gqa_untied", attention_bias=True, eos_token_id=[5, 6]))
    assert llama.attention_bias and llama.attention_out_bias and llama.eos_token_id == (5, 6)
    plain = models.TransformerConfig.from_hf_dict(
        _hf_dict("llama3_gqa_untied", attention_bias=False))
    assert not plain.attention_bias and not plain.attention_out_bias
    assert llama.to_hf_dict()["eos_token_id"] == [5, 6]


@pytest.mark.parametrize(("overrides", "field"), [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "architectures"),
    ({"architectures": None, "model_type": "gpt2"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 2.0}},
     "low_freq_factor"),
    ({"vocab_size": None}, "vocab_size"),
    ({"num_key_value_heads": 3}, "num_kv_heads"),
])
def test_unsupported_config_fields_raise_naming_the_field(overrides, field):
    d = _hf_dict("llama3_gqa_untied", **overrides)
    if d.get("vocab_size", 0) is None:
        del d["vocab_size"]
    with pytest.raises(ValueError, match=field):
        models.TransformerConfig.from_hf_dict(d)


def test_state_round_trips_through_hf_names(tiny_config):
    model = models.init_random(tiny_config, seed=1)
    flat = models.hf_from_state(nnx.state(model))
    assert list(flat) == models.param_names(model)
    # decoder layers stacked on a leading layer axis, Linear weights [in, out]
    assert flat["model.layers.self_attn.q_proj.weight"].shape == (2, 32, 32)
    assert flat["model.layers.self_attn.k_proj.weight"].shape == (2, 32, 16)
    assert flat["model.layers.input_layernorm.weight"].shape == (2, 32)
    assert flat["lm_head.weight"].shape == (32, 97)
    assert flat["model.embed_tokens.weight"].shape == (97, 32)
    state = models.state_from_hf(tiny_config, {k: np.asarray(v) for k, v in flat.items()})
    again = models.hf_from_state(state)
    for k, v in flat.items():
        np.testing.assert_array_equal(again[k], v)

    other = models.init_random(tiny_config, seed=2)
    models.load_hf_state_dict(other, models.hf_state_dict(model))
    for k, v in models.hf_from_state(nnx.state(other)).items():
        np.testing.assert_array_equal(v, flat[k])
    torch_layout = models.hf_state_dict(model)
    assert torch_layout["lm_head.weight"].shape == (97, 32)  # HF [out, in]
    # one tensor per layer, as HF checkpoints hold them
    np.testing.assert_array_equal(torch_layout["model.layers.1.self_attn.q_proj.weight"],
                                  np.asarray(flat["model.layers.self_attn.q_proj.weight"][1]).T)
    assert not any(k.startswith("model.layers.self_attn") for k in torch_layout)


def test_a_flat_view_of_a_state_leaves_no_garbage_holding_its_arrays(tiny_config):
    """A sampler reads its served state flat often; a reference cycle per read would keep
    retired weights (and the staging buffers they alias) alive until a full collection."""
    state = nnx.state(models.init_random(tiny_config))
    gc.collect()
    gc.disable()
    try:
        flat = models.hf_from_state(state)
        del flat
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_layer_views_hold_no_copy_and_run_the_scans_forward(tiny_config):
    """On CPU each layer's weights apart (what the sampler's CPU programs read) are views of
    the stacked arrays' memory, held once; the forward unrolled over them gives the scan's
    hidden states."""
    model = models.init_random(tiny_config, seed=0)
    stacked = nnx.state(model.model.layers)
    views = models.layer_views(stacked, tiny_config.num_layers)
    for whole, *layers in zip(jax.tree.leaves(stacked), *map(jax.tree.leaves, views),
                              strict=True):
        for i, layer in enumerate(layers):
            np.testing.assert_array_equal(layer, whole[i])
            offset = i * whole.nbytes // whole.shape[0]
            assert layer.unsafe_buffer_pointer() == whole.unsafe_buffer_pointer() + offset
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 5)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    mask = models.causal_mask(jnp.arange(5), jnp.arange(5), jnp.ones((2, 5), bool))

    @jax.jit
    def hidden(views):
        return model.forward_with(tokens, positions, models.DenseAttention(mask),
                                  layers=views)[0]

    np.testing.assert_allclose(hidden(views), hidden(None), rtol=1e-6, atol=1e-6)


def test_layer_views_of_an_array_not_one_shard_per_device_name_it_and_its_devices():
    """The sampler once failed on every generation step with only "Expected 2 per-device
    arrays ... got 4" to go by (two threads had built a served array's shard list at once,
    see the sampler's WeightStore). An array placed on a mesh listing a device twice has such
    shards too (4 shards, 2 devices); the error names the parameter, its sharding and the
    devices of its shards instead."""
    first, second = jax.devices()[:2]
    mesh = jax.sharding.Mesh(np.array([first, second, first, second]), ("tensor",))
    stacked = jax.make_array_from_callback(
        (3, 4), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
        lambda index: np.ones((3, 4), np.float32)[index])
    with pytest.raises(ValueError, match=(
            rf"layer_views: \['self_attn'\]\['w'\] \(shape \(3, 4\), float32\) has 4 shards on "
            rf"devices \[{first.id}, {first.id}, {second.id}, {second.id}\], but its sharding "
            r"NamedSharding\(mesh=Mesh\('tensor': 4")):
        models.layer_views({"self_attn": {"w": stacked}}, 3)


def test_state_from_hf_rejects_bad_names_and_shapes(tiny_config):
    flat = models.hf_from_state(nnx.state(models.init_random(tiny_config)))
    missing = {k: v for k, v in flat.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"missing \[model.norm.weight\]"):
        models.state_from_hf(tiny_config, missing)
    with pytest.raises(ValueError, match=r"unexpected \[model.layers.9.mlp.up_proj.weight\]"):
        models.state_from_hf(tiny_config, {**flat, "model.layers.9.mlp.up_proj.weight": 0})
    wrong = {**flat, "model.layers.mlp.up_proj.weight": jnp.zeros((2, 48, 32))}
    with pytest.raises(ValueError, match=r"up_proj.weight.*\(2, 48, 32\).*expected \(2, 32, 48\)"):
        models.state_from_hf(tiny_config, wrong)


def test_state_from_hf_casts_to_param_dtype(tiny_config):
    flat = models.hf_from_state(nnx.state(models.init_random(tiny_config)))
    state = models.state_from_hf(tiny_config, flat, param_dtype=jnp.bfloat16)
    assert {v.dtype for v in models.hf_from_state(state).values()} == {jnp.dtype(jnp.bfloat16)}


@pytest.fixture
def checkpoint(tiny_config, tmp_path):
    models.save_pretrained(models.init_random(tiny_config), tmp_path)
    return tmp_path


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_checkpoint_missing_a_weight_names_it(checkpoint):
    _rewrite(checkpoint, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"missing \[model.layers.1.mlp.down_proj.weight\]"):
        models.from_pretrained(checkpoint)


def test_checkpoint_with_wrong_shape_names_tensor_and_shapes(checkpoint):
    def edit(t):
        t["model.layers.0.self_attn.v_proj.weight"] = np.zeros((8, 32), np.float32)

    _rewrite(checkpoint, edit)
    with pytest.raises(ValueError, match=r"v_proj.weight' has shape \(8, 32\), expected \(16, 32"):
        models.from_pretrained(checkpoint)


def test_checkpoint_with_unknown_tensor_names_it(checkpoint):
    _rewrite(checkpoint, lambda t: t.update({"model.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match=r"unexpected \[model.extra.weight\]"):
        models.from_pretrained(checkpoint)


def test_checkpoint_with_unknown_architecture_is_rejected(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["architectures"] = ["GemmaForCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GemmaForCausalLM"):
        models.from_pretrained(checkpoint)


def test_missing_files_raise_file_not_found(tmp_path, tiny_config):
    with pytest.raises(FileNotFoundError, match="config.json"):
        models.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config.to_hf_dict()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        models.from_pretrained(tmp_path)


def test_tied_checkpoint_with_redundant_lm_head_loads(tiny_config, tmp_path):
    config = dataclasses.replace(tiny_config, tie_word_embeddings=True)
    models.save_pretrained(models.init_random(config), tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
    model = models.from_pretrained(tmp_path)
    assert model.lm_head is None


def test_from_pretrained_places_each_tensor_on_its_sharding(checkpoint, tiny_config):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))

    def spec(shape):  # the last two dims (a stacked layer axis stays whole)
        axes = (None,) * (len(shape) - 2) + ("fsdp", "tensor")[:len(shape)]
        return PartitionSpec(*(a if d % 2 == 0 else None for a, d in zip(axes, shape, strict=True)))

    shardings = {name: NamedSharding(mesh, spec(s.shape))
                 for name, s in models.param_shapes(tiny_config).items()}
    sharded = models.from_pretrained(checkpoint, shardings=shardings)
    plain = models.from_pretrained(checkpoint)
    reference = models.hf_from_state(nnx.state(plain))
    for name, value in models.hf_from_state(nnx.state(sharded)).items():
        assert value.sharding == shardings[name], name
        np.testing.assert_array_equal(value, reference[name])
