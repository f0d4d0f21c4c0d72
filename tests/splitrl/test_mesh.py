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
