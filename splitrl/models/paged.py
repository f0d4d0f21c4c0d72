"""Decode attention over a paged KV cache: the Pallas TPU `paged_attention` kernel, and the same
attention in XLA ops (CPU, and the reference the kernel is tested against).

A paged cache keeps every sequence's keys/values in fixed-size *pages* of one pool, per layer
``k_pages``/``v_pages`` [K, P, page_size, Dh]; row r's token t lives at page
``page_indices[r, t // page_size]``, offset ``t % page_size`` (vLLM's PagedAttention). The
sampler's page pool (`sampler_service.paged_cache.PagedCache`) hands rows pages from a free
list as they grow.

`jax.experimental.pallas.ops.tpu.paged_attention` reads only the pages below each row's
length (double-buffered DMAs from HBM), one query token per row. It reads keys and values as
bfloat16 whatever their storage dtype (its choice: a TPU serves a bfloat16 cache), so its
parity with `paged_attend_xla` is exact up to float32 rounding for a bfloat16 cache.

Like every Pallas kernel it is not partitioned by GSPMD: `paged_attend` runs it under a
`shard_map` over the caller's mesh, key/value heads (and their query heads)
over the tensor axis when both divide by it; the page pool is shared by every row, so rows
are not split. On CPU the kernel runs in Pallas TPU interpret mode
(`pltpu.force_tpu_interpret_mode`) for tests; `jax.experimental.pallas.ops.tpu.
ragged_paged_attention` does not run in interpret mode in jax 0.10.2 (its interpreter lacks a
reshape of refs the kernel uses); `paged_attention` takes what the engine's decode has, one
query token per row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from splitrl.models.attention import MASK_VALUE

# Key/value tokens the kernel processes per block: as many whole pages as fit in this.
_BLOCK_TOKENS = 512


def gather_pages(pages, page_indices):
    """Row-major view of a paged cache: pages [K, P, page, Dh] and page_indices [R, n] ->
    [R, K, n * page, Dh] (row r's slots in order). A copy: for tests and the XLA path."""
    k, _, page, dh = pages.shape
    rows, n = page_indices.shape
    out = jnp.take(pages, page_indices.reshape(-1), axis=1)  # [K, R*n, page, Dh]
    return out.reshape(k, rows, n * page, dh).transpose(1, 0, 2, 3)


def paged_attend_xla(q, k_pages, v_pages, lengths, page_indices):
    """Decode attention in XLA ops: q [R,H,Dh] over row r's slots < lengths[r] of the paged
    cache (pages gathered to rows, softmax in float32)."""
    r, h, dh = q.shape
    keys, values = gather_pages(k_pages, page_indices), gather_pages(v_pages, page_indices)
    kh = keys.shape[1]
    qg = q.reshape(r, kh, h // kh, dh).astype(jnp.float32) * dh ** -0.5
    s = jnp.einsum("rkgd,rksd->rkgs", qg, keys.astype(jnp.float32))
    visible = jnp.arange(keys.shape[2]) < lengths[:, None, None, None]
    s = jnp.where(visible, s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("rkgs,rksd->rkgd", p, values.astype(jnp.float32))
    return out.reshape(r, h, dh).astype(q.dtype)


def pages_per_block(pages_per_sequence: int, page_size: int) -> int:
    """The kernel's pages per compute block: the largest divisor of ``pages_per_sequence``
    whose pages hold at most 512 tokens (at least one page)."""
    best = 1
    for n in range(1, pages_per_sequence + 1):
        if pages_per_sequence % n == 0 and n * page_size <= _BLOCK_TOKENS:
            best = n
    return best


def paged_attend_kernel(q, k_pages, v_pages, lengths, page_indices, mesh=None):
    """`paged_attend_xla` through the Pallas kernel, under a shard_map over ``mesh`` (default:
    the mesh set with `jax.set_mesh`; none: the arrays are on one device)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    h, dh = q.shape[1:]
    kv_heads, _, page_size, _ = k_pages.shape
    block = pages_per_block(page_indices.shape[1], page_size)
    q = (q.astype(jnp.float32) * dh ** -0.5).astype(q.dtype)  # the kernel does not scale

    def local(q, k_pages, v_pages, lengths, page_indices):
        return paged_attention(q, k_pages, v_pages, lengths.astype(jnp.int32),
                               page_indices.astype(jnp.int32), pages_per_compute_block=block)

    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return local(q, k_pages, v_pages, lengths, page_indices)
    tp = dict(mesh.shape).get("tensor", 1)
    heads = "tensor" if tp > 1 and h % tp == 0 and kv_heads % tp == 0 else None
    pages = PartitionSpec(heads, None, None, None)
    return jax.shard_map(
        local, mesh=mesh, in_specs=(PartitionSpec(None, heads, None), pages, pages, PartitionSpec(),
                         PartitionSpec()),
        out_specs=PartitionSpec(None, heads, None), check_vma=False,
    )(q, k_pages, v_pages, lengths, page_indices)


def paged_attend(q, k_pages, v_pages, lengths, page_indices, mesh=None):
    """Decode attention over a paged cache, by platform: the Pallas kernel on TPU (under a
    shard_map over ``mesh``, see `paged_attend_kernel`), XLA ops elsewhere (resolved when the
    program is lowered for its devices)."""
    return jax.lax.platform_dependent(
        q, k_pages, v_pages, lengths, page_indices,
        tpu=functools.partial(paged_attend_kernel, mesh=mesh), default=paged_attend_xla)
