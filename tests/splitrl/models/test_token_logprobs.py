"""Chunked token_logprobs / entropy equal the full-logits computation, values and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import VOCAB, left_padded_batch, randomize
from flax import nnx

from splitrl import models

T = 13  # prime: no chunk size divides it


def _full(logits, targets, temperature):
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return picked, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


@pytest.mark.parametrize(
    ("vocab_axis", "chunk_size", "vocab_chunk_size", "temperature"),
    [(0, 5, 10, 0.7), (1, 4, 30, 1.3), (0, 1, 96, 1.0)],
)
def test_chunked_logprobs_and_grads_match_full_logits(
        vocab_axis, chunk_size, vocab_chunk_size, temperature):
    """Both weight layouts (tied [V, D], lm_head [D, V]); chunks that divide neither T nor V."""
    kh, kw, kt = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(kh, (2, T, 16))
    w = jax.random.normal(kw, (VOCAB, 16) if vocab_axis == 0 else (16, VOCAB))
    targets = jax.random.randint(kt, (2, T), 0, VOCAB)
    weights = jnp.linspace(0.5, 1.5, T)

    def loss(h, w, chunked):
        if chunked:
            lp, ent = models.logprobs_from_hidden(
                h, w, targets, vocab_axis=vocab_axis, chunk_size=chunk_size,
                vocab_chunk_size=vocab_chunk_size, temperature=temperature)
        else:
            logits = h @ (w.T if vocab_axis == 0 else w)
            lp, ent = _full(logits, targets, temperature)
        return jnp.sum((lp + 0.3 * ent) * weights), (lp, ent)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    (_, (lp, ent)), grads = fn(h, w, True)
    (_, (ref_lp, ref_ent)), ref_grads = fn(h, w, False)
    assert lp.shape == ent.shape == (2, T)
    np.testing.assert_allclose(lp, ref_lp, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-4, rtol=1e-5)
    for g, ref in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-4, rtol=1e-4)


def test_token_logprobs_of_model_match_log_softmax_of_logits_with_grads_and_remat(tiny_config):
    """The chunked side also rematerialises every layer ("full"): grads must not change."""
    model = models.init_random(tiny_config, seed=0, std=0.3)
    randomize(model, seed=2)
    tokens, mask = left_padded_batch([T, 9], T, seed=6)
    targets = jnp.roll(tokens, -1, axis=1)
    positions = models.left_pad_positions(mask)
    graphdef, state = nnx.split(model)
    remat_graphdef = nnx.split(models.abstract_model(tiny_config, remat="full"))[0]

    def loss(state, chunked):
        m = nnx.merge(remat_graphdef if chunked else graphdef, state)
        if chunked:
            # default chunk sizes: one time chunk, one vocabulary chunk
            lp, ent = models.token_logprobs(m, tokens, targets, positions, mask,
                                            temperature=0.7)
        else:
            logits = m(tokens, positions, attention_mask=mask)[0]
            lp, ent = _full(logits, targets, 0.7)
        return jnp.sum((lp + 0.1 * ent) * mask), (lp, ent)

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, (lp, ent)), grads = fn(state, True)
    (_, (ref_lp, ref_ent)), ref_grads = fn(state, False)
    np.testing.assert_allclose(lp, ref_lp, atol=1e-4)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-4)
    assert float(jnp.min(ref_lp)) < -np.log(VOCAB)  # not a near-uniform toy distribution
    ref_flat = models.hf_from_state(ref_grads)
    for name, g in models.hf_from_state(grads).items():
        np.testing.assert_allclose(g, ref_flat[name], atol=1e-4, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("policy,layer_loop", [
    ("full", "scan"), ("save_dots", "scan"),
    ("none", "unrolled"), ("full", "unrolled"), ("save_dots", "unrolled"),
])
def test_remat_policies_and_layer_loops_give_the_gradients_of_the_plain_scan(
        tiny_config, policy, layer_loop):
    """`model.remat` changes what the backward pass keeps, and `model.layer_loop` how the
    layers are applied (the trainer's CPU programs run them unrolled), never what they
    compute: values and gradients are the scan's without remat, to float32 tolerance."""
    model = models.init_random(tiny_config, seed=0, std=0.3)
    randomize(model, seed=3)
    tokens, mask = left_padded_batch([T, 7], T, seed=4)
    targets = jnp.roll(tokens, -1, axis=1)
    positions = models.left_pad_positions(mask)
    state = nnx.state(model)
    graphdefs = {
        which: nnx.split(models.abstract_model(tiny_config, remat=which[0],
                                               layer_loop=which[1]))[0]
        for which in (("none", "scan"), (policy, layer_loop))}

    def loss(state, which):
        m = nnx.merge(graphdefs[which], state)
        lp, ent = models.token_logprobs(m, tokens, targets, positions, mask)
        return jnp.sum((lp + 0.1 * ent) * mask)

    fn = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    value, grads = fn(state, (policy, layer_loop))
    ref_value, ref_grads = fn(state, ("none", "scan"))
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    ref_flat = models.hf_from_state(ref_grads)
    for name, g in models.hf_from_state(grads).items():
        np.testing.assert_allclose(g, ref_flat[name], rtol=1e-4, atol=1e-5, err_msg=name)
