"""The tensor wire format: chunking, regions for resharding, and the receiver's checks."""

from __future__ import annotations

import grpc
import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from splitrl import wire
from splitrl.wire import ChunkAssembler, TargetLayout, WireError


def _params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a.weight": rng.standard_normal((8, 6)).astype(np.float32),
        "b.weight": rng.standard_normal((4, 10)).astype(ml_dtypes.bfloat16),
        "c.bias": rng.integers(-5, 5, (7,)).astype(np.int32),
        "d.scalar": np.array(3.5, np.float32),
        "e.empty": np.zeros((0, 3), np.float32),
    }


def _manifest(params):
    return {n: (wire.dtype_name(a.dtype), a.shape) for n, a in params.items()}


def _chunks(params, version=1, max_chunk_bytes=40, targets=None):
    msgs = list(wire.iter_push_messages(params, version, max_chunk_bytes=max_chunk_bytes,
                                        target_shardings=targets))
    return msgs[0].header, [m.chunk for m in msgs[1:]]


def _assembler(params, header, max_chunk_bytes=40):
    return ChunkAssembler(_manifest(params), version=header.version,
                          max_chunk_bytes=max_chunk_bytes, tensor_count=header.tensor_count,
                          total_bytes=header.total_bytes)


def _feed(assembler, chunks):
    out = {}
    for chunk in chunks:
        done = assembler.add(chunk)
        if done:
            out[done] = assembler.pop(done)
    assembler.finish()
    return out


def _assert_bitwise_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def test_whole_tensors_round_trip_bitwise_in_bounded_checksummed_chunks():
    params = _params()
    header, chunks = _chunks(params)
    assert header.tensor_count == 5
    assert header.total_bytes == sum(a.nbytes for a in params.values())
    assert all(len(c.data) <= 40 and c.checksum == wire.checksum(c.data) for c in chunks)
    assert all(not c.region_shape for c in chunks)
    out = _feed(_assembler(params, header), chunks)
    for name, array in params.items():
        _assert_bitwise_equal(out[name], array)
        assert wire.array_digest(out[name]) == wire.array_digest(array)


def test_regions_follow_the_receivers_blocks_and_reassemble():
    params = {"w": np.arange(48, dtype=np.float32).reshape(8, 6)}
    axes = (("data", 1), ("tensor", 2))
    targets = {"w": TargetLayout(("tensor", ""), axes)}
    header, chunks = _chunks(params, targets=targets)
    regions = {(tuple(c.region_start), tuple(c.region_shape)) for c in chunks}
    assert regions == {((0, 0), (4, 6)), ((4, 0), (4, 6))}
    out = _feed(_assembler(params, header), chunks)
    _assert_bitwise_equal(out["w"], params["w"])


def test_sender_casts_to_the_receivers_dtype():
    params = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)}
    targets = {"w": TargetLayout(("", ""), (("tensor", 1),), dtype="bfloat16")}
    header, chunks = _chunks(params, targets=targets)
    assert {c.dtype for c in chunks} == {"bfloat16"}
    manifest = {"w": ("bfloat16", (3, 4))}
    assembler = ChunkAssembler(manifest, version=1, max_chunk_bytes=40,
                               total_bytes=header.total_bytes)
    out = _feed(assembler, chunks)
    _assert_bitwise_equal(out["w"], params["w"].astype(ml_dtypes.bfloat16))


def test_plan_regions_intersects_sender_shards_with_receiver_blocks():
    target = TargetLayout(("tensor", ""), (("tensor", 4),))
    # A sender fsdp shard covering rows [0, 8) of 16 and all 4 columns splits into two blocks.
    regions = wire.plan_regions(((0, 8), (0, 4)), (16, 4), target)
    assert regions == [((0, 4), (0, 4)), ((4, 8), (0, 4))]
    # A column shard crosses every row block.
    regions = wire.plan_regions(((0, 16), (2, 4)), (16, 4), target)
    assert regions == [((0, 4), (2, 4)), ((4, 8), (2, 4)), ((8, 12), (2, 4)), ((12, 16), (2, 4))]


