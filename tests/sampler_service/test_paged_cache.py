"""The paged KV cache: page tables (assign, release, move, exhaustion), tokens written through
them gathered back against a dense cache, the Pallas `paged_attention` kernel in Pallas TPU
interpret mode against the XLA path (alone and under the shard_map over the tensor axis), the
model decoding token by token through the cache against its full forward, and the decode
step compiled for a TPU v5e (libtpu, no TPU)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from sampler_helpers import tiny_config

from sampler_service.paged_cache import (
    PagedDecodeAttention,
    PagesExhausted,
    PageTable,
    check_page_settings,
    init_pages,
    write_tokens,
)
from splitrl import models
from splitrl.mesh import param_shardings
from splitrl.models import TransformerConfig
from splitrl.models.paged import (
    gather_pages,
    paged_attend_kernel,
    paged_attend_xla,
    pages_per_block,
)
from splitrl.platforms import libtpu_installed

CONFIG = tiny_config()


def test_page_table_assigns_releases_and_moves_pages():
    table = PageTable(rows=3, num_pages=6, page_size=16, pages_per_sequence=3)
    assert table.assign(0, 33) == [0, 1, 2]  # 33 tokens: three pages of 16
    assert table.assign(2, 16) == [3]
    with pytest.raises(PagesExhausted, match="3 pages needed, 2 free"):
        table.assign(1, 40)
    with pytest.raises(ValueError, match="more than pages_per_sequence 3"):
        table.assign(1, 49)
    np.testing.assert_array_equal(table.indices(), [[0, 1, 2], [0, 0, 0], [3, 0, 0]])
    table.move(np.array([2, -1, -1]))  # row 2 moves to the front, row 0 is dropped
    np.testing.assert_array_equal(table.indices(), [[3, 0, 0], [0, 0, 0], [0, 0, 0]])
    assert table.free_pages == 5
    assert table.assign(1, 40) == [0, 1, 2]  # row 0's pages, back in the pool


def test_page_settings_are_validated_by_name():
    check_page_settings(16, 8, 128)
    with pytest.raises(ValueError, match="page_size: expected a positive multiple of 16"):
        check_page_settings(12, 8, 96)
    with pytest.raises(ValueError, match="pages_per_sequence: 4 pages of 16 tokens hold 64"):
        check_page_settings(16, 4, 100)


def test_pages_per_block_divides_the_table_within_512_tokens():
    assert [pages_per_block(n, 16) for n in (1, 6, 32, 64)] == [1, 6, 32, 32]
    assert pages_per_block(6, 128) == 3


def _random_paged_cache(rows, page_size, n, lengths, seed=0, dtype=jnp.float32):
    """A dense cache [R, K, n*page, Dh] and the same tokens written into a paged pool through
    a shuffled page table (a row's pages are scattered over the pool)."""
    rng = np.random.default_rng(seed)
    kh, dh = CONFIG.num_kv_heads, CONFIG.head_dim
    dense = rng.standard_normal((rows, kh, n * page_size, dh)).astype(np.float32)
    order = rng.permutation(rows * n)
    table = PageTable(rows=rows, num_pages=rows * n, page_size=page_size, pages_per_sequence=n)
    table._free = list(order)  # pages come out in a shuffled order
    for r, length in enumerate(lengths):
        table.assign(r, int(length))
    indices = jnp.asarray(table.indices())
    row_of = np.concatenate([np.full(m, r) for r, m in enumerate(lengths)]).astype(np.int32)
    slots = np.concatenate([np.arange(m) for m in lengths]).astype(np.int32)
    pages = write_tokens(jnp.zeros((kh, rows * n, page_size, dh), dtype), indices,
                         jnp.asarray(row_of), jnp.asarray(slots),
                         jnp.asarray(dense[row_of, :, slots]))  # [N, K, Dh]
    return jnp.asarray(dense, dtype), pages, indices


def test_tokens_written_through_the_page_table_gather_to_the_dense_cache():
    lengths = np.array([5, 16, 33, 0])
    dense, pages, indices = _random_paged_cache(4, 16, 3, lengths)
    gathered = np.asarray(gather_pages(pages, indices))
    for r, length in enumerate(lengths):
        np.testing.assert_array_equal(gathered[r, :, :length], np.asarray(dense)[r, :, :length])


def _decode_inputs(dtype=jnp.bfloat16, heads=4):
    lengths = np.array([5, 16, 33, 48], np.int32)
    _, pages_k, indices = _random_paged_cache(4, 16, 3, lengths, seed=1, dtype=dtype)
    _, pages_v, _ = _random_paged_cache(4, 16, 3, lengths, seed=2, dtype=dtype)
    q = jnp.asarray(np.random.default_rng(3).standard_normal((4, heads, CONFIG.head_dim)),
                    jnp.float32)
    return q, pages_k, pages_v, jnp.asarray(lengths), indices


def test_paged_attention_kernel_in_interpret_mode_matches_the_xla_path():
    """GQA (4 query heads over 2 key/value heads), rows ending mid-page and on a page
    boundary, pages scattered over the pool; a bfloat16 cache (the kernel reads keys and
    values as bfloat16, see splitrl.models.paged)."""
    q, k_pages, v_pages, lengths, indices = _decode_inputs()
    with pltpu.force_tpu_interpret_mode():
        got = jax.jit(paged_attend_kernel)(q, k_pages, v_pages, lengths, indices)
    want = jax.jit(paged_attend_xla)(q, k_pages, v_pages, lengths, indices)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_paged_attention_kernel_under_shard_map_over_the_tensor_axis():
    """Key/value heads split over tensor=2: each device runs the kernel on its heads' pages."""
    q, k_pages, v_pages, lengths, indices = _decode_inputs()
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    pages = NamedSharding(mesh, PartitionSpec("tensor"))
    k_pages, v_pages = jax.device_put(k_pages, pages), jax.device_put(v_pages, pages)
    with jax.set_mesh(mesh), pltpu.force_tpu_interpret_mode():
        got = jax.jit(paged_attend_kernel)(q, k_pages, v_pages, lengths, indices)
    want = jax.jit(paged_attend_xla)(q, k_pages, v_pages, lengths, indices)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _decode_step(graphdef, state, cache, indices, token, slot):
    model = nnx.merge(graphdef, state)
    backend = PagedDecodeAttention(cache, indices, slot)
    h, backend = model.forward_with(token[:, None], slot[:, None], backend)
    return model.logits(h[:, 0]), backend.cache


def test_decoding_through_the_paged_cache_matches_the_full_forward():
    """Two rows decode 20 tokens one at a time (crossing page boundaries) through scattered
    pages; each step's logits equal the full forward's at that position."""
    model = models.init_random(CONFIG, seed=0)
    graphdef, state = nnx.split(model)
    steps, page_size, n = 20, 16, 2
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, steps)),
                         jnp.int32)
    want = np.asarray(model(tokens)[0])
    table = PageTable(rows=2, num_pages=5, page_size=page_size, pages_per_sequence=n)
    table._free = [3, 0, 4, 1, 2]  # row 0 gets pages 2, 1; row 1 gets 4, 0
    table.assign(0, steps)
    table.assign(1, steps)
    indices = jnp.asarray(table.indices())
    cache = init_pages(CONFIG, 5, page_size, jnp.float32)
    step = jax.jit(_decode_step, static_argnums=0, donate_argnums=2)
    for t in range(steps):
        logits, cache = step(graphdef, state, cache, indices, tokens[:, t],
                             jnp.full((2,), t, jnp.int32))
        np.testing.assert_allclose(np.asarray(logits), want[:, t], rtol=1e-5, atol=1e-5)


