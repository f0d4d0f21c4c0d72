"""Tensors on the wire: bounded, checksummed chunks of (regions of) named parameters.

This module is the whole weight-transfer contract between the trainer's publisher and the
sampler's receiver (``TensorChunk`` / ``WeightPushMessage`` in ``protos/splitrl/v1``). It is
pure: no gRPC calls, no global state.

Sender (:func:`iter_push_messages`)
    Yields a ``PushHeader`` and then, for every parameter, the *regions* the receiver's layout
    needs. A region is the intersection of one of the sender's own shards with one of the
    receiver's device blocks (from ``GetInfo``: each parameter's partition strings and the
    mesh's axis sizes). So:

    - the sender never gathers a tensor: it copies one shard at a time to the host
      (``np.asarray(shard.data)``, zero-copy for CPU devices) and slices regions out of it;
      host memory beyond the shard is one region plus one chunk;
    - every region lies inside exactly one receiver block, so a receiver could route each region
      straight to the device (or host) that owns that block without reassembling the tensor;
    - replicas are sent once (shards with ``replica_id == 0``).

    Without a target layout each sender shard is sent as one region. Casting to the receiver's
    dtype (when the target says so) happens per region. Byte order is little-endian (C order).

Receiver (:class:`ChunkAssembler`)
    Checks every chunk against the receiver's manifest ``{name: (dtype, shape)}``: known name,
    version, chunk size, dtype, shape, region bounds, byte range, CRC-32, overlaps and duplicates
    (between regions and between chunks of a region), and at :meth:`ChunkAssembler.finish` that
    every tensor arrived completely and the byte count matches the header. A tensor is returned
    as a numpy array the moment its last byte arrives, so the caller can place it on devices
    while later tensors are still in flight.

Every violation raises :class:`WireError`, carrying the gRPC status code to return and a
message naming the parameter, the field, the value received and the expectation.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product

import grpc
import ml_dtypes
import numpy as np

from splitrl.v1 import sampler_pb2, tensor_pb2

_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "float64", "float32", "float16", "int64", "int32", "int16", "int8",
        "uint64", "uint32", "uint16", "uint8", "bool",
    )
}
_DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)


class WireError(Exception):
    """A push violates the wire contract; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


# ----------------------------------------------------------------------------------------------
# Shared helpers


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


