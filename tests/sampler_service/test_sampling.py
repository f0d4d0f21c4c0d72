"""Sampling primitives: options validation, filters, draws, logprobs (pure functions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sampler_service import sampling
from sampler_service.sampling import SamplingOptions
from splitrl.config import SamplingConfig


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -0.1), ("temperature", 1e-38), ("top_k", -1), ("top_k", 2.5),
     ("top_p", 0.0), ("top_p", 1.5), ("max_new_tokens", 0), ("stop_token_ids", [1, -2]),
     ("stop_token_ids", "7"), ("seed", "x"), ("greedy", 1)],
)
def test_invalid_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingOptions\.{field}: expected"):
        SamplingOptions(**{field: value})


def test_options_from_config_and_greedy_flags():
    opts = SamplingOptions.from_config(
        SamplingConfig(temperature=0.0, top_k=5, max_new_tokens=3, stop_token_ids=[4, 5]))
    assert opts.stop_token_ids == (4, 5) and opts.top_k == 5 and opts.max_new_tokens == 3
    assert opts.is_greedy and opts.logprob_temperature == 1.0
    assert SamplingOptions(temperature=0.5, greedy=True).logprob_temperature == 0.5


@jax.jit
def _uniforms(seed, draws_like, step):
    keys = jax.random.split(jax.random.key(seed), draws_like.shape[0])
    return sampling.step_uniforms(keys, step)


def _probs(logits, temperature=1.0):
    z = np.asarray(logits, np.float64) / temperature
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_top_k_filter_keeps_the_k_largest():
    logits = jax.random.normal(jax.random.key(0), (5, 300))
    out = np.asarray(sampling.top_k_filter(logits, 7))
    for row, kept in zip(np.asarray(logits), np.isfinite(out), strict=True):
        assert set(np.flatnonzero(kept)) == set(np.argsort(-row)[:7])


def test_top_p_filter_matches_a_sorted_reference():
    logits = 2.0 * jax.random.normal(jax.random.key(1), (6, 500))
    for top_p in (0.3, 0.9, 0.999):
        kept = np.isfinite(np.asarray(jax.jit(sampling.top_p_filter)(logits, top_p)))
        for row, got in zip(_probs(logits), kept, strict=True):
            order = np.argsort(-row)
            before = np.cumsum(row[order]) - row[order]
            expect = set(order[before < top_p])
            assert set(np.flatnonzero(got)) == expect


def test_inverse_cdf_draws_follow_the_distribution_and_skip_masked_tokens():
    v, draws = 300, 40_000
    logits = jax.random.normal(jax.random.key(2), (v,))
    logits = logits.at[::3].set(-jnp.inf)  # a third of the tokens are impossible
    u = _uniforms(3, jnp.zeros(draws), 0)
    draw = jax.jit(lambda lg, u: sampling.inverse_cdf_sample(jnp.broadcast_to(lg, (draws, v)), u))
    idx = np.asarray(draw(logits, u))
    counts = np.bincount(idx, minlength=v)
    assert counts[::3].sum() == 0
    p = _probs(np.where(np.isfinite(logits), logits, -1e30))
    # Every token's frequency within 5 binomial standard deviations.
    sd = np.sqrt(draws * p * (1 - p)) + 1e-9
    assert np.all(np.abs(counts - draws * p) <= 5 * sd + 1)


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.6), (8, 0.5)])
def test_top_k_and_top_p_restrict_the_support(top_k, top_p):
    v, draws, temperature = 64, 20_000, 0.8
    logits = 1.5 * jax.random.normal(jax.random.key(4), (1, v))
    u = _uniforms(5, jnp.zeros(draws), 7)
    draw = jax.jit(lambda lg, u: sampling.sample_tokens(
        jnp.broadcast_to(lg, (draws, v)), u, temperature=temperature, top_k=top_k,
        use_top_p=top_p < 1.0, top_p=top_p, greedy=False, logprob_temperature=temperature))
    tokens, logprobs = draw(logits, u)
    p = _probs(logits[0], temperature)
    order = np.argsort(-p)
    allowed = order[:top_k] if top_k else order
    q = p[allowed] / p[allowed].sum()
    before = np.cumsum(q) - q
    allowed = set(allowed[before < top_p])
    seen = set(np.asarray(tokens).tolist())
    assert seen <= allowed
    assert seen == allowed  # each allowed token has probability >~ 1e-2 here
    # Logprobs are under the full temperature-scaled distribution, not the truncated one.
    np.testing.assert_allclose(np.asarray(logprobs), np.log(p[np.asarray(tokens)]), atol=1e-5)


def test_greedy_is_argmax_with_untempered_logprob():
    logits = jax.random.normal(jax.random.key(6), (4, 50))
    tokens, lp = jax.jit(lambda lg: sampling.sample_tokens(
        lg, None, temperature=1.0, top_k=0, use_top_p=False, top_p=1.0, greedy=True,
        logprob_temperature=1.0))(logits)
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))
    ref = jax.nn.log_softmax(logits)[np.arange(4), np.argmax(logits, -1)]
    np.testing.assert_allclose(lp, ref, atol=1e-6)


def test_row_keys_depend_only_on_prompt_seed_sample_and_version():
    @jax.jit
    def draw(seeds, samples, version):
        return sampling.step_uniforms(sampling.row_keys(seeds, samples, version), 3)

    seeds = jnp.asarray(sampling.seed_words([7, 8, 9]))
    v0 = jnp.array([0, 0], jnp.uint32)
    a = np.asarray(draw(seeds, jnp.array([0, 0, 1]), v0))
    b = np.asarray(draw(seeds[jnp.array([2, 0, 1])], jnp.array([1, 0, 0]), v0))
    np.testing.assert_array_equal(a[[2, 0, 1]], b)  # rows move, draws follow them
    assert len(set(a.tolist())) == 3
    other_seed = np.asarray(draw(jnp.asarray(sampling.seed_words([6, 8, 9])),
                                 jnp.array([0, 0, 1]), v0))
    assert other_seed[0] != a[0] and other_seed[1] == a[1]
    other_version = np.asarray(draw(seeds, jnp.array([0, 0, 1]), jnp.array([1, 0], jnp.uint32)))
    assert not np.any(other_version == a)


def test_prompt_seeds_are_distinct_hashes_of_request_seed_and_index():
    seeds = [sampling.prompt_seed(5, i) for i in range(100)]
    assert len(set(seeds)) == 100 and all(0 <= s < 1 << 64 for s in seeds)
    assert sampling.prompt_seed(5, 3) == seeds[3] and sampling.prompt_seed(6, 3) != seeds[3]
    words = sampling.seed_words([(1 << 64) - 1, 1 << 32])
    assert words.tolist() == [[0xFFFFFFFF, 0xFFFFFFFF], [0, 1]]
