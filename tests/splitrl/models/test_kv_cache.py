"""Prefill + step-by-step KV-cache decode reproduces the full forward pass (left-padded batch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import VOCAB, left_padded_batch, randomize, run
from flax import nnx

from splitrl import models

TOL = 1e-4


def test_prefill_then_decode_matches_full_forward(tiny_config):
    model = models.init_random(tiny_config, seed=0, std=0.2)
    randomize(model, seed=1)
    graphdef, state = nnx.split(model)
    step = jax.jit(models.apply, static_argnums=0, donate_argnames="cache")

    prompt_len, new_tokens, max_len = 6, 4, 13  # two slots stay unused
    prompt, prompt_mask = left_padded_batch([6, 2, 4], prompt_len, seed=3)
    gen = jnp.asarray(np.random.default_rng(4).integers(0, VOCAB, (3, new_tokens)), jnp.int32)
    full_tokens = jnp.concatenate([prompt, gen], axis=1)
    full_mask = jnp.concatenate([prompt_mask, jnp.ones_like(gen, bool)], axis=1)
    full_positions = models.left_pad_positions(full_mask)
    full = np.asarray(run(model, full_tokens, full_positions, full_mask))

    cache = models.init_cache(tiny_config, 3, max_len, jnp.float32)
    logits, cache = step(graphdef, state, prompt, models.left_pad_positions(prompt_mask),
                         attention_mask=prompt_mask, cache=cache, cache_index=jnp.int32(0))
    m = np.asarray(prompt_mask)
    assert np.abs(np.asarray(logits)[m] - full[:, :prompt_len][m]).max() <= TOL

    left_pad = prompt_len - prompt_mask.sum(axis=1)
    for i in range(new_tokens):
        slot = prompt_len + i
        positions = (slot - left_pad)[:, None].astype(jnp.int32)
        logits, cache = step(graphdef, state, gen[:, i:i + 1], positions, cache=cache,
                             cache_index=jnp.int32(slot))
        assert logits.shape == (3, 1, VOCAB)
        assert np.abs(np.asarray(logits)[:, 0] - full[:, slot]).max() <= TOL, i
    assert step._cache_size() == 2  # prefill + one decode program for all steps

    expected_valid = np.zeros((3, max_len), bool)
    expected_valid[:, :prompt_len + new_tokens] = np.asarray(full_mask)
    np.testing.assert_array_equal(np.asarray(cache.mask), expected_valid)
    assert cache.k.shape == (tiny_config.num_layers, 3, max_len, tiny_config.num_kv_heads,
                             tiny_config.head_dim)


def test_cache_requires_cache_index(tiny_config):
    model = models.init_random(tiny_config)
    cache = models.init_cache(tiny_config, 1, 4)
    try:
        model(jnp.zeros((1, 2), jnp.int32), cache=cache)
    except ValueError as e:
        assert "cache_index" in str(e)
    else:
        raise AssertionError("expected ValueError")
