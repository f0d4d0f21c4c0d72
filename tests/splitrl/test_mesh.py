"""Meshes from config and partition rules, on 8 emulated CPU devices (see conftest)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from splitrl.config import ConfigError, MeshConfig
from splitrl.mesh import (
    build_mesh,
    param_shardings,
    partition_spec,
    select_devices,
    spec_to_strings,
    strings_to_spec,
)

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 emulated devices")

# A Qwen2-like layer in the models' [in, out] layout: hidden 64, 4 heads of 16, 2 kv heads, mlp 128.
SHAPES = {
    "model.embed_tokens.weight": (512, 64),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.layers.0.self_attn.q_proj.bias": (64,),
    "model.layers.0.self_attn.k_proj.weight": (64, 32),
    "model.layers.0.self_attn.o_proj.weight": (64, 64),
    "model.layers.0.mlp.gate_proj.weight": (64, 128),
    "model.layers.0.mlp.down_proj.weight": (128, 64),
    "model.layers.0.input_layernorm.weight": (64,),
    "model.norm.weight": (64,),
    "lm_head.weight": (64, 512),
}


def test_axes_and_fill_axis():
    mesh = build_mesh(MeshConfig(axes={"fsdp": -1}))
    assert mesh.axis_names == ("fsdp",) and mesh.devices.shape == (8,)
    mesh = build_mesh(MeshConfig(axes={"fsdp": 2, "tensor": -1}))
    assert dict(zip(mesh.axis_names, mesh.devices.shape, strict=True)) == {"fsdp": 2, "tensor": 4}


def test_fraction_and_offset_split_the_host():
    trainer = build_mesh(MeshConfig(axes={"fsdp": -1}, device_fraction=0.5))
    sampler = build_mesh(
        MeshConfig(axes={"tensor": -1}, device_fraction=0.25, device_offset=4, strategy="tp")
    )
    trainer_ids = {d.id for d in trainer.devices.flat}
    sampler_ids = {d.id for d in sampler.devices.flat}
    assert len(trainer_ids) == 4 and len(sampler_ids) == 2
    assert not trainer_ids & sampler_ids
    assert sampler_ids == {jax.devices()[4].id, jax.devices()[5].id}


def test_bad_mesh_configs_say_why():
    with pytest.raises(ConfigError, match="need 6 devices but 8"):
        build_mesh(MeshConfig(axes={"fsdp": 2, "tensor": 3}))
    with pytest.raises(ConfigError, match="exceeds the 8 devices"):
        select_devices(MeshConfig(axes={"fsdp": -1}, device_fraction=0.5, device_offset=6))


def test_fsdp_shards_the_largest_dimension():
    mesh = build_mesh(MeshConfig(axes={"fsdp": 4}, device_fraction=0.5))
    specs = {n: partition_spec(n, s, mesh) for n, s in SHAPES.items()}
    assert specs["model.embed_tokens.weight"] == P("fsdp", None)
    assert specs["model.layers.0.mlp.gate_proj.weight"] == P(None, "fsdp")
    assert specs["model.layers.0.mlp.down_proj.weight"] == P("fsdp", None)
    assert specs["lm_head.weight"] == P(None, "fsdp")
    # Vectors stay whole: sharding them saves nothing and costs a gather.
    assert specs["model.norm.weight"] == P(None)
    assert specs["model.layers.0.self_attn.q_proj.bias"] == P(None)


def test_tensor_parallel_is_megatron_style():
    mesh = build_mesh(MeshConfig(axes={"tensor": 2}, device_fraction=0.25, strategy="tp"))
    specs = {n: partition_spec(n, s, mesh) for n, s in SHAPES.items()}
    assert specs["model.layers.0.self_attn.q_proj.weight"] == P(None, "tensor")  # column
    assert specs["model.layers.0.self_attn.q_proj.bias"] == P("tensor")
    assert specs["model.layers.0.self_attn.o_proj.weight"] == P("tensor", None)  # row
    assert specs["model.layers.0.mlp.down_proj.weight"] == P("tensor", None)
    assert specs["model.embed_tokens.weight"] == P("tensor", None)  # vocab
    assert specs["lm_head.weight"] == P(None, "tensor")
    assert specs["model.layers.0.input_layernorm.weight"] == P(None)


def test_two_dimensional_mesh_uses_both_axes_and_skips_indivisible_dims():
    mesh = build_mesh(MeshConfig(axes={"fsdp": 2, "tensor": 4}))
    spec = partition_spec("model.layers.0.mlp.gate_proj.weight", (64, 128), mesh)
    assert spec == P("fsdp", "tensor")
    # 30 output features do not divide by 4 tensor shards: that dim stays whole.
    spec = partition_spec("model.layers.0.self_attn.k_proj.weight", (64, 30), mesh)
    assert spec == P("fsdp", None)


def test_stacked_layer_parameters_keep_the_layer_axis_whole():
    """The models stack their decoder layers on a leading axis (and scan over it): every layer
    is laid out as one layer alone would be, even where the layer axis would divide best."""
    mesh = build_mesh(MeshConfig(axes={"fsdp": 2, "tensor": 4}))
    for name, shape in SHAPES.items():
        if not name.startswith("model.layers.0."):
            continue
        stacked = name.replace("model.layers.0.", "model.layers.")
        one = partition_spec(name, shape, mesh)
        assert partition_spec(stacked, (1024, *shape), mesh) == P(None, *one), name
    # fsdp takes the largest free dimension after the layer axis, never the layer axis
    spec = partition_spec("model.layers.input_layernorm.weight", (64, 64), mesh)
    assert spec == P(None, None)


def test_shardings_place_arrays_as_specified():
    mesh = build_mesh(MeshConfig(axes={"fsdp": 2, "tensor": 4}))
    shardings = param_shardings(mesh, SHAPES)
    name = "model.layers.0.mlp.gate_proj.weight"
    x = jax.device_put(np.arange(64 * 128, dtype=np.float32).reshape(64, 128), shardings[name])
    assert x.sharding.spec == P("fsdp", "tensor")
    assert {s.data.shape for s in x.addressable_shards} == {(32, 32)}
    np.testing.assert_array_equal(np.asarray(x), np.arange(64 * 128).reshape(64, 128))


def test_spec_strings_round_trip():
    for spec, ndim in [(P("fsdp", None), 2), (P(None, ("fsdp", "tensor")), 2), (P(), 3)]:
        text = spec_to_strings(spec, ndim)
        assert len(text) == ndim
        assert strings_to_spec(text) == P(*(list(spec) + [None] * (ndim - len(spec))))


# SmolLM2-135M's attention shape (9 query heads, 3 kv heads), scaled down: a tensor axis of 2
# or 4 divides neither head count. GSPMD keeps the maths of a split that cuts
# through a head (XLA reshards where the heads are formed), and the sampler's KV cache keeps
# kv heads whole (replicated) when the tensor axis does not divide them: every layout serves
# and trains the same model.
NINE_HEADS = dict(family="llama", vocab_size=96, hidden_size=72, intermediate_size=64,
                  num_layers=2, num_heads=9, num_kv_heads=3, head_dim=8,
                  tie_word_embeddings=True)
HEAD_LAYOUTS = [{"tensor": 1}, {"tensor": 2}, {"fsdp": 2, "tensor": 4}]


def _nine_head_model():
    from splitrl.models import TransformerConfig, init_random

    return init_random(TransformerConfig(**NINE_HEADS), seed=0, std=0.3)


def test_sampler_serves_nine_query_three_kv_heads_on_tensor_axes_that_do_not_divide_them():
    from flax import nnx

    from sampler_service.engine import GenerationEngine
    from sampler_service.sampling import SamplingOptions

    model = _nine_head_model()
    graphdef, state = nnx.split(model)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    tokens = {}
    for axes in HEAD_LAYOUTS:
        mesh = build_mesh(MeshConfig(axes=axes), jax.devices()[:int(np.prod([*axes.values()]))])
        engine = GenerationEngine(model.config, graphdef, mesh=mesh, max_batch_size=4,
                                  max_sequence_length=32, eos_token_ids=(), segment_steps=4)
        try:
            out = engine.generate(engine.place_state(state), prompts,
                                  SamplingOptions(greedy=True, max_new_tokens=8))
        finally:
            engine.close()
        tokens[str(axes)] = [list(o[0].token_ids) for o in out]
    assert len({str(t) for t in tokens.values()}) == 1, tokens


def test_trainer_trains_nine_query_three_kv_heads_on_tensor_axes_that_do_not_divide_them():
    from splitrl.config import AlgorithmConfig, OptimizerConfig
    from trainer_service.learning.learner import Learner, TrainBatch

    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 96, (4, 8)).astype(np.int32)
    completion = np.zeros((4, 8), bool)
    completion[:, 4:] = True
    batch = TrainBatch(tokens=tokens, attention_mask=np.ones((4, 8), bool),
                       completion_mask=completion, sampler_logprobs=np.zeros((4, 8), np.float32),
                       advantages=np.array([1.0, -1.0, 0.5, -0.5], np.float32),
                       group_ids=np.array([0, 0, 1, 1]), rewards=np.array([1.0, 0, 1, 0]))
    results = []
    for axes in HEAD_LAYOUTS:
        mesh = build_mesh(MeshConfig(axes=axes), jax.devices()[:int(np.prod([*axes.values()]))])
        learner = Learner(_nine_head_model(), algorithm=AlgorithmConfig(loss="grpo"),
                          optimizer=OptimizerConfig(lr=1e-2), mesh=mesh)
        logprobs = learner.logprobs(batch)
        batch.sampler_logprobs = logprobs
        metrics = learner.train_step(batch)
        results.append((logprobs, metrics["loss"], metrics["grad_norm"]))
    for logprobs, loss, grad_norm in results[1:]:
        np.testing.assert_allclose(logprobs, results[0][0], atol=1e-5)
        np.testing.assert_allclose([loss, grad_norm], results[0][1:], rtol=1e-4, atol=1e-6)