def crc32(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def _byte_view(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (copies only if it is not contiguous)."""
    return np.asarray(array, order="C").reshape(-1).view(np.uint8)


def array_digest(array) -> str:
    """SHA-256 over dtype, shape and C-order bytes: equal digests mean bitwise-equal tensors."""
    host = np.asarray(array)
    h = hashlib.sha256()
    h.update(f"{dtype_name(host.dtype)}{list(host.shape)}".encode())
    h.update(_byte_view(host))
    return "sha256:" + h.hexdigest()


def model_fingerprint(architecture: str, params: Mapping[str, tuple[str, Sequence[int]]]) -> str:
    """Hash of the architecture and every parameter's name, dtype and shape.

    Trainer and sampler compute it the same way, so equal fingerprints mean a push will fit.
    """
    desc = {"architecture": architecture,
            "params": [[n, params[n][0], [int(d) for d in params[n][1]]] for n in sorted(params)]}
    return "sha256:" + hashlib.sha256(json.dumps(desc).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------
# Sender


@dataclass(frozen=True)
class TargetLayout:
    """How the receiver holds one parameter: mesh-axis names per dim, axis sizes, dtype, shape.

    ``partition`` uses the ``ParamInfo.partition`` strings ("" = not split along that dim,
    "a+b" = split over several axes). ``dtype``/``shape`` None means "as the sender has it".
    """

    partition: tuple[str, ...]
    axis_sizes: tuple[tuple[str, int], ...]
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    def blocks_per_dim(self, shape: Sequence[int]) -> list[int]:
        sizes = dict(self.axis_sizes)
        parts = list(self.partition) + [""] * (len(shape) - len(self.partition))
        if len(parts) > len(shape):
            raise ValueError(f"partition {list(self.partition)} has more dims than shape "
                             f"{list(shape)}")
        out = []
        for dim, part in enumerate(parts):
            n = 1
            for axis in filter(None, part.split("+")):
                if axis not in sizes:
                    raise ValueError(f"partition names mesh axis {axis!r}, not in the mesh "
                                     f"{dict(self.axis_sizes)}")
                n *= sizes[axis]
            if shape[dim] % n:
                raise ValueError(f"dim {dim} of size {shape[dim]} does not divide into {n} "
                                 f"blocks (partition {part!r})")
            out.append(n)
        return out


def layouts_from_info(info: sampler_pb2.SamplerInfo) -> dict[str, TargetLayout]:
    """``{name: TargetLayout}`` from a sampler's ``GetInfo`` reply."""
    axes = tuple(zip(info.mesh.axis_names, (int(s) for s in info.mesh.axis_sizes), strict=True))
    return {
        p.name: TargetLayout(tuple(p.partition), axes, p.dtype or None, tuple(p.shape))
        for p in info.params
    }


def layout_from_sharding(sharding, dtype=None) -> TargetLayout:
    """A :class:`TargetLayout` from a ``jax.sharding.NamedSharding`` (same-process tests)."""
    from splitrl.mesh import spec_to_strings

    mesh = sharding.mesh
    spec = sharding.spec
    return TargetLayout(
        tuple(spec_to_strings(spec, len(spec))),
        tuple(zip(mesh.axis_names, mesh.devices.shape, strict=True)),
        None if dtype is None else dtype_name(dtype),
    )


def _norm_index(index: Sequence[slice], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    out = []
    for sl, n in zip(index, shape, strict=True):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"shard index {index} has a step")
        out.append((start, stop))
    return tuple(out)


def _sender_blocks(array) -> list[tuple[tuple[tuple[int, int], ...], object]]:
    """``[(bounds per dim, host-array getter)]`` for each unique shard the sender holds."""
    shape = tuple(array.shape)
    shards = getattr(array, "addressable_shards", None)
    if shards is None:
        return [(tuple((0, n) for n in shape), lambda: np.asarray(array))]
    blocks = {}
    for shard in shards:
        if shard.replica_id != 0:
            continue
        bounds = _norm_index(shard.index, shape)
        blocks.setdefault(bounds, shard)
    covered = sum(math.prod(b - a for a, b in bounds) for bounds in blocks)
    if covered != math.prod(shape):
        raise ValueError(
            f"array of shape {list(shape)} is not fully addressable by this process "
            f"(its replica-0 shards cover {covered} of {math.prod(shape)} elements); "
            "a multi-host sender must push from a process that holds every region")
    return [(bounds, lambda s=shard: np.asarray(s.data)) for bounds, shard in
            sorted(blocks.items())]


def plan_regions(
    block: tuple[tuple[int, int], ...], shape: Sequence[int], target: TargetLayout | None
) -> list[tuple[tuple[int, int], ...]]:
    """Split one sender block along the receiver's block boundaries (its intersections)."""
    if target is None:
        return [block]
    per_dim = []
    for (lo, hi), n, size in zip(block, target.blocks_per_dim(shape), shape, strict=True):
        step = size // n if n else size
        cuts = [lo] + [c for c in range(0, size, step or 1) if lo < c < hi] + [hi]
        per_dim.append(list(zip(cuts[:-1], cuts[1:], strict=True)))
    return [tuple(r) for r in product(*per_dim)]


def iter_region_chunks(
    name: str,
    region: np.ndarray,
    *,
    shape: Sequence[int],
    version: int,
    max_chunk_bytes: int,
    region_start: Sequence[int] | None = None,
) -> Iterator[tensor_pb2.TensorChunk]:
    """Chunks (<= ``max_chunk_bytes`` each, whole elements) of ``region`` of a tensor.

    ``region_start`` None means ``region`` is the whole tensor (sent with empty region fields).
    """
    region = np.asarray(region, order="C")
    itemsize = region.dtype.itemsize
    if max_chunk_bytes < itemsize:
        raise ValueError(f"max_chunk_bytes {max_chunk_bytes} is smaller than one {region.dtype} "
                         "element")
    shape = [int(d) for d in shape]
    start = [0] * len(shape) if region_start is None else [int(s) for s in region_start]
    whole = list(region.shape) == shape and not any(start)
    meta = dict(
        name=name,
        dtype=dtype_name(region.dtype),
        shape=shape,
        region_start=[] if whole else start,
        region_shape=[] if whole else list(region.shape),
        version=version,
    )
    raw = _byte_view(region)
    step = max_chunk_bytes // itemsize * itemsize
    for offset in range(0, max(raw.size, 1), step):
        data = raw[offset : offset + step].tobytes()
        yield tensor_pb2.TensorChunk(offset=offset, data=data, checksum=crc32(data), **meta)


def iter_tensor_chunks(
    name: str,
    array,
    *,
    version: int,
    max_chunk_bytes: int,
    target: TargetLayout | None = None,
) -> Iterator[tensor_pb2.TensorChunk]:
    """All chunks of one parameter: per sender shard, per receiver block it overlaps."""
    shape = tuple(int(d) for d in array.shape)
    cast = numpy_dtype(target.dtype) if target is not None and target.dtype else None
    for block, get_host in _sender_blocks(array):
        host = get_host()
        for region in plan_regions(block, shape, target):
            local = tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in
                          zip(region, block, strict=True))
            data = host[local]
            if cast is not None and data.dtype != cast:
                data = data.astype(cast)
            yield from iter_region_chunks(
                name, data, shape=shape, version=version, max_chunk_bytes=max_chunk_bytes,
                region_start=[a for a, _ in region])


def iter_push_messages(
    flat_params: Mapping[str, object],
    version: int,
    *,
    max_chunk_bytes: int,
    target_shardings: Mapping[str, TargetLayout] | None = None,
    sender: str = "",
    reset: bool = False,
) -> Iterator[sampler_pb2.WeightPushMessage]:
    """The ``PushWeights`` request stream: a header, then every parameter's chunks.

    ``flat_params`` maps HF names to ``jax.Array`` (any sharding, fully addressable) or numpy
    arrays. ``target_shardings`` (from :func:`layouts_from_info`) is the receiver's layout:
    names must match it exactly, and values are cast to its dtypes; None sends each sender shard
    as one region. ``reset`` lets the receiver accept a version that is not newer (rollback to
    a checkpoint). Lazy: tensors are read one shard at a time as the stream is consumed.
    """
    if target_shardings is not None:
        missing = sorted(set(target_shardings) - set(flat_params))
        extra = sorted(set(flat_params) - set(target_shardings))
        if missing or extra:
            raise ValueError(f"parameters do not match the receiver's: missing {missing[:8]}, "
                             f"unexpected {extra[:8]}")
        for name, layout in target_shardings.items():
            got = tuple(flat_params[name].shape)
            if layout.shape is not None and tuple(layout.shape) != got:
                raise ValueError(f"parameter {name!r}: shape {list(got)}, receiver expects "
                                 f"{list(layout.shape)}")
    total = 0
    for name, array in flat_params.items():
        target = target_shardings[name] if target_shardings is not None else None
        dtype = numpy_dtype(target.dtype) if target and target.dtype else np.dtype(array.dtype)
        total += math.prod(array.shape) * dtype.itemsize
    header = sampler_pb2.PushHeader(
        version=version, tensor_count=len(flat_params), total_bytes=total, sender=sender,
        reset=reset)
    yield sampler_pb2.WeightPushMessage(header=header)
    for name in sorted(flat_params):
        target = target_shardings[name] if target_shardings is not None else None
        for chunk in iter_tensor_chunks(name, flat_params[name], version=version,
                                        max_chunk_bytes=max_chunk_bytes, target=target):
            yield sampler_pb2.WeightPushMessage(chunk=chunk)


# ----------------------------------------------------------------------------------------------
# Receiver


_INVALID = grpc.StatusCode.INVALID_ARGUMENT


@dataclass
class _Region:
    start: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    buffer: np.ndarray | None  # the region's own array (None once copied into the tensor)
    starts: list[int] = field(default_factory=list)  # sorted chunk byte intervals
    ends: list[int] = field(default_factory=list)
    received: int = 0


@dataclass
class _Tensor:
    dtype: np.dtype
    shape: tuple[int, ...]
    array: np.ndarray | None = None
    regions: dict[tuple, _Region] = field(default_factory=dict)
    done_elements: int = 0
    complete: bool = False
    taken: bool = False

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class ChunkAssembler:
    """Receiver side of one push: verifies chunks and assembles numpy arrays.

    ``expected`` is the receiver's manifest ``{name: (dtype name, shape)}``. ``tensor_count``
    and ``total_bytes`` come from the push header and are checked against it up front.
    """

    def __init__(
        self,
        expected: Mapping[str, tuple[str, Sequence[int]]],
        *,
        version: int,
        max_chunk_bytes: int,
        tensor_count: int | None = None,
        total_bytes: int | None = None,
    ):
        self.version = version
        self.max_chunk_bytes = max_chunk_bytes
        self._tensors = {
            name: _Tensor(numpy_dtype(dtype), tuple(int(d) for d in shape))
            for name, (dtype, shape) in expected.items()
        }
        self.expected_bytes = sum(t.size * t.dtype.itemsize for t in self._tensors.values())
        if tensor_count is not None and tensor_count != len(self._tensors):
            raise WireError(_INVALID, f"header.tensor_count is {tensor_count}, expected "
                            f"{len(self._tensors)} (every parameter of the sampler's model; "
                            "partial pushes are not supported)")
        if total_bytes is not None and total_bytes != self.expected_bytes:
            raise WireError(_INVALID, f"header.total_bytes is {total_bytes}, expected "
                            f"{self.expected_bytes} (the sampler's parameters in their dtypes)")
        self.total_bytes = total_bytes
        self.bytes_received = 0
        self.chunks_received = 0

    def add(self, chunk: tensor_pb2.TensorChunk) -> str | None:
        """Verify and store one chunk; returns the tensor's name if it is now complete."""
        index = self.chunks_received
        self.chunks_received += 1
        name = chunk.name
        where = f"chunk #{index} for {name!r}"
        tensor = self._tensors.get(name)
        if tensor is None:
            known = sorted(self._tensors)
            raise WireError(_INVALID, f"chunk #{index}: unknown parameter name {name!r}; the "
                            f"sampler's model has {len(known)} parameters, e.g. {known[:3]}")
        if chunk.version != self.version:
            raise WireError(_INVALID, f"{where}: version is {chunk.version}, expected "
                            f"{self.version} (the push header's version)")
        size = len(chunk.data)
        if size > self.max_chunk_bytes:
            raise WireError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{where}: data is {size} bytes, more than the sampler's "
                            f"max_chunk_bytes {self.max_chunk_bytes}")
        if chunk.dtype != tensor.dtype.name:
            raise WireError(_INVALID, f"{where}: dtype is {chunk.dtype!r}, expected "
                            f"{tensor.dtype.name!r}")
        if tuple(chunk.shape) != tensor.shape:
            raise WireError(_INVALID, f"{where}: shape is {list(chunk.shape)}, expected "
                            f"{list(tensor.shape)}")
        region = self._region(tensor, chunk, where)
        if region.buffer is None:
            raise WireError(_INVALID, f"{where}: duplicate chunk, region start "
                            f"{list(region.start)} shape {list(region.shape)} is already complete")
        end = chunk.offset + size
        if chunk.offset < 0 or end > region.nbytes or (size == 0 and region.nbytes > 0):
            raise WireError(_INVALID, f"{where}: bytes [{chunk.offset}, {end}) are outside the "
                            f"region's {region.nbytes} bytes (or empty)")
        if crc32(chunk.data) != chunk.checksum:
            raise WireError(grpc.StatusCode.DATA_LOSS,
                            f"{where}: checksum mismatch at offset {chunk.offset} "
                            f"(got crc32 {crc32(chunk.data):#010x}, header says "
                            f"{chunk.checksum:#010x}); the data was corrupted in transit")
        self._claim(region, chunk.offset, end, where)
        self.bytes_received += size
        if self.total_bytes is not None and self.bytes_received > self.total_bytes:
            raise WireError(_INVALID, f"{where}: {self.bytes_received} bytes received, more "
                            f"than header.total_bytes {self.total_bytes}")
        if size:
            region.buffer.reshape(-1).view(np.uint8)[chunk.offset : end] = np.frombuffer(
                chunk.data, np.uint8)
        region.received += size
        if region.received < region.nbytes:
            return None
        if region.buffer is not tensor.array:
            slices = tuple(slice(s, s + n) for s, n in zip(region.start, region.shape,
                                                           strict=True))
            tensor.array[slices] = region.buffer
        region.buffer = None
        tensor.done_elements += math.prod(region.shape)
        if tensor.done_elements == tensor.size:
            tensor.complete = True
            return name
        return None

    def _region(self, tensor: _Tensor, chunk, where: str) -> _Region:
        rank = len(tensor.shape)
        whole = not chunk.region_start and not chunk.region_shape
        start = (0,) * rank if whole else tuple(chunk.region_start)
        shape = tensor.shape if whole else tuple(chunk.region_shape)
        key = (start, shape)
        region = tensor.regions.get(key)
        if region is not None:
            return region
        if len(start) != rank or len(shape) != rank:
            raise WireError(_INVALID, f"{where}: region_start {list(start)} / region_shape "
                            f"{list(shape)} must both have {rank} entries (or both be empty)")
        for dim, (s, n, full) in enumerate(zip(start, shape, tensor.shape, strict=True)):
            if s < 0 or n < 0 or s + n > full or (n == 0 and tensor.size):
                raise WireError(_INVALID, f"{where}: region [{s}, {s + n}) in dim {dim} is "
                                f"outside [0, {full}) or empty")
        for other in tensor.regions.values():
            if all(max(a, b) < min(a + m, b + n) for a, m, b, n in
                   zip(start, shape, other.start, other.shape, strict=True)):
                raise WireError(_INVALID, f"{where}: region start {list(start)} shape "
                                f"{list(shape)} overlaps region start {list(other.start)} "
                                f"shape {list(other.shape)} already received")
        if tensor.array is None:
            tensor.array = np.empty(tensor.shape, tensor.dtype)
        buffer = tensor.array if shape == tensor.shape else np.empty(shape, tensor.dtype)
        region = _Region(start, shape, math.prod(shape) * tensor.dtype.itemsize, buffer)
        tensor.regions[key] = region
        return region

    @staticmethod
    def _claim(region: _Region, start: int, end: int, where: str) -> None:
        i = bisect.bisect_right(region.starts, start)
        if i and region.ends[i - 1] > start or i < len(region.starts) and region.starts[i] < end:
            kind = "duplicate" if start in region.starts else "overlapping"
            raise WireError(_INVALID, f"{where}: {kind} chunk, bytes [{start}, {end}) were "
                            "already received for this region")
        region.starts.insert(i, start)
        region.ends.insert(i, end)

    def pop(self, name: str) -> np.ndarray:
        """The assembled array of a complete tensor (the assembler drops its reference)."""
        tensor = self._tensors[name]
        if not tensor.complete or tensor.taken:
            raise KeyError(f"{name!r} is not complete or was already taken")
        array, tensor.array, tensor.taken = tensor.array, None, True
        return array

    def finish(self) -> None:
        """Raise INVALID_ARGUMENT unless every tensor arrived completely."""
        incomplete = []
        for name, tensor in sorted(self._tensors.items()):
            if tensor.complete:
                continue
            got = sum(r.received if r.buffer is not None else r.nbytes
                      for r in tensor.regions.values())
            incomplete.append(f"{name} ({got} of {tensor.size * tensor.dtype.itemsize} bytes)")
        if incomplete:
            raise WireError(_INVALID, f"incomplete push: {len(incomplete)} of "
                            f"{len(self._tensors)} tensors missing or partial: "
                            f"{', '.join(incomplete[:5])}"
                            + (f" ... (+{len(incomplete) - 5} more)" if len(incomplete) > 5
                               else ""))
        if self.total_bytes is not None and self.bytes_received != self.total_bytes:
            raise WireError(_INVALID, f"received {self.bytes_received} bytes, header.total_bytes "
                            f"said {self.total_bytes}")

    def complete_names(self) -> list[str]:
        return [n for n, t in self._tensors.items() if t.complete]


def assemble(
    messages: Iterable[tensor_pb2.TensorChunk],
    expected: Mapping[str, tuple[str, Sequence[int]]],
    *,
    version: int,
    max_chunk_bytes: int,
) -> dict[str, np.ndarray]:
    """Assemble a whole set of chunks into ``{name: array}`` (tests, tools)."""
    assembler = ChunkAssembler(expected, version=version, max_chunk_bytes=max_chunk_bytes)
    out = {}
    for chunk in messages:
        done = assembler.add(chunk)
        if done is not None:
            out[done] = assembler.pop(done)
    assembler.finish()
    return out
