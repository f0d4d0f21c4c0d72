"""Adapter pushes from the trainer's publisher to real sampler processes (LoRA runs): a relay
chain over the bulk data plane and a gRPC-only sampler both end serving exactly the trainer's
merged weights, pushes carry the adapters' bytes only, and samplers of another base checkpoint
(or keeping none) are refused at registration with the reason.

Three sampler processes (2 emulated devices each, tensor parallel, float32, ``model.lora`` set so
they keep their base); this process is the trainer (adapters and base fsdp over 4 devices).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from splitrl import wire
from splitrl.config import PushConfig, ServicesConfig
from splitrl.mesh import param_shardings
from splitrl.models import lora as lora_lib
from splitrl.models.hf_io import checkpoint_fingerprint
from splitrl.serving import make_channel
from splitrl.v1 import sampler_pb2, sampler_pb2_grpc
from tests.sampler_service.sampler_helpers import SamplerProcess
from trainer_service.orchestration.identity import ModelIdentity
from trainer_service.orchestration.membership import SamplerPool
from trainer_service.orchestration.publisher import WeightPublisher

pytestmark = pytest.mark.slow  # three sampler processes


@pytest.fixture(scope="module")
def samplers(tmp_path_factory, arith_model):
    """Two samplers with the bulk data plane and one with gRPC only."""
    directory = tmp_path_factory.mktemp("samplers")

    def start(i):
        cfg = {
            "model": {"path": str(arith_model), "lora": {"rank": 4}},
            "sampler": {"max_batch_size": 4, "max_sequence_length": 32,
                        "max_chunk_bytes": 16 * 1024, "push_idle_timeout_s": 20,
                        "mesh": {"axes": {"tensor": 2}, "strategy": "tp"},
                        "data_port": 0 if i < 2 else None,
                        "register_with_trainer": False, "shutdown_grace_s": 1},
            "services": {"host": "127.0.0.1", "sampler_port": 0, "reward_address": ""},
            "trainer": {"steps": 100},
        }
        path = directory / f"sampler-{i}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return SamplerProcess(path, devices=2)

    with ThreadPoolExecutor(3) as pool:
        procs = list(pool.map(start, range(3)))
    yield procs
    for proc in procs:
        proc.stop()


@pytest.fixture(scope="module")
def trainer(arith_model):
    """The trainer's base (float32, fsdp over 4), spec and fingerprint."""
    from flax import nnx

    from splitrl.models import from_pretrained, hf_from_state

    model = from_pretrained(arith_model, jnp.float32)
    mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    flat = hf_from_state(nnx.state(model, nnx.Param))
    base = jax.device_put(flat, param_shardings(mesh, flat, "fsdp"))
    spec = lora_lib.LoraSpec(4, 8.0, lora_lib.resolve_targets(model.config,
                                                              lora_lib.ALL_PROJECTIONS))
    return base, spec, checkpoint_fingerprint(arith_model), model.config, mesh


def _info(proc, digests=False) -> sampler_pb2.SamplerInfo:
    with make_channel(proc.address) as channel:
        return sampler_pb2_grpc.SamplerStub(channel).GetInfo(
            sampler_pb2.GetInfoRequest(include_digests=digests), timeout=60)


def _adapters(config, spec, mesh, seed):
    rng = np.random.default_rng(seed)
    host = {n: (0.05 * rng.standard_normal(a.shape)).astype(np.float32)
            for n, a in lora_lib.init_adapters(config, spec).items()}
    return jax.device_put(host, param_shardings(mesh, host, "fsdp"))


def test_adapter_pushes_serve_the_trainers_merge_bitwise_over_both_transports(samplers, trainer):
    base, spec, fingerprint, config, mesh = trainer
    identity = ModelIdentity.of(_info(samplers[0]).architecture, base, fingerprint)
    pool = SamplerPool(ServicesConfig(sampler_addresses=[p.address for p in samplers],
                                      sampler_timeout_s=300), max_message_bytes=1 << 22,
                       identity=identity)
    pool.refresh()
    assert len(pool.all()) == 3  # all three keep this base
    publisher = WeightPublisher(pool, push=PushConfig(timeout_s=120), lora=spec,
                                base_fingerprint=fingerprint)
    adapter_bytes = sum(4 * int(np.prod(s)) for s in spec.shapes(config).values())
    full_bytes = sum(a.nbytes for a in base.values())
    try:
        for version, seed, reset in ((1, 1, False), (2, 2, False), (1, 1, True)):
            adapters = _adapters(config, spec, mesh, seed)
            results = publisher.push_all(adapters, version, reset=reset)
            assert all(r.ok for r in results), [r.error for r in results]
            assert {r.transport for r in results} == {"bulk", "grpc"}
            assert all(r.bytes == adapter_bytes and r.full_bytes == adapter_bytes
                       for r in results)
            want = {n: wire.array_digest(np.asarray(a))
                    for n, a in lora_lib.merge(base, adapters, spec).items()}
            for proc in samplers:
                info = _info(proc, digests=True)
                assert info.weight_version == version
                assert {p.name: p.digest for p in info.params} == want, proc.address
        # Bulk: one relay chain, the trainer sends the adapters once for both.
        bulk = [r for r in results if r.transport == "bulk"]
        assert sum(r.egress_bytes > 0 for r in bulk) == 1
    finally:
        publisher.close()
        pool.stop()
    print(f"\nadapter push {adapter_bytes} bytes vs full push {full_bytes} bytes "
          f"({adapter_bytes / full_bytes:.3f})")


def test_samplers_of_another_base_or_keeping_none_are_refused_with_the_reason(samplers,
                                                                             trainer):
    base, _, fingerprint, _, _ = trainer
    info = _info(samplers[0])
    assert info.base_fingerprint == fingerprint
    ours = ModelIdentity.of(info.architecture, base, fingerprint)
    assert ours.mismatch(info) is None
    other = ModelIdentity.of(info.architecture, base, "sha256:" + "0" * 64)
    reason = other.mismatch(info)
    assert "base checkpoint differs from the trainer's" in reason
    assert fingerprint[:19] in reason and "model.path" in reason
    info.base_fingerprint = ""
    assert "keeps no base checkpoint" in ours.mismatch(info)
    # Without LoRA the base does not matter: a full push replaces every weight.
    assert ModelIdentity.of(info.architecture, base).mismatch(info) is None
