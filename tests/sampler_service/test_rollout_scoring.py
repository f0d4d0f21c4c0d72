"""How a Rollout batches finished groups into Score calls (``RolloutWorker._scored_as_finished``).

The engine's events go through the same queue the real request uses; only the scoring itself is
replaced by a recorder (the reward service is the subject of other tests)."""

from __future__ import annotations

import queue
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from sampler_service.requests import FinishedGroup, GeneratedSequence
from sampler_service.rollout import RequestError, RewardClient, RolloutWorker
from splitrl.error_cause import Cause
from splitrl.v1 import sampler_pb2


class RecordingWorker(RolloutWorker):
    """The worker's streaming logic, with a scorer that records which groups each call got."""

    def __init__(self):  # none of the engine, weights or tokenizer is needed here
        self._scorer = ThreadPoolExecutor(1)
        self.calls: list[list[int]] = []

    def _score_groups(self, request, prompts, finished):
        self.calls.append([g.index for g in finished])
        return [sampler_pb2.ScoredGroup(prompt_id=str(g.index)) for g in finished]


def finished(index: int) -> FinishedGroup:
    return FinishedGroup(index, [GeneratedSequence([1, 2], [-0.1, -0.2], "length", (0,))],
                         queue_s=0.0, generate_s=0.01)


def test_groups_that_finish_together_are_scored_in_one_call():
    worker = RecordingWorker()
    events = queue.SimpleQueue()
    for i in range(4):  # one decode segment finishes every group of the request
        events.put(finished(i))
    events.put(None)
    out = list(worker._scored_as_finished(None, [object()] * 4, events))
    assert [g.prompt_id for g in out] == ["0", "1", "2", "3"]
    assert worker.calls == [[0, 1, 2, 3]]


def test_an_engine_that_stops_before_the_groups_finish_is_unavailable():
    worker = RecordingWorker()
    events = queue.SimpleQueue()
    events.put(finished(0))
    events.put(None)
    with pytest.raises(RequestError) as e:
        list(worker._scored_as_finished(None, [object()] * 2, events))
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert worker.calls == [[0]]


def test_a_reward_service_that_is_not_there_is_a_typed_outage():
    # The trainer pauses dispatching on this cause rather than blame the sampler; it travels
    # as a field (splitrl.error_cause), the message only says it to people.
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    client = RewardClient(address, timeout_s=2.0, connect_timeout_s=2.0)
    try:
        with pytest.raises(RequestError) as e:
            client.check_reachable()
    finally:
        client.close()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert e.value.cause is Cause.REWARD_UNAVAILABLE


def test_score_calls_go_round_robin_over_reward_replicas():
    """Reward replicas behind one name (compose --scale, a headless Service) share the calls:
    here two real servers, one target naming both addresses as a DNS answer would."""
    from splitrl.serving import start_server
    from splitrl.v1 import reward_pb2, reward_pb2_grpc

    class Replica(reward_pb2_grpc.RewardServicer):
        def __init__(self):
            self.calls = 0

        def Score(self, request, context):
            self.calls += 1
            return reward_pb2.ScoreReply(scores=[reward_pb2.ItemScore(item_id=i.item_id)
                                                 for i in request.items])

    replicas = [Replica(), Replica()]
    servers = [start_server(lambda s, r=r: reward_pb2_grpc.add_RewardServicer_to_server(r, s),
                            "127.0.0.1:0", service_names=["splitrl.v1.Reward"])
               for r in replicas]
    client = RewardClient(f"ipv4:{','.join(s.address for s in servers)}", timeout_s=10)
    try:
        # Round-robin over the replicas as each connection becomes ready (gRPC's default,
        # pick-first, would send every call to one of them).
        for _ in range(200):
            client.score([reward_pb2.ScoreItem(item_id="a")], [])
            if all(r.calls for r in replicas):
                break
            time.sleep(0.05)
        assert all(r.calls for r in replicas), [r.calls for r in replicas]
    finally:
        client.close()
        for s in servers:
            s.stop(0)
