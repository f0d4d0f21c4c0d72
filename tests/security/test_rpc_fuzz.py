"""Fuzz every RPC of the three services (read from the descriptors) against real processes.

Three batches per RPC: Hypothesis-generated messages (any field set to anything its type
allows); a valid request with a few fields anywhere in it replaced (or, for the weight push,
a valid stream with some messages changed, dropped, doubled or moved), which reaches the deeper
checks; and damaged serializations (flipped, inserted, deleted bytes; cuts; noise), all sent
through a raw channel. Every call carries the token, so it reaches the handler. Whatever the
input, the answer must be a deliberate status: never INTERNAL or UNKNOWN (a handler that did
not expect it), never UNAVAILABLE (a server that died). After each batch the server must still
pass the standard health check and answer one valid request.

Bounded: ``SPLITRL_FUZZ_EXAMPLES`` examples per batch (default 30), each call with a deadline.
The examples are derandomized (the same every run, as CI needs); set ``SPLITRL_FUZZ_SEED`` to
explore others.
"""

from __future__ import annotations

import os
from collections import Counter
from operator import methodcaller

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from proto_strategies import field_mutated, messages, mutated_bytes, stream_mutated
from rpc_catalog import call_raw, splitrl_rpcs
from services import AUTH

from splitrl import wire
from splitrl.serving import check_health, make_channel
from splitrl.v1 import (
    common_pb2,
    reward_pb2,
    sampler_pb2,
    sampler_pb2_grpc,
    trainer_pb2,
)

EXAMPLES = int(os.environ.get("SPLITRL_FUZZ_EXAMPLES", "30"))
SEED = os.environ.get("SPLITRL_FUZZ_SEED")
CALL_TIMEOUT_S = 60.0
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE,
       grpc.StatusCode.UNAUTHENTICATED}
KINDS = ["messages", "fields", "bytes"]


def _prompt(**kw) -> common_pb2.Prompt:
    return common_pb2.Prompt(prompt_id="p", text="1+2=", reference="3", **kw)


# One valid request per RPC, as the services' real clients send them: the start of the "fields"
# and "bytes" batches. The weight push is built per batch (a reset to version 1: the run's
# trainer.steps bounds the versions a sampler accepts). After each batch, AFTER_BATCH's request
# to that server must succeed.
VALID = {
    "splitrl.v1.Sampler/GetInfo": sampler_pb2.GetInfoRequest(include_digests=True),
    "splitrl.v1.Sampler/Rollout": sampler_pb2.RolloutRequest(
        request_id="r", prompts=[_prompt(metadata={"k": "v"})], group_size=2,
        sampling=common_pb2.SamplingParams(temperature=0.7, top_k=4, top_p=0.9,
                                           max_new_tokens=2, seed=1, has_seed=True)),
    "splitrl.v1.Sampler/Generate": sampler_pb2.GenerateRequest(
        prompts=[_prompt(), common_pb2.Prompt(prompt_id="q", token_ids=[3, 4, 5])],
        sampling=common_pb2.SamplingParams(temperature=1.0, max_new_tokens=2), n=2),
    "splitrl.v1.Reward/Score": reward_pb2.ScoreRequest(
        items=[reward_pb2.ScoreItem(item_id="i", prompt="1+2=", completion="3", reference="3",
                                    completion_tokens=1, metadata={"k": "v"})],
        functions=["exact_answer"]),
    "splitrl.v1.Reward/ListRewardFunctions": reward_pb2.ListRewardFunctionsRequest(),
    "splitrl.v1.Trainer/Status": trainer_pb2.StatusRequest(),
    "splitrl.v1.Trainer/RegisterSampler": trainer_pb2.RegisterSamplerRequest(
        sampler_id="fuzz", address="127.0.0.1:9"),
    "splitrl.v1.Trainer/Heartbeat": trainer_pb2.HeartbeatRequest(
        sampler_id="fuzz", address="127.0.0.1:9", weight_version=0),
}
PUSH = "splitrl.v1.Sampler/PushWeights"
AFTER_BATCH = {"sampler": "splitrl.v1.Sampler/Generate", "reward": "splitrl.v1.Reward/Score",
               "trainer": "splitrl.v1.Trainer/Status"}


