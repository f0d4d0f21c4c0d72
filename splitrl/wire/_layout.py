"""Where the bytes of a tensor are: the sender's shards, the receiver's blocks, and the regions
(their intersections) a push is cut into."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING

import numpy as np

from splitrl.v1 import sampler_pb2
from splitrl.wire._core import dtype_name

if TYPE_CHECKING:  # the wire reads jax arrays without importing jax
    import jax

Bounds = tuple[tuple[int, int], ...]  # [start, stop) per dim


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


def overlap(a: Bounds, b: Bounds) -> Bounds | None:
    """The intersection of two boxes, or None if it is empty."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def local_index(inner: Bounds, outer: Bounds) -> tuple[slice, ...]:
    """Box ``inner`` as an index into an array that holds box ``outer``."""
    return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer, strict=True))


def _norm_index(index: Sequence[slice], shape: Sequence[int]) -> Bounds:
    out = []
    for sl, n in zip(index, shape, strict=True):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"shard index {index} has a step")
        out.append((start, stop))
    return tuple(out)


@dataclass(frozen=True)
class SenderBlock:
    """One unique shard the sender holds: its bounds in the tensor and how to read it."""

    bounds: Bounds
    read: Callable[[], np.ndarray]  # the block as a host array, in the sender's dtype


def build_shard_lists(arrays: Iterable) -> None:
    """Have jaxlib build each ``jax.Array``'s list of per-device arrays now, on this thread,
    before other threads read the arrays. jaxlib (0.10) builds that list on the first read of
    an array's shards and does not guard the build: a second reader that runs while it is under
    way (a thread switch there) adds every device's buffer again, for good, and the array then
    fails every program it is passed to ("Expected 2 per-device arrays ... got 4"). A sampler's
    two batches once made the layer views of a just-pushed state at once; a LoRA sampler's
    warm-up reads the served arrays while requests are served; the trainer's push threads read
    the same parameters' shards (:func:`sender_blocks`), one thread per group of samplers.
    Built here, the list is only ever read after."""
    for array in arrays:
        getattr(array, "addressable_shards", None)  # host arrays have none


def sender_blocks(array) -> list[SenderBlock]:
    """The unique shards (``replica_id == 0``) of ``array``: a ``jax.Array`` of any sharding,
    fully addressable, or a host array (one block). Reading a block copies one shard to the
    host (zero-copy for CPU devices)."""
    shape = tuple(array.shape)
    shards = getattr(array, "addressable_shards", None)
    if shards is None:
        return [SenderBlock(tuple((0, n) for n in shape), lambda: np.asarray(array))]
    blocks: dict[Bounds, jax.Shard] = {}
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
    return [SenderBlock(bounds, functools.partial(_read_shard, shard))
            for bounds, shard in sorted(blocks.items())]


def _read_shard(shard: jax.Shard) -> np.ndarray:
    return np.asarray(shard.data)


@functools.lru_cache(maxsize=4096)
def target_blocks(shape: tuple[int, ...], target: TargetLayout) -> tuple[Bounds, ...]:
    """The receiver's blocks of a tensor of ``shape`` (each once, replicas aside), in C order
    of the block grid. Cached: every push of a run asks for the same ones."""
    per_dim = []
    for size, n in zip(shape, target.blocks_per_dim(shape), strict=True):
        step = size // n
        per_dim.append([(i * step, (i + 1) * step) for i in range(n)])
    return tuple(tuple(b) for b in product(*per_dim))


def plan_regions(block: Bounds, shape: Sequence[int], target: TargetLayout | None) -> list[Bounds]:
    """Split one sender block along the receiver's block boundaries (its intersections)."""
    if target is None:
        return [block]
    per_dim = []
    for (lo, hi), n, size in zip(block, target.blocks_per_dim(shape), shape, strict=True):
        step = size // n if n else size
        cuts = [lo] + [c for c in range(0, size, step or 1) if lo < c < hi] + [hi]
        per_dim.append(list(zip(cuts[:-1], cuts[1:], strict=True)))
    return [tuple(r) for r in product(*per_dim)]
