"""The receiver's side of a push: every chunk verified, regions assembled into host arrays."""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
from numpy.typing import DTypeLike

from splitrl.v1 import tensor_pb2
from splitrl.wire._core import (
    aligned_empty,
    byte_view,
    checksum,
    has_nonfinite,
    numpy_dtype,
)
from splitrl.wire._delta import BITMAP, delta_apply
from splitrl.wire._layout import Bounds, local_index, overlap
from splitrl.wire_error import WireError

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_RAW, _SPARSE = tensor_pb2.TensorChunk.RAW, tensor_pb2.TensorChunk.SPARSE
_DELTAS = (_SPARSE, BITMAP)
_NAMES = {_RAW: "RAW", _SPARSE: "SPARSE", BITMAP: "BITMAP"}


@dataclass
class _Block:
    """One of the receiver's own blocks of a tensor (a device shard): where bytes end up."""

    bounds: Bounds
    array: np.ndarray | None = None  # 64-byte aligned, allocated on first use


@dataclass
class _Region:
    """A region being received: its bytes, in the region's C order, are ``runs`` of
    ``run_bytes`` each at those byte offsets of ``flat`` (its block's buffer, so chunks land in
    place; or, for a region spanning blocks, its own buffer, copied into the blocks it overlaps
    once complete)."""

    start: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    flat: np.ndarray | None  # None once complete
    runs: np.ndarray
    run_bytes: int
    own: bool
    starts: list[int] = field(default_factory=list)  # sorted chunk byte intervals
    ends: list[int] = field(default_factory=list)
    received: int = 0
    base: np.ndarray | None = None  # flat bytes of the same region of the served tensor

    @property
    def bounds(self) -> Bounds:
        return tuple((s, s + n) for s, n in zip(self.start, self.shape, strict=True))

    def place(self, start: int, end: int) -> memoryview | None:
        """The region's bytes [start, end) as one writable view, if they are contiguous."""
        assert self.flat is not None, "a complete region receives no more bytes"
        if end <= start:
            return self.flat[:0].data
        first, last = start // self.run_bytes, (end - 1) // self.run_bytes
        if first != last:
            return None
        at = int(self.runs[first]) if len(self.runs) else 0
        offset = start - first * self.run_bytes
        return self.flat[at + offset : at + offset + end - start].data

    def write(self, start: int, end: int, data: np.ndarray) -> None:
        """Copy ``data`` (flat bytes) to the region's bytes [start, end): whole runs in one
        strided numpy copy when the runs are evenly spaced (rows of a 2-D block)."""
        step, runs = self.run_bytes, self.runs
        assert self.flat is not None, "a complete region receives no more bytes"
        if end <= start:
            return
        first, last = start // step, (end - 1) // step
        spacing = np.diff(runs[first : last + 1])
        if last - first < 2 or not (spacing == spacing[0]).all():
            at = 0
            for i in range(first, last + 1):
                lo, hi = max(start - i * step, 0), min(end - i * step, step)
                self.flat[runs[i] + lo : runs[i] + hi] = data[at : at + hi - lo]
                at += hi - lo
            return
        rows = np.lib.stride_tricks.as_strided(
            self.flat[runs[first]:], shape=(last - first + 1, step),
            strides=(int(spacing[0]), 1), writeable=True)
        head = start - first * step
        rows[0, head:] = data[: step - head]
        middle = (last - first - 1) * step
        at = step - head
        rows[1:-1] = data[at : at + middle].reshape(-1, step)
        rows[-1, : end - last * step] = data[at + middle :]


@dataclass
class _Tensor:
    dtype: np.dtype
    dtype_name: str  # the wire name, compared with every chunk's
    shape: tuple[int, ...]
    blocks: list[_Block]
    regions: dict[tuple, _Region] = field(default_factory=dict)
    done_elements: int = 0
    complete: bool = False
    taken: bool = False
    modified: bool = False  # any byte differs from the base (always, for a full push)
    nonfinite: bool = False  # a chunk held a NaN or an Inf
    base: np.ndarray | None = None  # the served tensor on the host (delta pushes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _inside(inner: Bounds, outer: Bounds) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer, strict=True))


