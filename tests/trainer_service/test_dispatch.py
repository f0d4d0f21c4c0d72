"""Dispatcher and sampler pool over real gRPC, against samplers whose failures are scripted
(`scripted_sampler.py`): a sampler dying mid-request, one behind on weights, invalid prompts,
a reward outage; what each request carries; and membership states."""

from __future__ import annotations

import pytest

from splitrl.config import ServicesConfig
from splitrl.v1 import common_pb2
from tests.trainer_service.scripted_sampler import Script, ScriptedSampler
from trainer_service.orchestration.dispatcher import Dispatcher
from trainer_service.orchestration.membership import (
    NEW,
    READY,
    SUSPECT,
    SYNCING,
    NoUsableSampler,
    SamplerPool,
)
from trainer_service.orchestration.queue import Lane, RolloutQueue
from trainer_service.orchestration.rollouts import TRAIN, WorkItem, item_seed

SAMPLING = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=2)
WAIT_S = 60  # a bound for the test, never reached when things work
ROLLOUT_TIMEOUT_S = 60.0  # trainer.rollout_timeout_s: never reached (one test sets its own)


@pytest.fixture
def samplers():
    started = []

    def make(name, **script):
        sampler = ScriptedSampler(name, Script(**script)).start()
        started.append(sampler)
        return sampler

    yield make
    for sampler in started:
        sampler.stop()


def pool_of(*samplers, version=0, timeout_s=30.0):
    services = ServicesConfig(sampler_addresses=[s.address for s in samplers],
                              sampler_timeout_s=timeout_s)
    pool = SamplerPool(services, max_message_bytes=4 << 20)
    pool.refresh()  # probes every sampler: new -> syncing, announced by next_joined
    for handle in pool.all():
        pool.mark_ready(handle, version)  # what a successful push does
    return pool, joined_now(pool)


def joined_now(pool):
    """The joins the pool has announced so far (each is handed out once)."""
    out = []
    while (handle := pool.next_joined(0)) is not None:
        out.append(handle)
    return out


def work(n, texts=None, seed=0):
    texts = texts or [f"{i % 5}+0=" for i in range(n)]
    return [WorkItem(uid=f"p{i}#{i}", row={"prompt_id": f"p{i}", "prompt": texts[i],
                                           "reference": "0"},
                     seq=i, seed=item_seed(seed, f"p{i}#{i}")) for i in range(n)]


def run_dispatch(pool, lane, items, n=None):
    """Dispatch ``items`` until ``n`` (default all) groups are buffered; returns them and the
    queue."""
    queue = RolloutQueue([lane])
    queue.add(items)
    dispatcher = Dispatcher(pool, queue, rollout_timeout_s=ROLLOUT_TIMEOUT_S)
    dispatcher.start()
    try:
        taken = queue.take(TRAIN, n or len(items), timeout_s=WAIT_S)
    finally:
        dispatcher.stop()
        pool.stop()
    return taken, queue


def test_a_sampler_dying_mid_request_hands_its_prompts_to_another(samplers):
    dying = samplers("dying", fail_after=1, capacity=8)
    healthy = samplers("healthy", capacity=8)
    pool, _ = pool_of(dying, healthy)
    lane = Lane(TRAIN, 2, SAMPLING)  # adaptive: a fair share to each
    taken, queue = run_dispatch(pool, lane, work(8))
    assert [g.item.seq for g in taken.groups] == list(range(8))
    requests = {s.name: [len(r.prompts) for r in s.requests] for s in (dying, healthy)}
    assert queue.counts["redispatched"] >= 1, (dict(queue.counts), requests)
    assert queue.outstanding() == 0, (dict(queue.counts), requests)
    by = {g.sampler_id for g in taken.groups}
    assert "healthy" in by
    # Suspect until a probe answers. (Its failure count may be back at 0: it is a count of
    # consecutive failures, and a request it held at the same time may have completed.)
    handle = next(h for h in pool.all() if h.sampler_id == "dying")
    assert handle.state == SUSPECT


