"""WeightStore with LoRA adapter pushes (in-process, 2 devices tensor parallel): adapters merged
into the kept base bitwise as the trainer merges them, versioned and atomic; pushes for another
base, to a store that kept none, or with non-finite adapters are refused and change nothing."""

from __future__ import annotations

import grpc
import jax
import numpy as np
import pytest
from flax import nnx
from sampler_helpers import tiny_config

from sampler_service.weights import WeightStore
from splitrl import wire
from splitrl.mesh import param_shardings
from splitrl.models import hf_from_state, init_random
from splitrl.models import lora as lora_lib
from splitrl.v1 import sampler_pb2
from splitrl.wire import WireError

MAX_CHUNK = 1024
BASE = "sha256:base-of-this-run"


@pytest.fixture(scope="module")
def config():
    return tiny_config()


@pytest.fixture(scope="module")
def base(config):
    return hf_from_state(nnx.state(init_random(config, seed=0, std=0.1), nnx.Param))


@pytest.fixture(scope="module")
def spec(config):
    return lora_lib.LoraSpec(4, 8.0, lora_lib.resolve_targets(config, lora_lib.ALL_PROJECTIONS))


def _store(config, base, keep=True):
    mesh = jax.make_mesh((2,), ("tensor",), devices=jax.devices()[:2])
    state = nnx.state(init_random(config, seed=0, std=0.1))
    store = WeightStore.from_state(config, state, mesh, strategy="tp", max_chunk_bytes=MAX_CHUNK)
    if keep:
        store.keep_base(BASE)
    return store


def _adapters(config, spec, seed):
    rng = np.random.default_rng(seed)
    return {n: (0.1 * rng.standard_normal(a.shape)).astype(np.float32)
            for n, a in lora_lib.init_adapters(config, spec).items()}


def _push(adapters, version, spec, fingerprint=BASE, **kw):
    messages = list(wire.iter_push_messages(adapters, version, max_chunk_bytes=MAX_CHUNK, **kw))
    messages[0].header.lora.CopyFrom(wire.adapter_header(spec, fingerprint))
    return iter(messages)


def _trainer_merge(base, adapters, spec):
    """What the trainer serves: its own merge on its own mesh (fsdp over 4)."""
    mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    placed = jax.device_put(base, param_shardings(mesh, base, "fsdp"))
    merged = lora_lib.merge(placed, jax.device_put(adapters, param_shardings(mesh, adapters)),
                            spec)
    return {n: wire.array_digest(np.asarray(a)) for n, a in merged.items()}


def test_adapter_pushes_serve_the_base_with_adapters_merged_bitwise(config, base, spec):
    store = _store(config, base)
    _, checkpoint_state = store.snapshot()
    first = _adapters(config, spec, 1)
    result = store.apply_push(_push(first, 1, spec))
    assert result.version == 1 and store.version == 1
    assert result.bytes_received == sum(a.nbytes for a in first.values())
    assert store.digests() == _trainer_merge(base, first, spec)
    _, served = store.snapshot()
    flat = hf_from_state(served)
    q = "model.layers.self_attn.q_proj.weight"
    assert flat[q].sharding == store.shardings[q]  # merged on the sampler's own layout
    assert flat["model.norm.weight"] is hf_from_state(checkpoint_state)["model.norm.weight"]
    # The next push merges into the base again (not into version 1's weights); a reset rolls
    # back to exactly version 1.
    second = _adapters(config, spec, 2)
    store.apply_push(_push(second, 2, spec))
    assert store.digests() == _trainer_merge(base, second, spec)
    store.apply_push(_push(first, 1, spec, reset=True))
    assert store.version == 1 and store.digests() == _trainer_merge(base, first, spec)


def _refused(store, messages, code) -> str:
    before_version, before = store.version, store.digests()
    with pytest.raises(WireError) as info:
        store.apply_push(messages)
    assert info.value.code == code, info.value
    assert store.version == before_version and store.digests() == before
    return info.value.message


def test_pushes_for_another_base_or_without_one_are_refused(config, base, spec):
    adapters = _adapters(config, spec, 3)
    store = _store(config, base)
    message = _refused(store, _push(adapters, 1, spec, fingerprint="sha256:another"),
                       grpc.StatusCode.FAILED_PRECONDITION)
    assert "for the base checkpoint sha256:another" in message and BASE in message
    no_base = _store(config, base, keep=False)
    message = _refused(no_base, _push(adapters, 1, spec), grpc.StatusCode.FAILED_PRECONDITION)
    assert "keeps no base checkpoint" in message and "model.lora" in message


def test_malformed_adapter_pushes_change_nothing(config, base, spec):
    store = _store(config, base)
    adapters = _adapters(config, spec, 4)
    bad = dict(adapters)
    bad["model.layers.mlp.up_proj.lora_B.weight"] = np.full_like(
        adapters["model.layers.mlp.up_proj.lora_B.weight"], np.nan)
    message = _refused(store, _push(bad, 1, spec), grpc.StatusCode.INVALID_ARGUMENT)
    assert "non-finite" in message and "up_proj.lora_B.weight" in message
    wrong_rank = lora_lib.LoraSpec(8, 8.0, spec.targets)
    message = _refused(store, _push(adapters, 1, wrong_rank), grpc.StatusCode.INVALID_ARGUMENT)
    assert "header.total_bytes is 16384, expected 32768" in message  # rank 8's adapters
    unknown = sampler_pb2.LoraAdapters(rank=4, alpha=8.0, target_modules=["model.norm"],
                                       base_fingerprint=BASE)
    messages = list(wire.iter_push_messages(adapters, 1, max_chunk_bytes=MAX_CHUNK))
    messages[0].header.lora.CopyFrom(unknown)
    message = _refused(store, iter(messages), grpc.StatusCode.INVALID_ARGUMENT)
    assert "header.lora" in message and "'model.norm' is not a Linear module" in message
    # A sampler that never applies a push keeps serving the checkpoint's weights.
    assert store.version == 0 and store.weights_id == ""
