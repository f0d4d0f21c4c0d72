"""WeightStore: verified, staged, atomic weight intake (in-process, one device unless a test
says otherwise)."""

from __future__ import annotations

import gc
import threading

import grpc
import jax
import numpy as np
import pytest
from flax import nnx
from sampler_helpers import tiny_config

from sampler_service.weights import WeightStore
from splitrl import wire
from splitrl.models import hf_from_state, init_random
from splitrl.v1 import sampler_pb2
from splitrl.wire import WireError

MAX_CHUNK = 1024


@pytest.fixture(scope="module")
def config():
    return tiny_config()


@pytest.fixture(scope="module")
def initial_state(config):
    return nnx.state(init_random(config, seed=0, std=0.1))


@pytest.fixture()
def store(config, initial_state):
    mesh = jax.make_mesh((1,), ("tensor",))
    return WeightStore.from_state(config, initial_state, mesh, strategy="tp",
                                  max_chunk_bytes=MAX_CHUNK)


def _new_params(config, seed=1):
    """Random weights with the model's names, shapes and dtypes (host arrays)."""
    rng = np.random.default_rng(seed)
    from splitrl.models import param_shapes

    return {n: rng.standard_normal(s.shape).astype(s.dtype)
            for n, s in param_shapes(config).items()}


def _messages(params, version, **kw):
    return list(wire.iter_push_messages(params, version, max_chunk_bytes=MAX_CHUNK, **kw))


def _rejected(store, messages, code):
    before_version, before = store.version, store.digests()
    with pytest.raises(WireError) as info:
        store.apply_push(iter(messages))
    assert info.value.code == code, info.value
    assert store.version == before_version
    assert store.digests() == before
    return info.value.message


def test_push_swaps_in_bitwise_equal_weights_with_the_stores_shardings(store, config):
    params = _new_params(config)
    _, old_state = store.snapshot()
    result = store.apply_push(iter(_messages(params, 1)))
    assert result.version == 1 and store.version == 1
    assert result.bytes_received == sum(a.nbytes for a in params.values())
    version, state = store.snapshot()
    flat = hf_from_state(state)
    for name, array in params.items():
        assert np.asarray(flat[name]).tobytes() == array.tobytes(), name
        assert flat[name].sharding == store.shardings[name]
    assert store.digests() == {n: wire.array_digest(a) for n, a in params.items()}
    # The snapshot taken before the push still holds the old weights.
    assert hf_from_state(old_state)["model.norm.weight"] is not flat["model.norm.weight"]


def _shards_read_with_a_second_reader_inside(array: jax.Array) -> int:
    """How many shards ``array`` has after a read of them during which a second reader of the
    same array runs, started by a garbage collection inside the first read (a gen-0
    collection at every allocation): what a thread switch at that point does, every time."""
    ran: list[bool] = []

    def second_reader(phase, _info):
        if phase == "start" and not ran:
            ran.append(True)
            len(array.addressable_shards)

    thresholds = gc.get_threshold()
    gc.callbacks.append(second_reader)
    gc.set_threshold(1)
    try:
        len(array.addressable_shards)
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(second_reader)
    return len(array.addressable_shards)


