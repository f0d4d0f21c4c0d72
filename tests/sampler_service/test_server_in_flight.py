"""In-flight weight updates over real gRPC: a sampler with ``sampler.update_in_flight=true``
applies a push between the tokens of a running generation, and its completions say so.

The push carries the weights the sampler already serves under a new version, so greedy tokens
do not change and the test can compare them with a run before the push; the generation is
400 tokens long, decoded one token per segment (a boundary after every token), and the push
is released only once the metrics show it in flight. A first push (version 1) before that one
compiles the push path (finiteness checks), so the held push (version 2) lands within a few
segments of its release instead of racing the generation's end.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import numpy as np
import pytest
import yaml
from flax import nnx
from sampler_helpers import SamplerProcess
from test_server import FakeReward

from splitrl import wire
from splitrl.serving import make_channel, start_server
from splitrl.v1 import common_pb2, reward_pb2_grpc, sampler_pb2, sampler_pb2_grpc

LONG = 400


@pytest.fixture(scope="module")
def sampler(tmp_path_factory, arith_model):
    reward = start_server(lambda s: reward_pb2_grpc.add_RewardServicer_to_server(FakeReward(), s),
                          "127.0.0.1:0", service_names=["splitrl.v1.Reward"])
    cfg = {
        "run_name": "test-in-flight",
        "model": {"path": str(arith_model)},
        "sampler": {"max_batch_size": 4, "max_sequence_length": LONG + 24, "segment_steps": 1,
                    "update_in_flight": True, "register_with_trainer": False,
                    "mesh": {"axes": {"tensor": 1}, "strategy": "tp"}},
        "services": {"host": "127.0.0.1", "sampler_port": 0, "metrics_port": 0,
                     "reward_address": reward.address},
    }
    path = tmp_path_factory.mktemp("cfg") / "sampler.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = SamplerProcess(path, devices=1)
    channel = make_channel(proc.address)
    yield proc, sampler_pb2_grpc.SamplerStub(channel)
    channel.close()
    assert proc.stop() == 0, proc.log_path.read_text()[-3000:]
    reward.stop(0)


def _metric(proc, name: str) -> float:
    port = proc.listening["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def _same_weights_as(arith_model, info, version):
    from splitrl.models import from_pretrained, hf_from_state

    params = {n: np.asarray(a) for n, a in
              hf_from_state(nnx.state(from_pretrained(arith_model))).items()}
    return list(wire.iter_push_messages(params, version, max_chunk_bytes=info.max_chunk_bytes,
                                        target_shardings=wire.layouts_from_info(info),
                                        sender="pytest"))


def test_completions_spanning_a_push_carry_both_versions(sampler, arith_model):
    proc, stub = sampler
    info = stub.GetInfo(sampler_pb2.GetInfoRequest())
    assert stub.PushWeights(iter(_same_weights_as(arith_model, info, 1)), timeout=300).version == 1
    prompt = common_pb2.Prompt(prompt_id="p", text="1+2=", reference="3")
    greedy = common_pb2.SamplingParams(greedy=True, max_new_tokens=LONG)
    request = sampler_pb2.GenerateRequest(prompts=[prompt], sampling=greedy, n=2)
    before = stub.Generate(request, timeout=300)
    assert before.weight_version == 1
    for c in before.outputs[0].completions:
        assert c.finish_reason == "length" and list(c.weight_versions) == [1]

    messages = _same_weights_as(arith_model, info, 2)
    resume, pushed, generated = threading.Event(), [], []

    def held_push():
        yield messages[0]
        resume.wait(120)
        yield from messages[1:]

    pusher = threading.Thread(target=lambda: pushed.append(stub.PushWeights(held_push(),
                                                                            timeout=300)))
    generator = threading.Thread(target=lambda: generated.append(stub.Generate(request,
                                                                               timeout=300)))
    pusher.start()
    generator.start()
    deadline = time.monotonic() + 120
    while _metric(proc, "splitrl_sampler_active_sequences") < 2:
        assert time.monotonic() < deadline, "the generation never started"
        time.sleep(0.02)
    resume.set()
    pusher.join(120)
    assert pushed and pushed[0].version == 2
    generator.join(300)
    (reply,) = generated
    assert reply.weight_version == 1  # the oldest version any of its tokens came from
    for got, want in zip(reply.outputs[0].completions, before.outputs[0].completions,
                         strict=True):
        assert list(got.weight_versions) == [1, 2]
        assert list(got.token_ids) == list(want.token_ids)  # same weights, new version

    rollout = sampler_pb2.RolloutRequest(
        request_id="after", group_size=2, min_version=2, prompts=[prompt],
        sampling=common_pb2.SamplingParams(temperature=1.0, max_new_tokens=8, has_seed=True,
                                           seed=3))
    (group,) = list(stub.Rollout(rollout, timeout=300))
    assert group.weight_version == 2
    assert all(list(c.weight_versions) == [2] for c in group.completions)
