"""Sampling: options, temperature, top-k / top-p filtering and per-row reproducible draws.

Everything here is a pure `jnp` function of logits `[R, V]` (one row per sequence), usable
inside the engine's jitted decode loop.

**Which logprob is reported.** For a sampled token `t` the engine reports
`log_softmax(logits / temperature)[t]`: the temperature-scaled distribution *before* top-k /
top-p truncation. The trainer recomputes exactly that from its own logits and the same
temperature, so the importance ratio `pi_train / pi_sampler` compares like with like; the
truncation only decides which tokens can be drawn. Greedy decoding (`greedy=True` or
`temperature == 0`) reports `log_softmax(logits)` (temperature 1) unless a positive temperature
is given alongside `greedy=True`, in which case that temperature is used.

**Draws.** Every row owns a PRNG key derived from its prompt's seed, its sample index and the
weight version (see `row_keys`); step `i` of a row uses `fold_in(row_key, i)`. A prompt's seed
is the one the request gives it (a trainer derives it from the run seed and the prompt's uid),
else a hash of the request seed and the prompt's index (`prompt_seed`). A sample therefore
depends only on (prompt seed, sample index, weight version) and the model's logits, not on the
request or batch it lands in. A draw is one uniform per row and step, mapped through the inverse CDF
of the filtered distribution (cheaper on CPU than Gumbel-max, which needs V random numbers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from splitrl.config import MIN_TEMPERATURE, temperature_ok

NEG_INF = float("-inf")
# Blocks for the two-level inverse-CDF over a full vocabulary (XLA's cumsum over 16k+ entries
# is ~10x slower than a cumsum over block sums followed by one within the chosen block).
_CDF_BLOCK = 128
# Bisection steps for the top-p threshold without top-k (float32 has 24 mantissa bits).
_TOP_P_ITERS = 32


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """How to sample one generation request.

    temperature: > 0 scales logits; 0 means greedy. top_k: keep the k most likely tokens
    (0 = off). top_p: keep the smallest set of most likely tokens whose probability reaches
    top_p (1 = off), applied after top-k. max_new_tokens: generation budget per sequence.
    stop_token_ids: extra stop tokens (besides the engine's EOS ids); the stop token is
    included in the output. seed: per-request seed. greedy: argmax decoding.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    greedy: bool = False

    def __post_init__(self):
        def bad(field, expected, value):
            raise ValueError(f"SamplingOptions.{field}: expected {expected}, got {value!r}")

        if not _is_number(self.temperature) or not temperature_ok(self.temperature):
            bad("temperature", f"0 (greedy) or a number >= {MIN_TEMPERATURE:g} (smaller ones "
                "overflow float32 logits / temperature)", self.temperature)
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0 = off)", self.top_k)
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "a number with 0 < top_p <= 1", self.top_p)
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            bad("max_new_tokens", "an integer >= 1", self.max_new_tokens)
        if not isinstance(self.stop_token_ids, Sequence) or isinstance(self.stop_token_ids, str):
            bad("stop_token_ids", "a sequence of token ids", self.stop_token_ids)
        stops = tuple(self.stop_token_ids)
        if any(not _is_int(t) or t < 0 for t in stops):
            bad("stop_token_ids", "non-negative integer token ids", self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        if not _is_int(self.seed):
            bad("seed", "an integer", self.seed)
        if not isinstance(self.greedy, bool):
            bad("greedy", "a bool", self.greedy)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution the reported logprobs are under."""
        return float(self.temperature) if self.temperature > 0 else 1.0

    @classmethod
    def from_config(cls, config, **overrides) -> SamplingOptions:
        """From a `splitrl.config.SamplingConfig` (or anything with the same fields)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {name: getattr(config, name) for name in fields if hasattr(config, name)}
        if "stop_token_ids" in values:
            values["stop_token_ids"] = tuple(values["stop_token_ids"])
        values.update(overrides)
        return cls(**values)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


# ---------------------------------------------------------------------------- distributions


def _per_row(value) -> jax.Array:
    """A scalar, or one value per row [R] as a column [R, 1] (broadcasts against [R, V])."""
    value = jnp.asarray(value, jnp.float32)
    return value[:, None] if value.ndim == 1 else value


def scale_logits(logits: jax.Array, temperature) -> jax.Array:
    """logits / temperature in float32 (temperature > 0: a scalar or one per row)."""
    return logits.astype(jnp.float32) / _per_row(temperature)


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature) -> jax.Array:
    """log_softmax(logits / temperature)[row, tokens[row]]: the reported logprob (see module doc).

    logits [R, V], tokens [R] -> [R] float32; temperature a scalar or one per row. Computed on
    the full, untruncated distribution.
    """
    scaled = scale_logits(logits, temperature)
    picked = jnp.take_along_axis(scaled, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(scaled, axis=-1)


def top_k_filter(logits: jax.Array, k: int) -> jax.Array:
    """Logits with everything below the k-th largest value of its row set to -inf.

    Ties with the k-th value are kept (so a row may keep more than k tokens on exact ties).
    k = 0 or k >= V returns the logits unchanged.
    """
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits >= kth, logits, NEG_INF)


