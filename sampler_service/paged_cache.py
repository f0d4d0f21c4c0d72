"""The decode KV cache laid out as pages, for the Pallas `paged_attention` kernel (TPU).

`PagedLayout` is one of the slot cache's layouts (`kv_cache.SlotCache`; `kv_cache.layout_for`
picks it from ``sampler.decode_attention``: by default on TPU). Keys and values are
``[L, K, R, S, Dh]``, heads before rows, so one layer's ``[K, R, S, Dh]`` *is* the kernel's
page pool ``[K, R * n, page, Dh]`` (a reshape, no copy; n = S / page): row r owns pages
``[r * n, (r + 1) * n)`` and its page table is that range (`page_table`). The kernel reads, per
row, only the pages below the row's length, where the slot layout's matmuls read every slot of
the cache's width and mask the rest.

What it does not do: hand rows pages on demand from a shared pool. A row owns the cache's
full (bucketed) width, so memory is what the slot layout takes, and rows move between segments
by the slot cache's resize (a copy), not by rewriting a page table.

Pages: ``sampler.kv_page_size`` tokens at most (a multiple of 16, so a bfloat16 page fills
whole TPU tiles); a cache S slots wide uses the largest page of at most that size that divides
S (`page_for`): the bucketed widths are powers of two from 32, and the widest is rounded up to
a multiple of 16 (`width_cap`), so pages per sequence are S / page.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from splitrl.models import TransformerConfig
from splitrl.models.paged import paged_attend

PAGE_MULTIPLE = 16


def check_page_size(page_size: int, key: str = "kv_page_size") -> None:
    """ValueError naming ``key`` unless ``page_size`` is a positive multiple of 16."""
    if page_size < 1 or page_size % PAGE_MULTIPLE:
        raise ValueError(f"{key}: expected a positive multiple of {PAGE_MULTIPLE} (a bfloat16 "
                         f"page fills whole TPU tiles), got {page_size}")


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """The slot cache as pages (module docstring); the methods of `kv_cache.CacheLayout`.
    ``mesh`` is the engine's: the kernel runs under a shard_map over it (key/value heads over
    its tensor axis)."""

    page_size: int
    mesh: Mesh | None = None

    row_axis = 2
    head_axis = 1
    slot_axes = (3, 3)

    def __post_init__(self):
        check_page_size(self.page_size)

    def width_cap(self, max_width: int) -> int:
        """The widest cache: ``max_width`` rounded up to whole pages of 16."""
        return -(-max_width // PAGE_MULTIPLE) * PAGE_MULTIPLE

    def page_for(self, width: int) -> int:
        """Tokens per page of a cache ``width`` slots wide (divides it)."""
        return math.gcd(self.page_size, width)

    def shapes(self, config: TransformerConfig, rows: int, width: int) -> tuple[tuple, tuple]:
        """(keys' shape, values' shape): both [L, K, rows, width, Dh]."""
        shape = (config.num_layers, config.num_kv_heads, rows, width, config.head_dim)
        return shape, shape

    def write(self, cache: tuple, layer, rows, slots, k, v) -> tuple:
        """Keys/values ``k, v`` [N, P, K, Dh] at slots ``slots`` [N, P] of rows ``rows`` [N]
        in layer ``layer`` (in place when ``cache`` is donated; an index past the cache:
        dropped), one layer at a time as `kv_cache.CacheLayout.write` says why."""
        k_cache, v_cache = cache
        # The heads indexed, not sliced: the written window is the head dimension alone, the
        # cache's minor one. With the heads in it (a major axis here) the TPU compiler lays the
        # whole cache out again for the scatter, in admit and through decode's loop.
        heads = jnp.arange(k_cache.shape[self.head_axis])[None, None, :]
        rows, slots = rows[:, None, None], slots[:, :, None]
        return (k_cache.at[layer, heads, rows, slots].set(k.astype(k_cache.dtype), mode="drop"),
                v_cache.at[layer, heads, rows, slots].set(v.astype(v_cache.dtype), mode="drop"))

    def page_table(self, rows: int, width: int) -> jax.Array:
        """[rows, pages per sequence] int32: row r's pages are r * n ... r * n + n - 1."""
        n = width // self.page_for(width)
        return jnp.arange(rows * n, dtype=jnp.int32).reshape(rows, n)

    def pages(self, layer_cache: jax.Array) -> jax.Array:
        """One layer's [K, R, S, Dh] as the kernel's page pool [K, R * n, page, Dh]."""
        k, r, s, dh = layer_cache.shape
        page = self.page_for(s)
        return layer_cache.reshape(k, r * (s // page), page, dh)

    def attend(self, q, cache: tuple, layer, length):
        """Decode attention of q [R, H, Dh] over layer ``layer`` of each row's slots
        ``< length[r]`` (`splitrl.models.paged.paged_attend`: the kernel on TPU)."""
        k_cache, v_cache = cache
        rows, width = k_cache.shape[self.row_axis], k_cache.shape[self.slot_axes[0]]
        return paged_attend(q, self.pages(k_cache[layer]), self.pages(v_cache[layer]), length,
                            self.page_table(rows, width), mesh=self.mesh)
