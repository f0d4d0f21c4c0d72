"""Continuous batching: requests joining a running batch, exclusive (reproducible) requests,
the KV-cache budget under a burst, static batching, cancellation and in-flight weight updates.

Most tests drive the engine's scheduler one segment boundary at a time (what the engine's
thread does in a loop), so "admitted while another request is running" is a fact of the test,
not of thread timing; the burst test uses the engine's own thread and concurrent callers.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from test_engine import PROMPTS, greedy_reference, make_engine, tiny_model

from sampler_service._inputs import pack_prompts
from sampler_service.requests import PinnedWeights
from sampler_service.sampling import SamplingOptions
from splitrl.config import MeshConfig
from splitrl.mesh import build_mesh

STOPS = tuple(range(0, 96, 14))  # ~1 in 14 tokens ends a sampled sequence: lengths vary
SAMPLED = SamplingOptions(temperature=1.0, max_new_tokens=12, seed=5, stop_token_ids=STOPS)
PROMPT_SET = [PROMPTS[0], PROMPTS[1], PROMPTS[2], [30, 31], [40, 41, 42, 43, 44], [50] * 7]


@pytest.fixture(scope="module")
def setup():
    model = tiny_model()
    mesh = build_mesh(MeshConfig(axes={"tensor": 1}), jax.devices()[:1])
    engine, state = make_engine(model, mesh)
    return model, mesh, state


def queue(engine, prompts, options, n=1, **kw):
    """A request appended to the scheduler's queue (as `submit` does, without the thread)."""
    request = engine.new_request(prompts, options, n, **kw)
    engine.scheduler.queue.append(request)
    return request


def run_until_idle(engine, check=None, max_steps=500):
    for _ in range(max_steps):
        if engine.scheduler.idle:
            return
        engine.scheduler.step()
        if check is not None:
            check(engine.scheduler)
    raise AssertionError("the engine did not finish")


def step_until(engine, condition, max_steps=500):
    for _ in range(max_steps):
        if condition():
            return
        engine.scheduler.step()
    raise AssertionError("condition never held")


def greedy(k):
    return SamplingOptions(greedy=True, max_new_tokens=k)


def test_prompts_are_packed_first_fit_by_decreasing_length():
    prompts = [np.arange(1, n + 1) for n in (20, 9, 30, 3, 2, 17, 16)]
    tokens, positions, segments, starts = pack_prompts(prompts, max_width=256, pad=0)
    # Width 32 (the longest prompt's power of two): [30, 2], [20, 9, 3], [17], [16] -> 4 rows.
    assert tokens.shape == (4, 32)
    assert segments[0].tolist() == [2] * 30 + [4] * 2
    assert segments[1].tolist() == [0] * 20 + [1] * 9 + [3] * 3
    assert segments[2].tolist() == [5] * 17 + [-1] * 15
    for i, p in enumerate(prompts):
        flat = tokens.reshape(-1)[starts[i]:starts[i] + p.size]
        np.testing.assert_array_equal(flat, p)
        np.testing.assert_array_equal(positions.reshape(-1)[starts[i]:starts[i] + p.size],
                                      np.arange(p.size))


def test_greedy_is_the_reference_for_requests_that_join_a_running_batch(setup):
    model, mesh, state = setup
    engine, _ = make_engine(model, mesh, max_batch_size=2)
    pinned = PinnedWeights(0, state)
    a = queue(engine, [PROMPTS[1]], greedy(12), weights=pinned)
    engine.scheduler.step()  # a alone: prefill + 4 decode steps
    b = queue(engine, [PROMPTS[0]], greedy(3), weights=pinned)
    c = queue(engine, [PROMPTS[2]], greedy(10), weights=pinned)
    engine.scheduler.step()
    assert b.next_prompt == 1 and c.next_prompt == 0  # b took the free row; c waits
    step_until(engine, lambda: c.next_prompt == 1)
    assert b.finished and not a.finished  # c took b's row while a was mid-sequence
    run_until_idle(engine)
    for request, prompt, k in ((a, PROMPTS[1], 12), (b, PROMPTS[0], 3), (c, PROMPTS[2], 10)):
        (seq,), = request.result()
        assert seq.token_ids == greedy_reference(model, prompt, k)
        assert seq.weight_versions == (0,)
    assert engine.stats["peak_active_sequences"] == 2


