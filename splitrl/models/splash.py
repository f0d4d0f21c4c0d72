"""Splash attention: the Pallas TPU kernel behind the model's attention over given keys.

`jax.experimental.pallas.ops.tpu.splash_attention` is a flash-attention kernel that also skips
the key blocks its mask hides (causal: about half of them) and takes the mask in a compact form:
a static causal mask plus per-token *segment ids* (a query sees a key iff both carry the same
id). That is exactly the model's masks: training attends causally over each row's real tokens
(segment 1, padding 0), and the sampler's packed prefill causally within each prompt.

A Pallas kernel is not partitioned by GSPMD, so `splash_attend` runs it under a `shard_map`
over the mesh the caller set with `jax.set_mesh` (the trainer sets its own around its
programs): rows split over the mesh's data/fsdp axes (as the learner lays out its batch),
heads over the tensor axis when both the query and the key/value heads divide by it (else
every tensor shard computes all heads), every other axis replicated. Query heads are grouped
over key/value heads (GQA) inside the kernel, as `attention.dense_attend` groups them: query
head h uses key/value head h // (H/K).

On CPU the same kernel runs in Pallas interpret mode (``interpret=True``): slow, for tests
and debugging; tests/splitrl/models/test_splash.py holds it to the dense path's values and
gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.sharding import PartitionSpec

from splitrl.mesh import DATA_AXIS, FSDP_AXIS, TENSOR_AXIS

# Sequence tiles of the kernel: multiples of the TPU's 128 lanes. A sequence is padded up to
# a whole number of tiles; the padding gets a segment id of its own, so no real token sees it.
LANES = 128
MAX_BLOCK = 512
_PAD_SEGMENT = jnp.iinfo(jnp.int32).min


def block_size(length: int) -> int:
    """The kernel's query and key tile for sequences of ``length``: the length rounded up to
    whole 128-lane tiles, at most 512 (larger tiles leave the TPU's vector memory short in the
    backward pass)."""
    return min(MAX_BLOCK, -(-length // LANES) * LANES)


def splash_attend(q, k, v, segment_ids, *, interpret: bool = False):
    """Causal attention within segments: q [B,T,H,Dh], k/v [B,T,K,Dh], segment_ids [B,T] int
    -> out [B,T,H,Dh] (``q``'s dtype).

    Query t of row b sees key s iff s <= t and segment_ids[b, s] == segment_ids[b, t]. This
    equals `attention.dense_attend` under ``causal_mask`` for every query whose segment holds
    all the keys the dense mask lets it see (every real token; a padding query may differ,
    and nothing reads it). The kernel does not scale: ``q`` is scaled by 1/sqrt(Dh) first (in
    float32, then back to its dtype); the kernel's softmax is in float32."""
    b, t, h, dh = q.shape
    kv_heads = k.shape[2]
    block = block_size(t)
    padded = -(-t // block) * block
    scale = dh ** -0.5
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    # The kernel's layout: heads before the sequence.
    q, k, v = (jnp.pad(x, ((0, 0), (0, padded - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
               for x in (q, k, v))
    segments = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, padded - t)),
                       constant_values=_PAD_SEGMENT)

    def local(q, k, v, segments):  # one shard's rows and heads
        kernel = _kernel(q.shape[1], padded, block, interpret)
        one = lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s))
        return jax.vmap(one)(q, k, v, segments)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:  # no mesh set: the arrays are on one device
        out = local(q, k, v, segments)
    else:
        rows, heads = _shard_axes(dict(mesh.shape), b, h, kv_heads)
        qkv = PartitionSpec(rows, heads, None, None)
        out = jax.shard_map(local, in_specs=(qkv, qkv, qkv, PartitionSpec(rows, None)),
                            out_specs=qkv, check_vma=False)(q, k, v, segments)
    return out.transpose(0, 2, 1, 3)[:, :t]


def _shard_axes(sizes: dict[str, int], rows: int, heads: int, kv_heads: int):
    """(row axes, head axis) of the shard_map: the data/fsdp axes the rows divide by (as the
    learner shards its batch), the tensor axis when the query and key/value heads divide by
    it; None where nothing splits."""
    row_axes = tuple(a for a in (DATA_AXIS, FSDP_AXIS) if sizes.get(a, 1) > 1)
    ways = 1
    for a in row_axes:
        ways *= sizes[a]
    row_spec = row_axes if row_axes and rows % ways == 0 else None
    tp = sizes.get(TENSOR_AXIS, 1)
    head_spec = TENSOR_AXIS if tp > 1 and heads % tp == 0 and kv_heads % tp == 0 else None
    return row_spec, head_spec


def _kernel(heads: int, length: int, block: int, interpret: bool):
    """The splash kernel for ``heads`` query heads over sequences of ``length`` (causal).
    Built inside the trace that calls it (its mask tables become constants of that program;
    a kernel cached across traces would carry one trace's values into another)."""
    mask = masks.MultiHeadMask([masks.CausalMask((length, length))] * heads)
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block)
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)
