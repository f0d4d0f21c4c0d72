"""The committed protobuf/gRPC modules are exactly what `make protos` generates now."""

from __future__ import annotations

from splitrl import protogen


def test_generated_modules_are_current(tmp_path):
    fresh = {p.name: p.read_bytes() for p in protogen.generate(tmp_path)}
    committed = {
        p.name: p.read_bytes() for p in sorted(protogen.GENERATED_DIR.glob("*_pb2*.py*"))
    }
    assert fresh, "protoc generated nothing"
    assert sorted(fresh) == sorted(committed), "generated file set differs: run `make protos`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"out of date with protos/: {stale}; run `make protos`"


def test_services_expose_the_designed_methods():
    from splitrl.v1 import reward_pb2, sampler_pb2, trainer_pb2

    sampler = sampler_pb2.DESCRIPTOR.services_by_name["Sampler"]
    methods = {m.name: m for m in sampler.methods}
    assert set(methods) >= {"GetInfo", "PushWeights", "Rollout", "Generate"}
    assert methods["PushWeights"].client_streaming and not methods["PushWeights"].server_streaming
    assert methods["Rollout"].server_streaming and not methods["Rollout"].client_streaming
    reward = reward_pb2.DESCRIPTOR.services_by_name["Reward"]
    assert {m.name for m in reward.methods} >= {"Score", "ListRewardFunctions"}
    trainer = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"]
    assert "Status" in {m.name for m in trainer.methods}


def test_tensor_chunk_carries_the_wire_fields():
    from splitrl.v1 import tensor_pb2

    fields = set(tensor_pb2.TensorChunk.DESCRIPTOR.fields_by_name)
    assert fields >= {"name", "dtype", "shape", "offset", "data", "checksum", "version"}