needs_libtpu = pytest.mark.skipif(
    not libtpu_installed(),
    reason="libtpu (the TPU compiler) is not installed: pip install -e '.[tpu-plan]'")


@needs_libtpu
def test_decode_step_compiles_the_paged_kernel_for_a_tpu():
    """One decode step of a model with 128-wide heads, bfloat16, on a v5e 2x2 slice with the
    key/value heads over tensor=2 (libtpu compiles it; nothing runs)."""
    from splitrl_app.planning import tpu_target

    config = TransformerConfig(family="llama", vocab_size=256, hidden_size=512,
                               intermediate_size=1024, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=128)
    devices = tpu_target("v5e:2x2").devices[:2]
    mesh = Mesh(np.array(devices), ("tensor",))
    dtype = jnp.bfloat16
    graphdef = nnx.split(models.abstract_model(config, dtype))[0]
    shapes = models.param_shapes(config)
    placed = param_shardings(mesh, {k: v.shape for k, v in shapes.items()}, "tp")
    state = models.state_from_hf(config, {
        k: jax.ShapeDtypeStruct(v.shape, dtype, sharding=placed[k]) for k, v in shapes.items()})
    rows, n, page_size = 8, 4, 16
    replicated = NamedSharding(mesh, PartitionSpec())
    pages = jax.ShapeDtypeStruct(
        (config.num_layers, config.num_kv_heads, rows * n, page_size, config.head_dim), dtype,
        sharding=NamedSharding(mesh, PartitionSpec(None, "tensor")))
    ints = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=replicated)
    step = jax.jit(_decode_step, static_argnums=0, donate_argnums=2)
    with jax.set_mesh(mesh):
        lowered = step.lower(graphdef, state, (pages, pages), ints((rows, n)), ints((rows,)),
                             ints((rows,)))
    assert set(re.findall(r'kernel_name\s*=\s*"([^"]+)"', lowered.as_text())) == {
        "paged_flash_attention_kernel_inline_seq_dim"}
    lowered.compile()
