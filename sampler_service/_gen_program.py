"""The compiled generation program: prefill once per prompt, then a KV-cache decode loop.

One jitted function per bucket does everything on device, with no host round trip per token:

1. **Prefill** the P (left-padded) distinct prompts through the model's own cached forward,
   keeping each layer's keys/values as a *prompt cache* (`[P, K, Dh, T]` keys, `[P, K, T, Dh]`
   values) and the logits of the
   last prompt position only.
2. **Fan out** to R = P * n rows (n completions per prompt) *without copying* the prompt cache:
   the n rows of a prompt keep sharing it. Each row gets its own *generation cache*
   (`[R, K, Dh, S]` keys, `[R, K, S, Dh]` values) for the S tokens it generates.
3. **Decode** in a `lax.while_loop` that stops when every row is done or max_new_tokens is
   reached. Each step embeds the previous tokens, runs the layers (the model's own norm,
   projection, RoPE and MLP modules) with an attention that reads the shared prompt cache once
   per prompt for all its n rows plus the row's generated keys, and samples on device.

Weights are an argument (`state`), never a closure constant, so one compiled program serves
every weight version of the same shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from sampler_service import sampling
from splitrl.models import init_cache, left_pad_positions
from splitrl.models.rope import apply_rope, inv_frequencies, rope_tables

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static (compile-time) part of a generation call; hashable, part of the jit cache key."""

    new_tokens: int  # generation buffer length (bucketed max_new_tokens)
    top_k: int
    use_top_p: bool
    greedy: bool
    prompt_cache_sharding: NamedSharding | None = None  # for [P, K, T or Dh, Dh or T]
    gen_cache_sharding: NamedSharding | None = None  # for [P * n, K, S or Dh, Dh or S]


def _constrain(x, sharding):
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def _attend(q, pk, pv, pmask, gk, gv, slot):
    """Decode attention for one new token per row.

    q [P,n,K,G,D]; prompt cache pk [P,K,D,T], pv [P,K,T,D] with pmask [P,T]; generation
    cache gk [R,K,D,S], gv [R,K,S,D] (R = P*n) whose slots <= slot are valid (the new
    token's k/v already written: on XLA CPU reading the cache *before* the in-place update
    makes the loop copy it). Keys are stored transposed ([D, slots]): the score reduction then
    runs along contiguous slots.
    One softmax over the prompt's and the row's generated keys.
    """
    p, n, kh, g, dh = q.shape
    scale = dh ** -0.5
    f32 = jnp.float32
    # Broadcast-multiply-reduce instead of dot_general: the products are batches of tiny
    # ([G, D] x [D, slots]) matrices, for which XLA CPU's dot kernels are ~2x slower than
    # one vectorised loop fusion streaming the cache.
    qf = (q.astype(f32) * scale).reshape(p, n, kh, g, dh, 1)
    s_p = jnp.sum(qf * pk.astype(f32)[:, None, :, None], axis=-2)  # [P, n, K, G, T]
    s_p = jnp.where(pmask[:, None, None, None, :], s_p, _MASK_VALUE)
    s_g = jnp.sum(qf.reshape(p * n, kh, g, dh, 1) * gk.astype(f32)[:, :, None], axis=-2)
    s_g = s_g.reshape(p, n, kh, g, -1)
    s_g = jnp.where(jnp.arange(gk.shape[3]) <= slot, s_g, _MASK_VALUE)
    m = jnp.maximum(jnp.max(s_p, axis=-1, keepdims=True), jnp.max(s_g, axis=-1, keepdims=True))
    e_p, e_g = jnp.exp(s_p - m), jnp.exp(s_g - m)
    denom = jnp.sum(e_p, axis=-1, keepdims=True) + jnp.sum(e_g, axis=-1, keepdims=True)
    out_p = jnp.sum(e_p[..., None] * pv.astype(f32)[:, None, :, None], axis=-2)
    out_g = jnp.sum(e_g.reshape(p * n, kh, g, -1, 1) * gv.astype(f32)[:, :, None], axis=-2)
    out = (out_p + out_g.reshape(q.shape)).astype(q.dtype)
    return out / denom.astype(out.dtype)


def _decode_layers(model, tokens, positions, prompt_kv, pmask, gen_kv, slot, plan):
    """One decode step for tokens [P, n] at RoPE positions [P, n]; returns (logits, gen_kv)."""
    cfg = model.config
    p, n = tokens.shape
    r = p * n
    kh, dh = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // kh
    x = model.model.embed_tokens(tokens.reshape(r, 1))  # [R, 1, D]
    cos, sin = rope_tables(inv_frequencies(cfg), positions.reshape(r, 1))
    new_gen = []
    for layer, (pk, pv), (gk, gv) in zip(model.model.layers, prompt_kv, gen_kv, strict=True):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.q_proj(h).reshape(r, 1, cfg.num_heads, dh)
        k = a.k_proj(h).reshape(r, 1, kh, dh)
        v = a.v_proj(h).reshape(r, 1, kh, dh)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Write this token's k/v at generation slot `slot`, then attend.
        k = k.reshape(r, kh, dh, 1).astype(gk.dtype)
        v = v.reshape(r, kh, 1, dh).astype(gv.dtype)
        gk = _constrain(jax.lax.dynamic_update_slice(gk, k, (0, 0, 0, slot)),
                        plan.gen_cache_sharding)
        gv = _constrain(jax.lax.dynamic_update_slice(gv, v, (0, 0, slot, 0)),
                        plan.gen_cache_sharding)
        new_gen.append((gk, gv))
        attn = _attend(q.reshape(p, n, kh, g, dh), pk, pv, pmask, gk, gv, slot)
        x = x + a.o_proj(attn.reshape(r, 1, cfg.num_heads * dh).astype(x.dtype))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits = model.logits(model.model.norm(x)[:, 0])
    return logits, tuple(new_gen)


