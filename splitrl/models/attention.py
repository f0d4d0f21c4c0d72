"""Pluggable attention: how a decoder layer's queries, keys and values become its output.

The model's forward (`CausalLM.forward_with`) computes each layer's projections, q/k norms and
RoPE, then hands the post-RoPE ``q [B,T,H,Dh]``, ``k/v [B,T,K,Dh]`` to an *attention backend*:

    out, backend = backend.attend(layer, q, k, v)     # out [B,T,H,Dh]

The backend decides which keys the queries see and where keys/values are kept, and returns
itself updated (a pytree, so it threads through `jit`, `lax.while_loop` and `jax.checkpoint`).
The layers run under a `lax.scan` with the backend in its carry, so ``layer`` is a traced
int32 scalar: a backend keeps its per-layer arrays stacked on a leading layer axis and reads
and writes them at a dynamic index.
Everything else about the model (projections, norms, RoPE, MLP, residuals) exists once, in
`layers.py` / `transformer.py`, and is shared by the trainer and every cache layout.

The attention itself is one function per shape of query: `attend` (queries over given keys:
training, scoring, prefill; its implementation chosen by the platform the program is lowered
for) and `slot_attend` (one decode query per row over a slot cache, by the cache's layout).

Backends here:
- `DenseAttention`: attend over the T given tokens under an explicit mask [B,T,T] (training,
  scoring, a prefill); built with `DenseAttention.keeping_kv` it also returns every layer's
  keys/values, which is how a generation engine fills a cache of its own layout from one
  prefill.
- `KVCacheAttention`: the static-shape `KVCache` of `cache.py` (write at a slot, read the
  whole layer), behind `CausalLM.__call__(..., cache=, cache_index=)`.

A serving engine implements its own (e.g. the sampler's slot-indexed decode cache, written in
place inside its decode loop) with the same one-method protocol.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import jax.numpy as jnp

from splitrl.models.cache import KVCache
from splitrl.models.config import TransformerConfig

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


def blockwise_attend(q, k, v, mask, *, block_q: int = 512, block_kv: int = 512):
    """`dense_attend` without the [B,H,T,S] scores: memory-efficient attention for long
    sequences (Rabe & Staats 2021; the FlashAttention recurrence in plain XLA ops).

    Queries go in blocks of ``block_q`` (`lax.map`); each block runs an online softmax over
    key blocks of ``block_kv`` (`lax.scan`: running max, normaliser and weighted sum, in
    float32). Both loops are under `jax.checkpoint`, so the backward pass recomputes each
    score block instead of keeping it: one [B,K,G,block_q,block_kv] block is alive at a time
    (compiled for a TPU v5e at T = 2048: 19 MiB of temporaries for the gradient instead of
    the dense path's 384 MiB). Plain XLA, so GSPMD shards it like the dense path (batch over
    data/fsdp, heads over tensor). It computes every block, masked or not: the Pallas splash
    kernel (`jax.experimental.pallas.ops.tpu`) would also skip the blocks a causal mask hides,
    but needs a `shard_map` over the caller's mesh. Same inputs, outputs and masking convention
    as `dense_attend`, up to float32 rounding (tests/splitrl/models/test_attention.py); a
    query with no visible key averages the values of every key, padding slots included.
    """
    b, t, h, dh = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = h // kh
    bq, bk = min(block_q, t), min(block_kv, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    q = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, sp - s), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, sp - s), (0, 0), (0, 0)))
    mask = jnp.pad(mask, ((0, 0), (0, tp - t), (0, sp - s)))
    nq, nk = tp // bq, sp // bk
    # [nq, B, bq, K, G, Dh]; keys/values [nk, B, bk, K, Dh]; mask [nq, nk, B, bq, bk]
    qs = q.reshape(b, nq, bq, kh, g, dh).transpose(1, 0, 2, 3, 4, 5)
    ks = k.reshape(b, nk, bk, kh, dh).transpose(1, 0, 2, 3, 4)
    vs = v.reshape(b, nk, bk, kh, dh).transpose(1, 0, 2, 3, 4)
    ms = mask.reshape(b, nq, bq, nk, bk).transpose(1, 3, 0, 2, 4)
    scale = dh ** -0.5

    @jax.checkpoint
    def query_block(args):
        qb, mb = args  # [B, bq, K, G, Dh], [nk, B, bq, bk]

        @jax.checkpoint
        def key_block(carry, xs):
            m, norm, acc = carry
            kb, vb, mbb = xs
            scores = jnp.einsum("bqkgd,bskd->bkgqs", qb, kb,
                                preferred_element_type=jnp.float32) * scale
            scores = jnp.where(mbb[:, None, None], scores, MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
            p = jnp.exp(scores - m_new[..., None])
            correction = jnp.exp(m - m_new)
            norm = norm * correction + jnp.sum(p, axis=-1)
            acc = acc * correction[..., None] + jnp.einsum(
                "bkgqs,bskd->bkgqd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
            return (m_new, norm, acc), None

        init = (jnp.full((b, kh, g, bq), MASK_VALUE, jnp.float32),
                jnp.zeros((b, kh, g, bq), jnp.float32),
                jnp.zeros((b, kh, g, bq, dh), jnp.float32))
        (_, norm, acc), _ = jax.lax.scan(key_block, init, (ks, vs, mb))
        out = acc / norm[..., None]  # [B, K, G, bq, Dh]
        return out.transpose(0, 3, 1, 2, 4).astype(v.dtype)

    out = jax.lax.map(query_block, (qs, ms))  # [nq, B, bq, K, G, Dh]
    return out.transpose(1, 0, 2, 3, 4, 5).reshape(b, tp, h, dh)[:, :t]


# `model.attention`: how attention over given keys runs (training, scoring, prefill).
ATTENTION_IMPLEMENTATIONS = (
    # by platform: the XLA path on CPU and GPU; on TPU the splash kernel where the caller set
    # a mesh (`jax.set_mesh`, as the trainer does) and the mask is causal within segments
    "auto",
    # always the XLA path (`xla_attend`)
    "xla",
    # always the splash kernel (`splash.splash_attend`); on CPU in Pallas interpret mode
    "splash",
)


def xla_attend(q, k, v, mask):
    """The model's attention over given keys in plain XLA ops, by platform: the dense einsum
    path on CPU (fastest there for the lengths a CPU trains), the memory-efficient
    `blockwise_attend` on TPU and GPU, where the dense path's [B,H,T,S] scores, kept per
    layer for the backward pass, are what bounds the sequence length. Resolved when the
    program is lowered for its devices (`jax.lax.platform_dependent`), so a plan compiled for
    a TPU topology on a CPU host gets the TPU path."""
    return jax.lax.platform_dependent(q, k, v, mask, cpu=dense_attend, default=blockwise_attend)


def attend(q, k, v, mask, segments=None, implementation: str = "auto"):
    """Attention over given keys (`dense_attend`'s shapes) with ``implementation`` (one of
    `ATTENTION_IMPLEMENTATIONS`).

    ``segments`` [B,T] int, when given, is ``mask`` in the splash kernel's form: ``mask`` lets
    query t see key s iff s <= t and segments[b, s] == segments[b, t] (for every real token;
    see `splash.splash_attend`). Without it the kernel cannot run and the XLA path does.
    "auto" keeps CPU on `dense_attend`, bit for bit."""
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention: expected one of {ATTENTION_IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if segments is None or implementation == "xla":
        return xla_attend(q, k, v, mask)
    from splitrl.models import splash  # Pallas: imported only where a kernel may run

    if implementation == "splash":
        return jax.lax.platform_dependent(
            q, k, v, segments,
            cpu=functools.partial(splash.splash_attend, interpret=True),
            default=splash.splash_attend)
    if jax.sharding.get_abstract_mesh().empty:  # "auto" without a mesh: no shard_map to run in
        return xla_attend(q, k, v, mask)
    return jax.lax.platform_dependent(
        q, k, v, mask, segments,
        tpu=lambda q, k, v, mask, segments: splash.splash_attend(q, k, v, segments),
        default=lambda q, k, v, mask, segments: xla_attend(q, k, v, mask))


def _slot_attend_streaming(q, k_cache, v_cache, length):
    """`slot_attend` on CPU: broadcast-multiply-reduce instead of dot_general. The products
    are batches of tiny ([G, Dh] x [Dh, S]) matrices, for which XLA CPU's dot kernels are ~2x
    slower than one vectorised loop fusion streaming the cache."""
    r, h, dh = q.shape
    kh = k_cache.shape[1]
    f32 = jnp.float32
    qf = (q.astype(f32) * dh ** -0.5).reshape(r, kh, h // kh, dh, 1)
    s = jnp.sum(qf * k_cache.astype(f32)[:, :, None], axis=-2)  # [R, K, G, S]
    visible = jnp.arange(k_cache.shape[3]) < length[:, None, None, None]
    s = jnp.where(visible, s, MASK_VALUE)
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    out = jnp.sum(e[..., None] * v_cache.astype(f32)[:, :, None], axis=-2)  # [R, K, G, Dh]
    out = out / jnp.sum(e, axis=-1)[..., None]
    return out.reshape(r, h, dh).astype(q.dtype)


def _slot_attend_matmul(q, k_cache, v_cache, length):
    """`slot_attend` over a slot-major cache (TPU/GPU): two batched matmuls on the cache as
    stored (bfloat16 in, float32 accumulation), so the matrix units do the work and neither an
    upcast copy of the cache nor a [R,K,G,Dh,S] product is ever formed."""
    r, h, dh = q.shape
    kh = k_cache.shape[2]
    qg = q.reshape(r, kh, h // kh, dh).astype(k_cache.dtype)
    s = jnp.einsum("rkgd,rskd->rkgs", qg, k_cache, preferred_element_type=jnp.float32)
    s = s * dh ** -0.5
    visible = jnp.arange(k_cache.shape[1]) < length[:, None, None, None]
    s = jnp.where(visible, s, MASK_VALUE)
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    out = jnp.einsum("rkgs,rskd->rkgd", e.astype(v_cache.dtype), v_cache,
                     preferred_element_type=jnp.float32)
    out = out / jnp.sum(e, axis=-1)[..., None]
    return out.reshape(r, h, dh).astype(q.dtype)


def slot_attend(q, k_cache, v_cache, length, *, slot_major: bool = False):
    """Decode attention: one query per row against its cache row; slots < length[r] are
    visible. q [R,H,Dh]; the cache in the layout its platform gets
    (`sampler_service.kv_cache.CacheLayout`): on CPU keys [R,K,Dh,S] and values [R,K,S,Dh]
    (`_slot_attend_streaming`), on TPU and GPU ``slot_major`` keys and values [R,S,K,Dh]
    (`_slot_attend_matmul`)."""
    if slot_major:
        return _slot_attend_matmul(q, k_cache, v_cache, length)
    return _slot_attend_streaming(q, k_cache, v_cache, length)


def causal_mask(query_slots, key_slots, key_valid) -> jax.Array:
    """[B,T,S] bool: key slot s is visible to query slot t iff s <= t and key_valid[b, s]."""
    return (key_slots[None, :] <= query_slots[:, None])[None] & key_valid[:, None, :]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseAttention:
    """Attention over the given tokens under ``mask`` [B,T,T] (True = may attend).

    With ``kv`` (see `keeping_kv`) the returned backend's ``kv`` holds ``(k, v)``
    [L,B,T,K,Dh]: every layer's keys and values (e.g. to fill a generation cache from a
    prefill). ``segments`` [B,T] is ``mask`` as causal attention within segments (see
    `attend`), which lets ``implementation`` (`ATTENTION_IMPLEMENTATIONS`) run the splash
    kernel.
    """

    mask: jax.Array
    kv: tuple | None = None
    segments: jax.Array | None = None
    implementation: str = dataclasses.field(default="auto", metadata=dict(static=True))

    @classmethod
    def keeping_kv(cls, mask: jax.Array, config: TransformerConfig, dtype, *,
                   segments: jax.Array | None = None,
                   implementation: str = "auto") -> DenseAttention:
        """A backend that also collects every layer's keys/values (in ``dtype``)."""
        b, t = mask.shape[:2]
        shape = (config.num_layers, b, t, config.num_kv_heads, config.head_dim)
        return cls(mask, (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)), segments,
                   implementation)

    def attend(self, layer, q, k, v):
        out = attend(q, k, v, self.mask, self.segments, self.implementation)
        if self.kv is None:
            return out, self
        k_all, v_all = self.kv
        k_all = jax.lax.dynamic_update_index_in_dim(k_all, k.astype(k_all.dtype), layer, 0)
        v_all = jax.lax.dynamic_update_index_in_dim(v_all, v.astype(v_all.dtype), layer, 0)
        return out, dataclasses.replace(self, kv=(k_all, v_all))


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
        out = attend(q, k_all[layer].astype(q.dtype), v_all[layer].astype(q.dtype), self.mask)
        cache = self.cache._replace(k=k_all, v=v_all)
        return out, dataclasses.replace(self, cache=cache)
