"""Attention by platform: the memory-efficient paths TPUs take (`blockwise_attend` for
queries over given keys, the matmul form of `slot_attend` for decode) against the CPU paths,
on this CPU, for values and gradients; and the CPU path of `attend` is the dense one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from splitrl.models import attend, blockwise_attend, causal_mask, dense_attend
from splitrl.models.attention import _slot_attend_matmul, _slot_attend_streaming, slot_attend


def _inputs(b=2, t=37, h=4, kh=2, dh=8, seed=0):
    """GQA q/k/v and a causal mask with left padding (row 1 starts at token 5), plus a
    second segment packed after the first in row 0 (the prefill's packed prompts)."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, dh)), jnp.float32)
               for n in (h, kh, kh))
    valid = np.ones((b, t), bool)
    valid[1, :5] = False
    mask = np.array(causal_mask(jnp.arange(t), jnp.arange(t), jnp.asarray(valid)))
    segments = np.where(np.arange(t) < 20, 0, 1)
    mask[0] &= segments[:, None] == segments[None, :]
    # Queries with no visible key (left padding) mean nothing downstream: compared out.
    seen = mask.any(-1)
    return q, k, v, jnp.asarray(mask), jnp.asarray(seen)


@pytest.mark.parametrize("block_q, block_kv", [(16, 8), (5, 37)])
def test_blockwise_attention_matches_dense_values_and_gradients(block_q, block_kv):
    q, k, v, mask, seen = _inputs()
    weights = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)

    def loss(f):
        def fn(q, k, v):
            out = f(q, k, v, mask)
            return jnp.sum(jnp.where(seen[..., None, None], out * weights, 0.0))
        return fn

    blockwise = lambda q, k, v, m: blockwise_attend(q, k, v, m, block_q=block_q,
                                                    block_kv=block_kv)
    got = jax.jit(blockwise)(q, k, v, mask)
    want = jax.jit(dense_attend)(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(got)[np.asarray(seen)],
                               np.asarray(want)[np.asarray(seen)], rtol=1e-5, atol=1e-5)
    got_grads = jax.jit(jax.grad(loss(blockwise), argnums=(0, 1, 2)))(q, k, v)
    want_grads = jax.jit(jax.grad(loss(dense_attend), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert float(jnp.abs(w).max()) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_attend_on_cpu_is_the_dense_path_bitwise():
    q, k, v, mask, _ = _inputs()
    np.testing.assert_array_equal(np.asarray(jax.jit(attend)(q, k, v, mask)),
                                  np.asarray(jax.jit(dense_attend)(q, k, v, mask)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_attention_matmul_form_matches_the_cpu_form(dtype):
    rng = np.random.default_rng(2)
    r, h, kh, dh, s = 6, 4, 2, 8, 40
    q = jnp.asarray(rng.standard_normal((r, h, dh)), dtype)
    k_cache = jnp.asarray(rng.standard_normal((r, kh, dh, s)), dtype)
    v_cache = jnp.asarray(rng.standard_normal((r, kh, s, dh)), dtype)
    length = jnp.asarray([1, 7, 40, 13, 2, 33], jnp.int32)
    want = jax.jit(_slot_attend_streaming)(q, k_cache, v_cache, length)
    # the accelerators' slot-major layout: keys and values [R, S, K, Dh]
    got = jax.jit(_slot_attend_matmul)(q, k_cache.transpose(0, 3, 1, 2),
                                       v_cache.transpose(0, 2, 1, 3), length)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(jax.jit(slot_attend)(q, k_cache, v_cache, length)),
                                  np.asarray(want))