def generate_program(graphdef, state, tokens, prompt_mask, row_valid, prompt_seeds, sample_ids,
                     version, temperature, top_p, logprob_temperature, max_new, stop_ids, *,
                     plan: Plan):
    """Prefill + decode for P prompts x n rows. Jit with `graphdef` and `plan` static.

    tokens/prompt_mask [P, T] (left padded); row_valid/sample_ids [P, n]; prompt_seeds uint32
    [P, 2] (each prompt's seed, see `sampling.row_keys`); version uint32 [2] (the weights');
    temperature/top_p/logprob_temperature float32 scalars; max_new int32 scalar
    (<= plan.new_tokens); stop_ids int32 [S] (-1 = unused).
    Returns (tokens [R, N] int32, logprobs [R, N] float32, lengths [R] int32,
    stopped [R] bool) with R = P * n rows in prompt-major order and N = plan.new_tokens.
    """
    model = nnx.merge(graphdef, state)
    cfg = model.config
    p, t = tokens.shape
    n = row_valid.shape[1]
    r, nb = p * n, plan.new_tokens
    dtype = model.dtype

    # 1. Prefill with the model's cached forward; keep k [P, K, D, T], v [P, K, T, D].
    cache = init_cache(cfg, p, t, dtype)
    h, cache = model.forward_hidden(tokens, left_pad_positions(prompt_mask),
                                    attention_mask=prompt_mask, cache=cache, cache_index=0)
    last_logits = model.logits(h[:, -1])  # [P, V]
    prompt_kv = tuple(
        (_constrain(cache.k[i].transpose(0, 2, 3, 1), plan.prompt_cache_sharding),
         _constrain(cache.v[i].transpose(0, 2, 1, 3), plan.prompt_cache_sharding))
        for i in range(cfg.num_layers))
    prompt_len = jnp.sum(prompt_mask, axis=-1).astype(jnp.int32)  # [P]
    row_pos0 = jnp.broadcast_to(prompt_len[:, None], (p, n))  # position of generated token 0

    row_seeds = jnp.broadcast_to(prompt_seeds[:, None], (p, n, 2)).reshape(r, 2)
    keys = None if plan.greedy else sampling.row_keys(row_seeds, sample_ids.reshape(r), version)

    def draw(logits, step):
        u = None if plan.greedy else sampling.step_uniforms(keys, step)
        return sampling.sample_tokens(
            logits, u, temperature=temperature, top_k=plan.top_k, use_top_p=plan.use_top_p,
            top_p=top_p, greedy=plan.greedy, logprob_temperature=logprob_temperature)

    def is_stop(tok):
        return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)

    # 2. First token from the prefill logits, shared by the n rows of each prompt.
    logits0 = jnp.broadcast_to(last_logits[:, None], (p, n, last_logits.shape[-1]))
    tok0, lp0 = draw(logits0.reshape(r, -1), 0)
    alive = row_valid.reshape(r)
    pad = jnp.int32(0)
    tok0 = jnp.where(alive, tok0, pad)
    out_tok = jnp.zeros((r, nb), jnp.int32).at[:, 0].set(tok0)
    out_lp = jnp.zeros((r, nb), jnp.float32).at[:, 0].set(jnp.where(alive, lp0, 0.0))
    lengths = alive.astype(jnp.int32)
    stopped = alive & is_stop(tok0)
    done = ~alive | stopped | (max_new <= 1)

    slots = max(nb - 1, 1)
    k_shape = (r, cfg.num_kv_heads, cfg.head_dim, slots)
    v_shape = (r, cfg.num_kv_heads, slots, cfg.head_dim)
    gen_kv = tuple((_constrain(jnp.zeros(k_shape, dtype), plan.gen_cache_sharding),
                    _constrain(jnp.zeros(v_shape, dtype), plan.gen_cache_sharding))
                   for _ in range(cfg.num_layers))

    # 3. Decode: step i feeds token i-1 (generation slot i-1) and samples token i.
    def cond(carry):
        i, _, _, _, _, _, _, done = carry
        return (i < max_new) & ~jnp.all(done)

    def body(carry):
        i, gen_kv, cur, out_tok, out_lp, lengths, stopped, done = carry
        slot = i - 1
        logits, gen_kv = _decode_layers(model, cur.reshape(p, n), row_pos0 + slot, prompt_kv,
                                        prompt_mask, gen_kv, slot, plan)
        tok, lp = draw(logits, i)
        tok = jnp.where(done, pad, tok)
        out_tok = jax.lax.dynamic_update_slice(out_tok, tok[:, None], (0, i))
        out_lp = jax.lax.dynamic_update_slice(out_lp, jnp.where(done, 0.0, lp)[:, None], (0, i))
        lengths = lengths + (~done).astype(jnp.int32)
        stopped = stopped | (~done & is_stop(tok))
        done = done | stopped
        return i + 1, gen_kv, tok, out_tok, out_lp, lengths, stopped, done

    carry = (jnp.int32(1), gen_kv, tok0, out_tok, out_lp, lengths, stopped, done)
    carry = jax.lax.while_loop(cond, body, carry)
    _, _, _, out_tok, out_lp, lengths, stopped, _ = carry
    return out_tok, out_lp, lengths, stopped
