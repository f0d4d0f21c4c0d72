"""The decode KV cache as a page pool shared by every row, for the Pallas `paged_attention`
kernel (TPU): vLLM's PagedAttention memory model.

Used when ``sampler.decode_attention`` resolves to "paged" (`kv_cache.layout_for`: by default
on TPU when the model's heads are 128 wide); the slot cache (`kv_cache.SlotCache`) otherwise.

Memory: keys and values are each one pool ``[L, K, pages + 1, page_size, Dh]`` allocated once
(``sampler.kv_pages`` pages of ``sampler.kv_page_size`` tokens, one layer's ``[K, P, page,
Dh]`` being the kernel's pool as is), so what a batch holds is set by the pool, not by rows x
the longest sequence. The extra page is scratch: a page table's unused entries point at it,
so a row that is empty or has finished writes its (discarded) keys/values there and reads
finite values, never another row's page.

Rows: row r's token t lives at page ``table[r, t // page_size]``, offset ``t % page_size``. A
row's pages (a list of page numbers, in token order) are taken from the free list as it grows,
a decode segment's worth at each boundary (`PagedCache.grow`), and returned when it finishes
(`PagedCache.free`). A
sequence holds at most ``sampler.kv_pages_per_sequence`` pages (the table's width), which
bounds ``max_sequence_length``.

Admission reserves pages for each row's *final* length (prompt + max_new_tokens, rounded up
to pages; `PagedCache.admits`), so a running row always finds the pages it grows into: a
prompt whose rows do not fit waits in the queue until rows finish; nothing is preempted.
Pages are taken when needed and reused as soon as freed, so the pool's contents depend on
the history of the batch; which pages a row holds never changes a value it reads (a page is
written before it is read, slots past a row's length are masked or not read at all).

The tables passed to the programs are cut to the segment's cache width (`CacheShape.width`,
bucketed as the slot cache's is), so the XLA path gathers, and programs are compiled for,
about as many pages as the longest row needs, not the table's full width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sampler_service.kv_cache import zeros_program
from splitrl.mesh import TENSOR_AXIS
from splitrl.models import TransformerConfig
from splitrl.models.paged import paged_attend

PAGE_MULTIPLE = 16


def check_page_size(page_size: int, key: str = "kv_page_size") -> None:
    """ValueError naming ``key`` unless ``page_size`` is a positive multiple of 16."""
    if page_size < 1 or page_size % PAGE_MULTIPLE:
        raise ValueError(f"{key}: expected a positive multiple of {PAGE_MULTIPLE} (a bfloat16 "
                         f"page fills whole TPU tiles), got {page_size}")


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens."""
    return -(-int(tokens) // page_size)


def page_bytes(config: TransformerConfig, dtype, page_size: int) -> int:
    """Bytes of one page: ``page_size`` tokens' keys and values over all layers."""
    return (page_size * 2 * config.num_layers * config.num_kv_heads * config.head_dim
            * jnp.dtype(dtype).itemsize)


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """The page pool's layout (module docstring): the methods of `kv_cache.CacheLayout`, each
    with the rows' page tables ``pages`` [R, n] (int32; the scratch page where unused).
    ``mesh`` is the engine's: the kernel runs under a shard_map over it (key/value heads over
    its tensor axis)."""

    page_size: int
    mesh: Mesh | None = None

    head_axis = 1
    layers_apart = False  # decode scans the layers (`kv_cache.CacheLayout.layers_apart`)

    def __post_init__(self):
        check_page_size(self.page_size)

    def shapes(self, config: TransformerConfig, pages: int) -> tuple[tuple, tuple]:
        """(keys' shape, values' shape) of a pool of ``pages`` pages (the scratch page
        included): both [L, K, pages, page_size, Dh]."""
        shape = (config.num_layers, config.num_kv_heads, pages, self.page_size, config.head_dim)
        return shape, shape

    def width(self, cache: tuple, pages) -> int:
        """Slots a row can address through ``pages``."""
        return pages.shape[1] * self.page_size

    def rows(self, cache: tuple, pages) -> int:
        """Rows the page tables ``pages`` hold."""
        return pages.shape[0]

    def write(self, cache: tuple, layer, rows, slots, k, v, pages,
              sharding: NamedSharding | None = None) -> tuple:
        """Keys/values ``k, v`` [N, P, K, Dh] at slots ``slots`` [N, P] of rows ``rows`` [N]
        in layer ``layer``, through the rows' page tables (in place when ``cache`` is
        donated; a row past the tables or a slot past their width: dropped), the pools laid
        out by ``sharding``."""
        k_cache, v_cache = cache
        table_rows, columns = pages.shape
        rows = rows[:, None]
        page = pages.at[rows, slots // self.page_size].get(mode="clip")
        inside = (rows < table_rows) & (slots < columns * self.page_size)
        page = jnp.where(inside, page, k_cache.shape[2])  # past the pool: dropped
        # The heads indexed, not sliced: the written window is the head dimension alone, the
        # cache's minor one (as `kv_cache.CacheLayout.write` says why).
        heads = jnp.arange(k_cache.shape[self.head_axis])[None, None, :]
        at = (layer, heads, page[:, :, None], (slots % self.page_size)[:, :, None])
        written = (k_cache.at[at].set(k.astype(k_cache.dtype), mode="drop"),
                   v_cache.at[at].set(v.astype(v_cache.dtype), mode="drop"))
        if sharding is not None:
            written = tuple(jax.lax.with_sharding_constraint(x, sharding) for x in written)
        return written

    def attend(self, q, cache: tuple, layer, length, pages):
        """Decode attention of q [R, H, Dh] over layer ``layer`` of each row's slots
        ``< length[r]`` (`splitrl.models.paged.paged_attend`: the kernel on TPU)."""
        k_cache, v_cache = cache
        return paged_attend(q, k_cache[layer], v_cache[layer], length, pages, mesh=self.mesh)


class PagedCache:
    """A batch's page pool, its free list and its accounting: the methods the scheduler uses
    of `kv_cache.SlotCache`, plus `admits`, `grow`, `free` and `page_table`."""

    paged = True
    num_arrays = 2  # keys, values (each stacked over the layers)

    def __init__(self, config: TransformerConfig, dtype, mesh: Mesh, *, layout: PagedLayout,
                 pages: int, pages_per_sequence: int, max_rows: int, max_width: int):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.mesh = mesh
        self.layout = layout
        self.page_size = layout.page_size
        self.num_pages = int(pages)
        self.pages_per_sequence = int(pages_per_sequence)
        if pages_for(max_width, self.page_size) > self.pages_per_sequence:
            raise ValueError(
                f"kv_pages_per_sequence: {self.pages_per_sequence} pages of {self.page_size} "
                f"tokens hold {self.pages_per_sequence * self.page_size} tokens, fewer than "
                f"max_sequence_length {max_width}")
        self.max_rows = int(max_rows)
        self.max_width = int(max_width)
        self.scratch = self.num_pages  # the page unused table entries point at
        self.budget_bytes = (self.num_pages + 1) * page_bytes(config, dtype, self.page_size)
        self.shape = None  # kv_cache.CacheShape of the next program: rows, width bucket
        self.arrays: tuple | None = None
        self.allocated_bytes = 0
        self.peak_bytes = 0
        # The free pages, the next one taken last (so a fresh pool hands out 0, 1, 2...);
        # freed pages go back on the end: the next taken are the last freed.
        self.free_list = list(range(self.num_pages - 1, -1, -1))
        spec: list[str | None] = [None] * 5
        tp = dict(mesh.shape).get(TENSOR_AXIS, 1)
        if tp > 1 and config.num_kv_heads % tp == 0:
            spec[layout.head_axis] = TENSOR_AXIS
        self._sharding = NamedSharding(mesh, PartitionSpec(*spec))

    # -- admission and pages ----------------------------------------------------------------

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self.free_list)

    def admits(self, widths: list[int]) -> bool:
        """Whether rows of final widths ``widths`` (those in the batch and the candidates) fit
        the rows and the pool, each reserving the pages of its final width."""
        return (len(widths) <= self.max_rows
                and sum(pages_for(w, self.page_size) for w in widths) <= self.num_pages)

    def guaranteed_rows(self) -> int:
        """How many sequences of the maximum length always fit (0 if not even one)."""
        return min(self.max_rows, self.num_pages // pages_for(self.max_width, self.page_size))

    def grow(self, pages: list[int], tokens: int) -> None:
        """Extend a row's ``pages`` (in place) to hold its first ``tokens`` tokens. Admission
        reserved them (`admits`): running out is a scheduler bug, raised rather than written
        over."""
        need = pages_for(tokens, self.page_size) - len(pages)
        if need > len(self.free_list):
            raise RuntimeError(f"page pool exhausted: a row needs {need} more pages, "
                               f"{len(self.free_list)} free of {self.num_pages}")
        for _ in range(max(need, 0)):
            pages.append(self.free_list.pop())

    def free(self, pages: list[int]) -> None:
        """Return a finished row's ``pages`` to the pool (and empty the list)."""
        self.free_list.extend(reversed(pages))
        pages.clear()

    def page_table(self, rows: list[list[int] | None]) -> np.ndarray:
        """[rows, pages the shape's width needs] int32: each row's pages in token order (one
        list per cache row, None for an empty one), the scratch page where a row has none."""
        assert self.shape is not None, "page_table() before resize()"
        columns = pages_for(self.shape.width, self.page_size)
        out = np.full((len(rows), columns), self.scratch, np.int32)
        for r, pages in enumerate(rows):
            if pages:
                held = pages[:columns]
                out[r, :len(held)] = held
        return out

    # -- arrays -----------------------------------------------------------------------------

    def sharding(self, rows: int | None = None) -> NamedSharding:
        """KV heads on the "tensor" axis when they divide by it; the pool is otherwise
        replicated (every row may hold any page): a data axis holds it, and decodes every row,
        once per data shard."""
        return self._sharding

    def shape_bytes(self, shape=None) -> int:
        return self.budget_bytes

    def bound_for(self, rows: int, width: int):
        from sampler_service.kv_cache import CacheShape, bucket_rows, bucket_width

        return CacheShape(bucket_rows(rows, self.max_rows), bucket_width(width, self.max_width))

    def resize(self, shape, sources=None) -> None:
        """The next programs' rows and width (page tables are cut to it); the pool itself is
        allocated once, on the first call, and never copied (``sources`` is not needed: rows
        move by their page tables)."""
        if self.arrays is None:
            self.arrays = _zeros(self)
            self.allocated_bytes = self.budget_bytes
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        self.shape = shape

    def abstract_arrays(self, shape=None) -> tuple:
        """The pool as sharded ShapeDtypeStructs (for lowering ahead of time)."""
        return tuple(jax.ShapeDtypeStruct(s, self.dtype, sharding=self._sharding)
                     for s in self.layout.shapes(self.config, self.num_pages + 1))

    def release(self) -> None:
        """Drop the pool and free every page (after a failed program, or when idle)."""
        self.shape, self.arrays = None, None
        self.free_list = list(range(self.num_pages - 1, -1, -1))
        self.allocated_bytes = 0


def _zeros(cache: PagedCache) -> tuple:
    shapes = cache.layout.shapes(cache.config, cache.num_pages + 1)
    return zeros_program(tuple(shapes), cache.dtype, cache.sharding())()