def test_seeded_samples_do_not_depend_on_neighbours_or_admission_time(setup):
    model, mesh, state = setup
    pinned = PinnedWeights(3, state)
    alone, _ = make_engine(model, mesh)
    reference = alone.generate(state, PROMPT_SET[:2], SAMPLED, n=2, version=3)
    busy, _ = make_engine(model, mesh, max_batch_size=4)
    other = queue(busy, PROMPT_SET[3:],
                  SamplingOptions(temperature=0.8, top_k=5, max_new_tokens=12, seed=9), n=2,
                  weights=pinned)
    busy.scheduler.step()
    late = queue(busy, PROMPT_SET[:2], SAMPLED, n=2, weights=pinned)
    run_until_idle(busy)
    assert other.finished
    for got, want in zip(late.result(), reference, strict=True):
        for x, y in zip(got, want, strict=True):
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    lengths = {len(s.token_ids) for row in reference for s in row}
    assert len(lengths) > 1  # the stop ids make lengths differ


def _run_exclusive(engine, state, others=()):
    """The exclusive request X (12 rows through 4 decode rows), with ``others`` queued in the
    scheduler around it; checks nothing shares X's batch; returns X's result."""
    pinned = PinnedWeights(1, state)
    for options in others[:1]:
        queue(engine, PROMPT_SET[3:], options, n=2, weights=pinned)
        engine.scheduler.step()  # running when X arrives
    x = queue(engine, PROMPT_SET, SAMPLED, n=2, exclusive=True, weights=pinned)
    for options in others[1:]:
        queue(engine, PROMPT_SET[:3], options, n=1, weights=pinned)

    def alone(scheduler):
        owners = {row.group.request for row in scheduler.rows.values()}
        assert x not in owners or owners == {x}

    run_until_idle(engine, check=alone)
    return x.result()


