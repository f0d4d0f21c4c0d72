"""The rollout queue, the one owner of work items: claims, deliveries, failures, staleness,
dynamic sampling, refusals, reproducible request units and checkpoint snapshots."""

from __future__ import annotations

import threading

import pytest

from splitrl.v1 import common_pb2, sampler_pb2
from trainer_service.orchestration.dispatcher import group_from_wire
from trainer_service.orchestration.queue import Failure, Lane, RolloutQueue
from trainer_service.orchestration.rollouts import (
    EVAL,
    TRAIN,
    Completion,
    RolloutGroup,
    WorkItem,
    item_seed,
)

SAMPLING = common_pb2.SamplingParams(temperature=1.0)


def queue(*, staleness=0, request_size=None, filter_zero_variance=False, group_size=2):
    train = Lane(TRAIN, group_size, SAMPLING, max_staleness=staleness,
                 request_size=request_size, filter_zero_variance=filter_zero_variance)
    return RolloutQueue([train, Lane(EVAL, 1, SAMPLING, request_size=4)])


def items(n, start=0, lane=TRAIN):
    return [WorkItem(uid=f"p{i}#{i}", row={"prompt_id": f"p{i}"}, seq=i, lane=lane)
            for i in range(start, start + n)]


def group(item, version=0, rewards=(1.0, 0.0), request_id=""):
    return RolloutGroup(
        item=WorkItem(uid=item.uid, row=item.row, seq=-1),  # what the wire brings back
        prompt_token_ids=[1, 2],
        completions=[Completion([3], [-0.1], r, {"acc": r}, "stop") for r in rewards],
        weight_version=version, sampler_id="s", request_id=request_id)


def serve(q, claim, version=0, rewards=(1.0, 0.0), only=None):
    """Deliver groups for the claim's items (all, or the uids in ``only``)."""
    for item in claim.items:
        if only is None or item.uid in only:
            q.deliver(claim.request_id, group(item, version, rewards))


def test_groups_are_taken_in_draw_order_whatever_order_they_arrive_in():
    q = queue()
    q.add(items(4))
    claim = q.claim("s0", 0, capacity=8)
    assert [i.uid for i in claim.items] == ["p0#0", "p1#1", "p2#2", "p3#3"]
    for item in reversed(claim.items):
        q.deliver(claim.request_id, group(item))
    q.finish(claim.request_id)
    taken = q.take(TRAIN, 3)
    assert [g.item.seq for g in taken.groups] == [0, 1, 2]  # the queue's items, not the wire's
    assert q.outstanding() == 1


def test_adaptive_claims_share_the_queue_and_respect_capacity():
    q = queue(group_size=4)
    q.add(items(10))
    first = q.claim("s0", 0, capacity=12, ready_samplers=2)  # 3 prompts of 4 completions
    assert len(first.items) == 3
    second = q.claim("s1", 0, capacity=64, ready_samplers=2)  # fair share of the 7 left
    assert len(second.items) == 4
    assert q.claim("s0", 0, capacity=12, ready_samplers=2) is None  # s0 is full
    assert q.inflight_by_sampler() == {"s0": 3, "s1": 4}


def test_a_sampler_failing_mid_request_loses_nothing():
    q = queue()
    q.add(items(3))
    claim = q.claim("s0", 0, capacity=8)
    serve(q, claim, only={"p0#0"})
    lost = q.finish(claim.request_id, Failure("UNAVAILABLE: connection reset"))
    assert [i.uid for i in lost] == ["p1#1", "p2#2"] and all(i.attempts == 1 for i in lost)
    retry = q.claim("s1", 0, capacity=8)
    assert [i.uid for i in retry.items] == ["p1#1", "p2#2"]  # first in line again
    serve(q, retry)
    q.finish(retry.request_id)
    assert [g.item.uid for g in q.take(TRAIN, 3).groups] == ["p0#0", "p1#1", "p2#2"]
    assert q.counts["redispatched"] == 2


