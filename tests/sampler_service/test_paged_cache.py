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

from sampler_service import paged_cache
from sampler_service.engine import GenerationEngine
from sampler_service.kv_cache import CacheLayout, CacheShape, layout_for
from sampler_service.paged_cache import PagedCache, PagedLayout, pages_for
from sampler_service.requests import PinnedWeights
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


def test_paged_layout_writes_through_scattered_page_tables_read_back_as_the_slot_cache():
    """Prompts, then one token per row, written in both layouts, the paged one through page
    tables scattered over a pool: every layer's pages, gathered through the tables, are the
    slot layout's rows; the writes of a row without pages land on the scratch page, and a row
    or slot past the tables is dropped."""
    rng = np.random.default_rng(0)
    layers, kh, dh, rows, width = 2, CONFIG.num_kv_heads, CONFIG.head_dim, 4, 64
    paged, slots = PagedLayout(16), CacheLayout(slot_major=True)
    pages = 4 * rows  # + the scratch page, number 16
    table = jnp.asarray(rng.permutation(pages).reshape(rows, 4), jnp.int32)
    table = table.at[2].set(pages)  # row 2 holds no pages: the scratch page
    cache = {paged: tuple(jnp.zeros(s) for s in paged.shapes(CONFIG, pages + 1)),
             slots: tuple(jnp.zeros(s) for s in slots.shapes(CONFIG, rows, width))}
    k, v = (jnp.asarray(rng.standard_normal((layers, 3, 20, kh, dh)), jnp.float32)
            for _ in range(2))
    # the third prompt's row (4) is past the tables: dropped by both layouts
    prompt_rows = jnp.asarray([3, 1, 4])
    prompt_slots = jnp.asarray(np.arange(20)[None].repeat(3, 0))
    token = [jnp.asarray(rng.standard_normal((rows, kh, dh)), jnp.float32) for _ in range(2)]
    at = jnp.asarray([20, 20, 0, width])  # row 3's slot is past the width: dropped
    for lay in cache:
        pt = table if lay is paged else None
        for layer in range(layers):
            cache[lay] = lay.write(cache[lay], layer, prompt_rows, prompt_slots, k[layer],
                                   v[layer], pt)
        cache[lay] = lay.write(cache[lay], 1, jnp.arange(rows), at[:, None],
                               *(x[:, None] for x in token), pt)
    for i in range(2):  # keys, values
        pool = np.asarray(cache[paged][i])
        for layer in range(layers):
            gathered = np.asarray(gather_pages(pool[layer], table))  # [R, K, S, Dh]
            want = np.asarray(cache[slots][i][layer]).transpose(0, 2, 1, 3)
            for r in (0, 1, 3):
                np.testing.assert_array_equal(gathered[r], want[r])
        # the scratch page holds row 2's token (layer 1, slot 0), nothing else was written
        np.testing.assert_array_equal(pool[1, :, pages, 0], np.asarray(token[i][2]))
        assert not pool[0, :, pages].any() and not pool[1, :, pages, 1:].any()
        written = set(np.asarray(table)[[0, 1, 3]].reshape(-1).tolist()) | {pages}
        assert not pool[:, :, sorted(set(range(pages + 1)) - written)].any()


def _pool(pages=8, page=16, rows=4, width=64):
    mesh = Mesh(np.array(jax.devices()[:1]), ("tensor",))
    return PagedCache(CONFIG, jnp.float32, mesh, layout=PagedLayout(page, mesh), pages=pages,
                      pages_per_sequence=pages_for(width, page), max_rows=rows, max_width=width)


def test_page_pool_reserves_final_lengths_grows_rows_and_frees_them():
    pool = _pool()
    assert pool.guaranteed_rows() == 2  # 8 pages, 4 per sequence of 64 tokens
    assert pool.admits([64, 64]) and pool.admits([40, 20, 33])  # 3 + 2 + 3 pages
    assert not pool.admits([40, 20, 33, 17])  # 9 pages
    assert not pool.admits([1] * 5)  # rows: at most 4
    a, b = [], []
    pool.grow(a, 17)
    pool.grow(b, 5)
    pool.grow(a, 32)  # still two pages
    pool.grow(a, 33)
    assert (a, b) == ([0, 1, 3], [2])
    pool.shape = CacheShape(4, 32)  # the segment's width: two pages per table row
    np.testing.assert_array_equal(pool.page_table([None, a, b, None]),
                                  [[8, 8], [0, 1], [2, 8], [8, 8]])
    pool.free(a)
    assert a == [] and pool.free_list[-3:] == [3, 1, 0]
    pool.grow(b, 40)  # the last freed first
    assert b == [2, 0, 1]
    with pytest.raises(RuntimeError, match="page pool exhausted: a row needs 6 more pages"):
        pool.grow([], 90)
    assert pool.budget_bytes == 9 * 16 * 2 * 2 * CONFIG.num_kv_heads * CONFIG.head_dim * 4


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [20], [30, 31, 32], [40, 41],
           [50, 51, 52, 53, 54]]