@functools.lru_cache(maxsize=4096)
def _home(region: Bounds, blocks: tuple[Bounds, ...]) -> int | None:
    """The index of the first of ``blocks`` that holds all of ``region`` (None: it spans
    several). Cached: every push of a run cuts the same regions."""
    return next((i for i, block in enumerate(blocks) if _inside(region, block)), None)


@functools.lru_cache(maxsize=4096)
def _runs(inner: Bounds, outer: Bounds, itemsize: int) -> tuple[np.ndarray, int]:
    """Where sub-box ``inner`` of C-order box ``outer`` lies: the byte offsets of its
    contiguous runs (in ``inner``'s C order) and the bytes per run. A region of whole rows is
    one run; fsdp columns inside a tensor-parallel column block are one run per row. Cached
    (read-only): every push of a run cuts the same regions."""
    extents = [i1 - i0 for i0, i1 in inner]
    sizes = [o1 - o0 for o0, o1 in outer]
    rank = len(extents)
    split = rank - 1 if rank else 0  # dims after ``split`` are whole: a run spans them
    while split > 0 and extents[split] == sizes[split]:
        split -= 1
    strides = [math.prod(sizes[d + 1:]) for d in range(rank)]
    first = sum((i0 - o0) * st for (i0, _), (o0, _), st in zip(inner, outer, strides,
                                                                strict=True))
    run = math.prod(extents[split:]) if rank else 1
    lead = extents[:split]
    grid = np.indices(lead, dtype=np.int64).reshape(len(lead), -1) if lead else \
        np.zeros((0, 1), np.int64)
    offsets = (first + (grid * np.array(strides[:split], np.int64)[:, None]).sum(0)) * itemsize
    offsets.flags.writeable = False
    return offsets, run * itemsize


@dataclass
class _Pending:
    """A RAW chunk whose bytes are being received straight into their place."""

    chunk: tensor_pb2.TensorChunk
    tensor: _Tensor
    region: _Region
    start: int
    end: int
    where: str
    view: memoryview  # where the bytes were received
    scattered: bool  # ``view`` is scratch: copy into the region's runs on commit