def test_a_rollout_past_its_deadline_hands_its_prompts_to_another(samplers):
    # trainer.rollout_timeout_s bounds each Rollout call: a sampler that stalls past it is
    # failed like a dead one, and its prompts are generated elsewhere.
    stalled = samplers("stalled", stall_s=WAIT_S, capacity=8)
    healthy = samplers("healthy", capacity=8)
    pool, _ = pool_of(stalled, healthy)
    queue = RolloutQueue([Lane(TRAIN, 2, SAMPLING)])
    queue.add(work(8))
    dispatcher = Dispatcher(pool, queue, rollout_timeout_s=0.5)
    dispatcher.start()
    try:
        taken = queue.take(TRAIN, 8, timeout_s=WAIT_S)
    finally:
        dispatcher.stop()
        pool.stop()
    assert [g.item.seq for g in taken.groups] == list(range(8))
    assert len(stalled.requests) == 1 and queue.counts["redispatched"] >= 1
    assert {g.sampler_id for g in taken.groups} == {"healthy"}
    assert next(h for h in pool.all() if h.sampler_id == "stalled").state == SUSPECT


def test_requests_carry_each_prompts_seed_and_fixed_units_whatever_the_samplers(samplers):
    seen = []
    for count in (1, 2):
        group = [samplers(f"s{i}", capacity=64) for i in range(count)]
        pool, _ = pool_of(*group)
        lane = Lane(TRAIN, 4, SAMPLING, request_size=3)
        taken, _ = run_dispatch(pool, lane, work(8, seed=7))
        requests = [r for s in group for r in s.requests]
        assert all(r.reproducible and r.group_size == 4 for r in requests)
        for r in requests:
            for p in r.prompts:
                assert p.has_seed and p.seed == item_seed(7, p.prompt_id)
        seen.append(sorted([p.prompt_id for p in r.prompts] for r in requests))
        assert [g.item.seq for g in taken.groups] == list(range(8))
    # One sampler or two: the same requests, cut in draw order.
    assert seen[0] == seen[1] == [["p0#0", "p1#1", "p2#2"], ["p3#3", "p4#4", "p5#5"],
                                  ["p6#6", "p7#7"]]


def test_synchronous_steps_rotate_over_every_sampler(samplers):
    # Each step: two requests of four prompts (a synchronous run cuts a step so), three
    # samplers with room for both. Offered in pool order every time, the third never got any.
    group = [samplers(f"s{i}", capacity=64) for i in range(3)]
    pool, _ = pool_of(*group)
    queue = RolloutQueue([Lane(TRAIN, 4, SAMPLING, request_size=4)])
    dispatcher = Dispatcher(pool, queue, rollout_timeout_s=ROLLOUT_TIMEOUT_S)
    dispatcher.start()
    items = work(24)
    try:
        for step in range(3):
            queue.add(items[8 * step: 8 * step + 8])
            queue.take(TRAIN, 8, timeout_s=WAIT_S)
    finally:
        dispatcher.stop()
        pool.stop()
    assert [len(s.requests) for s in group] == [2, 2, 2]


def test_a_sampler_behind_on_weights_is_resynced_not_blamed(samplers):
    behind = samplers("behind", version=0)
    pool, joined = pool_of(behind, version=3)  # the pool thinks it holds version 3
    queue = RolloutQueue([Lane(TRAIN, 2, SAMPLING)])
    queue.set_version(3)
    queue.add(work(2))
    dispatcher = Dispatcher(pool, queue, rollout_timeout_s=ROLLOUT_TIMEOUT_S)
    assert dispatcher.dispatch_once()
    handle = pool.all()[0]
    _wait(lambda: handle.state == NEW, "the sampler to be marked for a resync")
    assert handle.failures == 0 and handle.weight_version < 3
    assert queue.outstanding() == 2  # its prompts wait for a sampler with version 3
    pool.refresh()  # the next probe announces it again, for a weight push
    joined += joined_now(pool)
    assert handle.state == SYNCING and [h.sampler_id for h in joined] == ["behind", "behind"]
    dispatcher.stop()
    pool.stop()