@pytest.mark.parametrize(("sender", "receiver"), [
    (("fsdp", None), ("", "tensor")),  # row shards into column blocks (q/k/v/gate/up)
    ((None, "fsdp"), ("tensor", "")),  # column shards into row blocks (o/down, embeddings)
    (("fsdp", None), ("tensor", "")),  # row shards into row blocks
])
def test_the_sender_gathers_each_receiver_block_so_every_chunk_lands_in_place(sender, receiver):
    mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    rng = np.random.default_rng(0)
    shape = (16, 24)
    layout = TargetLayout(receiver, (("tensor", 2),), "bfloat16", shape)
    blocks = [tuple(b) for b in wire.target_blocks(shape, layout)]

    def push(version, params, base=None):
        """Frames of ``params`` received as the sampler does (reserve/commit; deltas by add),
        into buffers from ``allocate``: which records what the receiver had to allocate."""
        sharded = jax.device_put(params, NamedSharding(mesh, P(*sender)))
        allocated = []

        def allocate(shape, dtype):
            allocated.append(tuple(shape))
            return np.empty(shape, dtype)

        assembler = ChunkAssembler({"w": ("bfloat16", shape)}, version=version,
                                   max_chunk_bytes=100, blocks={"w": blocks},
                                   allocate=allocate,
                                   base=None if base is None else (lambda _: base))
        kept = {}
        frames = wire.iter_push_frames(
            {"w": sharded}, version, max_chunk_bytes=100, target_shardings={"w": layout},
            base=None if base is None else (lambda n, b: kept_before.get(b)),
            sink=lambda n, b, host, fresh: kept.__setitem__(b, np.array(host)))
        for chunk, payload in frames:
            if chunk.encoding == chunk.RAW:
                assembler.reserve(chunk, len(payload))[:] = payload
                assembler.commit()
            else:
                assembler.add(chunk, payload)
        assembler.finish()
        return assembler.pop("w"), allocated, kept

    first = rng.standard_normal(shape).astype(np.float32)
    got, allocated, kept_before = push(1, first)
    _assert_bitwise_equal(got, first.astype(ml_dtypes.bfloat16))
    # Only the receiver's own blocks: no scratch buffer for a chunk out of place.
    assert sorted(allocated) == sorted(tuple(b - a for a, b in bounds) for bounds in blocks)
    second = first.copy()
    second[::3, ::5] += 1  # a delta against what the receiver serves
    got, allocated, _ = push(2, second, base=first.astype(ml_dtypes.bfloat16))
    _assert_bitwise_equal(got, second.astype(ml_dtypes.bfloat16))


def _error(params, chunks, header=None, max_chunk_bytes=40) -> WireError:
    header = header or _chunks(params)[0]
    with pytest.raises(WireError) as info:
        _feed(_assembler(params, header, max_chunk_bytes), chunks)
    return info.value


def test_corrupted_chunk_is_data_loss_naming_the_tensor():
    params = _params()
    _, chunks = _chunks(params)
    bad = chunks[2]
    bad.data = bytes([bad.data[0] ^ 1]) + bad.data[1:]
    err = _error(params, chunks)
    assert err.code == grpc.StatusCode.DATA_LOSS
    assert bad.name in err.message and "checksum" in err.message


def test_unknown_name_wrong_shape_wrong_dtype_are_invalid_argument():
    params = _params()
    _, chunks = _chunks(params)
    chunks[0].name = "model.nope.weight"
    err = _error(params, chunks)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown parameter name 'model.nope.weight'" in err.message

    _, chunks = _chunks(params)
    chunks[0].shape[:] = [6, 8]
    err = _error(params, chunks)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'a.weight'" in err.message and "shape is [6, 8], expected [8, 6]" in err.message

    _, chunks = _chunks(params)
    chunks[0].dtype = "float16"
    err = _error(params, chunks)
    assert "dtype is 'float16', expected 'float32'" in err.message


def test_oversized_chunk_is_resource_exhausted():
    params = _params()
    _, chunks = _chunks(params, max_chunk_bytes=64)
    err = _error(params, chunks, max_chunk_bytes=40)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_chunk_bytes 40" in err.message


def test_missing_tensor_duplicate_and_overlap_are_rejected():
    params = _params()
    _, chunks = _chunks(params)
    err = _error(params, [c for c in chunks if c.name != "c.bias"])
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "incomplete push" in err.message and "c.bias" in err.message

    err = _error(params, chunks[:2] + [chunks[1]] + chunks[2:])
    assert "duplicate chunk" in err.message

    # Two regions that overlap in rows [2, 4).
    w = params["a.weight"]
    first = list(wire.iter_region_chunks("a.weight", w[0:4], shape=w.shape, version=1,
                                         max_chunk_bytes=400, region_start=(0, 0)))
    second = list(wire.iter_region_chunks("a.weight", w[2:8], shape=w.shape, version=1,
                                          max_chunk_bytes=400, region_start=(2, 0)))
    assembler = ChunkAssembler(_manifest(params), version=1, max_chunk_bytes=400)
    assembler.add(first[0])
    with pytest.raises(WireError, match="overlaps region start"):
        assembler.add(second[0])


