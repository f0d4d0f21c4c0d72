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
    w = model.lm_head_weight().astype(model.dtype)
    return logprobs_from_hidden(h.astype(model.dtype), w, targets, chunk_size=chunk_size,
                                vocab_chunk_size=vocab_chunk_size, temperature=temperature)


def logprobs_from_hidden(h, w, targets, *, chunk_size: int = 256, vocab_chunk_size: int = 16384,
                         temperature: float = 1.0):
    """`token_logprobs` from hidden states h [B,T,D] and output weight w [V,D]."""
    b, t, d = h.shape
    c = max(1, min(chunk_size, t))
    n = -(-t // c)
    pad = n * c - t
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets.astype(jnp.int32), ((0, 0), (0, pad)))
    h_chunks = h.reshape(b, n, c, d).swapaxes(0, 1)
    t_chunks = targets.reshape(b, n, c).swapaxes(0, 1)
    w_chunks, vc = _vocab_chunks(w, vocab_chunk_size)
    inv_temp = 1.0 / jnp.asarray(temperature, jnp.float32)
    vocab = w.shape[0]

    @jax.checkpoint
    def time_chunk(hc, tc):
        return _chunk_stats(hc, tc, w_chunks, vc, vocab, inv_temp)

    _, (lp, ent) = jax.lax.scan(lambda carry, x: (carry, time_chunk(*x)), None,
                                (h_chunks, t_chunks))
    lp = lp.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    ent = ent.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    return lp, ent


def _vocab_chunks(w, vocab_chunk_size):
    """w [V,D] -> ([nv, vc, D] zero-padded, vc)."""
    v, d = w.shape
    vc = max(1, min(vocab_chunk_size, v))
    nv = -(-v // vc)
    w = jnp.pad(w, ((0, nv * vc - v), (0, 0)))
    return w.reshape(nv, vc, d), vc


def _chunk_stats(hc, tc, w_chunks, vc, vocab, inv_temp):
    """Target log-prob and entropy for one time chunk hc [B,c,D], tc [B,c]."""
    shape = tc.shape
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))

    @jax.checkpoint
    def vocab_chunk(carry, xs):
        m, s, u, tgt = carry
        wc, start = xs
        z = jnp.einsum("bcd,vd->bcv", hc, wc, preferred_element_type=jnp.float32) * inv_temp
        ids = start + jnp.arange(vc)
        z = jnp.where(ids < vocab, z, -jnp.inf)
        # The shift cancels out of logZ; no gradient through it keeps the backward simple.
        m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(z, axis=-1)))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(z - m_new[..., None])
        s = s * scale + jnp.sum(e, axis=-1)
        u = u * scale + jnp.sum(e * jnp.where(ids < vocab, z, 0.0), axis=-1)
        tgt = tgt + jnp.sum(jnp.where(ids == tc[..., None], z, 0.0), axis=-1)
        return (m_new, s, u, tgt), None

    starts = jnp.arange(w_chunks.shape[0], dtype=jnp.int32) * vc
    (m, s, u, tgt), _ = jax.lax.scan(vocab_chunk, init, (w_chunks, starts))
    logz = m + jnp.log(s)
    return tgt - logz, logz - u / s