def test_a_request_without_failure_that_misses_groups_requeues_them():
    q = queue()
    q.add(items(2))
    claim = q.claim("s0", 0, capacity=8)
    serve(q, claim, only={"p1#1"})
    assert [i.uid for i in q.finish(claim.request_id)] == ["p0#0"]
    assert q.outstanding() == 2  # one queued again, one buffered


def test_late_and_unexpected_groups_are_ignored():
    q = queue()
    q.add(items(2))
    claim = q.claim("s0", 0, capacity=8)
    q.finish(claim.request_id, Failure("CANCELLED"))
    q.deliver(claim.request_id, group(claim.items[0]))  # the cancelled call still streamed
    assert q.counts["late"] == 1
    again = q.claim("s1", 0, capacity=8)
    q.deliver(again.request_id, group(WorkItem("stranger#9", {})))
    serve(q, again)
    serve(q, again)  # twice: the second copy is unexpected
    assert q.counts["unexpected"] == 3
    q.finish(again.request_id)
    assert len(q.take(TRAIN, 2).groups) == 2 and q.outstanding() == 0


def test_stale_groups_go_back_to_the_queue_and_come_back_fresh():
    q = queue(staleness=1)
    q.set_version(3)
    q.add(items(3))
    claim = q.claim("s0", 2, capacity=8)
    assert claim.min_version == 2
    for item, version in zip(claim.items, (2, 3, 2), strict=True):
        q.deliver(claim.request_id, group(item, version))
    q.finish(claim.request_id)
    q.set_version(4)  # groups of version 2 are now two versions old
    assert q.counts["stale_dropped"] == 2
    assert q.claim("s0", 2, capacity=8) is None  # a sampler still on version 2 gets nothing
    retry = q.claim("s0", 4, capacity=8)
    assert [i.uid for i in retry.items] == ["p0#0", "p2#2"]
    serve(q, retry, version=4)
    q.finish(retry.request_id)
    assert [g.item.uid for g in q.take(TRAIN, 3).groups] == ["p0#0", "p1#1", "p2#2"]


def test_a_group_generated_partly_with_old_weights_counts_by_its_oldest_version():
    q = queue(staleness=0)
    q.set_version(5)
    q.add(items(1))
    claim = q.claim("s0", 5, capacity=8)
    q.deliver(claim.request_id, group(claim.items[0], version=4))  # oldest token: version 4
    q.finish(claim.request_id)
    assert q.counts["stale_dropped"] == 1 and q.outstanding() == 1


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_wire_group_spanning_a_weight_update_is_judged_by_its_oldest_token(staleness):
    """A sampler with ``update_in_flight`` swaps weights under running completions: each lists
    the versions its tokens came from. Even if the group's own field named the newest version,
    the trainer takes the oldest, so ``max_staleness`` decides: dropped (and re-queued) at 0,
    trained at 1 (its per-token logprobs are the behaviour policy the loss corrects against)."""
    q = queue(staleness=staleness)
    q.set_version(5)
    q.add(items(1))
    claim = q.claim("s0", 5, capacity=8)
    msg = sampler_pb2.ScoredGroup(
        prompt_id="p0", prompt_token_ids=[1, 2], weight_version=5, sampler_id="s0",
        completions=[common_pb2.Completion(token_ids=[3, 4], logprobs=[-0.1, -0.2],
                                           total_reward=r, weight_versions=versions)
                     for r, versions in ((1.0, [4, 5]), (0.0, [5]))])
    built = group_from_wire(claim.items[0], msg, claim.request_id)
    assert built.weight_version == 4
    assert [c.weight_versions for c in built.completions] == [[4, 5], [5]]
    q.deliver(claim.request_id, built)
    q.finish(claim.request_id)
    if staleness == 0:
        assert q.counts["stale_dropped"] == 1 and q.outstanding() == 1
    else:
        assert q.counts["stale_dropped"] == 0
        (taken,) = q.take(TRAIN, 1).groups
        assert taken.weight_version == 4 and taken.item.uid == "p0#0"


