"""Delta chunks: only the elements that changed since the version the receiver serves.

Two encodings of one chunk's change, against the same chunk of the served bytes:

- SPARSE: ``k`` little-endian uint32 element indices (ascending, relative to the chunk's first
  element), then the ``k`` new element values: ``k * (4 + itemsize)`` bytes;
- BITMAP: one bit per element of the chunk (bit ``i`` of byte ``j`` is element ``8j + i``),
  then the new values of the set ones in order: ``ceil(n / 8) + k * itemsize`` bytes.

Elements are compared as unsigned integers of the element's width, so "changed" means "not
bitwise equal" (a NaN that stays NaN is unchanged, -0.0 -> +0.0 is a change): after any chain
of deltas the receiver's bytes equal the sender's. The sender picks, chunk by chunk, the
smallest of RAW, SPARSE and BITMAP: SPARSE while under ``1/32`` of the elements changed (bf16),
BITMAP up to ``1 - 1/(8 * itemsize)`` of them (15/16 for bf16), RAW beyond.
"""

from __future__ import annotations

import numpy as np

from splitrl.v1 import tensor_pb2

INDEX = np.dtype("<u4")
RAW, SPARSE, BITMAP = (tensor_pb2.TensorChunk.RAW, tensor_pb2.TensorChunk.SPARSE,
                       tensor_pb2.TensorChunk.BITMAP)


def _as_uint(raw: np.ndarray, itemsize: int) -> np.ndarray:
    return raw.view(np.dtype(f"<u{itemsize}"))


def delta_encode(new: np.ndarray, base: np.ndarray,
                 itemsize: int) -> tuple[tensor_pb2.TensorChunk.Encoding, bytes] | None:
    """The smallest delta turning ``base`` into ``new`` (flat uint8 views of equal length) as
    ``(encoding, payload)``, or None when no delta is smaller than ``new`` itself."""
    a, b = _as_uint(new, itemsize), _as_uint(base, itemsize)
    differs = a != b
    count = int(np.count_nonzero(differs))
    sparse = count * (INDEX.itemsize + itemsize)
    bitmap = -(-a.size // 8) + count * itemsize
    if min(sparse, bitmap) >= new.size:
        return None
    if sparse <= bitmap:
        index = np.flatnonzero(differs)
        return SPARSE, index.astype(INDEX).tobytes() + a[index].tobytes()
    return BITMAP, np.packbits(differs, bitorder="little").tobytes() + a[differs].tobytes()


def sparse_encode(new: np.ndarray, base: np.ndarray, itemsize: int) -> bytes | None:
    """The SPARSE payload turning ``base`` into ``new``, or None when it is not smaller."""
    a, b = _as_uint(new, itemsize), _as_uint(base, itemsize)
    index = np.flatnonzero(a != b)
    if index.size * (INDEX.itemsize + itemsize) >= new.size:
        return None
    return index.astype(INDEX).tobytes() + a[index].tobytes()


def delta_apply(dst: np.ndarray, payload, itemsize: int, encoding: int) -> int:
    """Write a delta's values into ``dst`` (a flat uint8 view holding the base bytes); returns
    how many elements changed. ValueError names what is malformed."""
    payload = memoryview(payload).cast("B")
    elements = dst.size // itemsize
    values_dtype = np.dtype(f"<u{itemsize}")
    if encoding == BITMAP:
        head = -(-elements // 8)
        if len(payload) < head:
            raise ValueError(f"a BITMAP payload of {len(payload)} bytes is shorter than the "
                             f"{head}-byte bitmap of {elements} elements")
        changed = np.unpackbits(np.frombuffer(payload, np.uint8, head), count=elements,
                                bitorder="little").view(bool)
        count = int(np.count_nonzero(changed))
        if len(payload) != head + count * itemsize:
            raise ValueError(f"a BITMAP payload with {count} changes must be "
                             f"{head + count * itemsize} bytes, got {len(payload)}")
        _as_uint(dst, itemsize)[changed] = np.frombuffer(payload, values_dtype, count, head)
        return count
    if encoding != SPARSE:
        raise ValueError(f"encoding {encoding} is not a delta")
    return sparse_apply(dst, payload, itemsize)


def sparse_apply(dst: np.ndarray, payload, itemsize: int) -> int:
    """Write a SPARSE payload's values into ``dst`` (a flat uint8 view holding the base bytes);
    returns how many elements changed. ValueError names what is malformed."""
    payload = memoryview(payload).cast("B")
    record = INDEX.itemsize + itemsize
    if len(payload) % record:
        raise ValueError(f"a SPARSE payload of {len(payload)} bytes is not a whole number of "
                         f"({INDEX.itemsize}-byte index, {itemsize}-byte value) records")
    count = len(payload) // record
    elements = dst.size // itemsize
    if count > elements:
        raise ValueError(f"a SPARSE payload of {count} changes for a chunk of {elements} "
                         "elements")
    if not count:
        return 0
    index = np.frombuffer(payload, INDEX, count)
    if int(index[-1]) >= elements or (count > 1 and not bool(np.all(index[1:] > index[:-1]))):
        raise ValueError(f"SPARSE indices must ascend strictly within [0, {elements}) (the "
                         f"chunk's elements); got first {int(index[0])}, last {int(index[-1])}")
    values = np.frombuffer(payload, np.dtype(f"<u{itemsize}"), count, count * INDEX.itemsize)
    _as_uint(dst, itemsize)[index] = values
    return count