def test_region_out_of_bounds_offset_and_version_are_checked():
    params = {"w": np.ones((4, 4), np.float32)}
    chunk = next(wire.iter_region_chunks("w", params["w"][2:4], shape=(4, 4), version=1,
                                         max_chunk_bytes=400, region_start=(3, 0)))
    with pytest.raises(WireError, match=r"region \[3, 5\) in dim 0 is outside \[0, 4\)"):
        ChunkAssembler(_manifest(params), version=1, max_chunk_bytes=400).add(chunk)

    chunk = next(wire.iter_region_chunks("w", params["w"], shape=(4, 4), version=1,
                                         max_chunk_bytes=400))
    chunk.offset = 40
    with pytest.raises(WireError, match="outside the region's 64 bytes"):
        ChunkAssembler(_manifest(params), version=1, max_chunk_bytes=400).add(chunk)

    chunk.offset = 0
    with pytest.raises(WireError, match="version is 1, expected 2"):
        ChunkAssembler(_manifest(params), version=2, max_chunk_bytes=400).add(chunk)


def test_header_must_match_the_manifest():
    params = _params()
    header, _ = _chunks(params)
    with pytest.raises(WireError, match="header.tensor_count is 4, expected 5"):
        ChunkAssembler(_manifest(params), version=1, max_chunk_bytes=40, tensor_count=4)
    with pytest.raises(WireError, match="header.total_bytes"):
        ChunkAssembler(_manifest(params), version=1, max_chunk_bytes=40,
                       total_bytes=header.total_bytes + 1)


def test_fingerprint_depends_on_names_shapes_and_dtypes():
    manifest = _manifest(_params())
    base = wire.model_fingerprint("Qwen2ForCausalLM", manifest)
    assert base == wire.model_fingerprint("Qwen2ForCausalLM", dict(reversed(manifest.items())))
    changed = dict(manifest, **{"a.weight": ("float32", (6, 8))})
    assert wire.model_fingerprint("Qwen2ForCausalLM", changed) != base
    assert wire.model_fingerprint("LlamaForCausalLM", manifest) != base


# -- receiver blocks: bytes land in place -------------------------------------------------------


