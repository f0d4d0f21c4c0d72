"""The paged KV cache layout and the Pallas `paged_attention` kernel: the kernel in Pallas TPU
interpret mode against the XLA path (alone and under the shard_map over the tensor axis), the
paged layout's writes read back through its page table against the slot layout's cache, the
engine decoding through the paged layout (with refills that move rows) against the slot
layout, and the settings' checks. `splitrl plan`'s TPU test compiles the engine's decode with
the kernel in it (tests/splitrl_app/planning/test_plan_compile.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from sampler_helpers import REPO, tiny_config

from sampler_service.engine import GenerationEngine
from sampler_service.kv_cache import CacheLayout, layout_for
from sampler_service.paged_cache import PagedLayout
from sampler_service.sampling import SamplingOptions
from splitrl.config import ConfigError, load_config
from splitrl.models import TransformerConfig, init_random
from splitrl.models.paged import (
    gather_pages,
    paged_attend_kernel,
    paged_attend_xla,
    pages_per_block,
)
from splitrl.platforms import libtpu_installed

CONFIG = tiny_config()


def test_pages_per_block_divides_the_table_within_512_tokens():
    assert [pages_per_block(n, 16) for n in (1, 6, 32, 64)] == [1, 6, 32, 32]
    assert pages_per_block(6, 128) == 3


def test_paged_layout_pages_divide_every_cache_width():
    layout = PagedLayout(64)
    # bucketed widths are powers of two from 32; the widest is rounded up to whole 16s
    assert layout.width_cap(100) == 112 and layout.width_cap(256) == 256
    assert [layout.page_for(w) for w in (32, 64, 128, 112)] == [32, 64, 64, 16]
    np.testing.assert_array_equal(layout.page_table(2, 128), [[0, 1], [2, 3]])


def test_page_size_is_checked_by_name():
    with pytest.raises(ValueError, match="kv_page_size: expected a positive multiple of 16"):
        PagedLayout(24)
    with pytest.raises(ConfigError, match="sampler.kv_page_size: expected a multiple of 16"):
        load_config(None, ["sampler.kv_page_size=40"])
    with pytest.raises(ValueError, match="decode_attention: expected one of"):
        layout_for(Mesh(np.array(jax.devices()[:1]), ("tensor",)), "flash")


def test_decode_attention_picks_the_layout_by_platform():
    cpu = Mesh(np.array(jax.devices()[:1]), ("tensor",))
    assert layout_for(cpu) == CacheLayout(slot_major=False)  # "auto" on CPU: unchanged
    assert layout_for(cpu, "paged", 32) == PagedLayout(32, cpu)


def _pages_from_rows(rows, page_size, order):
    """A paged pool [K, P, page, Dh] holding ``rows`` [R, K, S, Dh], row r's pages at
    ``order[r * n:(r + 1) * n]`` of the pool; returns (pool, page table)."""
    r, k, s, dh = rows.shape
    n = s // page_size
    table = np.asarray(order, np.int32).reshape(r, n)
    pool = np.zeros((k, r * n, page_size, dh), rows.dtype)
    pool[:, table.reshape(-1)] = rows.reshape(r, k, n, page_size, dh).transpose(
        1, 0, 2, 3, 4).reshape(k, r * n, page_size, dh)
    return pool, table


def _decode_inputs(heads=4):
    """q [4, H, Dh]; a bfloat16 cache of 4 rows x 48 slots in pages of 16, scattered over the
    pool; rows end mid-page and on page boundaries. (The kernel reads keys and values as
    bfloat16: splitrl.models.paged.)"""
    rng = np.random.default_rng(3)
    kh, dh = CONFIG.num_kv_heads, CONFIG.head_dim
    order = rng.permutation(12)
    k_pool, table = _pages_from_rows(rng.standard_normal((4, kh, 48, dh)), 16, order)
    v_pool, _ = _pages_from_rows(rng.standard_normal((4, kh, 48, dh)), 16, order)
    q = jnp.asarray(rng.standard_normal((4, heads, dh)), jnp.float32)
    return (q, jnp.asarray(k_pool, jnp.bfloat16), jnp.asarray(v_pool, jnp.bfloat16),
            jnp.asarray([5, 16, 33, 48], jnp.int32), jnp.asarray(table))


def test_pages_gather_back_to_the_rows_through_the_page_table():
    rows = np.random.default_rng(0).standard_normal((3, 2, 64, 8)).astype(np.float32)
    pool, table = _pages_from_rows(rows, 16, np.random.default_rng(1).permutation(12))
    np.testing.assert_array_equal(np.asarray(gather_pages(jnp.asarray(pool),
                                                          jnp.asarray(table))), rows)


def test_paged_attention_kernel_in_interpret_mode_matches_the_xla_path():
    """GQA (4 query heads over 2 key/value heads), pages scattered over the pool."""
    q, k_pages, v_pages, lengths, table = _decode_inputs()
    with pltpu.force_tpu_interpret_mode():
        got = jax.jit(paged_attend_kernel)(q, k_pages, v_pages, lengths, table)
    want = jax.jit(paged_attend_xla)(q, k_pages, v_pages, lengths, table)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_paged_attention_kernel_under_shard_map_over_the_tensor_axis():
    """Key/value heads split over tensor=2: each device runs the kernel on its heads' pages."""
    q, k_pages, v_pages, lengths, table = _decode_inputs()
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    pages = NamedSharding(mesh, PartitionSpec("tensor"))
    k_pages, v_pages = jax.device_put(k_pages, pages), jax.device_put(v_pages, pages)
    with pltpu.force_tpu_interpret_mode():
        got = jax.jit(lambda *a: paged_attend_kernel(*a, mesh=mesh))(q, k_pages, v_pages,
                                                                      lengths, table)
    want = jax.jit(paged_attend_xla)(q, k_pages, v_pages, lengths, table)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_paged_layout_writes_read_back_through_its_page_table_as_the_slot_cache():
    """Prompts, then one token per row, written in both layouts: every layer's pages,
    gathered through the paged layout's table, are the slot layout's rows."""
    rng = np.random.default_rng(0)
    layers, kh, dh, rows, width = 2, CONFIG.num_kv_heads, CONFIG.head_dim, 4, 64
    paged, slots = PagedLayout(16), CacheLayout(slot_major=True)
    cache = {lay: tuple(jnp.zeros(s) for s in lay.shapes(CONFIG, rows, width))
             for lay in (paged, slots)}
    k, v = (jnp.asarray(rng.standard_normal((layers, 2, 20, kh, dh)), jnp.float32)
            for _ in range(2))
    prompt_rows, prompt_slots = jnp.asarray([3, 1]), jnp.asarray(np.arange(20)[None].repeat(2, 0))
    token = [jnp.asarray(rng.standard_normal((rows, kh, dh)), jnp.float32) for _ in range(2)]
    at = jnp.asarray([20, 20, 0, 20])
    for lay in cache:
        for layer in range(layers):
            cache[lay] = lay.write(cache[lay], layer, prompt_rows, prompt_slots, k[layer],
                                   v[layer])
        cache[lay] = lay.write(cache[lay], 1, jnp.arange(rows), at[:, None],
                               *(x[:, None] for x in token))
    for i in range(2):  # keys, values
        for layer in range(layers):
            pool = paged.pages(cache[paged][i][layer])
            gathered = gather_pages(pool, paged.page_table(rows, width))  # [R, K, S, Dh]
            want = cache[slots][i][layer].transpose(0, 2, 1, 3)  # [R, S, K, Dh] -> [R, K, S, Dh]
            np.testing.assert_array_equal(np.asarray(gathered), np.asarray(want))


