"""The engine's compiled programs: prefill, admit (fill cache rows, draw first tokens), decode.

All three run the model through its own forward (`CausalLM.forward_with`, a scan over the
stacked layers) with an attention backend: prefill with `DenseAttention.keeping_kv` (causal
over each padded prompt, returning every layer's keys/values, stacked), decode with
`kv_cache.SlotDecodeAttention` (one token per row, written in place into the row's cache slot
of each layer). On CPU (`kv_cache.CacheLayout.layers_apart`) the weights come with each
layer's arrays apart (`served_weights`, views of the stacked ones) and the cache holds each
layer in arrays of its own, so the three run their layers unrolled over those instead of the
scan: no layer is copied out of a stack. Weights are an argument (``leaves``), never a closure
constant, so one compiled program serves every weight version of the same shapes; the static
arguments are the bucketed shapes and a `SamplePlan`.

1. `prefill`: prompts packed into rows of W tokens (several short prompts share a row, each
   attending only to itself, so padding is what the packing leaves, not every prompt's gap
   to the longest) -> every layer's k/v [L, B, W, K, Dh] and the hidden states [B, W, D]. A
   prompt is prefilled once for its n rows.
2. `admit`: writes each admitted row's prompt keys/values into its slots of the cache (only
   those slots, in place: a loop over the layers, so the program holds one layer of the rows'
   keys/values at a time and no copy of the cache) and draws each row's first token from the
   logits after its prompt (draw index 0 of its key). Its entries are rows, padded to the
   cache's rows, so neither the mix of prompts and completions per prompt admitted nor their
   number sets its shape; its writes and output projection run over the admitted rows only
   (a loop and a branch sized at run time), so neither does its cost.
3. `decode`: up to ``steps`` decode steps in a `lax.while_loop` over all rows of the cache;
   stops early when no row is live or ``refill_at`` rows have finished (so their slots can be
   refilled). Row r's token i is drawn with `fold_in(row_key, i)`, row_key from (prompt seed,
   sample index, admission weight version), so a row's noise never depends on the step at
   which, or the batch in which, it is decoded.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from sampler_service import sampling
from sampler_service.kv_cache import CacheLayout, SlotDecodeAttention
from splitrl.models import DenseAttention, layer_views

RowArray = jax.Array | np.ndarray


@dataclasses.dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters and identity, one entry per row (built as host arrays; the
    programs take them as device arrays)."""

    seeds: RowArray  # uint32 [R, 2] the prompt's seed
    sample_ids: RowArray  # int32 [R] completion index within its prompt
    versions: RowArray  # uint32 [R, 2] weight version the row was admitted under
    temperature: RowArray  # float32 [R] > 0: of the draws and of the reported logprobs
    top_k: RowArray  # int32 [R] (0 = whole vocabulary)
    top_p: RowArray  # float32 [R] (1 = off)
    greedy: RowArray  # bool [R]
    max_new: RowArray  # int32 [R]
    stop_ids: RowArray  # int32 [R, S] (-1 = unused)


jax.tree_util.register_dataclass(RowParams)


def _row_keys(params: RowParams):
    return sampling.row_keys(params.seeds, params.sample_ids, params.versions)


def _draw(logits, params: RowParams, keys, draw_index, plan: sampling.SamplePlan):
    u = sampling.step_uniforms(keys, draw_index) if plan.sampled else None
    return sampling.sample_rows(
        logits, u, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        greedy=params.greedy, plan=plan)


def _is_stop(tokens, stop_ids):
    return jnp.any(tokens[:, None] == stop_ids, axis=-1)


def served_weights(state, layers_apart: bool):
    """What the programs take as weights (flattened): the model's ``state``, and with
    ``layers_apart`` (`kv_cache.CacheLayout.layers_apart`) each decoder layer's weights as
    arrays of their own, views of the stacked ones on CPU (`splitrl.models.layer_views`: no
    copy, nothing held twice). Made once per weight state (`ServedWeights`)."""
    if not layers_apart:
        return state
    stacked = state["model"]["layers"]
    return state, layer_views(stacked, jax.tree.leaves(stacked)[0].shape[0])