def _blocks(shape, per_dim):
    """The bounds of an even split of ``shape`` into ``per_dim`` blocks along each dim."""
    import itertools

    axes = [[(i * n // k, (i + 1) * n // k) for i in range(k)] for n, k in zip(shape, per_dim,
                                                                              strict=True)]
    return [tuple(b) for b in itertools.product(*axes)]


@pytest.mark.parametrize(("sender", "receiver"), [
    (("fsdp", ""), ("tensor", "")),   # rows inside row blocks: one run per region
    (("", "fsdp"), ("", "tensor")),   # column shards inside column blocks: a run per row
    (("fsdp", ""), ("", "tensor")),   # row shards across column blocks
    (("", ""), ("tensor", "tensor2")),
])
def test_regions_are_received_in_place_in_the_receivers_blocks(sender, receiver):
    w = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    axes = (("fsdp", 4), ("tensor", 2), ("tensor2", 3))
    target = TargetLayout(receiver, axes)
    blocks = _blocks(w.shape, target.blocks_per_dim(w.shape))
    # The sender's own shards as host blocks: the regions are cut from them.
    sender_layout = TargetLayout(sender, axes)
    regions = []
    for block in _blocks(w.shape, sender_layout.blocks_per_dim(w.shape)):
        for region in wire.plan_regions(block, w.shape, target):
            regions.append(region)
    chunks = []
    for region in regions:
        data = w[tuple(slice(a, b) for a, b in region)]
        chunks += list(wire.iter_region_chunks("w", data, shape=w.shape, version=1,
                                               max_chunk_bytes=20,
                                               region_start=[a for a, _ in region]))
    assembler = ChunkAssembler({"w": ("float32", w.shape)}, version=1, max_chunk_bytes=20,
                               blocks={"w": blocks})
    done = [assembler.add(c) for c in chunks]
    assert done[-1] == "w" and done.count("w") == 1
    parts = assembler.pop_blocks("w")
    assert sorted(parts) == sorted(blocks)
    for bounds, array in parts.items():
        assert array.ctypes.data % 64 == 0  # XLA:CPU can alias it
        _assert_bitwise_equal(array, w[tuple(slice(a, b) for a, b in bounds)])


def test_reserve_receives_in_place_when_contiguous_else_in_scratch_copied_on_commit():
    w = np.arange(4 * 6, dtype=np.int32).reshape(4, 6)
    assembler = ChunkAssembler({"w": ("int32", (4, 6))}, version=1, max_chunk_bytes=64)
    rows = next(wire.iter_region_chunks("w", w[:2], shape=(4, 6), version=1,
                                        max_chunk_bytes=64, region_start=(0, 0)))
    view = assembler.reserve(rows, len(rows.data))  # two whole rows: their own place
    view[:] = rows.data
    assert assembler.commit() is None
    right = next(wire.iter_region_chunks("w", w[2:, 3:], shape=(4, 6), version=1,
                                         max_chunk_bytes=64, region_start=(2, 3)))
    scratch = assembler.reserve(right, len(right.data))  # half rows: not one run
    scratch[:] = right.data
    assert assembler.commit() is None
    left = next(wire.iter_region_chunks("w", w[2:, :3], shape=(4, 6), version=1,
                                        max_chunk_bytes=64, region_start=(2, 0)))
    assert assembler.add(left) == "w"
    _assert_bitwise_equal(assembler.pop("w"), w)


def test_strided_writes_cover_partial_first_and_last_runs():
    w = np.arange(12 * 10, dtype=np.float32).reshape(12, 10)
    # Column region [2, 7) of every row, in chunks that start and end mid-row.
    chunks = list(wire.iter_region_chunks("w", w[:, 2:7], shape=w.shape, version=1,
                                          max_chunk_bytes=28, region_start=(0, 2)))
    chunks += list(wire.iter_region_chunks("w", w[:, :2], shape=w.shape, version=1,
                                           max_chunk_bytes=28, region_start=(0, 0)))
    chunks += list(wire.iter_region_chunks("w", w[:, 7:], shape=w.shape, version=1,
                                           max_chunk_bytes=28, region_start=(0, 7)))
    assembler = ChunkAssembler({"w": ("float32", w.shape)}, version=1, max_chunk_bytes=28)
    assert [assembler.add(c) for c in chunks][-1] == "w"
    _assert_bitwise_equal(assembler.pop("w"), w)


# -- deltas -------------------------------------------------------------------------------------


def _changed(params, fraction, seed=1):
    rng = np.random.default_rng(seed)
    out = {}
    for name, a in params.items():
        b = a.copy()
        flat = b.reshape(-1)
        picks = rng.random(flat.size) < fraction
        if flat.dtype.kind == "f":
            flat[picks] = (flat[picks].astype(np.float32) + 1).astype(flat.dtype)
        elif flat.dtype.kind in "iu":
            flat[picks] += 1
        out[name] = b
    return out


def _delta_chunks(new, old, max_chunk_bytes=64):
    base = {(n, tuple((0, d) for d in a.shape)): a for n, a in old.items()}
    frames = wire.iter_push_frames(new, 2, max_chunk_bytes=max_chunk_bytes,
                                   base=lambda n, b: base.get((n, b)))
    return [(chunk, bytes(payload)) for chunk, payload in frames]


def test_a_delta_carries_only_the_changed_elements_and_rebuilds_the_new_bytes():
    old = _params()
    new = _changed(old, 0.05)
    frames = _delta_chunks(new, old)
    sparse = [c for c, _ in frames if c.encoding == c.SPARSE]
    assert sparse and all(c.length > 0 for c in sparse)
    sent = sum(len(p) for _, p in frames)
    assert sent < 0.5 * sum(a.nbytes for a in new.values())
    assembler = ChunkAssembler(_manifest(new), version=2, max_chunk_bytes=64,
                               base=lambda n: old[n])
    for chunk, payload in frames:
        if (done := assembler.add(chunk, payload)) is not None:
            _assert_bitwise_equal(assembler.pop(done), new[done])
    assembler.finish()
    assert assembler.payload_bytes == sent
    assert assembler.bytes_received == sum(a.nbytes for a in new.values())


def test_a_chunk_that_changed_too_much_goes_raw_and_an_unchanged_tensor_is_reported():
    old = {"a": np.zeros(16, np.float32), "b": np.ones(16, np.float32)}
    new = {"a": np.arange(1, 17, dtype=np.float32), "b": old["b"].copy()}
    frames = _delta_chunks(new, old)
    assert {c.encoding for c, _ in frames if c.name == "a"} == {0}  # RAW: all changed
    assert {c.encoding for c, _ in frames if c.name == "b"} == {1}  # no change: SPARSE, empty
    assert all(len(p) == 0 for c, p in frames if c.name == "b")
    assembler = ChunkAssembler(_manifest(new), version=2, max_chunk_bytes=64,
                               base=lambda n: old[n])
    for chunk, payload in frames:
        assembler.add(chunk, payload)
    assert assembler.modified("a") and not assembler.modified("b")


def test_a_delta_against_the_wrong_base_is_data_loss_and_a_delta_needs_a_base():
    old = _params()
    new = _changed(old, 0.05)
    frames = _delta_chunks(new, old)
    other = _changed(old, 0.05, seed=7)
    assembler = ChunkAssembler(_manifest(new), version=2, max_chunk_bytes=64,
                               base=lambda n: other[n])
    with pytest.raises(WireError) as info:
        for chunk, payload in frames:
            assembler.add(chunk, payload)
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    assert "does not turn the sampler's base" in info.value.message

    full = ChunkAssembler(_manifest(new), version=2, max_chunk_bytes=64)
    chunk, payload = next((c, p) for c, p in frames if c.encoding == c.SPARSE)
    with pytest.raises(WireError, match="SPARSE chunk in a full push"):
        full.add(chunk, payload)


@pytest.mark.parametrize(("mangle", "fragment"), [
    (lambda p: p[:-1], "not a whole number"),
    (lambda p: np.array([9, 3], "<u4").tobytes() + p[8:16], "must ascend strictly"),
    (lambda p: np.array([0, 999], "<u4").tobytes() + p[8:16], "must ascend strictly"),
])
def test_malformed_sparse_payloads_are_invalid_argument(mangle, fragment):
    old = {"w": np.zeros(256, np.float32)}
    new = {"w": old["w"].copy()}
    new["w"][[2, 5]] = 1.0
    (chunk, payload), = _delta_chunks(new, old, max_chunk_bytes=1024)
    assert chunk.encoding == chunk.SPARSE and len(payload) == 16
    assembler = ChunkAssembler(_manifest(new), version=2, max_chunk_bytes=1024,
                               base=lambda n: old[n])
    with pytest.raises(WireError) as info:
        assembler.add(chunk, mangle(payload))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in info.value.message and "'w'" in info.value.message


def test_sparse_encoding_compares_bits_not_values():
    base = np.array([0.0, np.nan, 1.0, 2.0], np.float32)
    new = np.array([-0.0, np.nan, 1.0, 2.0], np.float32)
    payload = wire.sparse_encode(new.view(np.uint8), base.view(np.uint8), 4)
    assert payload is not None
    out = base.copy()
    assert wire.sparse_apply(out.view(np.uint8), payload, 4) == 1
    assert out.tobytes() == new.tobytes()


def test_the_sender_picks_the_smallest_delta_encoding_per_chunk():
    base = np.zeros(4096, ml_dtypes.bfloat16)
    few, many = base.copy(), base.copy()
    few[[5, 900]] = 1.0  # 2 of 4096: indices are cheaper than a bitmap
    many[::3] = 1.0  # a third: a bitmap is cheaper than indices, values still beat raw
    raw = base.view(np.uint8)
    for new, encoding, size in [(few, wire.SPARSE, 2 * 6), (many, wire.BITMAP, 512 + 1366 * 2)]:
        got, payload = wire.delta_encode(new.view(np.uint8), raw, 2)
        assert (got, len(payload)) == (encoding, size)
        out = raw.copy()
        assert wire.delta_apply(out, payload, 2, got) == np.count_nonzero(new != base)
        assert out.tobytes() == new.tobytes()
    assert wire.delta_encode(np.ones(4096, ml_dtypes.bfloat16).view(np.uint8), raw, 2) is None


def test_a_malformed_bitmap_payload_is_invalid_argument():
    old = {"w": np.zeros(64, np.float32)}
    new = {"w": old["w"].copy()}
    new["w"][::2] = 1.0
    (chunk, payload), = _delta_chunks(new, old, max_chunk_bytes=256)
    assert chunk.encoding == wire.BITMAP
    assembler = ChunkAssembler(_manifest(new), version=2, max_chunk_bytes=256,
                               base=lambda n: old[n])
    with pytest.raises(WireError, match="a BITMAP payload with 32 changes must be 136 bytes"):
        assembler.add(chunk, payload[:-4])