GRAPHDEF, STATE = nnx.split(init_random(CONFIG, seed=0, std=0.3))
RUNS = ((9, {}), (13, dict(temperature=1.0, seed=7)))  # (max_new_tokens, sampling), greedy first


def _engine(decode_attention="paged", **kw):
    mesh = Mesh(np.array(jax.devices()[:1]), ("tensor",))
    kw = dict(max_batch_size=4, max_sequence_length=40, segment_steps=4, kv_page_size=16) | kw
    return GenerationEngine(CONFIG, GRAPHDEF, mesh=mesh, eos_token_ids=(), pad_token_id=0,
                            decode_attention=decode_attention, **kw)


def _generate(engine, runs=RUNS, prompts=PROMPTS, **kw):
    """The engine's completions of ``prompts`` for each of ``runs``; the engine stays open
    (closing it releases the pool)."""
    placed = engine.place_state(STATE)
    return [engine.generate(placed, prompts, SamplingOptions(max_new_tokens=m, **o), **kw)
            for m, o in runs]


def _same_tokens(want, got, atol=1e-5):
    for a, b in zip(want, got, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x[0].token_ids == y[0].token_ids
            np.testing.assert_allclose(x[0].logprobs, y[0].logprobs, atol=atol)


@pytest.fixture(scope="module")
def slot_cache_tokens():
    """The slot cache's (XLA) tokens of `RUNS`: what every page pool must give."""
    engine = _engine("xla")
    try:
        return _generate(engine)
    finally:
        engine.close()


def test_engine_decoding_through_the_page_pool_gives_the_slot_caches_tokens(slot_cache_tokens):
    """Six prompts through four rows (finished rows are refilled, rows move between slots),
    greedy and sampled: the page pool's tokens are the slot cache's, logprobs equal up to
    float32 rounding (on CPU its attention gathers the pages: XLA ops); every page is back
    in the pool at the end and the pool was allocated once."""
    engine = _engine()
    try:
        _same_tokens(slot_cache_tokens, _generate(engine))
        assert sorted(engine.cache.free_list) == list(range(engine.cache.num_pages))
        assert engine.stats["kv_cache_peak_bytes"] == engine.cache.budget_bytes
    finally:
        engine.close()


def test_engine_decoding_through_the_kernel_in_interpret_mode_gives_the_slot_caches_tokens(
        monkeypatch):
    """Three prompts, greedy, over a bfloat16 cache (what a TPU serves, and what the kernel
    reads keys and values as): decode attention through the Pallas kernel (interpret mode)
    over the pool gives the slot cache's tokens, logprobs within 1e-3 (both read the same
    bfloat16 values; they round and accumulate differently on the way). The kernel stands in
    for what `paged_attend` picks on a TPU (there is none here); pages of 32 tokens give the
    decode program a layout of its own (no program traced with the XLA path is reused)."""
    def kernel(*args, **kw):  # traced on the engine's thread: the mode is thread-local
        with pltpu.force_tpu_interpret_mode():
            return paged_attend_kernel(*args, **kw)

    runs, prompts = ((9, {}),), PROMPTS[:3]
    dense = _engine("xla", dtype=jnp.bfloat16)
    try:
        want = _generate(dense, runs, prompts)
    finally:
        dense.close()
    monkeypatch.setattr(paged_cache, "paged_attend", kernel)
    engine = _engine(kv_page_size=32, dtype=jnp.bfloat16)
    try:
        got = _generate(engine, runs, prompts)
    finally:
        engine.close()
    _same_tokens(want, got, atol=1e-3)


def test_a_small_page_pool_makes_admission_wait_not_fail(slot_cache_tokens):
    """A pool of 3 pages (16 tokens each) holds the rows of two or three short prompts, not
    four: the rest wait for pages, and the tokens are still the slot cache's. Stepped by hand
    first: the first boundary admits the two prompts whose final pages (1 + 2) fill the pool,
    and their rows hold the pages of the first segment (one each)."""
    engine = _engine(kv_pages=3)
    try:
        assert engine.max_batch_size == 1  # guaranteed: one sequence of max_sequence_length
        scheduler = engine.scheduler
        scheduler.queue.append(engine.new_request(
            PROMPTS[:4], SamplingOptions(max_new_tokens=9),
            weights=PinnedWeights(0, engine.place_state(STATE))))
        scheduler.step()
        assert [len(row.pages) for row in scheduler.rows.values()] == [1, 1]
        assert engine.stats["kv_pages_in_use"] == 2 and engine.stats["queued_sequences"] == 2
        for _ in range(40):  # to the end: every prompt admitted and finished
            if not scheduler.rows and not scheduler.queue:
                break
            scheduler.step()
        assert engine.stats["kv_pages_in_use"] == 0
        _same_tokens(slot_cache_tokens, _generate(engine))
        assert 2 <= engine.stats["peak_active_sequences"] <= 3
        assert sorted(engine.cache.free_list) == [0, 1, 2]
    finally:
        engine.close()


def test_which_pages_a_row_gets_changes_no_token():
    """A reproducible request decoded by a fresh pool and by one whose free list an earlier
    workload left shuffled: other pages, bitwise the same tokens and logprobs."""
    runs = ((12, dict(temperature=1.0, seed=3)),)
    fresh, used = _engine(), _engine()
    try:
        want = _generate(fresh, runs, PROMPTS[:2], exclusive=True)
        # rows that grow page by page take interleaved pages: freed, they shuffle the list
        _generate(used, ((30, {}),), PROMPTS[2:])
        assert used.cache.free_list != list(range(used.cache.num_pages - 1, -1, -1))
        assert used.stats["kv_pages_in_use"] == 0
        got = _generate(used, runs, PROMPTS[:2], exclusive=True)
    finally:
        fresh.close()
        used.close()
    for a, b in zip(want[0], got[0], strict=True):
        assert a[0].token_ids == b[0].token_ids and a[0].logprobs == b[0].logprobs


def test_page_pool_settings_are_checked_by_name_and_size_the_pool():
    with pytest.raises(ValueError, match="kv_page_size: expected a positive multiple of 16"):
        PagedLayout(24)
    with pytest.raises(ConfigError, match="sampler.kv_page_size: expected a multiple of 16"):
        load_config(None, ["sampler.kv_page_size=40"])
    with pytest.raises(ValueError, match="decode_attention: expected one of"):
        layout_for(Mesh(np.array(jax.devices()[:1]), ("tensor",)), "flash")
    with pytest.raises(ConfigError, match="kv_pages_per_sequence: 3 pages of kv_page_size 16 "
                       "hold 48 tokens, fewer than max_sequence_length 64"):
        load_config(None, ["sampler.max_sequence_length=64", "sampler.kv_page_size=16",
                           "sampler.kv_pages_per_sequence=3"])
    with pytest.raises(ConfigError, match="sampler.kv_pages: 3 pages .* hold no sequence"):
        load_config(None, ["sampler.max_sequence_length=64", "sampler.kv_page_size=16",
                           "sampler.kv_pages=3"])
    with pytest.raises(ConfigError, match="kv_pages and sampler.kv_cache_bytes both"):
        load_config(None, ["sampler.kv_pages=64", "sampler.kv_cache_bytes=1000000"])
    with pytest.raises(ValueError, match="page pool's 2 pages of 16 tokens .* hold no sequence"):
        _engine(kv_pages=2)
    # kv_cache_bytes sizes the pool, its scratch page included: a page is 16 tokens x 2 layers
    # x (keys, values) x 2 heads x 8 x 4 bytes
    page = 16 * 2 * 2 * CONFIG.num_kv_heads * CONFIG.head_dim * 4
    assert _engine(kv_cache_bytes=6 * page + 100).cache.num_pages == 5


def test_the_launch_estimate_counts_the_page_pool_whole():
    """`splitrl up`'s arithmetic estimate: a sampler decoding through the page pool holds
    kv_pages + 1 pages whatever the sequences in flight."""
    from splitrl_app.planning.estimate import ModelShape, sampler_estimate

    model = ModelShape(vocab=256, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2,
                       head_dim=8, tied=False)
    cfg = load_config(None, ["sampler.decode_attention=paged", "sampler.kv_pages=40",
                             "sampler.kv_page_size=16", "sampler.dtype=float32",
                             "sampler.concurrent_batches=1"])
    m = sampler_estimate(cfg, model, devices=1, capacity=2**40)
    assert m.categories["kv cache"] == 41 * 16 * 2 * 2 * 2 * 8 * 4


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
    # The page pool, held once (no resize copy): 16 sequences x 2 pages of 64 tokens, plus the
    # scratch page; keys and values, bfloat16, the 2 KV heads split over the 2 chips.
    categories = report.measurement.categories
    assert categories["kv cache"] == (16 * 2 + 1) * 64 * 2 * 128 * 2 and (
        "kv cache resize" not in categories)
    mesh = Mesh(np.array(target.devices[:2]), ("tensor",))
    assert layout_for(mesh, "auto", 64, head_dim=64) == CacheLayout(slot_major=True)
    with pytest.raises(ValueError, match="needs head_dim a multiple of 128; this model's is 64"):
        layout_for(mesh, "paged", 64, head_dim=64)