def test_an_invalid_prompt_is_isolated_then_dropped_and_the_others_train(samplers):
    sampler = samplers("strict")
    pool, _ = pool_of(sampler)
    texts = ["1+0=", "BAD", "2+0=", "3+0="]
    lane = Lane(TRAIN, 2, SAMPLING)
    queue = RolloutQueue([lane])
    queue.add(work(4, texts))
    dispatcher = Dispatcher(pool, queue, rollout_timeout_s=ROLLOUT_TIMEOUT_S)
    dispatcher.start()
    try:
        assert queue.take(TRAIN, 4, timeout_s=WAIT_S).shortfall == 1
        taken = queue.take(TRAIN, 3, timeout_s=WAIT_S)
    finally:
        dispatcher.stop()
        pool.stop()
    assert [g.item.uid for g in taken.groups] == ["p0#0", "p2#2", "p3#3"]
    dropped = queue.drain_events().dropped
    assert [i.uid for i, _ in dropped] == ["p1#1"] and "max_sequence_length" in dropped[0][1]
    bad_requests = [r for r in sampler.requests if any(p.text == "BAD" for p in r.prompts)]
    assert len(bad_requests) == 2 and len(bad_requests[1].prompts) == 1  # then never again
    assert pool.all()[0].failures == 0  # refusing bad input is not a sampler failure


def test_a_reward_outage_pauses_dispatch_without_blaming_the_sampler(samplers):
    sampler = samplers("scoring-down", reward_down=2)
    pool, _ = pool_of(sampler)
    taken, queue = run_dispatch(pool, Lane(TRAIN, 2, SAMPLING), work(2))
    assert len(taken.groups) == 2
    handle = pool.all()[0]
    assert handle.failures == 0 and handle.state == READY
    assert len(sampler.requests) == 3  # two refused, then one that scored: no tight loop


def _fail_until_refused(broken, handle, pool, *, heartbeats: bool) -> None:
    """The broken sampler's rollouts fail inside it, three in a row; after each a probe makes
    it ready again (with ``heartbeats``, a heartbeat comes first: alive, which says nothing of
    its engine), until the third failure has it refused."""
    for failed in range(1, 4):
        _wait(lambda n=failed: len(broken.requests) == n and handle.state != READY,
              f"rollout {failed} to fail")
        if heartbeats:
            pool.report_ok(handle)
        pool.refresh()  # the probe succeeds: ready again, until the third failure
    _wait(lambda: pool.all() == [], "the broken sampler to be refused")


def test_a_sampler_failing_every_rollout_inside_is_refused_and_its_prompts_kept(samplers):
    # It answers probes, so each probe made it ready again for the next prompts to fail: the
    # run waited for groups that never came. After sampler_max_internal_failures in a row it
    # is refused, the run says why it is stalled, and every prompt is still the queue's.
    broken = samplers("broken", broken=True)
    pool, _ = pool_of(broken)
    handle = pool.all()[0]
    queue = RolloutQueue([Lane(TRAIN, 2, SAMPLING)])
    queue.add(work(2))
    dispatcher = Dispatcher(pool, queue, rollout_timeout_s=ROLLOUT_TIMEOUT_S)
    dispatcher.start()
    try:
        _fail_until_refused(broken, handle, pool, heartbeats=False)
    finally:
        dispatcher.stop()
        pool.stop()
    assert len(broken.requests) == 3 and pool.left == 1
    assert pool.stalled().startswith(f"every sampler was refused: {broken.address}: its last "
                                     "3 rollouts failed inside it; the last: INTERNAL: rollout "
                                     "failed: ValueError('Expected 2 per-device arrays')")
    assert queue.outstanding() == 2 and queue.counts["redispatched"] >= 2, dict(queue.counts)