def test_dynamic_sampling_filters_flat_groups_and_reports_the_shortfall():
    q = queue(filter_zero_variance=True)
    q.add(items(3))
    claim = q.claim("s0", 0, capacity=8)
    serve(q, claim, only={"p0#0", "p2#2"})
    q.deliver(claim.request_id, group(claim.items[1], rewards=(1.0, 1.0)))  # all correct
    q.finish(claim.request_id)
    assert q.take(TRAIN, 3).shortfall == 1  # the loop must draw one more
    events = q.drain_events()
    assert [g.item.uid for g in events.filtered] == ["p1#1"]
    assert q.counts["zero_variance_filtered"] == 1
    q.add(items(1, start=3))  # the replacement
    refill = q.claim("s0", 0, capacity=8)
    serve(q, refill)
    q.finish(refill.request_id)
    assert [g.item.uid for g in q.take(TRAIN, 3).groups] == ["p0#0", "p2#2", "p3#3"]
    assert q.drain_events().filtered == []  # drained once


def test_a_prompt_refused_twice_is_dropped_not_redispatched_forever():
    q = queue()
    q.add(items(3))
    claim = q.claim("s0", 0, capacity=8)
    q.finish(claim.request_id, Failure("INVALID_ARGUMENT: prompts[1]: too long", refused=True))
    # Each prompt is retried alone, so the bad one cannot take the others down again.
    singles = [q.claim("s0", 0, capacity=8) for _ in range(3)]
    assert [[i.uid for i in c.items] for c in singles] == [["p0#0"], ["p1#1"], ["p2#2"]]
    serve(q, singles[0])
    q.finish(singles[0].request_id)
    q.finish(singles[1].request_id, Failure("INVALID_ARGUMENT: too long", refused=True))
    serve(q, singles[2])
    q.finish(singles[2].request_id)
    dropped = q.drain_events().dropped
    assert [(i.uid, why) for i, why in dropped] == [("p1#1", "INVALID_ARGUMENT: too long")]
    assert q.counts["dropped_refused"] == 1
    assert q.take(TRAIN, 3).shortfall == 1
    assert [g.item.uid for g in q.take(TRAIN, 2).groups] == ["p0#0", "p2#2"]


def test_reproducible_units_are_fixed_in_draw_order_and_all_or_nothing():
    q = queue(request_size=2)
    q.add(items(5))
    # Whatever the sampler's capacity or how many samplers there are: units of 2, in order.
    sizes = []
    claims = []
    for sampler, ready in (("s0", 1), ("s1", 2), ("s0", 7)):
        claim = q.claim(sampler, 0, capacity=64, ready_samplers=ready)
        claims.append(claim)
        sizes.append([i.uid for i in claim.items])
    assert sizes == [["p0#0", "p1#1"], ["p2#2", "p3#3"], ["p4#4"]]
    # A unit's groups are accepted only when the whole request succeeded ...
    serve(q, claims[0], only={"p0#0"})
    with pytest.raises(TimeoutError):  # held with its request, not buffered
        q.take(TRAIN, 1, timeout_s=0)
    lost = q.finish(claims[0].request_id, Failure("UNAVAILABLE"))
    assert [i.uid for i in lost] == ["p0#0", "p1#1"]  # ... else the whole unit goes again
    again = q.claim("s1", 0, capacity=64)
    assert [i.uid for i in again.items] == ["p0#0", "p1#1"]
    for claim in (again, claims[1], claims[2]):
        serve(q, claim)
        q.finish(claim.request_id)
    assert [g.item.seq for g in q.take(TRAIN, 5).groups] == [0, 1, 2, 3, 4]


def test_reproducible_units_wait_for_a_sampler_with_room():
    q = queue(request_size=3, group_size=4)
    q.add(items(6))
    first = q.claim("s0", 0, capacity=16)  # 4 prompts fit: a unit of 3
    assert len(first.items) == 3
    assert q.claim("s0", 0, capacity=16) is None  # 1 free slot: the next unit waits
    assert len(q.claim("s1", 0, capacity=4).items) == 3  # an idle sampler takes it anyway


