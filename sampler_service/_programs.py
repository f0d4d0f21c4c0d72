"""The engine's compiled programs: prefill, admit (fill cache rows, draw first tokens), decode.

All three run the model through its own forward (`CausalLM.forward_with`) with an attention
backend: prefill with `splitrl.models.DenseAttention(keep_kv=True)` (causal over each padded
prompt, returning every layer's keys/values), decode with `kv_cache.SlotDecodeAttention` (one
token per row, written in place into the row's cache slot). Weights are an argument
(``state``), never a closure constant, so one compiled program serves every weight version of
the same shapes; the static arguments are the bucketed shapes and a `SamplePlan`.

1. `prefill`: P prompts right-padded to W tokens -> each layer's k/v [P, W, K, Dh] and the
   logits after each prompt's last token [P, V]. A prompt is prefilled once for its n rows.
2. `admit`: copies prompt p's keys/values into the cache rows of its n completions and draws
   each row's first token from the prompt's logits (draw index 0 of the row's key).
3. `decode`: up to ``steps`` decode steps in a `lax.while_loop` over all rows of the cache;
   stops early when no row is live or ``refill_at`` rows have finished (so their slots can be
   refilled). Row r's token i is drawn with `fold_in(row_key, i)`, row_key from (prompt seed,
   sample index, admission weight version), so a row's noise never depends on the step at
   which, or the batch in which, it is decoded.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from sampler_service import sampling
from sampler_service.kv_cache import SlotDecodeAttention
from splitrl.models import DenseAttention, causal_mask


@dataclasses.dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters and identity (device arrays, one entry per row)."""

    seeds: jax.Array  # uint32 [R, 2] the prompt's seed
    sample_ids: jax.Array  # int32 [R] completion index within its prompt
    versions: jax.Array  # uint32 [R, 2] weight version the row was admitted under
    temperature: jax.Array  # float32 [R] (> 0; 1 for greedy rows)
    top_k: jax.Array  # int32 [R] (0 = whole vocabulary)
    top_p: jax.Array  # float32 [R] (1 = off)
    greedy: jax.Array  # bool [R]
    logprob_temperature: jax.Array  # float32 [R]
    max_new: jax.Array  # int32 [R]
    stop_ids: jax.Array  # int32 [R, S] (-1 = unused)


jax.tree_util.register_dataclass(RowParams)


def _draw(logits, params: RowParams, draw_index, plan: sampling.SamplePlan):
    keys = sampling.row_keys(params.seeds, params.sample_ids, params.versions)
    u = sampling.step_uniforms(keys, draw_index) if plan.sampled else None
    return sampling.sample_rows(
        logits, u, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        greedy=params.greedy, logprob_temperature=params.logprob_temperature, plan=plan)


def _is_stop(tokens, stop_ids):
    return jnp.any(tokens[:, None] == stop_ids, axis=-1)


class Programs:
    """`prefill` and `decode` compiled for one model structure.

    Weights are passed as the flat list of the state's leaves (``jax.tree.flatten(state)[0]``,
    made once per weight version) and the model is rebuilt inside from the static graphdef
    and tree structure: hashing a graphdef and flattening an `nnx.State` cost milliseconds
    per call, which a decode segment of a small model cannot afford. Get one with
    `programs_for`, so engines of the same model share compiled programs.
    """

    def __init__(self, graphdef, treedef):
        self.graphdef, self.treedef = graphdef, treedef
        self.prefill = jax.jit(self._prefill)
        self.decode = jax.jit(self._decode, static_argnames=("plan", "steps", "sharding"),
                              donate_argnames=("cache",))

    def model(self, leaves):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))

    def _prefill(self, leaves, tokens, lengths):
        """tokens [P, W] right-padded, lengths [P] -> (((k, v) [P, W, K, Dh] per layer),
        last-token logits [P, V] float32)."""
        model = self.model(leaves)
        p, w = tokens.shape
        slots = jnp.arange(w)
        valid = slots[None, :] < lengths[:, None]
        positions = jnp.broadcast_to(slots, (p, w)).astype(jnp.int32)
        backend = DenseAttention(causal_mask(slots, slots, valid), keep_kv=True)
        h, backend = model.forward_with(tokens, positions, backend)
        last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return backend.kv, model.logits(last)

    def _decode(self, leaves, cache, last_token, length, generated, live, params: RowParams,
                steps_limit, refill_at, *, plan: sampling.SamplePlan, steps: int,
                sharding: NamedSharding | None):
        return _decode_loop(self.model(leaves), cache, last_token, length, generated, live,
                            params, steps_limit, refill_at, plan=plan, steps=steps,
                            sharding=sharding)