def top_p_keep_sorted(sorted_logits: jax.Array, top_p) -> jax.Array:
    """Nucleus mask over logits already sorted in descending order along the last axis.

    Keeps the smallest prefix whose probability (renormalised over the given entries) reaches
    top_p; the first entry is always kept.
    """
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return mass_before < _per_row(top_p)


def top_p_filter(logits: jax.Array, top_p) -> jax.Array:
    """Logits with the tokens outside the nucleus of probability top_p set to -inf.

    The nucleus is the smallest set of most likely tokens whose probability reaches top_p
    (ties at its edge are kept). Found without a full vocabulary sort (slow on CPU): the
    probability threshold is bisected, `_TOP_P_ITERS` passes over the row.
    """
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    target = _per_row(top_p)

    def mass_at_or_above(t):
        return jnp.sum(jnp.where(probs >= t, probs, 0.0), axis=-1, keepdims=True)

    # Invariant: mass(p >= lo) >= top_p; shrink [lo, hi] towards the largest such threshold.
    lo = jnp.zeros(probs.shape[:-1] + (1,), jnp.float32)
    hi = jnp.max(probs, axis=-1, keepdims=True)

    def body(_, bounds):
        lo, hi = bounds
        mid = 0.5 * (lo + hi)
        ok = mass_at_or_above(mid) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, hi = jax.lax.fori_loop(0, _TOP_P_ITERS, body, (lo, hi))
    # hi itself may already be enough (e.g. the top token alone has mass >= top_p).
    threshold = jnp.where(mass_at_or_above(hi) >= target, hi, lo)
    return jnp.where(probs >= threshold, logits, NEG_INF)


# ---------------------------------------------------------------------------- draws


def prompt_seed(request_seed: int, prompt_index: int) -> int:
    """The 64-bit seed of the prompt at ``prompt_index`` of a request that gave no per-prompt
    seed: a hash of (request seed, index), so neighbouring prompts get unrelated noise."""
    seed = int(request_seed) % (1 << 64)
    words = np.random.SeedSequence([seed & 0xFFFFFFFF, seed >> 32, int(prompt_index)])
    low, high = words.generate_state(2, np.uint32)
    return int(low) | (int(high) << 32)


def seed_words(seeds: Sequence[int]) -> np.ndarray:
    """64-bit seeds as uint32 [N, 2] (low word, high word) for the device."""
    values = [int(s) % (1 << 64) for s in seeds]
    return np.array([[v & 0xFFFFFFFF, v >> 32] for v in values], np.uint32).reshape(-1, 2)


