"""The receiver's staging buffers (reused across pushes, never while referenced) and its
NaN/Inf check over the bits of each chunk."""

from __future__ import annotations

import gc

import grpc
import jax
import ml_dtypes
import numpy as np
import pytest

from splitrl import wire
from splitrl.wire import ChunkAssembler, StagingPool, WireError

FLOATS = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_has_nonfinite_finds_every_nan_and_inf_and_nothing_else(dtype):
    info = ml_dtypes.finfo(dtype)
    n = 300_000  # several of the check's pieces
    values = np.random.default_rng(0).standard_normal(n).astype(dtype)
    values[:4] = [info.max, -info.max, info.smallest_subnormal, -0.0]
    assert not wire.has_nonfinite(values, dtype)
    for at in (0, 4, n // 2, n - 1):
        for bad in (np.inf, -np.inf, np.nan):
            damaged = values.copy()
            damaged[at] = bad
            assert wire.has_nonfinite(damaged, dtype), (at, bad)
    assert not wire.has_nonfinite(np.full(8, -1, np.int32), np.int32)
    assert not wire.has_nonfinite(b"", dtype)


def test_a_buffer_is_reused_only_once_nothing_refers_to_it():
    pool = StagingPool()
    first = pool.take((64, 32), np.float32)
    address = first.ctypes.data
    assert address % 64 == 0
    row = first[3]
    del first
    assert pool.take((64, 32), np.float32).ctypes.data != address  # a view still holds it
    del row
    again = pool.take((64, 32), np.float32)
    assert again.ctypes.data == address and pool.reused == 1
    # On XLA:CPU a device array aliases its host buffer: reused only once the array is gone.
    on_device = jax.device_put(again)
    del again
    gc.collect()
    assert pool.take((64, 32), np.float32).ctypes.data != address
    assert np.asarray(on_device).shape == (64, 32)
    del on_device
    gc.collect()
    assert pool.take((64, 32), np.float32).ctypes.data == address


def test_trim_keeps_at_most_one_spare_set():
    pool = StagingPool()
    held = [pool.take((1024,), np.uint8) for _ in range(3)]
    pool.trim()
    assert pool.nbytes == 3 * 1024  # all in use
    del held
    pool.trim()  # nothing taken since the last trim: the free ones go
    assert pool.nbytes == 0
    allocated = pool.allocated
    for _ in range(2):  # a push that takes two buffers, twice: the second reuses the first's
        batch = [pool.take((1024,), np.uint8) for _ in range(2)]
        del batch
        pool.trim()
    assert pool.nbytes == 2 * 1024 and pool.allocated == allocated + 2 and pool.reused == 2


def test_prefill_faults_in_buffers_the_first_push_takes():
    pool = StagingPool()
    pool.prefill([((16, 16), np.float32), ((8,), ml_dtypes.bfloat16)])
    assert pool.allocated == 2
    pool.take((16, 16), np.float32)
    pool.take((8,), ml_dtypes.bfloat16)
    assert pool.allocated == 2 and pool.reused == 2


def _assembler(params, **kw):
    return ChunkAssembler({n: (wire.dtype_name(a.dtype), a.shape) for n, a in params.items()},
                          version=1, max_chunk_bytes=64, **kw)


def test_the_assembler_names_tensors_with_nan_or_inf_and_takes_its_buffers_from_the_pool():
    params = {"a": np.arange(40, dtype=np.float32), "b": np.ones((4, 6), ml_dtypes.bfloat16),
              "c": np.arange(5, dtype=np.int32)}
    params["b"][2, 5] = np.nan
    pool = StagingPool()
    assembler = _assembler(params, allocate=pool.take)
    for chunk in wire.iter_push_messages(params, 1, max_chunk_bytes=64):
        if chunk.HasField("chunk"):
            assembler.add(chunk.chunk)
    assembler.finish()
    assert assembler.nonfinite_names() == ["b"]
    assert pool.allocated == 3
    np.testing.assert_array_equal(assembler.pop("a"), params["a"])


def test_a_chunk_that_splits_an_element_is_invalid_argument():
    params = {"a": np.arange(16, dtype=np.float32)}
    assembler = _assembler(params)
    chunk = next(m.chunk for m in wire.iter_push_messages(params, 1, max_chunk_bytes=64)
                 if m.HasField("chunk"))
    chunk.offset, chunk.data = 2, chunk.data[:30]
    chunk.checksum = wire.checksum(chunk.data)
    with pytest.raises(WireError) as e:
        assembler.add(chunk)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "whole 4-byte float32 elements" in e.value.message
