"""Delta chunks: only the elements that changed since the version the receiver serves.

A SPARSE payload is ``k`` little-endian uint32 element indices (ascending, relative to the
chunk's first element) followed by the ``k`` new element values. Elements are compared as
unsigned integers of the element's width, so "changed" means "not bitwise equal" (a NaN that
stays NaN is unchanged, -0.0 -> +0.0 is a change): after any chain of deltas the receiver's bytes
equal the sender's. The sender picks SPARSE for a chunk only when it is smaller than the raw
bytes, i.e. when fewer than itemsize / (4 + itemsize) of the elements changed (a third for bf16).
"""

from __future__ import annotations

import numpy as np

INDEX = np.dtype("<u4")


def _as_uint(raw: np.ndarray, itemsize: int) -> np.ndarray:
    return raw.view(np.dtype(f"<u{itemsize}"))


def sparse_encode(new: np.ndarray, base: np.ndarray, itemsize: int) -> bytes | None:
    """The SPARSE payload turning ``base`` into ``new`` (flat uint8 views of equal length), or
    None when it would not be smaller than ``new`` itself."""
    a, b = _as_uint(new, itemsize), _as_uint(base, itemsize)
    differs = a != b
    count = int(np.count_nonzero(differs))
    if count * (INDEX.itemsize + itemsize) >= new.size:
        return None
    index = np.flatnonzero(differs)
    return index.astype(INDEX).tobytes() + a[index].tobytes()


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
