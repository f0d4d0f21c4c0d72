"""What every part of the wire shares: the error type, dtype names, checksums and digests."""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Mapping, Sequence

import crc32c as _crc32c
import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "float64", "float32", "float16", "int64", "int32", "int16", "int8",
        "uint64", "uint32", "uint16", "uint8", "bool",
    )
}
_DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})


def dtype_name(dtype) -> str:
    """The wire name of a numpy/jax dtype ("float32", "bfloat16", ...)."""
    return np.dtype(dtype).name


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a wire dtype name; ValueError for names the wire does not carry."""
    try:
        return _DTYPES[name]
    except KeyError:
        supported = sorted(_DTYPES)
        raise ValueError(f"dtype {name!r} is not supported (supported: {supported})") from None


def checksum(data, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of a bytes-like object: what ``TensorChunk.checksum`` carries;
    ``value``: the CRC of the bytes before ``data`` (to checksum a chunk piece by piece).

    Hardware-accelerated (SSE 4.2 / ARMv8 CRC): ~16 GB/s here against zlib's CRC-32 at ~2.3
    GB/s, which alone would cost a push a third of its budget at 1 GB/s on each end.
    """
    return _crc32c.crc32c(data, value)


ALIGNMENT = 64  # what XLA:CPU needs to use a host buffer as a device buffer without a copy


def aligned_empty(shape, dtype) -> np.ndarray:
    """``np.empty`` on a 64-byte boundary: on CPU, ``jax.device_put`` then aliases it (no copy)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    skip = -raw.ctypes.data % ALIGNMENT
    return raw[skip : skip + nbytes].view(dtype).reshape(shape)


# Float dtype name -> (unsigned view of the same width, bits of the magnitude, bits of +Inf):
# an element is NaN or Inf iff its magnitude bits are at least those of Inf.
_NONFINITE_BITS = {
    "bfloat16": (np.uint16, 0x7FFF, 0x7F80),
    "float16": (np.uint16, 0x7FFF, 0x7C00),
    "float32": (np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
    "float64": (np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
}
_PIECE_BYTES = 512 * 1024  # cache-sized pieces: the masked copy never leaves the cache
_scratch = threading.local()  # one masked-copy buffer per receiving thread


def has_nonfinite(data, dtype) -> bool:
    """True iff the bytes ``data`` (whole elements of float ``dtype``) hold a NaN or an Inf.

    Integer passes over the bits (mask off the sign, compare the maximum with Inf's bits) in
    cache-sized pieces: measured ~2.5x memcpy speed for bfloat16 here, where a float reduction
    (XLA's or numpy's max(|x|)) of bfloat16 runs below memcpy speed, and a receiver at wire speed
    cannot afford a pass slower than the copy that brought the bytes. Exact: no overflow, no
    rounding. False for non-float dtypes.
    """
    spec = _NONFINITE_BITS.get(np.dtype(dtype).name)
    if spec is None:
        return False
    unsigned, magnitude, inf = spec
    bits = np.frombuffer(data, np.uint8).view(unsigned)
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None:
        buffer = _scratch.buffer = np.empty(_PIECE_BYTES, np.uint8)
    masked = buffer.view(unsigned)
    step = len(masked)
    mask = unsigned(magnitude)
    for i in range(0, len(bits), step):
        piece = bits[i : i + step]
        out = masked[: len(piece)]
        np.bitwise_and(piece, mask, out=out)
        if np.maximum.reduce(out) >= inf:
            return True
    return False


def byte_view(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (copies only if it is not contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def array_digest(array) -> str:
    """SHA-256 over dtype, shape and C-order bytes: equal digests mean bitwise-equal tensors."""
    host = np.asarray(array)
    h = hashlib.sha256()
    h.update(f"{dtype_name(host.dtype)}{list(host.shape)}".encode())
    h.update(byte_view(host))
    return "sha256:" + h.hexdigest()


def model_fingerprint(architecture: str, params: Mapping[str, tuple[str, Sequence[int]]]) -> str:
    """Hash of the architecture and every parameter's name, dtype and shape.

    Trainer and sampler compute it the same way, so equal fingerprints mean a push will fit.
    """
    desc = {"architecture": architecture,
            "params": [[n, params[n][0], [int(d) for d in params[n][1]]] for n in sorted(params)]}
    return "sha256:" + hashlib.sha256(json.dumps(desc).encode()).hexdigest()