def test_checkpoint_snapshot_holds_queued_inflight_and_buffered_items_once():
    q = queue()
    q.add(items(6))
    busy = q.claim("s0", 0, capacity=4)  # 2 in flight
    done = q.claim("s1", 0, capacity=4)  # 2 buffered
    serve(q, done)
    q.finish(done.request_id)
    q.take(TRAIN, 1)  # p2 trained: not unfinished any more
    unfinished = q.unfinished(TRAIN)
    assert [i.uid for i in unfinished] == ["p0#0", "p1#1", "p3#3", "p4#4", "p5#5"]
    assert busy.request_id  # still in flight, and in the snapshot
    restored = RolloutQueue([q.lane(TRAIN), q.lane(EVAL)])
    restored.add([WorkItem.from_json(i.to_json()) for i in unfinished])
    assert restored.outstanding() == 5 and restored.unfinished()[0].seq == 0


def test_a_group_taken_before_its_request_ends_is_not_in_the_snapshot():
    # An adaptive lane buffers each group as it arrives: the first of a request's groups can be
    # trained while the sampler still streams the rest. A checkpoint then must not list it as
    # unfinished (a resume would train it twice), nor count it as outstanding.
    q = queue(staleness=1)
    q.add(items(3))
    claim = q.claim("s0", 0, capacity=8)
    assert len(claim.items) == 3
    serve(q, claim, only={"p0#0"})
    assert [g.item.uid for g in q.take(TRAIN, 1).groups] == ["p0#0"]
    assert [i.uid for i in q.unfinished(TRAIN)] == ["p1#1", "p2#2"]
    assert q.outstanding() == 2 and q.inflight_by_sampler() == {"s0": 2}
    serve(q, claim, only={"p1#1", "p2#2"})
    q.finish(claim.request_id)
    assert q.outstanding() == 2 and q.inflight_by_sampler() == {}


def test_evaluation_goes_first_and_needs_the_current_version():
    q = queue(staleness=2)
    q.set_version(3)
    q.add(items(2))
    q.add(items(3, lane=EVAL))
    stale = q.claim("s0", 1, capacity=8)
    assert stale.lane.name == TRAIN  # version 1 may serve training (3 - 2), not evaluation
    fresh = q.claim("s1", 3, capacity=8)
    assert fresh.lane.name == EVAL and len(fresh.items) == 3
    assert fresh.lane.group_size == 1 and fresh.min_version == 3


def test_take_waits_for_deliveries_and_stops_on_request():
    q = queue()
    q.add(items(1))
    claim = q.claim("s0", 0, capacity=8)
    waiting = threading.Event()
    result = {}

    def consumer():
        waiting.set()
        result["groups"] = q.take(TRAIN, 1, timeout_s=60).groups

    thread = threading.Thread(target=consumer)
    thread.start()
    waiting.wait(10)
    serve(q, claim)
    q.finish(claim.request_id)
    thread.join(60)
    assert [g.item.uid for g in result["groups"]] == ["p0#0"]

    q.add(items(1, start=1))
    stop = threading.Event()
    stop.set()
    with pytest.raises(InterruptedError):
        q.take(TRAIN, 1, stop=stop)
    with pytest.raises(TimeoutError, match="waited"):
        q.take(TRAIN, 1, timeout_s=0)


def test_item_seeds_depend_on_run_seed_and_uid_only():
    assert item_seed(0, "p1#7") == item_seed(0, "p1#7")
    assert len({item_seed(0, f"p#{i}") for i in range(1000)}) == 1000
    assert item_seed(1, "p1#7") != item_seed(0, "p1#7")
    assert 0 <= item_seed(123, "x") < 1 << 63