class ServedWeights:
    """Each weight state's `served_weights`, flattened, with the `Programs` of its structure:
    made once per state (a weight version, or a caller's pinned state) and shared by an
    engine's batches. A batch that starts empty takes its weights from here, and on CPU
    making the layers' views again (a `device_put` per layer and parameter) and looking the
    programs up (hashing the graphdef) cost milliseconds of host work per request of a small
    model, more than the rest of the boundary's host work (bench/README.md, "The sampler's
    weights served once per version"). An entry lives as long as its state object: it holds
    the state by a weak reference and goes when the state does, so it never keeps a replaced
    version's weights alive (the views alias the stacked arrays' memory: nothing is held
    twice)."""

    def __init__(self, graphdef, layers_apart: bool):
        self.graphdef, self.layers_apart = graphdef, layers_apart
        self._entries: dict[int, tuple[weakref.ref, list, Programs]] = {}
        self._lock = threading.Lock()  # one batch builds a state's entry, the other waits

    def get(self, state) -> tuple[list, Programs]:
        """(the leaves the programs take, the programs) for ``state``."""
        with self._lock:
            entry = self._entries.get(id(state))
            if entry is None or entry[0]() is not state:
                leaves, treedef = jax.tree.flatten(served_weights(state, self.layers_apart))
                entries, key = self._entries, id(state)
                entry = (weakref.ref(state, lambda _: entries.pop(key, None)), leaves,
                         programs_for(self.graphdef, treedef, self.layers_apart))
                entries[key] = entry
            return entry[1], entry[2]