def test_engine_decoding_through_the_paged_layout_gives_the_slot_layouts_tokens():
    """Six prompts through four rows (finished rows are refilled: the cache is resized and
    rows move), greedy and sampled: the paged layout's tokens are the slot layout's, logprobs
    equal up to float32 rounding (on CPU its attention gathers the pages: XLA ops)."""
    model = init_random(CONFIG, seed=0, std=0.3)
    mesh = Mesh(np.array(jax.devices()[:1]), ("tensor",))
    graphdef, state = nnx.split(model)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [20], [30, 31, 32],
               [40, 41], [50, 51, 52, 53, 54]]
    outputs = {}
    for decode_attention in ("xla", "paged"):
        engine = GenerationEngine(CONFIG, graphdef, mesh=mesh, max_batch_size=4,
                                  max_sequence_length=40, eos_token_ids=(), pad_token_id=0,
                                  segment_steps=4, decode_attention=decode_attention,
                                  kv_page_size=16)
        placed = engine.place_state(state)
        try:
            outputs[decode_attention] = [
                engine.generate(placed, prompts, SamplingOptions(max_new_tokens=m, **kw))
                for m, kw in ((9, {}), (13, dict(temperature=1.0, seed=7)))]
            assert engine.stats["cache_resizes"] > 0
        finally:
            engine.close()
    for want, got in zip(outputs["xla"], outputs["paged"], strict=True):
        for a, b in zip(want, got, strict=True):
            assert a[0].token_ids == b[0].token_ids
            np.testing.assert_allclose(a[0].logprobs, b[0].logprobs, atol=1e-5)


@pytest.mark.skipif(not libtpu_installed(), reason="libtpu (the TPU compiler) is not "
                    "installed: pip install -e '.[tpu-plan]'")
def test_a_tpu_sampler_plan_decodes_through_the_paged_kernel():
    """`splitrl plan` of a sampler on two v5e chips (tensor=2), bfloat16, a one-layer model
    with 128-wide heads: the engine's decode holds the paged_attention kernel and compiles
    (libtpu, no TPU). The kernel tiles heads by 128: with 64-wide heads "auto" keeps the XLA
    decode and "paged" is refused naming head_dim."""
    from splitrl_app.planning import plan_run, tpu_target

    cfg = load_config(str(REPO / "splitrl" / "configs" / "demo.yaml"), [
        "sampler.mesh.device_fraction=0.5", "sampler.max_batch_size=16",
        "sampler.max_sequence_length=128", "sampler.dtype=bfloat16"])
    config = TransformerConfig(family="llama", vocab_size=256, hidden_size=512,
                               intermediate_size=1024, num_layers=1, num_heads=4,
                               num_kv_heads=2, head_dim=128)
    target = tpu_target("v5e:2x2")
    [report] = plan_run(cfg, config, {"sampler": target}, search=False)
    assert report.mesh == {"tensor": 2} and report.measurement.fits
    kernels = {p.name: p.kernels for p in report.measurement.programs}
    assert kernels == {"prefill": (), "admit": (),
                       "decode": ("paged_flash_attention_kernel_inline_seq_dim",)}
    mesh = Mesh(np.array(target.devices[:2]), ("tensor",))
    assert layout_for(mesh, "auto", 64, head_dim=64) == CacheLayout(slot_major=True)
    with pytest.raises(ValueError, match="needs head_dim a multiple of 128; this model's is 64"):
        layout_for(mesh, "paged", 64, head_dim=64)