class ChunkAssembler:
    """Receiver side of one push: verifies chunks and assembles numpy arrays.

    ``expected`` is the receiver's manifest ``{name: (dtype name, shape)}``. ``tensor_count``
    and ``total_bytes`` come from the push header and are checked against it up front.
    ``blocks`` (``{name: [bounds per device shard]}``, default the whole tensor) is how the
    receiver holds each tensor: bytes are assembled per block in 64-byte aligned buffers, and a
    chunk of a region inside one block (what a sender that cuts along the receiver's blocks
    sends) is received straight into its place there when that is contiguous (rows, fsdp
    shards in tensor-parallel row blocks), else into a reused scratch buffer and copied into
    place in one strided copy (fsdp columns inside tensor-parallel column blocks). ``base`` (a
    delta push) returns the served tensor as a host array; only with it may chunks be deltas.
    ``allocate(shape, dtype)`` makes the blocks' buffers (64-byte aligned; e.g.
    :meth:`splitrl.wire.StagingPool.take`, which reuses the buffers of earlier pushes).

    Every float chunk is also checked for NaN and Inf while its bytes are still in the cache
    (:func:`has_nonfinite`); :meth:`nonfinite_names` lists the tensors that had any.
    """

    def __init__(
        self,
        expected: Mapping[str, tuple[str, Sequence[int]]],
        *,
        version: int,
        max_chunk_bytes: int,
        tensor_count: int | None = None,
        total_bytes: int | None = None,
        base: Callable[[str], np.ndarray] | None = None,
        blocks: Mapping[str, Sequence[Bounds]] | None = None,
        allocate: Callable[[tuple[int, ...], DTypeLike], np.ndarray] = aligned_empty,
    ):
        self.version = version
        self._allocate = allocate
        self.max_chunk_bytes = max_chunk_bytes
        self._base = base
        self._tensors = {}
        for name, (dtype, shape) in expected.items():
            shape = tuple(int(d) for d in shape)
            own = (blocks or {}).get(name) or [tuple((0, n) for n in shape)]
            self._tensors[name] = _Tensor(numpy_dtype(dtype), dtype, shape,
                                          [_Block(tuple((a, b) for a, b in bounds))
                                           for bounds in own])
        self.expected_bytes = sum(t.size * t.dtype.itemsize for t in self._tensors.values())
        if tensor_count is not None and tensor_count != len(self._tensors):
            raise WireError(_INVALID, f"header.tensor_count is {tensor_count}, expected "
                            f"{len(self._tensors)} (every parameter of the sampler's model; "
                            "partial pushes are not supported)")
        if total_bytes is not None and total_bytes != self.expected_bytes:
            raise WireError(_INVALID, f"header.total_bytes is {total_bytes}, expected "
                            f"{self.expected_bytes} (the sampler's parameters in their dtypes)")
        self.total_bytes = total_bytes
        self.bytes_received = 0  # decoded bytes
        self.payload_bytes = 0  # bytes on the wire (fewer than decoded for deltas)
        self.chunks_received = 0
        self._pending: _Pending | None = None
        self._scratch: np.ndarray | None = None  # chunks whose place is not contiguous

    # -- the two ways in --------------------------------------------------------------------

    def add(self, chunk: tensor_pb2.TensorChunk, payload=None) -> str | None:
        """Verify and store one chunk whose bytes are ``payload`` (default ``chunk.data``);
        returns the tensor's name if it is now complete."""
        payload = memoryview(chunk.data if payload is None else payload).cast("B")
        if chunk.encoding == _RAW:
            self.reserve(chunk, len(payload))[:] = payload
            return self.commit()
        tensor, region, start, end, where = self._locate(chunk, len(payload))
        if self._base is None:
            raise WireError(_INVALID, f"{where}: a {_NAMES[chunk.encoding]} chunk in a full push "
                            "(header.base_id is empty); deltas need the base the sampler serves")
        if region.base is None:
            region.base = self._region_base(chunk.name, tensor, region)
        decoded = region.base[start:end].copy()
        try:
            changed = delta_apply(decoded, payload, tensor.dtype.itemsize, chunk.encoding)
        except ValueError as e:
            raise WireError(_INVALID, f"{where}: {e}") from None
        self.payload_bytes += len(payload)
        tensor.modified = tensor.modified or changed > 0
        self._verify(chunk, checksum(decoded), start, where)
        self._check_finite(tensor, decoded)
        region.write(start, end, decoded)
        return self._complete(chunk, tensor, region, start, end)

    def reserve(self, chunk: tensor_pb2.TensorChunk, size: int) -> memoryview:
        """Check a RAW chunk of ``size`` bytes and return where to receive its bytes: its place
        in the receiver's block when that is contiguous (no copy at all), else a scratch buffer
        whose bytes :meth:`commit` copies into place in one strided copy. Receive, then call
        :meth:`commit` (before the next chunk)."""
        if chunk.encoding != _RAW:
            raise WireError(_INVALID, f"chunk #{self.chunks_received}: encoding "
                            f"{chunk.encoding} cannot be received in place; only RAW")
        if chunk.length and chunk.length != size:
            raise WireError(_INVALID, f"chunk #{self.chunks_received} for {chunk.name!r}: length "
                            f"is {chunk.length} for a RAW payload of {size} bytes")
        tensor, region, start, end, where = self._locate(chunk, size)
        view = region.place(start, end)
        scattered = view is None
        if view is None:
            if self._scratch is None or len(self._scratch) < size:
                self._scratch = self._allocate((max(size, self.max_chunk_bytes),), np.uint8)
            view = self._scratch[:size].data
        self._pending = _Pending(chunk, tensor, region, start, end, where, view, scattered)
        return view

    def commit(self) -> str | None:
        """Verify the bytes received for the chunk :meth:`reserve` placed."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("commit() without a reserve()")
        self.payload_bytes += pending.end - pending.start
        pending.tensor.modified = True
        self._verify(pending.chunk, checksum(pending.view), pending.start, pending.where)
        self._check_finite(pending.tensor, pending.view)
        if pending.scattered:
            pending.region.write(pending.start, pending.end,
                                 np.frombuffer(pending.view, np.uint8))
        return self._complete(pending.chunk, pending.tensor, pending.region, pending.start,
                              pending.end)

    # -- checks -----------------------------------------------------------------------------

    @staticmethod
    def _check_finite(tensor: _Tensor, data) -> None:
        if not tensor.nonfinite and has_nonfinite(data, tensor.dtype):
            tensor.nonfinite = True

    def _locate(self, chunk, size: int) -> tuple[_Tensor, _Region, int, int, str]:
        """Every check that does not need the bytes; claims the chunk's byte range."""
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
        if size > self.max_chunk_bytes:
            raise WireError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{where}: data is {size} bytes, more than the sampler's "
                            f"max_chunk_bytes {self.max_chunk_bytes}")
        if chunk.dtype != tensor.dtype_name:
            raise WireError(_INVALID, f"{where}: dtype is {chunk.dtype!r}, expected "
                            f"{tensor.dtype_name!r}")
        if tuple(chunk.shape) != tensor.shape:
            raise WireError(_INVALID, f"{where}: shape is {list(chunk.shape)}, expected "
                            f"{list(tensor.shape)}")
        if chunk.encoding not in _NAMES:
            raise WireError(_INVALID, f"{where}: unknown encoding {chunk.encoding} (expected "
                            f"one of {sorted(_NAMES.values())})")
        region = self._region(tensor, chunk, where)
        if region.flat is None:
            raise WireError(_INVALID, f"{where}: duplicate chunk, region start "
                            f"{list(region.start)} shape {list(region.shape)} is already complete")
        length = chunk.length if chunk.encoding in _DELTAS else size
        itemsize = tensor.dtype.itemsize
        if chunk.offset % itemsize or length % itemsize:
            raise WireError(_INVALID, f"{where}: bytes [{chunk.offset}, "
                            f"{chunk.offset + length}) do not start and end on whole "
                            f"{itemsize}-byte {tensor.dtype_name} elements")
        if chunk.encoding in _DELTAS and (length <= 0 or length > self.max_chunk_bytes):
            raise WireError(_INVALID, f"{where}: a delta chunk's length must be a positive "
                            f"number of {itemsize}-byte elements up to "
                            f"max_chunk_bytes {self.max_chunk_bytes}; got {length}")
        end = chunk.offset + length
        if chunk.offset < 0 or end > region.nbytes or (length == 0 and region.nbytes > 0):
            raise WireError(_INVALID, f"{where}: bytes [{chunk.offset}, {end}) are outside the "
                            f"region's {region.nbytes} bytes (or empty)")
        self._claim(region, chunk.offset, end, where)
        self.bytes_received += length
        if self.total_bytes is not None and self.bytes_received > self.total_bytes:
            raise WireError(_INVALID, f"{where}: {self.bytes_received} bytes received, more "
                            f"than header.total_bytes {self.total_bytes}")
        return tensor, region, chunk.offset, end, where

    @staticmethod
    def _verify(chunk, got: int, start: int, where: str) -> None:
        if got != chunk.checksum:
            what = ("the delta does not turn the sampler's base into the sender's bytes (or was "
                    "corrupted in transit)" if chunk.encoding in _DELTAS
                    else "the data was corrupted in transit")
            raise WireError(grpc.StatusCode.DATA_LOSS,
                            f"{where}: checksum mismatch at offset {start} (got crc32c "
                            f"{got:#010x}, header says {chunk.checksum:#010x}); {what}")

    def _complete(self, chunk, tensor: _Tensor, region: _Region, start: int,
                  end: int) -> str | None:
        region.received += end - start
        if region.received < region.nbytes:
            return None
        if region.own:
            assert region.flat is not None  # set to None below, once the region is complete
            values = region.flat.view(tensor.dtype).reshape(region.shape)
            for block in tensor.blocks:
                part = overlap(region.bounds, block.bounds)
                if part is not None:
                    self._block_array(tensor, block)[local_index(part, block.bounds)] = \
                        values[local_index(part, region.bounds)]
        region.flat = region.base = None
        tensor.done_elements += math.prod(region.shape)
        if tensor.done_elements == tensor.size:
            tensor.complete = True
            tensor.base = None
            return chunk.name
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
        nbytes = math.prod(shape) * tensor.dtype.itemsize
        bounds = tuple((s, s + n) for s, n in zip(start, shape, strict=True))
        home_index = _home(bounds, tuple(b.bounds for b in tensor.blocks))
        if home_index is not None:
            home = tensor.blocks[home_index]
            runs, run_bytes = _runs(bounds, home.bounds, tensor.dtype.itemsize)
            flat = self._block_array(tensor, home).reshape(-1).view(np.uint8)
            region = _Region(start, shape, nbytes, flat, runs, run_bytes, own=False)
        else:  # it spans blocks: assembled apart, copied into each block once complete
            region = _Region(start, shape, nbytes, np.empty(nbytes, np.uint8),
                             np.zeros(1, np.int64), max(nbytes, 1), own=True)
        tensor.regions[key] = region
        return region

    def _block_array(self, tensor: _Tensor, block: _Block) -> np.ndarray:
        if block.array is None:
            block.array = self._allocate(tuple(b - a for a, b in block.bounds), tensor.dtype)
        return block.array

    def _region_base(self, name: str, tensor: _Tensor, region: _Region) -> np.ndarray:
        if tensor.base is None:
            assert self._base is not None  # receive() refuses a delta chunk without a base
            base = np.asarray(self._base(name))
            if base.shape != tensor.shape or base.dtype != tensor.dtype:
                raise WireError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{name!r}: the served base is {base.dtype}{list(base.shape)}, "
                                f"the push {tensor.dtype}{list(tensor.shape)}")
            tensor.base = base
        whole = tuple((0, n) for n in tensor.shape)
        return byte_view(tensor.base[local_index(region.bounds, whole)])

    @staticmethod
    def _claim(region: _Region, start: int, end: int, where: str) -> None:
        i = bisect.bisect_right(region.starts, start)
        if i and region.ends[i - 1] > start or i < len(region.starts) and region.starts[i] < end:
            kind = "duplicate" if start in region.starts else "overlapping"
            raise WireError(_INVALID, f"{where}: {kind} chunk, bytes [{start}, {end}) were "
                            "already received for this region")
        region.starts.insert(i, start)
        region.ends.insert(i, end)

    # -- results ----------------------------------------------------------------------------

    def modified(self, name: str) -> bool:
        """False when a complete tensor of a delta push equals the base bit for bit (every chunk
        a delta with no change): the receiver may keep serving the base's array."""
        return self._tensors[name].modified

    def nonfinite_names(self) -> list[str]:
        """The tensors any of whose chunks held a NaN or an Inf, sorted."""
        return sorted(n for n, t in self._tensors.items() if t.nonfinite)

    def pop_blocks(self, name: str) -> dict[Bounds, np.ndarray]:
        """A complete tensor as ``{block bounds: array}`` (the assembler drops its references)."""
        tensor = self._tensors[name]
        if not tensor.complete or tensor.taken:
            raise KeyError(f"{name!r} is not complete or was already taken")
        tensor.taken = True
        out = {b.bounds: self._block_array(tensor, b) for b in tensor.blocks}
        for block in tensor.blocks:
            block.array = None
        return out

    def pop(self, name: str) -> np.ndarray:
        """A complete tensor as one array (the assembler drops its references)."""
        shape = self._tensors[name].shape
        blocks = self.pop_blocks(name)
        whole = tuple((0, n) for n in shape)
        if whole in blocks:
            return blocks[whole]
        array = np.empty(shape, self._tensors[name].dtype)
        for bounds, block in blocks.items():
            array[local_index(bounds, whole)] = block
        return array

    def finish(self) -> None:
        """Raise INVALID_ARGUMENT unless every tensor arrived completely."""
        incomplete = []
        for name, tensor in sorted(self._tensors.items()):
            if tensor.complete:
                continue
            got = sum(r.received for r in tensor.regions.values())
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