def test_an_evaluation_mid_run_drains_only_its_own_lanes_events():
    q = queue(filter_zero_variance=True)
    q.add(items(2))
    claim = q.claim("s0", 0, capacity=8)
    q.deliver(claim.request_id, group(claim.items[0], rewards=(1.0, 1.0)))  # filtered
    serve(q, claim, only={"p1#1"})
    q.finish(claim.request_id)
    q.add(items(1, start=5, lane=EVAL))
    evaluation = q.claim("s0", 0, capacity=8)
    q.finish(evaluation.request_id, Failure("INVALID_ARGUMENT: bad", refused=True))
    retry = q.claim("s0", 0, capacity=8)
    q.finish(retry.request_id, Failure("INVALID_ARGUMENT: bad", refused=True))
    assert [i.uid for i, _ in q.drain_events(EVAL).dropped] == ["p5#5"]
    train = q.drain_events(TRAIN)  # the train lane's filtered group is still there for it
    assert [g.item.uid for g in train.filtered] == ["p0#0"] and train.dropped == []
    assert q.drain_events().filtered == []


def claim_all(q, capacity=64):
    claims = []
    while (claim := q.claim("s0", 0, capacity=capacity)) is not None:
        claims.append(claim)
    return claims


def test_a_reproducible_shortfall_waits_until_nothing_is_queued_or_in_flight():
    # How many replacements are drawn, and so how they are cut into requests, must not depend
    # on which request finished first: one shortfall for the whole round, not one per request.
    q = queue(request_size=2, filter_zero_variance=True)
    q.add(items(4))
    first, second = claim_all(q)
    q.deliver(first.request_id, group(first.items[0], rewards=(0.0, 0.0)))  # flat
    q.deliver(first.request_id, group(first.items[1]))
    q.finish(first.request_id)
    with pytest.raises(TimeoutError):  # an adaptive lane would say "1 short" here
        q.take(TRAIN, 4, timeout_s=0)
    q.deliver(second.request_id, group(second.items[0]))
    q.deliver(second.request_id, group(second.items[1], rewards=(1.0, 1.0)))  # flat
    q.finish(second.request_id)
    assert q.take(TRAIN, 4).shortfall == 2


def test_the_snapshot_keeps_undrained_filtered_and_dropped_items():
    # Filtered or dropped but not yet drained by the run loop means in no audit record yet:
    # a checkpoint taken now must list them, or a resume would lose them.
    q = queue(request_size=2, filter_zero_variance=True)
    q.add(items(4))
    flat, refused = claim_all(q)
    serve(q, flat, rewards=(0.0, 0.0))
    q.finish(flat.request_id)
    q.finish(refused.request_id, Failure("INVALID_ARGUMENT: bad", refused=True))
    for single in claim_all(q):
        q.finish(single.request_id, Failure("INVALID_ARGUMENT: bad", refused=True))
    assert [i.uid for i in q.unfinished(TRAIN)] == ["p0#0", "p1#1", "p2#2", "p3#3"]
    # Nor does the loop draw replacements for them ahead of the shortfall take reports: how
    # far filtering had got when it looked would decide which prompts go out together.
    assert q.outstanding(TRAIN) == 4
    events = q.drain_events(TRAIN)
    assert len(events.filtered) == 2 and len(events.dropped) == 2
    assert q.unfinished(TRAIN) == [] and q.outstanding(TRAIN) == 0


def test_a_restored_snapshot_sends_the_same_requests():
    # Units of 2 for a step, then refills of 1 and of 2 (dynamic sampling): a restore that cut
    # the saved items afresh would send [4, 5] and [6] instead of [4] and [5, 6].
    q = queue(request_size=2)
    q.add(items(4))
    q.add(items(1, start=4))
    q.add(items(2, start=5))
    before = [[i.seq for i in c.items] for c in claim_all(q)]
    assert before == [[0, 1], [2, 3], [4], [5, 6]]
    saved = [WorkItem.from_json(i.to_json()) for i in q.unfinished(TRAIN)]
    restored = RolloutQueue([q.lane(TRAIN), q.lane(EVAL)])
    restored.add(saved)
    assert [[i.seq for i in c.items] for c in claim_all(restored)] == before
