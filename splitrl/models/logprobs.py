"""Per-token log-probabilities and entropies without materialising [B, T, V] logits.

For RL losses we need log p(target_t) and the entropy at every position, and gradients of
both. With vocabularies of 150k tokens the full logits (and their gradient) dominate memory,
so the output projection is done chunk by chunk: a `lax.scan` over time chunks, and inside it
a scan over vocabulary chunks with an online logsumexp. Each chunk is under `jax.checkpoint`,
so the backward pass recomputes a chunk's logits instead of storing them all.

Online accumulators per position, over vocabulary chunks of scaled logits z:
    m = running max, s = sum exp(z - m), u = sum exp(z - m) * z
so logZ = m + log s, E_p[z] = u / s and entropy = logZ - E_p[z].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from splitrl.models.transformer import CausalLM


def token_logprobs(model: CausalLM, tokens, targets, positions=None, attention_mask=None, *,
                   chunk_size: int = 256, vocab_chunk_size: int = 16384,
                   temperature: float = 1.0):
    """(logprobs [B,T], entropy [B,T]) float32 of `targets` under softmax(logits / temperature).

    `targets[b, t]` is the token whose probability is read from position t (callers pass the
    tokens shifted by one). Values at padding positions are meaningless; mask them. Time is
    processed in chunks of `chunk_size` and the vocabulary in chunks of `vocab_chunk_size`
    (neither needs to divide T or V). Differentiable w.r.t. the model's parameters.
    """
    h = model.hidden_states(tokens, positions, attention_mask=attention_mask)
    w, vocab_axis = model.output_weight()
    return logprobs_from_hidden(h.astype(model.dtype), w.astype(model.dtype), targets,
                                vocab_axis=vocab_axis, chunk_size=chunk_size,
                                vocab_chunk_size=vocab_chunk_size, temperature=temperature)


def logprobs_from_hidden(h, w, targets, *, vocab_axis: int = 0, chunk_size: int = 256,
                         vocab_chunk_size: int = 16384, temperature: float = 1.0):
    """`token_logprobs` from hidden states h [B,T,D] and the output weight w.

    w is [V, D] with `vocab_axis=0` (tied embedding) or [D, V] with `vocab_axis=1` (lm_head).
    """
    b, t, d = h.shape
    c = max(1, min(chunk_size, t))
    n = -(-t // c)
    pad = n * c - t
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets.astype(jnp.int32), ((0, 0), (0, pad)))
    h_chunks = h.reshape(b, n, c, d).swapaxes(0, 1)
    t_chunks = targets.reshape(b, n, c).swapaxes(0, 1)
    inv_temp = 1.0 / jnp.asarray(temperature, jnp.float32)

    @jax.checkpoint
    def time_chunk(hc, tc):
        return _chunk_stats(hc, tc, w, vocab_axis, vocab_chunk_size, inv_temp)

    _, (lp, ent) = jax.lax.scan(lambda carry, x: (carry, time_chunk(*x)), None,
                                (h_chunks, t_chunks))
    lp = lp.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    ent = ent.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    return lp, ent


def _chunk_stats(hc, tc, w, vocab_axis, vocab_chunk_size, inv_temp):
    """Target log-prob and entropy for one time chunk hc [B,c,D], tc [B,c].

    Vocabulary chunk i covers ids [i*vc, (i+1)*vc); the last one is slid back to end at V
    (so w is sliced in place, never padded or copied) and ignores ids already counted.
    """
    vocab = w.shape[vocab_axis]
    vc = max(1, min(vocab_chunk_size, vocab))
    num_chunks = -(-vocab // vc)
    spec = "bcd,vd->bcv" if vocab_axis == 0 else "bcd,dv->bcv"
    shape = tc.shape
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))

    @jax.checkpoint
    def vocab_chunk(carry, i):
        m, s, u, tgt = carry
        nominal = i * vc
        start = jnp.minimum(nominal, vocab - vc)
        wc = jax.lax.dynamic_slice_in_dim(w, start, vc, axis=vocab_axis)
        z = jnp.einsum(spec, hc, wc, preferred_element_type=jnp.float32) * inv_temp
        ids = start + jnp.arange(vc)
        fresh = ids >= nominal
        # The shift cancels out of logZ; no gradient through it keeps the backward simple.
        m_new = jax.lax.stop_gradient(
            jnp.maximum(m, jnp.max(jnp.where(fresh, z, -jnp.inf), axis=-1)))
        e = jnp.where(fresh, jnp.exp(z - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        s = s * scale + jnp.sum(e, axis=-1)
        u = u * scale + jnp.sum(e * z, axis=-1)
        tgt = tgt + jnp.sum(jnp.where(fresh & (ids == tc[..., None]), z, 0.0), axis=-1)
        return (m_new, s, u, tgt), None

    (m, s, u, tgt), _ = jax.lax.scan(vocab_chunk, init, jnp.arange(num_chunks, dtype=jnp.int32))
    logz = m + jnp.log(s)
    return tgt - logz, logz - u / s