class WeightPush:
    """Valid PushWeights streams for the sampler under test: random weights of its model."""

    def __init__(self, channel: grpc.Channel):
        self.stub = sampler_pb2_grpc.SamplerStub(channel)
        self.info = self.stub.GetInfo(sampler_pb2.GetInfoRequest(), timeout=30)
        rng = np.random.default_rng(0)
        self.params = {p.name: (0.02 * rng.standard_normal(tuple(p.shape))).astype(p.dtype)
                       for p in self.info.params}

    def messages(self) -> list[sampler_pb2.WeightPushMessage]:
        return list(wire.iter_push_messages(
            self.params, 1, max_chunk_bytes=self.info.max_chunk_bytes,
            target_shardings=wire.layouts_from_info(self.info), sender="fuzz", reset=True))


def _valid(rpc, pushes: WeightPush):
    return pushes.messages() if rpc.name == PUSH else VALID[rpc.name]


def _payloads(rpc, kind: str, valid) -> st.SearchStrategy:
    descriptor = rpc.method.input_type
    serialize = methodcaller("SerializeToString")
    if rpc.method.client_streaming:
        if kind == "messages":
            return st.lists(messages(descriptor).map(serialize), max_size=5)
        if kind == "fields":
            return stream_mutated(valid).map(lambda stream: [m.SerializeToString()
                                                             for m in stream])
        seeds = [m.SerializeToString() for m in valid]
        return st.lists(st.one_of(st.sampled_from(seeds), mutated_bytes(descriptor)),
                        min_size=1, max_size=len(seeds) + 2)
    if kind == "messages":
        return messages(descriptor).map(serialize)
    if kind == "fields":
        return field_mutated(valid).map(serialize)
    return mutated_bytes(descriptor, valid.SerializeToString())


@pytest.fixture(scope="module")
def channels(services):
    opened = {name: make_channel(s.address, auth=AUTH) for name, s in services.items()}
    yield opened
    for channel in opened.values():
        channel.close()


@pytest.fixture(scope="module")
def pushes(channels):
    return WeightPush(channels["sampler"])


def test_every_rpc_has_a_valid_request_to_start_from():
    assert {r.name for r in splitrl_rpcs()} == set(VALID) | {PUSH}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rpc", splitrl_rpcs(), ids=lambda r: f"{r.server}:{r.name}")
def test_fuzzed_requests_get_deliberate_answers_and_the_server_stays_healthy(
        services, channels, pushes, rpc, kind):
    service, channel = services[rpc.server], channels[rpc.server]
    codes: Counter[str] = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=SEED is None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(payload=_payloads(rpc, kind, _valid(rpc, pushes)))
    def one_call(payload):
        code, details = call_raw(channel, rpc, payload, timeout_s=CALL_TIMEOUT_S)
        codes[code.name] += 1
        assert code not in BAD, (f"{rpc} answered {code.name}: {details}\n"
                                 f"--- {service.name} log ---\n{service.tail()}")

    if SEED is not None:
        one_call = seed(int(SEED))(one_call)
    one_call()
    assert service.proc.poll() is None, service.tail()
    assert check_health(service.address, timeout_s=5, auth=AUTH)
    check = next(r for r in splitrl_rpcs() if r.name == AFTER_BATCH[rpc.server])
    code, details = call_raw(channel, check, VALID[check.name].SerializeToString(),
                             timeout_s=CALL_TIMEOUT_S)
    assert code == grpc.StatusCode.OK, f"after {rpc}: {check} got {code.name}: {details}"
    print(f"{rpc} {kind}: {sum(codes.values())} calls, {dict(codes)}")
