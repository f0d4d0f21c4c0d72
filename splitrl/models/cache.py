"""Static-shape KV cache for batched generation of left-padded prompts.

Design: prompts are left-padded to a common length P so every row writes the same slot at the
same step. Prefill writes slots [0, P) with `cache_index=0` and `attention_mask` marking the
real prompt tokens; decode step n writes one token at the scalar slot P + n. RoPE positions
are per row (slot - left_pad_of_row), passed by the caller. `mask[b, s]` says whether slot s of
row b holds a real token; a query at slot q attends to valid slots s <= q. All shapes are
static, the slot is a traced int32 scalar, and updates are `dynamic_update_slice`s, so one
compiled decode step serves the whole generation (donate the cache to update it in place).
The caller keeps cache_index + T <= max_len: like any `dynamic_update_slice`, an out-of-range
write is clamped, not reported (the index is traced, so it cannot be checked here).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from splitrl.models.config import TransformerConfig


class KVCache(NamedTuple):
    """k, v: [layers, batch, max_len, kv_heads, head_dim]; mask: [batch, max_len] bool."""

    k: jax.Array
    v: jax.Array
    mask: jax.Array


def init_cache(config: TransformerConfig, batch: int, max_len: int,
               dtype=jnp.float32) -> KVCache:
    """An empty cache (zeros, all slots invalid)."""
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   mask=jnp.zeros((batch, max_len), bool))


def left_pad_positions(attention_mask: jax.Array) -> jax.Array:
    """RoPE positions [B,T] int32 for a left-padded batch: 0 at each row's first real token.

    Padding slots get position 0 (they are masked out anyway).
    """
    pos = jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1
    return jnp.maximum(pos, 0).astype(jnp.int32)
