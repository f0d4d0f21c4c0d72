"""SlotCache: bucketed shapes, the budget arithmetic, resizes that carry rows, and the
decode attention backend against a dense reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sampler_service.kv_cache import (
    CacheLayout,
    CacheShape,
    SlotCache,
    SlotDecodeAttention,
    bucket_rows,
    bucket_width,
)
from splitrl.config import MeshConfig
from splitrl.mesh import build_mesh
from splitrl.models import TransformerConfig, dense_attend

CONFIG = TransformerConfig(family="qwen2", vocab_size=96, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                           attention_bias=True)
BYTES_PER_TOKEN = 2 * 2 * 2 * 8 * 4  # k and v, 2 layers, 2 kv heads, head_dim 8, float32


@pytest.fixture(scope="module")
def mesh():
    return build_mesh(MeshConfig(axes={"tensor": 1}), jax.devices()[:1])


def test_buckets_are_powers_of_two_within_their_caps():
    assert [bucket_rows(n, 48) for n in (0, 1, 3, 5, 33, 48)] == [1, 1, 4, 8, 48, 48]
    assert [bucket_width(n, 200) for n in (1, 32, 33, 100, 129, 200)] == [32, 32, 64, 128, 200,
                                                                          200]


@pytest.mark.parametrize("slot_major", [False, True], ids=["cpu-layout", "slot-major"])
def test_budget_counts_the_array_held_twice_during_a_resize(mesh, slot_major):
    # 4 rows x 32 slots = 32 KiB of cache, + the array a resize copies: its keys (or values)
    # of all layers when stacked, of one layer when the layers are apart (the CPU's).
    budget = 32768 + (8192 if not slot_major else 16384)
    layout = CacheLayout(slot_major)
    cache = SlotCache(CONFIG, jnp.float32, mesh, budget_bytes=budget, max_rows=8, max_width=32,
                      layout=layout)
    assert cache.bytes_per_token == BYTES_PER_TOKEN
    assert cache.fits(4, 32) and not cache.fits(5, 32)
    assert cache.fits(8, 16) is False  # widths below 32 still take a 32-slot row
    assert cache.guaranteed_rows() == 4
    assert SlotCache(CONFIG, jnp.float32, mesh, budget_bytes=budget - 1, max_rows=8,
                     max_width=32, layout=layout).guaranteed_rows() == 2


def test_resize_moves_rows_and_keeps_their_slots(mesh):
    cache = SlotCache(CONFIG, jnp.float32, mesh, budget_bytes=1 << 20, max_rows=8, max_width=128)
    cache.resize(CacheShape(4, 32), np.full(4, -1))
    assert cache.allocated_bytes == 4 * 32 * BYTES_PER_TOKEN
    (k0, v0), (k, v) = cache.arrays  # the CPU's: a (keys, values) pair per layer
    marked_k = k.at[2].set(jnp.arange(2 * 8 * 32, dtype=jnp.float32).reshape(2, 8, 32))
    marked_v = v.at[2].set(7.0)
    cache.arrays = ((k0, v0), (marked_k, marked_v))
    cache.resize(CacheShape(2, 64), np.array([2, -1]))  # old row 2 becomes row 0, wider
    (k0, _), (k, v) = cache.arrays
    assert k.shape == k0.shape == (2, 2, 8, 64) and v.shape == (2, 2, 64, 8)
    np.testing.assert_array_equal(k[0, :, :, :32], marked_k[2])
    np.testing.assert_array_equal(v[0, :, :32], 7.0)
    np.testing.assert_array_equal(k0[0, :, :, :32], 0.0)  # the other layer's row, moved too
    assert cache.allocated_bytes == 2 * 64 * BYTES_PER_TOKEN
    # Peak: the old cache plus one new array, one layer's keys (shrinking rows, doubling
    # width: same size).
    assert cache.peak_bytes == 4 * 32 * BYTES_PER_TOKEN + 2 * 64 * BYTES_PER_TOKEN // 4


def _as_slot_major(k_cache, v_cache):
    """CPU layout (keys [..., K, Dh, S], values [..., K, S, Dh]) -> slot-major [..., S, K, Dh]."""
    nd = k_cache.ndim
    lead = tuple(range(nd - 3))
    return (k_cache.transpose(*lead, nd - 1, nd - 3, nd - 2),
            v_cache.transpose(*lead, nd - 2, nd - 3, nd - 1))


def _laid_out(k_cache, v_cache, slot_major: bool) -> tuple:
    """Stacked CPU-layout keys and values [L, ...] as ``CacheLayout(slot_major)`` holds them:
    slot-major and stacked, or one (keys, values) pair per layer."""
    if slot_major:
        return _as_slot_major(k_cache, v_cache)
    return tuple(zip(k_cache, v_cache, strict=True))


def _stacked_cpu_layout(cache: tuple, slot_major: bool) -> tuple:
    """The inverse of `_laid_out`: stacked CPU-layout keys and values [L, ...]."""
    if slot_major:
        k_cache, v_cache = cache
        return k_cache.transpose(0, 1, 3, 4, 2), v_cache.transpose(0, 1, 3, 2, 4)
    return tuple(jnp.stack(x) for x in zip(*cache, strict=True))


@pytest.mark.parametrize("slot_major", [False, True], ids=["cpu-layout", "slot-major"])
def test_decode_backend_writes_each_rows_token_and_attends_to_its_own_prefix(slot_major):
    """Both layouts (the CPU's, and the TPU's, run here on CPU) write the same slots and give
    the dense reference's attention."""
    rng = np.random.default_rng(0)
    layers, rows, width, heads, kv_heads, dh = 2, 3, 32, 4, 2, 8
    k_cache = jnp.asarray(rng.standard_normal((layers, rows, kv_heads, dh, width)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((layers, rows, kv_heads, width, dh)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((rows, 1, heads, dh)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((rows, 1, kv_heads, dh)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((rows, 1, kv_heads, dh)), jnp.float32)
    write = jnp.array([0, 5, 31], jnp.int32)
    layout = CacheLayout(slot_major)
    backend = SlotDecodeAttention(_laid_out(k_cache, v_cache, slot_major), write, layout)
    if slot_major:  # traced, as under the model's scan over layers
        out, backend = jax.jit(lambda b, q, k, v, i: b.attend(i, q, k, v))(
            backend, q, k, v, jnp.int32(1))
    else:  # the layers apart: a Python int, the layer's own arrays
        out, backend = jax.jit(lambda b, q, k, v: b.attend(1, q, k, v))(backend, q, k, v)
    all_k, all_v = _stacked_cpu_layout(backend.cache, slot_major)
    np.testing.assert_array_equal(all_k[0], k_cache[0])  # other layers untouched
    np.testing.assert_array_equal(all_v[0], v_cache[0])
    new_k, new_v = all_k[1], all_v[1]
    for r in range(rows):
        w = int(write[r])
        np.testing.assert_array_equal(new_k[r, :, :, w], k[r, 0])
        np.testing.assert_array_equal(new_v[r, :, w], v[r, 0])
        keys = new_k[r].transpose(2, 0, 1)[None, : w + 1]  # [1, S, K, Dh]
        values = new_v[r].transpose(1, 0, 2)[None, : w + 1]
        ref = dense_attend(q[r:r + 1], keys, values, jnp.ones((1, 1, w + 1), bool))
        np.testing.assert_allclose(out[r], ref[0], atol=1e-5)


@pytest.mark.parametrize("slot_major", [False, True], ids=["cpu-layout", "slot-major"])
def test_admit_writes_only_the_new_rows_prompt_slots_in_every_layer(slot_major):
    """Admission gathers and writes each prompt's own slots (no full-width copy) into each of
    its rows: the other rows, and a new row's slots past its prompt, keep what they held."""
    from flax import nnx

    from sampler_service import _programs
    from sampler_service._inputs import pack_prompts
    from sampler_service.sampling import SamplePlan
    from splitrl.models import init_random

    model = init_random(CONFIG, seed=0, std=0.3)
    graphdef, state = nnx.split(model)
    layout = CacheLayout(slot_major)
    leaves, treedef = jax.tree.flatten(_programs.served_weights(state, layout.layers_apart))
    programs = _programs.programs_for(graphdef, treedef, layout.layers_apart)
    prompts = [np.array([5, 6, 7], np.int32), np.array([9, 10, 11, 12, 13], np.int32)]
    tokens, positions, segments, starts = pack_prompts(prompts, 32, 0)
    kv, hidden = programs.prefill(leaves, tokens, positions, segments)
    marker = 3.0

    def marked():  # [L, R, K, Dh, S], [L, R, K, S, Dh]
        return _laid_out(*(jnp.full(s, marker, jnp.float32) for s in (
            (2, 6, 2, 8, 32), (2, 6, 2, 32, 8))), slot_major)

    # prompt 0 -> rows 2 and 5, prompt 1 -> row 0; a padding entry (slot 6: dropped)
    row_start = np.array([starts[0], starts[0], starts[1], starts[1]], np.int32)
    row_length = np.array([3, 3, 5, 5], np.int32)
    row_slot = np.array([2, 5, 0, 6], np.int32)
    n = row_slot.size
    params = _programs.RowParams(
        seeds=np.zeros((n, 2), np.uint32), sample_ids=np.zeros(n, np.int32),
        versions=np.zeros((n, 2), np.uint32), temperature=np.ones(n, np.float32),
        top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32), greedy=np.ones(n, bool),
        max_new=np.full(n, 4, np.int32), stop_ids=np.full((n, 1), -1, np.int32))
    plan = SamplePlan(sampled=False)
    cache, tokens, logprobs, _ = programs.admit(
        leaves, marked(), None, kv, hidden, row_start, row_length, row_slot, params,
        plan=plan, sharding=None, layout=layout)
    k_cache, v_cache = _stacked_cpu_layout(cache, slot_major)
    assert tokens[0] == tokens[1]  # prompt 0's two rows: the same greedy first token
    # the padding entry changes nothing: the rows alone (another block and projection size)
    # write the same cache and draw the same tokens and logprobs, bit for bit
    alone, alone_tokens, alone_logprobs, _ = programs.admit(
        leaves, marked(), None, kv, hidden, row_start[:3], row_length[:3], row_slot[:3],
        jax.tree.map(lambda x: x[:3], params), plan=plan, sharding=None, layout=layout)
    for x, y in zip(jax.tree.leaves(alone), jax.tree.leaves(cache), strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(alone_tokens, tokens[:3])
    np.testing.assert_array_equal(alone_logprobs, logprobs[:3])
    k_all, v_all = (np.asarray(x).reshape(2, -1, 2, 8) for x in kv)  # [L, B*W, K, Dh]
    for row, prompt in ((2, 0), (5, 0), (0, 1)):
        size, start = prompts[prompt].size, starts[prompt]
        np.testing.assert_array_equal(k_cache[:, row, :, :, :size],
                                      k_all[:, start:start + size].transpose(0, 2, 3, 1))
        np.testing.assert_array_equal(v_cache[:, row, :, :size],
                                      v_all[:, start:start + size].transpose(0, 2, 1, 3))
        np.testing.assert_array_equal(k_cache[:, row, :, :, size:], marker)  # past the prompt
        np.testing.assert_array_equal(v_cache[:, row, :, size:], marker)
    for row in (1, 3, 4):  # rows nobody was admitted to
        np.testing.assert_array_equal(k_cache[:, row], marker)
        np.testing.assert_array_equal(v_cache[:, row], marker)