@functools.lru_cache(maxsize=8)
def programs_for(graphdef, treedef) -> Programs:
    return Programs(graphdef, treedef)


@functools.partial(jax.jit, static_argnames=("plan", "sharding"), donate_argnames=("cache",))
def admit(cache, kv, logits, row_prompt, row_slot, params: RowParams, *,
          plan: sampling.SamplePlan, sharding: NamedSharding | None):
    """Fills cache rows ``row_slot`` [N] (== rows of the cache: a padding entry, dropped) with
    the prompt ``row_prompt`` [N] indexes in ``kv``/``logits`` (from `prefill`), and draws
    each row's first token. Returns (cache, tokens [N], logprobs [N], stopped [N])."""
    width = cache[0][0].shape[3]
    out = []
    for (k_cache, v_cache), (k, v) in zip(cache, kv, strict=True):
        k = _fit_width(jnp.take(k, row_prompt, axis=0), width)  # [N, S, K, Dh]
        v = _fit_width(jnp.take(v, row_prompt, axis=0), width)
        k_cache = k_cache.at[row_slot].set(k.transpose(0, 2, 3, 1).astype(k_cache.dtype),
                                           mode="drop")
        v_cache = v_cache.at[row_slot].set(v.transpose(0, 2, 1, 3).astype(v_cache.dtype),
                                           mode="drop")
        if sharding is not None:
            k_cache = jax.lax.with_sharding_constraint(k_cache, sharding)
            v_cache = jax.lax.with_sharding_constraint(v_cache, sharding)
        out.append((k_cache, v_cache))
    tokens, logprobs = _draw(jnp.take(logits, row_prompt, axis=0), params,
                             jnp.zeros(row_prompt.shape, jnp.int32), plan)
    return tuple(out), tokens, logprobs, _is_stop(tokens, params.stop_ids)


def _fit_width(x, width):
    """x [N, W, ...] cut or zero-padded to [N, width, ...]."""
    have = x.shape[1]
    if width <= have:
        return x[:, :width]
    return jnp.pad(x, [(0, 0), (0, width - have)] + [(0, 0)] * (x.ndim - 2))


def _decode_loop(model, cache, last_token, length, generated, live, params: RowParams,
                 steps_limit, refill_at, *, plan: sampling.SamplePlan, steps: int,
                 sharding: NamedSharding | None):
    """Up to ``min(steps, steps_limit)`` decode steps over every cache row.

    Row r feeds ``last_token[r]`` at position/slot ``length[r]`` (its tokens so far) and, if
    ``live[r]``, draws its token number ``generated[r]``. A live row stops on a stop id or at
    ``params.max_new`` tokens. The loop ends early when no row is live or ``refill_at`` rows
    finished. Returns (cache, tokens [R, steps] (-1 where a row drew nothing), logprobs
    [R, steps], produced [R] tokens drawn, stopped [R] ended on a stop id).
    """
    rows = last_token.shape[0]

    def cond(carry):
        i, _, _, _, _, live, _, _, _, _, finished = carry
        return (i < steps_limit) & jnp.any(live) & (finished < refill_at)

    def body(carry):
        i, cache, last, length, generated, live, out_tok, out_lp, produced, stopped, finished = (
            carry)
        backend = SlotDecodeAttention(cache, length, sharding)
        h, backend = model.forward_with(last[:, None], length[:, None], backend)
        tok, lp = _draw(model.logits(h[:, 0]), params, generated, plan)
        out_tok = jax.lax.dynamic_update_slice(out_tok, jnp.where(live, tok, -1)[:, None], (0, i))
        out_lp = jax.lax.dynamic_update_slice(out_lp, jnp.where(live, lp, 0.0)[:, None], (0, i))
        step = live.astype(jnp.int32)
        hit_stop = live & _is_stop(tok, params.stop_ids)
        generated = generated + step
        ended = live & (hit_stop | (generated >= params.max_new))
        return (i + 1, backend.cache, jnp.where(live, tok, last), length + step, generated,
                live & ~ended, out_tok, out_lp, produced + step, stopped | hit_stop,
                finished + jnp.sum(ended.astype(jnp.int32)))

    carry = (jnp.int32(0), cache, last_token, length, generated, live,
             jnp.full((rows, steps), -1, jnp.int32), jnp.zeros((rows, steps), jnp.float32),
             jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), bool), jnp.int32(0))
    carry = jax.lax.while_loop(cond, body, carry)
    _, cache, _, _, _, _, out_tok, out_lp, produced, stopped, _ = carry
    return cache, out_tok, out_lp, produced, stopped