def test_a_run_whose_only_sampler_keeps_failing_inside_stops_waiting_naming_it(samplers):
    """Refused, then taken back when its address is tried again, the broken sampler is ready
    by every probe and push, yet not to the wait: the run's wait for groups gives up after
    services.sampler_wait_s, naming the sampler and its error, and every prompt is still the
    queue's (the checkpoint's). Heartbeats in between do not hide the failures."""
    broken = samplers("broken", broken=True)
    services = ServicesConfig(sampler_addresses=[broken.address], sampler_timeout_s=0.2,
                              sampler_wait_s=1.0)
    pool = SamplerPool(services, max_message_bytes=4 << 20)
    pool.refresh()
    handle = pool.all()[0]
    pool.mark_ready(handle, 0)
    queue = RolloutQueue([Lane(TRAIN, 2, SAMPLING)])
    queue.add(work(2))
    dispatcher = Dispatcher(pool, queue, rollout_timeout_s=ROLLOUT_TIMEOUT_S)
    dispatcher.start()
    try:
        _fail_until_refused(broken, handle, pool, heartbeats=True)
        _wait(lambda: (pool.refresh(), pool.all())[1], "its address to be tried again")
        pool.mark_ready(pool.all()[0], 0)  # the join push succeeds: it takes pushes
        assert pool.unready_s() > 0  # ready by its state, not to the wait
        assert pool.stalled().startswith(f"every sampler was refused: {broken.address}")
        with pytest.raises(NoUsableSampler) as stopped:
            queue.take(TRAIN, 2, timeout_s=WAIT_S, check=pool.check_usable)
    finally:
        dispatcher.stop()
        pool.stop()
    assert stopped.value.waited_s > 1.0
    assert stopped.value.samplers == {broken.address: (
        "refused: its last 3 rollouts failed inside it; the last: INTERNAL: rollout failed: "
        "ValueError('Expected 2 per-device arrays'); taken back, no rollout of it has "
        "completed since")}
    assert str(stopped.value).startswith("no sampler has been ready to take work for ")
    assert queue.outstanding() == 2


def test_a_sampler_restarting_at_its_address_is_waited_for_and_ready_again(samplers):
    """Killed and started again at the same address: dropped as unreachable meanwhile (the
    wait's clock runs, the wait goes on), then synced, ready, and the run's groups come."""
    sampler = samplers("restarting")
    services = ServicesConfig(sampler_addresses=[sampler.address], sampler_timeout_s=0.2,
                              sampler_wait_s=WAIT_S)
    pool = SamplerPool(services, max_message_bytes=4 << 20)
    pool.refresh()
    pool.mark_ready(pool.all()[0], 0)
    assert pool.unready_s() == 0
    sampler.stop()
    _wait(lambda: (pool.refresh(), pool.all())[1] == [], "the stopped sampler dropped")
    pool.check_usable()  # within services.sampler_wait_s: no error
    assert pool.unready_s() > 0
    assert pool.not_ready()[sampler.address].startswith("dropped: unreachable for ")
    sampler.start(sampler.address)  # the same address, a new process
    _wait(lambda: (pool.refresh(), pool.all())[1], "the restarted sampler to join")
    pool.mark_ready(pool.all()[0], 0)  # what the join push does
    assert pool.unready_s() == 0 and pool.stalled() == ""
    taken, _ = run_dispatch(pool, Lane(TRAIN, 2, SAMPLING), work(3))
    assert len(taken.groups) == 3


def test_membership_states_follow_probes_failures_and_drops(samplers):
    sampler = samplers("member")
    pool, joined = pool_of(sampler, timeout_s=0.001)
    handle = pool.all()[0]
    assert handle.state == READY and handle.capacity == 64 and len(joined) == 1
    pool.report_failure(handle, "UNAVAILABLE: a call failed")
    assert handle.state == SUSPECT and pool.ready() == []
    pool.refresh()  # a probe that succeeds makes it ready again
    assert handle.state == READY
    sampler.stop()
    pool.refresh()  # unreachable for longer than sampler_timeout_s: dropped
    assert pool.all() == [] and pool.left == 1
    pool.stop()


def _wait(predicate, what: str) -> None:
    import time

    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