class Programs:
    """`prefill` and `decode` compiled for one model structure.

    Weights are passed as the flat list of the leaves of `served_weights`
    (``jax.tree.flatten(...)[0]``, made once per weight state by `ServedWeights`) and the
    model is rebuilt inside from the static graphdef and tree structure: hashing a graphdef
    and flattening an `nnx.State` cost milliseconds per call, which a decode segment of a
    small model cannot afford. ``layers_apart``: the leaves hold each layer's weights apart
    too, and the programs run the layers over those. Get one with `programs_for`, so engines
    of the same model share compiled programs.
    """

    def __init__(self, graphdef, treedef, layers_apart: bool = False):
        self.graphdef, self.treedef, self.layers_apart = graphdef, treedef, layers_apart
        self.prefill = jax.jit(self._prefill)
        self.admit = jax.jit(self._admit, static_argnames=("plan", "sharding", "layout"),
                             donate_argnames=("cache",))
        self.decode = jax.jit(self._decode,
                              static_argnames=("plan", "steps", "sharding", "layout"),
                              donate_argnames=("cache",))

    def model(self, leaves):
        """(the model, its layers' weights apart or None) from the weights' leaves."""
        weights = jax.tree.unflatten(self.treedef, leaves)
        state, layers = weights if self.layers_apart else (weights, None)
        return nnx.merge(self.graphdef, state), layers

    def _prefill(self, leaves, tokens, positions, segments):
        """Packed prompts: tokens/positions/segments [B, W] (several prompts per row, each a
        run of one segment id, positions from 0; -1 = padding). Each token attends causally
        within its own prompt. Returns ((k, v) [L, B, W, K, Dh], hidden [B, W, D])."""
        model, layers = self.model(leaves)
        slots = jnp.arange(tokens.shape[1])
        same = segments[:, :, None] == segments[:, None, :]
        mask = same & (slots[None, :] <= slots[:, None])[None] & (segments >= 0)[:, None, :]
        backend = DenseAttention.keeping_kv(mask, model.config, model.dtype)
        h, backend = model.forward_with(tokens, positions, backend, layers=layers)
        return backend.kv, h

    def _admit(self, leaves, cache, pages, kv, hidden, row_start, row_length, row_slot,
               params: RowParams, *, plan: sampling.SamplePlan,
               sharding: NamedSharding | None, layout: CacheLayout):
        """Writes each admitted row's prompt (``row_length`` [E] tokens from flat packed
        position ``row_start`` [E] of `prefill`'s output) into slots [0, row_length[e]) of
        cache row ``row_slot[e]`` in every layer (a row past the cache's rows marks a padding
        entry: dropped), and draws each row's first token from the hidden state after its
        prompt. ``params`` are the rows' [E]. Returns (cache, tokens, logprobs, stopped), per
        row. ``pages``: the rows' page tables [R, n] of a paged cache
        (`paged_cache.PagedLayout`), else None.

        The entries are rows, not prompts x completions, padded to the cache's rows by the scheduler
        (the rows first, then the padding), so the program's shape is not set by how many rows are
        admitted or by the mix of prompts and completions per prompt they come from: a sampler whose
        admissions mix a rollout's groups with trajectories returning from their tools runs a few
        programs, not one per mix. With the layers apart (CPU) the padding costs (almost) nothing:
        the rows are written in blocks of the smallest of `admit_sizes`, only as many blocks as hold
        rows (a loop of run-time length), and their logits projected by `_admitted_logits`; only the
        draw (top-k over the logits) runs over every entry. The rows' slots are gathered and written
        in place in the donated cache one layer at a time: the program holds at most one layer of a
        block's keys and values (no more than a layer of the cache), never a copy of the cache. A
        row's slots past its prompt keep whatever they held (stale and finite, masked until decode
        writes them)."""
        model, _ = self.model(leaves)
        width = layout.width(cache, pages)
        b, w = hidden.shape[:2]
        admitted = jnp.sum(row_slot < layout.rows(cache, pages), dtype=jnp.int32)
        entries = row_slot.shape[0]
        # The stacked cache (TPU/GPU, paged) is written by the layer loop alone, all entries
        # at once and projected whole: nested in a loop over blocks, with the projection
        # branched, the TPU compiler held several times the cache in temporaries
        # (tests/splitrl_app/planning); the padding's cost is the CPU's (layers apart) concern.
        block = admit_sizes(entries)[0] if layout.layers_apart else entries
        pad = -entries % block  # whole blocks: the extra entries are padding (dropped)
        t = jnp.arange(min(w, width))
        # Row e's slot t reads packed position start + t; slots past its prompt are dropped.
        source = jnp.pad(jnp.minimum(row_start[:, None] + t, b * w - 1), ((0, pad), (0, 0)))
        slot = jnp.pad(jnp.where(t < row_length[:, None], t, width), ((0, pad), (0, 0)),
                       constant_values=width)  # width: out of range, dropped
        rows = jnp.pad(row_slot, (0, pad), constant_values=layout.rows(cache, pages))
        flat = tuple(x.reshape(x.shape[0], b * w, *x.shape[3:]) for x in kv)  # [L, B*W, K, Dh]

        def write_block(i, cache):
            at = i * block
            source_b, slot_b, rows_b = (jax.lax.dynamic_slice_in_dim(x, at, block)
                                        for x in (source, slot, rows))

            def write(layer, cache):
                k, v = (jnp.take(jax.lax.dynamic_index_in_dim(x, layer, keepdims=False),
                                 source_b, axis=0) for x in flat)  # [block, T, K, Dh]
                return layout.write(cache, layer, rows_b, slot_b, k, v, pages, sharding)

            if layout.layers_apart:  # each layer's own arrays
                for layer in range(flat[0].shape[0]):
                    cache = write(layer, cache)
                return cache
            return jax.lax.fori_loop(0, flat[0].shape[0], write, cache)

        last = jnp.take(hidden.reshape(b * w, -1), row_start + row_length - 1, axis=0)
        if layout.layers_apart:
            # only the blocks holding admitted rows (they come first): the padding costs nothing
            cache = jax.lax.fori_loop(0, -(-admitted // block), write_block, tuple(cache))
            logits = _admitted_logits(model, last, admitted)  # [E, V]
        else:
            cache = write_block(0, tuple(cache))
            logits = model.logits(last)
        tokens, logprobs = _draw(logits, params, _row_keys(params),
                                 jnp.zeros(logits.shape[:1], jnp.int32), plan)
        return cache, tokens, logprobs, _is_stop(tokens, params.stop_ids)

    def _decode(self, leaves, cache, pages, last_token, length, generated, live,
                params: RowParams, steps_limit, refill_at, *, plan: sampling.SamplePlan,
                steps: int, sharding: NamedSharding | None, layout: CacheLayout):
        model, layers = self.model(leaves)
        return _decode_loop(model, layers, cache, pages, last_token, length, generated,
                            live, params, steps_limit, refill_at, plan=plan, steps=steps,
                            sharding=sharding, layout=layout)


def admit_sizes(entries: int) -> list[int]:
    """The sizes admit's per-row work takes for ``entries`` entries: the powers of two (of
    ``entries``, halved and rounded up) from about an eighth of ``entries`` up to all of them.
    The smallest is the block of rows it writes at a time, and `_admitted_logits` picks the
    smallest holding the admitted rows."""
    sizes: list[int] = []
    size = entries
    while True:
        sizes.insert(0, size)
        if size == 1 or size * 8 <= entries:
            return sizes
        size = -(-size // 2)


def _admitted_logits(model, last, admitted):
    """Logits [E, V] of admit's entries from the hidden states after their prompts, ``last``
    [E, D], of which the first ``admitted`` are rows (the rest padding, whose logits read 0).

    The output projection (a [rows, D] x [D, V] matmul, the most of admit's arithmetic) runs
    over the smallest of `admit_sizes` holding the admitted rows, the branch picked at run
    time (`lax.switch`): a boundary that admits a few rows into a big cache, as continuous
    batching does (about an eighth of the batch at a time), projects those, not every row
    of the cache, while the program's shape stays the prefill's and the cache's. The branch
    is a function of the rows admitted, as the rest of the schedule is (an exclusive
    request's tokens stay bitwise a function of the request); on XLA:CPU a row's logits do
    not depend on the rows beside it, so no token changes. Only the projection is branched:
    branches that also drew the tokens (top-k, the inverse CDF) would each compile a draw,
    the bulk of admit's compile time (bench/README.md)."""
    entries = last.shape[0]

    def branch(size: int):
        def project(last):
            return jnp.pad(model.logits(last[:size]), ((0, entries - size), (0, 0)))
        return project

    sizes = admit_sizes(entries)
    index = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes, jnp.int32), admitted),
                        len(sizes) - 1)
    return jax.lax.switch(index, [branch(s) for s in sizes], last)