def test_served_arrays_keep_one_shard_per_device_when_two_readers_meet(config, initial_state):
    """jaxlib builds an array's list of per-device arrays on the first read of its shards,
    unguarded: a second reader running in the middle of that build adds every device's buffer
    again. A sampler's two batches once made the layer views of a just-pushed state at once
    and failed with "has 4 shards on devices [0, 0, 1, 1]" until the next push. The store
    builds the lists before any other thread can read its arrays, at start and at each swap."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tensor",))
    store = WeightStore.from_state(config, initial_state, mesh, strategy="tp",
                                   max_chunk_bytes=MAX_CHUNK)
    states = [store.snapshot()[1]]
    store.apply_push(iter(_messages(_new_params(config), 0, reset=True)))
    states.append(store.snapshot()[1])
    for state in states:
        for name, array in hf_from_state(state).items():
            assert _shards_read_with_a_second_reader_inside(array) == 2, name


def test_every_failure_leaves_the_old_weights_serving(store, config):
    params = _new_params(config)
    store.apply_push(iter(_messages(params, 3)))

    msg = _rejected(store, _messages(params, 3), grpc.StatusCode.FAILED_PRECONDITION)
    assert "version 3 is not newer than the serving version 3" in msg

    msgs = _messages(params, 4)
    chunk = msgs[5].chunk
    chunk.data = b"\x00" + chunk.data[1:] if chunk.data[:1] != b"\x00" else b"\x01" + chunk.data[1:]
    assert "checksum" in _rejected(store, msgs, grpc.StatusCode.DATA_LOSS)

    msgs = _messages(params, 4)
    msgs[1].chunk.name = "model.layers.9.mlp.up_proj.weight"
    assert "unknown parameter name" in _rejected(store, msgs, grpc.StatusCode.INVALID_ARGUMENT)

    msgs = _messages(params, 4)
    msgs[1].chunk.shape[:] = list(msgs[1].chunk.shape)[::-1] + [1]
    assert "shape is" in _rejected(store, msgs, grpc.StatusCode.INVALID_ARGUMENT)

    msgs = _messages(params, 4)
    msg = _rejected(store, msgs[:-1], grpc.StatusCode.INVALID_ARGUMENT)
    assert "incomplete push" in msg and msgs[-1].chunk.name in msg

    big = list(wire.iter_push_messages(params, 4, max_chunk_bytes=4 * MAX_CHUNK))
    assert "max_chunk_bytes" in _rejected(store, big, grpc.StatusCode.RESOURCE_EXHAUSTED)

    msgs = _messages(params, 4)
    assert "must start with a PushHeader" in _rejected(
        store, msgs[1:], grpc.StatusCode.INVALID_ARGUMENT)

    # After all that, a good push still works, and reset may roll back to an older version.
    assert store.apply_push(iter(_messages(params, 4))).version == 4
    assert store.apply_push(iter(_messages(params, 2, reset=True))).version == 2
    other = _new_params(config, seed=9)
    assert store.apply_push(iter(_messages(other, 2, reset=True))).version == 2
    assert store.digests() == {n: wire.array_digest(a) for n, a in other.items()}


def test_a_second_concurrent_push_is_aborted(store, config):
    params = _new_params(config)
    msgs = _messages(params, 1)
    started, release = threading.Event(), threading.Event()

    def slow():
        yield msgs[0]
        started.set()
        release.wait(10)
        yield from msgs[1:]

    results = []
    thread = threading.Thread(target=lambda: results.append(store.apply_push(slow())))
    thread.start()
    started.wait(10)
    with pytest.raises(WireError) as info:
        store.apply_push(iter(_messages(params, 2)))
    assert info.value.code == grpc.StatusCode.ABORTED
    assert "version 1" in info.value.message
    assert store.version == 0
    release.set()
    thread.join(10)
    assert results and results[0].version == 1 and store.version == 1


def test_param_infos_report_partitions_and_digests(store):
    infos = store.param_infos(include_digests=True)
    assert [i.name for i in infos] == sorted(store.manifest)
    assert all(i.digest.startswith("sha256:") for i in infos)
    assert isinstance(infos[0], sampler_pb2.ParamInfo)
    assert all(len(i.partition) == len(i.shape) for i in infos)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused_naming_the_tensor(store, config, bad):
    params = _new_params(config)
    name = "model.layers.mlp.down_proj.weight"
    params[name].reshape(-1)[[3, 7]] = bad
    msg = _rejected(store, _messages(params, 1), grpc.StatusCode.INVALID_ARGUMENT)
    assert "non-finite" in msg and f"'{name}' (2 of {params[name].size} values)" in msg
    assert "version 0 still serving" in msg


@pytest.mark.parametrize(("version", "reset"), [(-1, False), (-3, True)])
def test_negative_versions_are_refused(store, config, version, reset):
    msg = _rejected(store, _messages(_new_params(config), version, reset=reset),
                    grpc.StatusCode.INVALID_ARGUMENT)
    assert f"push version {version} is negative" in msg


def test_any_newer_version_is_taken_however_many_steps_the_run_had(store, config):
    """No bound from the sampler's own trainer.steps: a run resumed with more steps pushes
    versions past it, and its samplers keep serving without a restart."""
    result = store.apply_push(iter(_messages(_new_params(config), 2**63 - 1)))
    assert result.version == store.version == 2**63 - 1


def test_a_push_whose_sender_has_gone_is_never_applied(store, config):
    params = _new_params(config)
    msg = _rejected(store, [], grpc.StatusCode.INVALID_ARGUMENT)  # (nothing: not even a header)
    assert "must start with a PushHeader" in msg
    with pytest.raises(WireError) as info:
        store.apply_push(iter(_messages(params, 1)), sender_alive=lambda: False)
    assert info.value.code == grpc.StatusCode.CANCELLED and "went away" in info.value.message
    assert store.version == 0 and store.push_in_progress is None
    assert store.apply_push(iter(_messages(params, 1))).version == 1  # the lock was released


def _delta(store, params, version, base):
    """A delta push of ``params`` against ``base`` (the params the store serves)."""
    header = wire.push_header(params, version, push_id=f"v{version}",
                              base_id=store.weights_id)
    blocks = {(n, tuple((0, d) for d in a.shape)): a for n, a in base.items()}
    frames = wire.iter_push_frames(params, version, max_chunk_bytes=MAX_CHUNK,
                                   base=lambda n, b: blocks.get((n, b)))
    with store.begin_push(header) as session:
        for chunk, payload in frames:
            session.add(chunk, payload)
        session.finish()
        return session, session.swap()


def test_deltas_rebuild_the_senders_bytes_and_keep_unchanged_arrays(store, config):
    first = _new_params(config)
    header = wire.push_header(first, 1, push_id="v1")
    with store.begin_push(header) as session:
        for chunk, payload in wire.iter_push_frames(first, 1, max_chunk_bytes=MAX_CHUNK):
            session.add(chunk, payload)
        session.finish()
        session.swap()
    assert store.weights_id == "v1"
    _, before = store.snapshot()
    second = {n: a.copy() for n, a in first.items()}
    changed = "model.layers.mlp.up_proj.weight"
    second[changed].reshape(-1)[::50] += 1
    _, result = _delta(store, second, 2, first)
    assert result.bytes_received < result.decoded_bytes / 10
    assert store.digests() == {n: wire.array_digest(a) for n, a in second.items()}
    assert store.weights_id == "v2"
    _, after = store.snapshot()
    old, new = hf_from_state(before), hf_from_state(after)
    assert new["model.norm.weight"] is old["model.norm.weight"]  # bitwise the same: kept
    assert new[changed] is not old[changed]


def test_a_delta_must_name_the_served_weights_and_a_reset_is_never_a_delta(store, config):
    params = _new_params(config)
    header = wire.push_header(params, 1, push_id="v1", base_id="someone-else")
    with pytest.raises(WireError) as info:
        store.begin_push(header)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "against base 'someone-else'" in info.value.message and "full push" in info.value.message
    header = wire.push_header(params, 1, push_id="v1", base_id="", reset=True)
    header.base_id = "x"
    with pytest.raises(WireError, match="a reset must be a full push"):
        store.begin_push(header)
    assert store.push_in_progress is None


def test_staging_buffers_are_reused_but_never_under_weights_a_generation_still_holds(
        store, config):
    pushed, held = {}, None
    for version in range(1, 7):
        gc.collect()  # a held version must survive collections too
        params = _new_params(config, seed=version)
        store.apply_push(iter(_messages(params, version)))
        pushed[version] = params
        if version == 2:
            held = store.snapshot()  # a generation keeping version 2 through a long batch
    assert store.staging.reused > 0  # later pushes landed in earlier pushes' buffers...
    version, state = held
    assert version == 2  # ...but not in those of the weights still held
    for name, array in hf_from_state(state).items():
        assert np.asarray(array).tobytes() == pushed[2][name].tobytes(), name
    assert store.digests() == {n: wire.array_digest(a) for n, a in pushed[6].items()}
    # At most one spare set besides the served and the held weights.
    assert store.staging.nbytes <= 3 * sum(a.nbytes for a in pushed[6].values()) + 3 * MAX_CHUNK


def test_staging_buffers_come_back_without_a_full_garbage_collection(store, config):
    """Reading the served weights (GetInfo's digests, a delta's base) must leave no reference
    cycle holding them, and jax's deferred release of the host buffers its device arrays
    aliased must run: else every push takes fresh pages (a page fault per page)."""
    gc.collect()
    gc.disable()
    try:
        sizes = []
        for version in range(1, 6):
            store.apply_push(iter(_messages(_new_params(config, seed=version), version)))
            store.param_infos(include_digests=True)
            sizes.append(store.staging.allocated)
    finally:
        gc.enable()
    # Two sets (the served one and the next push's), then every push reuses the retired one.
    assert sizes[2:] == [sizes[1]] * 3 and sizes[1] == 2 * sizes[0]
    assert store.staging.reused >= 3 * sizes[0]
