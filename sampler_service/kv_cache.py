"""The decode KV cache: one contiguous row per sequence, resized between segments, under a budget.

Layout (`CacheLayout`, chosen by the platform that decodes): R rows (one per sequence in
flight), S slots. On CPU the layers apart, as the sampler's CPU weights are
(`_programs.served_weights`): one (keys, values) pair per layer, keys ``[R, K, Dh, S]``
(transposed, so the score reduction streams along contiguous slots) and values ``[R, K, S, Dh]``,
so prefill, admit and decode each read and write a layer's own buffers (XLA:CPU's matmul and
reduction kernels take whole buffers: a layer sliced out of a stacked array would be copied
before every read, bench/README.md). On TPU and GPU every layer stacked on the leading axis as
the model's weights are (its forward scans the layers, reading and writing layer l at a
dynamic index), keys and values both ``[L, R, S, K, Dh]``, the layout the TPU compiler gives a
slot write and the decode matmuls (with any other, it keeps the whole cache in its own layout
beside the argument for the program's length: a second copy of the cache). With
``sampler.decode_attention`` "paged" (the default on TPU) the cache is
`paged_cache.PagedCache` instead: a page pool shared by the rows, which the Pallas
`paged_attention` kernel reads through page tables.
Row r holds its sequence at slots ``[0, length_r)``: the prompt, then each generated token as
it is fed back. Slots at or past a row's length hold stale (finite) values and are masked.

Shapes are bucketed (`bucket_rows`, `bucket_width`) and change only between decode segments
(`SlotCache.resize`: gather the surviving rows to the front, widen or narrow), so attention
reads about as many slots as the longest sequence needs, not the configured maximum, and a
handful of compiled programs serve a run. Measured on XLA CPU: attention over a sliced prefix
of a wider cache is ~2x slower than over an array of exactly that width, hence the resize.

Budget: ``budget_bytes`` bounds everything the cache holds at any moment, including the one
array (all keys or all values, or on CPU one layer's) that is alive twice while a resize copies
it. `SlotCache.fits`
is the admission test; the engine reserves each sequence's *final* width (prompt +
max_new_tokens) so a running batch never has to grow past the budget. `allocated_bytes` /
`peak_bytes` are the accounting.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from splitrl.mesh import TENSOR_AXIS
from splitrl.models import TransformerConfig
from splitrl.models.attention import slot_attend

MIN_WIDTH = 32  # smallest cache width (slots)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def bucket_rows(n: int, cap: int) -> int:
    """Rows of the cache for n sequences: the next power of two, at most cap (n <= cap)."""
    return min(_pow2(max(n, 1)), cap)


def bucket_width(n: int, cap: int) -> int:
    """Slots of the cache for sequences up to n tokens: the next power of two >= MIN_WIDTH,
    at most cap (n <= cap)."""
    return min(max(_pow2(n), MIN_WIDTH), cap)


@dataclasses.dataclass(frozen=True)
class CacheShape:
    rows: int
    width: int


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """How the cache's keys and values are held (module docstring): on CPU (``slot_major``
    False) one (keys, values) pair per layer with the slot axis last, elsewhere the layers
    stacked with the slot axis right after the rows. Every program that reads or writes the
    cache goes through it, so a layout exists in one place."""

    slot_major: bool

    @classmethod
    def for_mesh(cls, mesh: Mesh) -> CacheLayout:
        return cls(slot_major=any(d.platform != "cpu" for d in mesh.devices.flat))

    @property
    def layers_apart(self) -> bool:
        """Whether the cache, and the weights the programs take (`_programs.served_weights`),
        hold each layer in arrays of its own, and the programs run the layers unrolled over
        them (a Python int for the layer) rather than scan the stacked arrays. On CPU (not
        ``slot_major``): XLA:CPU's matmul and reduction kernels take whole buffers, so a scan
        copies each layer's weights and keys/values out of the stacked arrays at every step
        before reading them (bench/README.md, issue 37's regression); held apart, nothing is
        copied and everything is held once. TPU and GPU fuse a layer's slice into its reader
        and keep the scan, whose compile time is flat in depth; the CPU's grows with it
        (bench/compile_depth.py prints both decodes)."""
        return not self.slot_major

    def shapes(self, config: TransformerConfig, rows: int, width: int) -> tuple[tuple, tuple]:
        """(keys' shape, values' shape) of one array of a cache of ``rows`` x ``width`` slots:
        all layers' when stacked, one layer's when `layers_apart`."""
        c = config
        if self.slot_major:
            shape = (c.num_layers, rows, width, c.num_kv_heads, c.head_dim)
            return shape, shape
        return ((rows, c.num_kv_heads, c.head_dim, width),
                (rows, c.num_kv_heads, width, c.head_dim))

    def arrange(self, config: TransformerConfig, rows: int, width: int, make) -> tuple:
        """The cache's arrays, each ``make(shape)``: (keys, values) stacked over the layers,
        or one (keys, values) pair per layer when `layers_apart`."""
        k, v = self.shapes(config, rows, width)
        if self.layers_apart:
            return tuple((make(k), make(v)) for _ in range(config.num_layers))
        return make(k), make(v)

    @property
    def slot_axes(self) -> tuple[int, int]:
        """The slot axis of the keys' and of the values' arrays."""
        return (2, 2) if self.slot_major else (3, 2)

    @property
    def row_axis(self) -> int:
        return 1 if self.slot_major else 0

    @property
    def head_axis(self) -> int:
        return 3 if self.slot_major else 1

    def _layer(self, cache: tuple, layer) -> tuple[tuple, tuple]:
        """(keys, values) holding layer ``layer``, and the index before a row's in them."""
        if self.layers_apart:
            return cache[layer], ()
        return cache, (layer,)

    def width(self, cache: tuple, pages=None) -> int:
        """Slots per row of ``cache`` (``pages``: the paged layout's; unused here)."""
        (k_cache, _), _ = self._layer(cache, 0)
        return k_cache.shape[self.slot_axes[0]]

    def rows(self, cache: tuple, pages=None) -> int:
        """Rows of ``cache`` (``pages``: the paged layout's; unused here)."""
        (k_cache, _), _ = self._layer(cache, 0)
        return k_cache.shape[self.row_axis]

    def write(self, cache: tuple, layer, rows, slots, k, v, pages=None,
              sharding: NamedSharding | None = None) -> tuple:
        """Keys/values ``k, v`` [N, P, K, Dh] at slots ``slots`` [N, P] of rows ``rows`` [N]
        in layer ``layer`` (in place when ``cache`` is donated; an index past the cache:
        dropped; ``pages``: the paged layout's, unused here), the written arrays laid out by
        ``sharding``. One layer at a time: with the layer axis in the written window, the
        TPU compiler lays the whole cache out again for the scatter (a second copy of it)."""
        (k_cache, v_cache), at = self._layer(cache, layer)
        rows = rows[:, None]
        if self.slot_major:
            k_at = v_at = (*at, rows, slots)
        else:
            k_at, v_at = (*at, rows, slice(None), slice(None), slots), (*at, rows, slice(None),
                                                                        slots, slice(None))
        written = (k_cache.at[k_at].set(k.astype(k_cache.dtype), mode="drop"),
                   v_cache.at[v_at].set(v.astype(v_cache.dtype), mode="drop"))
        if sharding is not None:
            written = tuple(jax.lax.with_sharding_constraint(x, sharding) for x in written)
        if self.layers_apart:
            return cache[:layer] + (written,) + cache[layer + 1:]
        return written

    def attend(self, q, cache: tuple, layer, length, pages=None):
        """Decode attention of q [R, H, Dh] over layer ``layer`` of each row's slots
        ``< length[r]``."""
        (k_cache, v_cache), at = self._layer(cache, layer)
        return slot_attend(q, k_cache[at], v_cache[at], length, slot_major=self.slot_major)


DECODE_ATTENTION = ("auto", "xla", "paged")


def layout_for(mesh: Mesh, decode_attention: str = "auto", page_size: int = 64,
               head_dim: int = 128):
    """The cache layout ``sampler.decode_attention`` asks for on ``mesh``: "auto" the paged
    layout (a `paged_cache.PagedCache`, the Pallas kernel) on TPU when the kernel takes the
    model's ``head_dim`` (a multiple of 128: its TPU lowering tiles the head dimension by 128),
    else
    `CacheLayout.for_mesh`; "xla" always `CacheLayout.for_mesh` (XLA ops); "paged" always the
    paged layout (off TPU its attention runs in XLA ops: for checking the layout)."""
    from sampler_service.paged_cache import PagedLayout

    if decode_attention not in DECODE_ATTENTION:
        raise ValueError(f"decode_attention: expected one of {DECODE_ATTENTION}, got "
                         f"{decode_attention!r}")
    tpu = all(d.platform == "tpu" for d in mesh.devices.flat)
    if tpu and decode_attention == "paged" and head_dim % 128:
        raise ValueError(f"decode_attention: 'paged' runs the Pallas paged_attention kernel on "
                         f"TPU, which needs head_dim a multiple of 128; this model's is "
                         f"{head_dim} (use 'auto' or 'xla')")
    if decode_attention == "paged" or (decode_attention == "auto" and tpu
                                       and head_dim % 128 == 0):
        return PagedLayout(page_size, mesh)
    return CacheLayout.for_mesh(mesh)


class SlotCache:
    """The cache arrays of the engine's batch, their shape and their memory accounting."""

    paged = False  # rows own their slots (`paged_cache.PagedCache`: pages from a pool)

    def __init__(self, config: TransformerConfig, dtype, mesh: Mesh, *, budget_bytes: int,
                 max_rows: int, max_width: int, layout=None):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.mesh = mesh
        self.budget_bytes = int(budget_bytes)
        self.max_rows = int(max_rows)
        self.layout = CacheLayout.for_mesh(mesh) if layout is None else layout
        self.max_width = int(max_width)
        # keys and values (each stacked over the layers), or a pair per layer
        self.num_arrays = 2 * (config.num_layers if self.layout.layers_apart else 1)
        # keys + values of one token over all layers
        self.bytes_per_token = (2 * config.num_layers * config.num_kv_heads * config.head_dim
                                * self.dtype.itemsize)
        self.shape: CacheShape | None = None
        self.arrays: tuple | None = None  # as `CacheLayout.arrange` arranges them
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self._shardings: dict[int, NamedSharding] = {}

    # -- accounting -------------------------------------------------------------------------

    def shape_bytes(self, shape: CacheShape) -> int:
        return shape.rows * shape.width * self.bytes_per_token

    def bound_for(self, rows: int, width: int) -> CacheShape:
        """The largest cache shape ``rows`` sequences of at most ``width`` tokens can need."""
        return CacheShape(bucket_rows(rows, self.max_rows), bucket_width(width, self.max_width))

    def fits(self, rows: int, width: int) -> bool:
        """Whether ``rows`` sequences of up to ``width`` tokens fit the budget, counting the
        array held twice while a resize copies it."""
        if rows > self.max_rows or width > self.max_width:
            return False
        total = self.shape_bytes(self.bound_for(rows, width))
        return total + total // self.num_arrays <= self.budget_bytes

    def admits(self, widths: list[int]) -> bool:
        """Whether rows of final widths ``widths`` (those in the batch and the candidates) fit
        the rows and the budget."""
        return len(widths) <= self.max_rows and self.fits(len(widths), max(widths))

    def guaranteed_rows(self) -> int:
        """How many sequences of the maximum length always fit (0 if not even one)."""
        for rows in range(self.max_rows, 0, -1):
            if self.fits(rows, self.max_width):
                return rows
        return 0

    # -- pages: the paged cache's protocol (`paged_cache.PagedCache`), which a row that owns
    # its slots does not need: the scheduler calls both caches alike

    pages_in_use = 0

    def grow(self, pages: list[int], tokens: int) -> None:
        """Nothing to take: a row's slots are its own (a page pool gives it pages here)."""

    def free(self, pages: list[int]) -> None:
        """Nothing to return: a finished row's slots go with the row."""

    def page_table(self, rows: list[list[int] | None]) -> None:
        """No page tables: the programs index the rows' own slots."""
        return None

    def _account(self, nbytes: int) -> None:
        self.allocated_bytes = nbytes
        self.peak_bytes = max(self.peak_bytes, nbytes)

    # -- arrays -----------------------------------------------------------------------------

    def sharding(self, rows: int) -> NamedSharding:
        """KV heads on the "tensor" axis when they divide by it; any other mesh axis (data,
        fsdp) splits the rows when they divide by it; the rest is replicated."""
        if rows not in self._shardings:
            self._shardings[rows] = self._sharding(rows)
        return self._shardings[rows]

    def _sharding(self, rows: int) -> NamedSharding:
        sizes = dict(zip(self.mesh.axis_names, self.mesh.devices.shape, strict=True))
        heads: list[str] = []
        batch: list[str] = []
        for name, size in sizes.items():
            if size == 1:
                continue
            if name == TENSOR_AXIS and self.config.num_kv_heads % size == 0:
                heads.append(name)
            elif rows % (size * int(np.prod([sizes[a] for a in batch] or [1]))) == 0:
                batch.append(name)
        spec: list[tuple[str, ...] | None] = [None] * (4 if self.layout.layers_apart else 5)
        spec[self.layout.row_axis] = tuple(batch) or None
        spec[self.layout.head_axis] = tuple(heads) or None
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def resize(self, shape: CacheShape, sources: np.ndarray) -> None:
        """Re-lay the cache as ``shape``: new row i takes old row ``sources[i]`` (-1: nothing
        to keep), cut or padded to the new width. One array after the other (the keys, then
        the values; on CPU layer after layer), each old array dropped once copied, so at most
        one array is alive twice; the first call allocates."""
        if self.arrays is None:
            self.shape, self.arrays = shape, _zeros(self, shape)
            self._account(self.shape_bytes(shape))
            return
        assert self.shape is not None  # set with the arrays
        old_bytes = self.shape_bytes(self.shape) // self.num_arrays
        new_bytes = self.shape_bytes(shape) // self.num_arrays
        sharding = self.sharding(shape.rows)
        src = jnp.asarray(np.maximum(np.asarray(sources, np.int32), 0))
        arrays, treedef = jax.tree.flatten(self.arrays)
        held = self.num_arrays * old_bytes
        self.arrays = None
        for i in range(len(arrays)):  # keys, values, (keys, values, ...)
            self._account(held + new_bytes)
            arrays[i] = _relayout(arrays[i], src, width=shape.width,
                                  axis=self.layout.slot_axes[i % 2],
                                  row_axis=self.layout.row_axis, sharding=sharding)
            held += new_bytes - old_bytes
        self.shape, self.arrays = shape, jax.tree.unflatten(treedef, arrays)
        self._account(self.shape_bytes(shape))

    def abstract_arrays(self, shape: CacheShape) -> tuple:
        """The arrays of a cache of ``shape`` as sharded ShapeDtypeStructs (for lowering the
        programs ahead of time: nothing is allocated)."""
        sharding = self.sharding(shape.rows)
        return self.layout.arrange(self.config, shape.rows, shape.width,
                                   lambda s: jax.ShapeDtypeStruct(s, self.dtype,
                                                                  sharding=sharding))

    def release(self) -> None:
        """Drop the arrays (after a failed program, or when idle)."""
        self.shape, self.arrays = None, None
        self._account(0)


def _zeros(cache: SlotCache, shape: CacheShape) -> tuple:
    leaves, treedef = jax.tree.flatten(cache.abstract_arrays(shape))
    zeros = zeros_program(tuple(x.shape for x in leaves), cache.dtype, cache.sharding(shape.rows))
    return jax.tree.unflatten(treedef, zeros())


@functools.cache
def zeros_program(shapes: tuple, dtype, sharding: NamedSharding):
    """The program that makes zero arrays of ``shapes`` laid out by ``sharding`` on the devices
    (never whole on one), one per distinct argument: a cache allocated again at a shape it had
    (after a release, a resize back, or by another engine) runs it without tracing and
    compiling it anew."""
    return jax.jit(lambda: tuple(jnp.zeros(s, dtype) for s in shapes), out_shardings=sharding)


@functools.partial(jax.jit, static_argnames=("width", "axis", "row_axis", "sharding"))
def _relayout(array, sources, *, width, axis, row_axis, sharding):
    out = jnp.take(array, sources, axis=row_axis)
    have = out.shape[axis]
    if width < have:
        out = jax.lax.slice_in_dim(out, 0, width, axis=axis)
    elif width > have:
        pad = [(0, 0)] * out.ndim
        pad[axis] = (0, width - have)
        out = jnp.pad(out, pad)
    return jax.lax.with_sharding_constraint(out, sharding)


# ------------------------------------------------------------------------- decode attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotDecodeAttention:
    """The `splitrl.models` attention backend of one decode step over a `SlotCache`.

    Each row feeds one token: its key/value is written in place at slot ``write[r]`` of its
    row in layer ``layer``, then the query attends to the row's slots ``< write[r] + 1`` of
    that layer. ``layer`` is a traced index when the model scans its layers over a stacked
    cache, a Python int when they run apart (`CacheLayout.layers_apart`).
    """

    cache: tuple  # as ``layout`` arranges it
    write: jax.Array  # [R] int32
    layout: CacheLayout = dataclasses.field(default=CacheLayout(False),
                                            metadata=dict(static=True))
    sharding: NamedSharding | None = dataclasses.field(default=None, metadata=dict(static=True))
    pages: jax.Array | None = None  # [R, n] int32 page tables (`paged_cache.PagedLayout`)

    def attend(self, layer, q, k, v):
        rows = jnp.arange(self.write.shape[0])
        cache = self.layout.write(self.cache, layer, rows, self.write[:, None], k, v,
                                  self.pages, self.sharding)
        out = self.layout.attend(q[:, 0], cache, layer, self.write + 1, self.pages)
        return out[:, None], dataclasses.replace(self, cache=cache)