def test_an_exclusive_request_is_bitwise_the_same_whatever_runs_around_it(setup):
    model, mesh, state = setup
    solo = _run_exclusive(make_engine(model, mesh, max_batch_size=4)[0], state)
    assert sum(len(s.token_ids) < 12 for row in solo for s in row) >= 3  # rows ended early
    busy_engine = make_engine(model, mesh, max_batch_size=4)[0]
    busy = _run_exclusive(busy_engine, state, others=(
        SamplingOptions(temperature=0.7, max_new_tokens=20, seed=1),
        SamplingOptions(greedy=True, max_new_tokens=4)))
    assert busy == solo  # tokens, logprobs (exact floats), finish reasons, versions
    # And through the engine's own thread, with concurrent callers.
    threaded_engine = make_engine(model, mesh, max_batch_size=4)[0]
    results = {}

    def call(name, **kw):
        results[name] = threaded_engine.generate(state, PROMPT_SET, SAMPLED, n=2, version=1,
                                                 **kw)

    threads = [threading.Thread(target=call, args=("x",), kwargs=dict(exclusive=True))]
    threads += [threading.Thread(target=call, args=(f"other{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    threaded_engine.close()
    assert results["x"] == solo


def test_concurrent_batches_decode_exclusive_requests_side_by_side_bitwise_as_alone(setup):
    model, mesh, state = setup
    pinned = PinnedWeights(1, state)
    first, second = PROMPT_SET[:3], PROMPT_SET[3:5]
    alone = make_engine(model, mesh, max_batch_size=4)[0]
    solo = []
    for prompts in (first, second):
        request = queue(alone, prompts, SAMPLED, n=2, exclusive=True, weights=pinned)
        run_until_idle(alone)
        solo.append(request.result())
    engine = make_engine(model, mesh, max_batch_size=4, concurrent_batches=2)[0]
    assert len(engine.schedulers) == 2 and engine.kv_cache_budget_bytes == 2 * (
        alone.kv_cache_budget_bytes)
    x, y = (engine.new_request(p, SAMPLED, 2, exclusive=True, weights=pinned)
            for p in (first, second))
    assert engine._batch_for(x) == 0
    engine.schedulers[0].queue.append(x)
    assert engine._batch_for(y) == 1  # batch 0 is taken by x: y need not wait for it
    engine.schedulers[1].queue.append(y)
    other = engine.new_request(second, SAMPLED, 1, weights=pinned)
    # Both batches are held by exclusive requests: the one with fewer sequences ahead.
    assert engine._batch_for(other) == 1
    # Step both batches in turn, as their two threads do, each batch holding one request.
    for _ in range(500):
        if all(s.idle for s in engine.schedulers):
            break
        for scheduler, request in zip(engine.schedulers, (x, y), strict=True):
            scheduler.step()
            assert {row.group.request for row in scheduler.rows.values()} <= {request}
    assert [x.result(), y.result()] == solo
    # Requests that need no exclusivity share the first batch no exclusive request holds.
    engine.schedulers[0].queue.append(engine.new_request(first, SAMPLED, 2, exclusive=True,
                                                         weights=pinned))
    assert engine._batch_for(other) == 1
    engine.schedulers[0].queue.clear()
    assert engine._batch_for(other) == 0
    # Through the engine's own threads, called at once.
    threaded = make_engine(model, mesh, max_batch_size=4, concurrent_batches=2)[0]
    results = {}

    def call(name, prompts):
        results[name] = threaded.generate(state, prompts, SAMPLED, n=2, version=1,
                                          exclusive=True)

    threads = [threading.Thread(target=call, args=(i, p)) for i, p in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    threaded.close()
    assert [results[0], results[1]] == solo
    assert threaded.stats["requests"] == 2 and threaded.stats["active_sequences"] == 0


def test_a_burst_beyond_the_kv_budget_queues_and_completes_within_it(setup):
    model, mesh, state = setup
    # Room for 4 rows of 32 slots (256 bytes per token) plus the resize copy of its keys
    # (or values).
    budget = 4 * 32 * 256 + 4 * 32 * 256 // 2
    engine, _ = make_engine(model, mesh, max_batch_size=8, kv_cache_bytes=budget)
    assert engine.max_batch_size == 4
    results, errors = {}, []

    def call(i):
        try:
            options = SamplingOptions(temperature=1.0, max_new_tokens=12, seed=i,
                                      stop_token_ids=STOPS)
            results[i] = engine.generate(state, PROMPT_SET[i % 4:i % 4 + 2], options, n=2)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    engine.close()
    assert not errors and len(results) == 8
    assert all(len(r) == 2 and all(len(g) == 2 for g in r) for r in results.values())
    stats = engine.stats
    assert stats["kv_cache_peak_bytes"] <= budget == stats["kv_cache_budget_bytes"]
    assert stats["peak_active_sequences"] <= 4 and stats["sequences"] == 32
    assert stats["peak_queued_sequences"] >= 8  # most of the burst waited for rows


def test_static_batching_admits_only_into_an_empty_batch(setup):
    model, mesh, state = setup
    engine, _ = make_engine(model, mesh, batching="static")
    pinned = PinnedWeights(0, state)
    a = queue(engine, [PROMPTS[1]], greedy(12), weights=pinned)
    engine.scheduler.step()
    b = queue(engine, [PROMPTS[0]], greedy(3), weights=pinned)
    step_until(engine, lambda: b.next_prompt == 1)
    assert a.finished
    run_until_idle(engine)
    assert b.result()[0][0].token_ids == greedy_reference(model, PROMPTS[0], 3)


def test_a_cancelled_request_frees_its_rows_and_others_finish(setup):
    model, mesh, state = setup
    engine, _ = make_engine(model, mesh, max_batch_size=4)
    pinned = PinnedWeights(0, state)
    doomed = queue(engine, PROMPT_SET, greedy(12), n=2, weights=pinned)
    kept = queue(engine, [PROMPTS[2]], greedy(8), weights=pinned)
    engine.scheduler.step()
    doomed.cancel()
    run_until_idle(engine)
    assert kept.result()[0][0].token_ids == greedy_reference(model, PROMPTS[2], 8)
    assert doomed.finished and list(doomed.groups()) == []


class Source:
    """A sampler's weight store in miniature: (version, state) of the newest push."""

    def __init__(self, version, state):
        self.version, self.state = version, state

    def __call__(self):
        return self.version, self.state


def _copy(state):
    return jax.tree.map(lambda x: x + 0, state)  # equal values, a different state object


@pytest.mark.parametrize("in_flight", [True, False])
def test_a_push_during_generation_is_applied_per_update_in_flight(setup, in_flight):
    model, mesh, state = setup
    source = Source(1, state)
    engine, _ = make_engine(model, mesh, weights=source,
                            update_in_flight=in_flight)
    a = queue(engine, [PROMPTS[1]], greedy(12))
    engine.scheduler.step()
    source.version, source.state = 2, _copy(state)  # a push completes mid-sequence
    b = queue(engine, [PROMPTS[0]], greedy(6))
    step_until(engine, lambda: b.next_prompt == 1)
    assert a.finished is not in_flight  # without in-flight updates b waits for a to drain
    run_until_idle(engine)
    (seq_a,), = a.result()
    (seq_b,), = b.result()
    assert seq_a.weight_versions == ((1, 2) if in_flight else (1,))
    assert seq_b.weight_versions == (2,)
    # Equal weights under a new version: greedy tokens are the reference either way.
    assert seq_a.token_ids == greedy_reference(model, PROMPTS[1], 12)
    assert engine.stats["weight_swaps_in_flight"] == int(in_flight)


def test_an_exclusive_request_keeps_its_weights_when_its_rows_all_end_together(setup):
    model, mesh, state = setup
    source = Source(1, state)
    engine, _ = make_engine(model, mesh, max_batch_size=2, weights=source,
                            update_in_flight=True)
    x = queue(engine, PROMPT_SET[:3], greedy(4), exclusive=True)  # 3 prompts through 2 rows
    engine.scheduler.step()
    source.version, source.state = 2, _copy(state)  # pushed while x generates
    later = queue(engine, [PROMPTS[0]], greedy(2))
    run_until_idle(engine)
    assert [s.weight_versions for (s,) in x.result()] == [(1,), (1,), (1,)]
    assert later.result()[0][0].weight_versions == (2,)


def _widths_per_segment(engine, request) -> list[int]:
    widths = []
    while not request.finished:
        engine.scheduler.step()
        if engine.scheduler.rows:
            widths.append(engine.scheduler.cache.shape.width)
    return widths


def test_an_exclusive_request_lays_out_the_cache_once_for_its_whole_generation(setup):
    model, mesh, state = setup
    pinned = PinnedWeights(0, state)
    tokens, widths, resizes = {}, {}, {}
    for exclusive in (True, False):
        engine, _ = make_engine(model, mesh, max_batch_size=2, max_sequence_length=64)
        # 2-token prompt, 40 new tokens in segments of 4: shared, the cache grows from 32
        # slots (the narrowest) to 64; an exclusive request runs alone, so its cache is 64
        # wide from its first segment and one decode program serves all its segments.
        request = queue(engine, [[30, 31]], greedy(40), weights=pinned, exclusive=exclusive)
        widths[exclusive] = _widths_per_segment(engine, request)
        resizes[exclusive] = engine.stats["cache_resizes"]
        (seq,), = request.result()
        tokens[exclusive] = seq.token_ids
    assert set(widths[True]) == {64} and resizes[True] == 1  # the first layout only
    assert widths[False][0] == 32 and widths[False][-1] == 64 and resizes[False] == 2
    assert tokens[True] == tokens[False] and len(tokens[True]) == 40
