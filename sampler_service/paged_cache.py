"""A paged decode KV cache: a pool of fixed-size pages per layer, a page table per row, and the
decode attention backend that writes into it and reads it through `splitrl.models.paged`.

Layout: keys and values ``[L, K, P, page_size, Dh]`` (every layer stacked on the leading axis,
as the model's weights are; per layer the [K, P, page, Dh] pages the Pallas `paged_attention`
kernel reads). `PageTable` (host side) hands each sequence the pages its final length needs
(prompt + max_new_tokens) from a free list and takes them back when it ends; its `indices`
[R, pages_per_sequence] int32 is the device-side page table (entries past a row's pages point
at page 0 and are never read: the kernel and the XLA path read only slots below a row's
length).

Both sizes are validated here with messages naming them: ``page_size`` (tokens per page, a
multiple of 16 so a bfloat16 page fills whole TPU tiles) and ``pages_per_sequence`` (the page
table's width: pages_per_sequence x page_size bounds a sequence's length).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from splitrl.models import TransformerConfig
from splitrl.models.paged import paged_attend

PAGE_MULTIPLE = 16


class PagesExhausted(Exception):
    """Not enough free pages for a sequence (it waits, or the pool is too small)."""


def check_page_settings(page_size: int, pages_per_sequence: int,
                        max_sequence_length: int) -> None:
    """ValueError naming the setting unless the pages can hold a sequence of
    ``max_sequence_length`` tokens on a TPU."""
    if page_size < 1 or page_size % PAGE_MULTIPLE:
        raise ValueError(f"page_size: expected a positive multiple of {PAGE_MULTIPLE} (a "
                         f"bfloat16 page fills whole TPU tiles), got {page_size}")
    if pages_per_sequence * page_size < max_sequence_length:
        raise ValueError(
            f"pages_per_sequence: {pages_per_sequence} pages of {page_size} tokens hold "
            f"{pages_per_sequence * page_size} tokens, fewer than max_sequence_length "
            f"{max_sequence_length}; expected at least "
            f"{-(-max_sequence_length // page_size)}")


class PageTable:
    """Which pages of the pool each row owns (host side; one owner: the engine's thread)."""

    def __init__(self, *, rows: int, num_pages: int, page_size: int, pages_per_sequence: int):
        if num_pages < 1:
            raise ValueError(f"num_pages: expected >= 1, got {num_pages}")
        self.rows, self.num_pages = rows, num_pages
        self.page_size, self.pages_per_sequence = page_size, pages_per_sequence
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._owned: dict[int, list[int]] = {}

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def assign(self, row: int, tokens: int) -> list[int]:
        """Pages for a sequence of up to ``tokens`` tokens in ``row`` (which holds none)."""
        if not 0 <= row < self.rows:
            raise ValueError(f"row: expected 0 <= row < {self.rows}, got {row}")
        if row in self._owned:
            raise ValueError(f"row {row} already holds pages {self._owned[row]}")
        need = self.pages_for(tokens)
        if need > self.pages_per_sequence:
            raise ValueError(f"tokens: {tokens} need {need} pages of {self.page_size}, more "
                             f"than pages_per_sequence {self.pages_per_sequence}")
        if need > len(self._free):
            raise PagesExhausted(f"{need} pages needed, {len(self._free)} free")
        self._owned[row] = [self._free.pop() for _ in range(need)]
        return list(self._owned[row])

    def release(self, row: int) -> None:
        """Return ``row``'s pages to the pool (a row holding none: nothing happens)."""
        self._free.extend(reversed(self._owned.pop(row, [])))

    def move(self, sources: np.ndarray) -> None:
        """Re-lay the rows: new row i takes old row ``sources[i]``'s pages (-1: none); rows
        not taken release theirs. No key or value moves: only the table changes."""
        taken = {int(s) for s in sources if s >= 0}
        for row in list(self._owned):
            if row not in taken:
                self.release(row)
        self._owned = {i: self._owned[int(s)] for i, s in enumerate(sources)
                       if s >= 0 and int(s) in self._owned}

    def indices(self) -> np.ndarray:
        """The device page table [rows, pages_per_sequence] int32 (unowned entries: 0)."""
        out = np.zeros((self.rows, self.pages_per_sequence), np.int32)
        for row, pages in self._owned.items():
            out[row, :len(pages)] = pages
        return out


def init_pages(config: TransformerConfig, num_pages: int, page_size: int, dtype,
               sharding=None) -> tuple[jax.Array, jax.Array]:
    """Zeroed keys and values [L, K, num_pages, page_size, Dh]."""
    shape = (config.num_layers, config.num_kv_heads, num_pages, page_size, config.head_dim)
    make = jax.jit(lambda: (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)),
                   out_shardings=sharding)
    return make()


def write_tokens(pages, page_indices, rows, slots, values, layer=None):
    """``pages`` with ``values`` [N, K, Dh] written at token ``slots`` [N] of rows ``rows``
    [N] (through the page table); ``pages`` [K, P, page, Dh], or [L, K, P, page, Dh] with
    ``layer`` (a traced index). A slot past the table (>= pages_per_sequence x page) is
    dropped."""
    page_size = pages.shape[-2]
    n = page_indices.shape[1]
    index = jnp.minimum(slots // page_size, n - 1)
    page = jnp.where(slots < n * page_size, page_indices[rows, index], pages.shape[-3])
    offset = slots % page_size
    values = values.astype(pages.dtype)
    if layer is None:  # adjacent advanced indices: their [N] axis stays in place
        return pages.at[:, page, offset].set(values.transpose(1, 0, 2), mode="drop")
    # advanced indices split by the heads' slice: their [N] axis comes first
    return pages.at[layer, :, page, offset].set(values, mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedDecodeAttention:
    """The `splitrl.models` attention backend of one decode step over a paged cache.

    Each row feeds one token: its key/value is written at slot ``write[r]`` of the row
    (through ``page_indices``) in layer ``layer`` (a traced index: the model scans its
    layers), then the query attends to the row's slots ``< write[r] + 1`` of that layer
    (`splitrl.models.paged.paged_attend`: the Pallas kernel on TPU)."""

    cache: tuple  # (k, v) [L, K, P, page, Dh]
    page_indices: jax.Array  # [R, pages_per_sequence] int32
    write: jax.Array  # [R] int32

    def attend(self, layer, q, k, v):
        k_pages, v_pages = self.cache
        rows = jnp.arange(q.shape[0])
        k_pages = write_tokens(k_pages, self.page_indices, rows, self.write, k[:, 0], layer)
        v_pages = write_tokens(v_pages, self.page_indices, rows, self.write, v[:, 0], layer)
        out = paged_attend(q[:, 0], k_pages[layer], v_pages[layer], self.write + 1,
                           self.page_indices)
        return out[:, None], dataclasses.replace(self, cache=(k_pages, v_pages))
