"""Pluggable attention: how a decoder layer's queries, keys and values become its output.

The model's forward (`CausalLM.forward_with`) computes each layer's projections, q/k norms and
RoPE, then hands the post-RoPE ``q [B,T,H,Dh]``, ``k/v [B,T,K,Dh]`` to an *attention backend*:

    out, backend = backend.attend(layer, q, k, v)     # out [B,T,H,Dh]

The backend decides which keys the queries see and where keys/values are kept, and returns
itself updated (a pytree, so it threads through `jit`, `lax.while_loop` and `jax.checkpoint`).
Everything else about the model (projections, norms, RoPE, MLP, residuals) exists once, in
`layers.py` / `transformer.py`, and is shared by the trainer and every cache layout.

Backends here:
- `DenseAttention`: attend over the T given tokens under an explicit mask [B,T,T] (training,
  scoring, a prefill); with ``keep_kv`` it also returns each layer's keys/values, which is how
  a generation engine fills a cache of its own layout from one prefill.
- `KVCacheAttention`: the static-shape `KVCache` of `cache.py` (write at a slot, read the
  whole layer), behind `CausalLM.__call__(..., cache=, cache_index=)`.

A serving engine implements its own (e.g. the sampler's slot-indexed decode cache, written in
place inside its decode loop) with the same one-method protocol.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp

from splitrl.models.cache import KVCache

# Large finite negative instead of -inf: a query with no visible key (a left-padding row)
# then gets a uniform distribution rather than NaNs that would poison gradients.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


class AttentionBackend(Protocol):
    """What a decoder layer calls with its post-RoPE queries, keys and values."""

    def attend(self, layer: int, q: jax.Array, k: jax.Array,
               v: jax.Array) -> tuple[jax.Array, AttentionBackend]:
        """q [B,T,H,Dh], k/v [B,T,K,Dh] -> (out [B,T,H,Dh], the backend after this layer)."""
        ...


def dense_attend(q, k, v, mask):
    """Softmax attention, q [B,T,H,Dh], k/v [B,S,K,Dh], mask [B,T,S]; softmax in float32.

    Query heads are grouped as [K, H/K] (HF's repeat_kv order: query head h uses kv head
    h // (H/K)), so no k/v repetition is materialised.
    """
    b, t, h, dh = q.shape
    num_kv_heads = k.shape[2]
    q = q.reshape(b, t, num_kv_heads, h // num_kv_heads, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (dh ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, dh)


def causal_mask(query_slots, key_slots, key_valid) -> jax.Array:
    """[B,T,S] bool: key slot s is visible to query slot t iff s <= t and key_valid[b, s]."""
    return (key_slots[None, :] <= query_slots[:, None])[None] & key_valid[:, None, :]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseAttention:
    """Attention over the given tokens under ``mask`` [B,T,T] (True = may attend).

    With ``keep_kv=True`` the returned backend's ``kv`` holds ``(k, v)`` [B,T,K,Dh] of every
    layer, in layer order (e.g. to fill a generation cache from a prefill).
    """

    mask: jax.Array
    kv: tuple = ()
    keep_kv: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def attend(self, layer, q, k, v):
        out = dense_attend(q, k, v, self.mask)
        if not self.keep_kv:
            return out, self
        return out, dataclasses.replace(self, kv=self.kv + ((k, v),))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCacheAttention:
    """The static-shape `KVCache`: this step's keys/values are written at slots
    [slot, slot + T) of every row, and queries read the whole layer under ``mask`` [B,T,S]."""

    cache: KVCache
    slot: jax.Array
    mask: jax.Array

    def attend(self, layer, q, k, v):
        k_all, v_all = self.cache.k, self.cache.v
        start = (layer, 0, self.slot, 0, 0)
        k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), start)
        v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), start)
        out = dense_attend(q, k_all[layer].astype(q.dtype), v_all[layer].astype(q.dtype),
                           self.mask)
        cache = self.cache._replace(k=k_all, v=v_all)
        return out, dataclasses.replace(self, cache=cache)
