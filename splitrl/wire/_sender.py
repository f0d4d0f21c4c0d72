"""The sender's side of a push: a header, then every parameter's regions in bounded chunks.

A chunk is produced as a *frame*: the ``TensorChunk`` fields without the bytes, plus the bytes
as a ``memoryview`` (zero-copy out of the host copy of one shard, or of the buffer a receiver
block is gathered in: valid until the next frame is drawn). The gRPC transport puts the bytes
into ``TensorChunk.data``; the bulk data plane sends them after the frame.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from splitrl.v1 import sampler_pb2, tensor_pb2
from splitrl.wire._core import WireArray, byte_view, checksum, dtype_name, numpy_dtype
from splitrl.wire._delta import delta_encode
from splitrl.wire._layout import (
    Bounds,
    TargetLayout,
    local_index,
    overlap,
    sender_blocks,
    target_blocks,
)

Frame = tuple[tensor_pb2.TensorChunk, memoryview]
# The host copy (in the wire dtype) of one sender block of the weights the receiver serves.
BaseBlocks = Callable[[str, Bounds], "np.ndarray | None"]
# Called with every block once its chunks are sent (in the wire dtype; ``fresh``: a cast made
# it, nobody else holds it): how a sender keeps the next base.
BlockSink = Callable[[str, Bounds, np.ndarray, bool], None]


def iter_region_frames(
    name: str,
    region: np.ndarray,
    *,
    shape: Sequence[int],
    version: int,
    max_chunk_bytes: int,
    region_start: Sequence[int] | None = None,
    base: np.ndarray | None = None,
) -> Iterator[Frame]:
    """Frames (<= ``max_chunk_bytes`` of payload each, whole elements) of ``region``.

    ``region_start`` None means ``region`` is the whole tensor (sent with empty region fields).
    With ``base`` (the same region of the weights the receiver serves) a chunk is sent as a
    delta (SPARSE or BITMAP, see ``_delta.py``) when that is smaller than its raw bytes.
    """
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
    raw = byte_view(region)
    old = None
    if base is not None:
        if base.shape != region.shape or base.dtype != region.dtype:
            raise ValueError(f"{name}: base region {base.dtype}{list(base.shape)} does not match "
                             f"{region.dtype}{list(region.shape)}")
        old = byte_view(base)
    step = max_chunk_bytes // itemsize * itemsize
    view = raw.data
    for offset in range(0, max(raw.size, 1), step):
        yield _chunk(meta, offset, view[offset : offset + step], raw[offset : offset + step],
                     None if old is None else old[offset : offset + step], itemsize)


def _chunk(meta: dict, offset: int, piece: memoryview, raw, old, itemsize: int):
    """One chunk: its checksum over the decoded bytes ``piece`` (``raw`` as numbers), sent as a
    delta against ``old`` (the receiver's copy of these bytes) when that is smaller, else raw."""
    crc = checksum(piece)
    if old is not None:
        encoded = delta_encode(raw, old, itemsize)
        if encoded is not None:
            encoding, payload = encoded
            return (tensor_pb2.TensorChunk(offset=offset, checksum=crc, encoding=encoding,
                                           length=len(piece), **meta), memoryview(payload))
    return tensor_pb2.TensorChunk(offset=offset, checksum=crc, **meta), piece


def iter_tensor_frames(
    name: str,
    array,
    *,
    version: int,
    max_chunk_bytes: int,
    target: TargetLayout | None = None,
    base: BaseBlocks | None = None,
    sink: BlockSink | None = None,
    gather: GatherBuffers | None = None,
) -> Iterator[Frame]:
    """All frames of one parameter: each of the receiver's blocks as one region, its bytes
    gathered from the sender's shards (each cast to the receiver's dtype once), so that every
    chunk lands contiguous in the receiver's block. ``target`` None: each sender shard is
    one region. ``base``/``sink``: see :func:`iter_push_frames`; ``gather``: the buffers to
    gather in (a push passes the same ones for every tensor)."""
    shape = tuple(int(d) for d in array.shape)
    cast = numpy_dtype(target.dtype) if target is not None and target.dtype else None
    shards = []
    for block in sender_blocks(array):
        host = block.read()
        fresh = cast is not None and host.dtype != cast
        if fresh:
            host = host.astype(cast)
        old = base(name, block.bounds) if base is not None else None
        if old is not None and (old.shape != host.shape or old.dtype != host.dtype):
            old = None  # the base was pushed from another sharding or dtype: send it whole
        if target is not None:
            shards.append(_Shard(block.bounds, host, old, fresh))
        else:  # one region per shard, read one shard at a time
            yield from iter_region_frames(name, host, shape=shape, version=version,
                                          max_chunk_bytes=max_chunk_bytes,
                                          region_start=[a for a, _ in block.bounds], base=old)
            if sink is not None:
                sink(name, block.bounds, host, fresh)
    if target is None:
        return
    gather = gather or GatherBuffers()
    itemsize = shards[0].host.dtype.itemsize
    bounds = tuple(shard.bounds for shard in shards)
    for target_block in target_blocks(shape, target):
        plan = _plan(target_block, bounds, max_chunk_bytes // itemsize * itemsize, itemsize)
        yield from _block_frames(name, plan, shards, shape=shape, version=version,
                                 max_chunk_bytes=max_chunk_bytes, gather=gather)
    if sink is not None:  # after the tensor's chunks: the bases may be overwritten now
        for shard in shards:
            sink(name, shard.bounds, shard.host, shard.fresh)


@dataclass(frozen=True)
class _Shard:
    bounds: Bounds
    host: np.ndarray  # in the wire dtype
    old: np.ndarray | None  # the same block of the weights the receiver serves
    fresh: bool


def _contiguous(inner: Bounds, outer: Bounds) -> bool:
    """Whether sub-box ``inner`` of a C-order array of box ``outer`` is one contiguous run:
    whole in every dim after the first it cuts, one element wide in every dim before it."""
    extents = [b - a for a, b in inner]
    if not math.prod(extents):
        return True
    sizes = [b - a for a, b in outer]
    d = len(sizes) - 1
    while d >= 0 and extents[d] == sizes[d]:
        d -= 1
    return all(e == 1 for e in extents[:max(d, 0)])


class GatherBuffers:
    """The buffers one push gathers slabs of receiver blocks in (the new bytes and, for a
    delta, the base's), reused from slab to slab: fresh ones would cost page faults."""

    def __init__(self) -> None:
        self._buffers = [np.empty(0, np.uint8), np.empty(0, np.uint8)]

    def get(self, nbytes: int, which: int) -> np.ndarray:
        if len(self._buffers[which]) < nbytes:
            self._buffers[which] = np.empty(nbytes, np.uint8)
        return self._buffers[which][:nbytes]


@dataclass(frozen=True)
class _BlockPlan:
    """How one receiver block is sent (:func:`_plan`). ``shard`` set: the block lies inside
    that shard where it is contiguous (rows of a row-split shard) and goes straight from the
    shard's memory at ``local``. ``parts`` set: its rows are longer than a chunk, and each
    (part, shard, local) overlap is its own region. Otherwise it is gathered in ``slabs`` of
    whole rows, each at most one chunk: (first row, rows, copies), a copy being (the piece's
    place in the slab, shard, its place in the shard)."""

    block: Bounds
    shard: int | None = None
    local: tuple[slice, ...] = ()
    parts: tuple[tuple[Bounds, int, tuple[slice, ...]], ...] = ()
    slabs: tuple[tuple[int, int, tuple[tuple[tuple[slice, ...], int, tuple[slice, ...]], ...]],
                 ...] = ()
    gathered_from: tuple[int, ...] = ()  # the shards a gathered block overlaps


@functools.lru_cache(maxsize=4096)
def _plan(block: Bounds, shards: tuple[Bounds, ...], step: int, itemsize: int) -> _BlockPlan:
    """How receiver ``block`` is cut from sender ``shards`` into chunks of at most ``step``
    bytes. Cached: every push of a run cuts the same blocks from the same shards, and working
    the overlaps out again cost more Python per push than the rest of the sender's."""
    extents = [b - a for a, b in block]
    parts = [(i, part) for i, bounds in enumerate(shards)
             if (part := overlap(block, bounds)) is not None]
    if not math.prod(extents):  # an empty tensor: sent as one empty region
        return _BlockPlan(block)
    if len(parts) == 1 and parts[0][1] == block and _contiguous(block, shards[parts[0][0]]):
        i = parts[0][0]
        return _BlockPlan(block, shard=i, local=local_index(block, shards[i]))
    row_bytes = math.prod(extents[1:]) * itemsize
    if not extents or row_bytes > step:
        return _BlockPlan(block, parts=tuple((part, i, local_index(part, shards[i]))
                                             for i, part in parts))
    rows = step // row_bytes
    top, bottom = block[0]
    slabs = []
    for first in range(top, bottom, rows):
        slab = ((first, min(first + rows, bottom)), *block[1:])
        copies = tuple((local_index(piece, slab), i, local_index(piece, shards[i]))
                       for i, _ in parts if (piece := overlap(slab, shards[i])) is not None)
        slabs.append((first - top, slab[0][1] - first, copies))
    return _BlockPlan(block, slabs=tuple(slabs), gathered_from=tuple(i for i, _ in parts))


def _block_frames(name: str, plan: _BlockPlan, shards: Sequence[_Shard], *, shape,
                  version: int, max_chunk_bytes: int, gather: GatherBuffers
                  ) -> Iterator[Frame]:
    """The frames of one receiver block, as ``plan`` says (C order).

    A gathered slab is one strided copy out of the sender's memory into a reused buffer in
    its cache, where the receiver would otherwise land the chunk in a scratch buffer and copy
    it into place with a strided write into memory not in its cache (measured ~5x slower per
    byte)."""
    dtype = shards[0].host.dtype
    block = plan.block
    start = [a for a, _ in block]
    kw = dict(shape=shape, version=version, max_chunk_bytes=max_chunk_bytes)
    if not plan.slabs:
        if plan.shard is not None:
            shard = shards[plan.shard]
            pieces = [(block, shard, plan.local)]
        elif plan.parts:
            pieces = [(part, shards[i], local) for part, i, local in plan.parts]
        else:  # empty: one empty chunk says it is complete
            yield from iter_region_frames(name, np.empty([b - a for a, b in block], dtype),
                                          region_start=start, **kw)
            return
        for part, shard, local in pieces:
            yield from iter_region_frames(
                name, shard.host[local], region_start=[a for a, _ in part],
                base=None if shard.old is None else shard.old[local], **kw)
        return
    delta = all(shards[i].old is not None for i in plan.gathered_from)
    extents = [b - a for a, b in block]
    meta = dict(name=name, dtype=dtype_name(dtype), shape=list(shape), region_start=start,
                region_shape=extents, version=version)
    row_bytes = math.prod(extents[1:]) * dtype.itemsize
    for first, count, copies in plan.slabs:
        new = gather.get(count * row_bytes, 0)
        out = new.view(dtype).reshape(count, *extents[1:])
        old = gather.get(count * row_bytes, 1) if delta else None
        for inside, i, local in copies:
            out[inside] = shards[i].host[local]
            if old is not None:
                base = shards[i].old
                assert base is not None  # delta: every shard gathered from has its base
                old.view(dtype).reshape(out.shape)[inside] = base[local]
        yield _chunk(meta, first * row_bytes, new.data, new, old, dtype.itemsize)


def check_targets(flat_params: Mapping[str, WireArray],
                  target_shardings: Mapping[str, TargetLayout] | None) -> None:
    """ValueError unless the receiver's layout names exactly our parameters, in our shapes."""
    if target_shardings is None:
        return
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


def push_header(
    flat_params: Mapping[str, WireArray],
    version: int,
    *,
    target_shardings: Mapping[str, TargetLayout] | None = None,
    sender: str = "",
    reset: bool = False,
    push_id: str = "",
    base_id: str = "",
) -> sampler_pb2.PushHeader:
    """The ``PushHeader`` of a push of ``flat_params`` (checked against the receiver's layout):
    ``total_bytes`` counts every parameter in the receiver's dtype."""
    check_targets(flat_params, target_shardings)
    total = 0
    for name, array in flat_params.items():
        target = target_shardings[name] if target_shardings is not None else None
        dtype = numpy_dtype(target.dtype) if target and target.dtype else np.dtype(array.dtype)
        total += math.prod(array.shape) * dtype.itemsize
    return sampler_pb2.PushHeader(version=version, tensor_count=len(flat_params),
                                  total_bytes=total, sender=sender, reset=reset,
                                  push_id=push_id, base_id=base_id)


def iter_push_frames(
    flat_params: Mapping[str, WireArray],
    version: int,
    *,
    max_chunk_bytes: int,
    target_shardings: Mapping[str, TargetLayout] | None = None,
    base: BaseBlocks | None = None,
    sink: BlockSink | None = None,
) -> Iterator[Frame]:
    """Every parameter's frames, in name order (the header comes from :func:`push_header`).

    ``flat_params`` maps HF names to ``jax.Array`` (any sharding, fully addressable) or numpy
    arrays; ``target_shardings`` (from ``layouts_from_info``) is the receiver's layout, whose
    dtypes the values are cast to; None sends each sender shard as one region. ``base`` gives
    the blocks of the weights the receiver serves (a delta push); ``sink`` sees every block as
    sent. Lazy: tensors are read one shard at a time as the stream is consumed.
    """
    check_targets(flat_params, target_shardings)
    gather = GatherBuffers()
    for name in sorted(flat_params):
        target = target_shardings[name] if target_shardings is not None else None
        yield from iter_tensor_frames(name, flat_params[name], version=version,
                                      max_chunk_bytes=max_chunk_bytes, target=target,
                                      base=base, sink=sink, gather=gather)


def _with_data(frames: Iterator[Frame]) -> Iterator[tensor_pb2.TensorChunk]:
    for chunk, payload in frames:
        chunk.data = bytes(payload)
        yield chunk


def iter_region_chunks(name: str, region: np.ndarray, **kw) -> Iterator[tensor_pb2.TensorChunk]:
    """:func:`iter_region_frames` as ``TensorChunk`` messages carrying their bytes in ``data``."""
    return _with_data(iter_region_frames(name, np.asarray(region), **kw))


def iter_tensor_chunks(name: str, array, **kw) -> Iterator[tensor_pb2.TensorChunk]:
    """:func:`iter_tensor_frames` as ``TensorChunk`` messages carrying their bytes in ``data``."""
    return _with_data(iter_tensor_frames(name, array, **kw))


def iter_push_messages(
    flat_params: Mapping[str, WireArray],
    version: int,
    *,
    max_chunk_bytes: int,
    target_shardings: Mapping[str, TargetLayout] | None = None,
    sender: str = "",
    reset: bool = False,
    push_id: str = "",
) -> Iterator[sampler_pb2.WeightPushMessage]:
    """The ``PushWeights`` request stream (gRPC): a header, then every parameter's chunks.

    A full push (the gRPC transport carries no deltas). ``reset`` lets the receiver accept a
    version that is not newer (rollback to a checkpoint).
    """
    yield sampler_pb2.WeightPushMessage(header=push_header(
        flat_params, version, target_shardings=target_shardings, sender=sender, reset=reset,
        push_id=push_id))
    frames = iter_push_frames(flat_params, version, max_chunk_bytes=max_chunk_bytes,
                              target_shardings=target_shardings)
    for chunk in _with_data(frames):
        yield sampler_pb2.WeightPushMessage(chunk=chunk)