@functools.lru_cache(maxsize=8)
def programs_for(graphdef, treedef, layers_apart: bool = False) -> Programs:
    return Programs(graphdef, treedef, layers_apart)


def _decode_loop(model, layers, cache, pages, last_token, length, generated, live,
                 params: RowParams, steps_limit, refill_at, *, plan: sampling.SamplePlan,
                 steps: int, sharding: NamedSharding | None, layout: CacheLayout):
    """Up to ``min(steps, steps_limit)`` decode steps over every cache row.

    Row r feeds ``last_token[r]`` at position/slot ``length[r]`` (its tokens so far) and, if
    ``live[r]``, draws its token number ``generated[r]``. A live row stops on a stop id or at
    ``params.max_new`` tokens. The loop ends early when no row is live or ``refill_at`` rows
    finished. ``layers``: each layer's weights apart (the layers run over them, unrolled) or
    None (the model scans its stacked layers). ``pages``: the rows' page tables of a paged
    cache, else None. Returns (cache, tokens [R, steps] (-1 where a row drew nothing),
    logprobs [R, steps], produced [R] tokens drawn, stopped [R] ended on a stop id).
    """
    rows = last_token.shape[0]
    keys = _row_keys(params)

    def cond(carry):
        i, _, _, _, _, live, _, _, _, _, finished = carry
        return (i < steps_limit) & jnp.any(live) & (finished < refill_at)

    def body(carry):
        i, cache, last, length, generated, live, out_tok, out_lp, produced, stopped, finished = (
            carry)
        backend = SlotDecodeAttention(cache, length, layout, sharding, pages)
        h, backend = model.forward_with(last[:, None], length[:, None], backend, layers=layers)
        tok, lp = _draw(model.logits(h[:, 0]), params, keys, generated, plan)
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
