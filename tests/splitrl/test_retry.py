"""One place for retries: gRPC's own retry policy on every channel, and wait_until."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from splitrl.retry import wait_until
from splitrl.serving import make_channel
from splitrl.v1 import reward_pb2, reward_pb2_grpc, sampler_pb2, sampler_pb2_grpc


class _FlakyReward(reward_pb2_grpc.RewardServicer):
    """Fails the first call (restarting, or busy with other calls), then answers."""

    def __init__(self):
        self.calls = []
        self.first = grpc.StatusCode.UNAVAILABLE

    def ListRewardFunctions(self, request, context):
        self.calls.append("ListRewardFunctions")
        if len(self.calls) == 1:
            context.abort(self.first, "restarting or busy")
        return reward_pb2.ListRewardFunctionsReply()


class _FlakySampler(sampler_pb2_grpc.SamplerServicer):
    def __init__(self):
        self.calls = 0

    def Generate(self, request, context):
        self.calls += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "busy")


@pytest.fixture()
def server():
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    reward, sampler = _FlakyReward(), _FlakySampler()
    reward_pb2_grpc.add_RewardServicer_to_server(reward, srv)
    sampler_pb2_grpc.add_SamplerServicer_to_server(sampler, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}", reward, sampler
    srv.stop(None)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_an_idempotent_call_that_meets_unavailable_or_busy_is_retried_by_grpc(server, code):
    address, reward, _ = server
    reward.first = code
    with make_channel(address) as channel:
        reward_pb2_grpc.RewardStub(channel).ListRewardFunctions(
            reward_pb2.ListRewardFunctionsRequest(), timeout=10)
    assert reward.calls == ["ListRewardFunctions"] * 2


def test_generation_is_not_retried_behind_the_callers_back(server):
    address, _, sampler = server
    with make_channel(address) as channel, pytest.raises(grpc.RpcError) as e:
        sampler_pb2_grpc.SamplerStub(channel).Generate(sampler_pb2.GenerateRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and sampler.calls == 1


def test_wait_until_returns_the_value_times_out_naming_it_and_stops():
    values = iter([0, [], "ready"])
    assert wait_until(lambda: next(values), timeout_s=5, interval_s=0.01, what="x") == "ready"
    with pytest.raises(TimeoutError, match="the moon: not within 0s"):
        wait_until(lambda: False, timeout_s=0, interval_s=0.01, what="the moon")
    stop = threading.Event()
    stop.set()
    with pytest.raises(InterruptedError, match="stopped while waiting: y"):
        wait_until(lambda: False, timeout_s=5, stop=stop, what="y")

    def gone():
        raise RuntimeError("the process exited")

    with pytest.raises(RuntimeError, match="exited"):
        wait_until(lambda: True, timeout_s=5, check=gone, what="z")