def row_keys(seeds: jax.Array | np.ndarray, sample_ids: jax.Array | np.ndarray,
             version: jax.Array | np.ndarray) -> jax.Array:
    """One PRNG key per row from its prompt's seed (uint32 [R, 2]), its sample index [R] and
    the weight version that generates it (uint32 [2]: low, high word; or one per row [R, 2]).

    So completion j of a prompt is drawn from the same noise whichever request, batch or row
    carries it; a new weight version gives it fresh noise. (With in-flight weight updates a
    row keeps the key of the version it was admitted under.)
    """
    version = jnp.broadcast_to(jnp.asarray(version, jnp.uint32), seeds.shape)

    def one(words, sample, version):
        key = jax.random.fold_in(jax.random.key(words[0]), words[1])
        key = jax.random.fold_in(jax.random.fold_in(key, version[0]), version[1])
        return jax.random.fold_in(key, sample)

    return jax.vmap(one)(seeds.astype(jnp.uint32), sample_ids.astype(jnp.uint32), version)


def step_uniforms(keys: jax.Array, step) -> jax.Array:
    """One uniform in (0, 1] per row for draw number `step` (a scalar or one per row):
    keys [R] -> [R]."""
    steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), keys.shape)
    u = jax.vmap(lambda k, i: jax.random.uniform(jax.random.fold_in(k, i)))(keys, steps)
    return 1.0 - u  # (0, 1]: a zero target could select a leading zero-probability token


