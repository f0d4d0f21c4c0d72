"""The tensor wire format: chunking, regions for resharding, and the receiver's checks."""

from __future__ import annotations

import grpc
import ml_dtypes
import numpy as np
import pytest

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
    assert all(len(c.data) <= 40 and c.checksum == wire.crc32(c.data) for c in chunks)
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