def inverse_cdf_sample(logits: jax.Array, u: jax.Array) -> jax.Array:
    """Index drawn from softmax(logits) per row, given uniforms u [R] in (0, 1].

    Tokens at -inf have probability 0 and are never drawn. Uses a two-level (block, then
    within-block) cumulative sum when the row is long.
    """
    logits = logits.astype(jnp.float32)
    r, v = logits.shape
    probs = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    if v <= 2 * _CDF_BLOCK:
        cdf = jnp.cumsum(probs, axis=-1)
        target = u * cdf[:, -1]
        idx = jnp.sum(cdf < target[:, None], axis=-1)
        return jnp.minimum(idx, v - 1).astype(jnp.int32)
    nb = -(-v // _CDF_BLOCK)
    probs = jnp.pad(probs, ((0, 0), (0, nb * _CDF_BLOCK - v))).reshape(r, nb, _CDF_BLOCK)
    block_mass = jnp.sum(probs, axis=-1)
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    target = u * block_cdf[:, -1]
    b = jnp.minimum(jnp.sum(block_cdf < target[:, None], axis=-1), nb - 1)
    before = (jnp.take_along_axis(block_cdf, b[:, None], axis=1)[:, 0]
              - jnp.take_along_axis(block_mass, b[:, None], axis=1)[:, 0])
    within = jnp.take_along_axis(probs, b[:, None, None], axis=1)[:, 0]
    cdf = jnp.cumsum(within, axis=-1) + before[:, None]
    j = jnp.sum(cdf < target[:, None], axis=-1)
    # Float rounding between the two levels can put the target just outside the block's
    # non-zero entries: clamp to them (the chosen block always has positive mass).
    first_nonzero = jnp.argmax(within > 0, axis=-1)
    last_nonzero = _CDF_BLOCK - 1 - jnp.argmax(within[:, ::-1] > 0, axis=-1)
    j = jnp.clip(j, first_nonzero, last_nonzero)
    return jnp.minimum(b * _CDF_BLOCK + j, v - 1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class SamplePlan:
    """The static (compile-time) part of sampling a batch of rows with per-row parameters.

    k_cap: top-k candidates computed (>= every top-k row's k; 0 = no row uses top-k);
    full: some sampled row draws from the whole vocabulary (its top_k is 0); top_p: some row
    has top_p < 1; sampled: some row is not greedy (else only argmax runs); greedy: some row
    is greedy.
    """

    k_cap: int = 0
    full: bool = False
    top_p: bool = False
    sampled: bool = True
    greedy: bool = True  # some row is greedy (else no argmax is computed)


def sample_rows(logits: jax.Array, u: jax.Array | None, *, temperature, top_k, top_p, greedy,
                plan: SamplePlan) -> tuple[jax.Array, jax.Array]:
    """(tokens [R] int32, logprobs [R] float32) for logits [R, V], one parameter set per row.

    temperature/top_p float32 [R], top_k int32 [R] (0 = whole vocabulary, else
    0 < k <= plan.k_cap), greedy bool [R]. A sampled row draws from softmax(logits /
    temperature); every row's logprob is `log_softmax(logits / temperature)` at its token (the
    module doc; a greedy row's temperature only sets that). A row's draw depends on its own
    parameters and uniform only, never on its neighbours': a top-k row inverts the CDF of its
    k candidates in descending order (the first k of `lax.top_k(plan.k_cap)`, the rest
    masked), a whole-vocabulary row the CDF in vocabulary order; top-p keeps the nucleus of
    what top-k left (renormalised); a greedy row takes the argmax.
    """
    logits = logits.astype(jnp.float32)
    scaled = scale_logits(logits, temperature)
    tokens = (jnp.argmax(logits, axis=-1).astype(jnp.int32)
              if plan.greedy or not plan.sampled else None)
    if plan.sampled:
        assert u is not None, "sampled rows draw from their uniforms"
        use_top_p = _per_row(top_p) < 1.0 if plan.top_p else None
        drawn = None
        if plan.k_cap:
            values, indices = jax.lax.top_k(scaled, plan.k_cap)
            values = jnp.where(jnp.arange(plan.k_cap) < top_k[:, None], values, NEG_INF)
            if plan.top_p:
                assert use_top_p is not None
                keep = top_p_keep_sorted(values, top_p) | ~use_top_p
                values = jnp.where(keep, values, NEG_INF)
            pick = inverse_cdf_sample(values, u)
            drawn = jnp.take_along_axis(indices, pick[:, None], axis=-1)[:, 0]
        if plan.full:
            nucleus = scaled
            if plan.top_p:
                assert use_top_p is not None
                nucleus = jnp.where(use_top_p, top_p_filter(scaled, top_p), scaled)
            whole = inverse_cdf_sample(nucleus, u)
            drawn = whole if drawn is None else jnp.where(top_k > 0, drawn, whole)
        assert drawn is not None, "a sampled row draws top-k (k_cap) or from everything (full)"
        drawn = drawn.astype(jnp.int32)
        tokens = drawn if tokens is None else jnp.where(greedy, tokens, drawn)
    assert tokens is not None  # argmax when no row is sampled
    picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
    return tokens, picked - jax.nn.logsumexp(scaled, axis=-1)


def sample_tokens(logits: jax.Array, u: jax.Array | None, *, temperature, top_k: int,
                  use_top_p: bool, top_p, greedy: bool,
                  logprob_temperature) -> tuple[jax.Array, jax.Array]:
    """`sample_rows` with one parameter set for every row (`top_k`, `use_top_p`, `greedy`
    static): temperature -> top-k -> top-p (renormalised over the top-k set) -> draw with
    uniforms u; or argmax when greedy. Sampled rows report logprobs under ``temperature``,
    greedy ones under ``logprob_temperature``."""
    r, v = logits.shape
    k = top_k if 0 < top_k < v else 0
    plan = SamplePlan(k_cap=k, full=k == 0, top_p=use_top_p, sampled=not greedy,
                      greedy=greedy)

    def rows(x, dtype=jnp.float32):
        return jnp.broadcast_to(jnp.asarray(x, dtype), (r,))

    return sample_rows(logits, u, temperature=rows(logprob_temperature if greedy else temperature),
                       top_k=rows(k, jnp.int32), top_p=rows(top_p if use_top_p else 1.0),
                       greedy=rows(greedy, bool), plan=plan)
