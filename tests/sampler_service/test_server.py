"""The sampler over real gRPC on 127.0.0.1, in its own process with 2 emulated devices (tp).

One sampler process serves the whole module (its start-up and first compile dominate the
cost); tests run in file order and each states the weight version it expects. A fake reward
service runs in the test process.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
import yaml
from sampler_helpers import HERE, SamplerProcess, subprocess_env

from splitrl import wire
from splitrl.config import AuthConfig
from splitrl.error_cause import Cause, cause_of
from splitrl.serving import check_health, make_channel, start_server
from splitrl.v1 import (
    common_pb2,
    reward_pb2,
    reward_pb2_grpc,
    sampler_pb2,
    sampler_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

MAX_CHUNK = 16 * 1024
TOKEN = "s3cret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


class FakeReward(reward_pb2_grpc.RewardServicer):
    """Scores a completion by its length in characters; counts calls."""

    def __init__(self):
        self.calls = 0
        self.items = []

    def Score(self, request, context):
        self.calls += 1
        self.items.extend(request.items)
        out = []
        for item in request.items:
            length = float(len(item.completion))
            out.append(reward_pb2.ItemScore(item_id=item.item_id, scores={"length": length},
                                            total=0.5 * length, reasons={"length": "ok"}))
        return reward_pb2.ScoreReply(scores=out)


@pytest.fixture(scope="module")
def reward():
    servicer = FakeReward()
    server = start_server(lambda s: reward_pb2_grpc.add_RewardServicer_to_server(servicer, s),
                          "127.0.0.1:0", service_names=["splitrl.v1.Reward"])
    yield server, servicer
    server.stop(0)


class FakeTrainer(trainer_pb2_grpc.TrainerServicer):
    """Records RegisterSampler and Heartbeat calls."""

    def __init__(self):
        self.registered, self.heartbeats = [], []

    def RegisterSampler(self, request, context):
        self.registered.append((request.sampler_id, request.address))
        return trainer_pb2.RegisterSamplerReply(accepted=True, heartbeat_interval_s=0.2)

    def Heartbeat(self, request, context):
        self.heartbeats.append(request.weight_version)
        return trainer_pb2.HeartbeatReply(known=True)


@pytest.fixture(scope="module")
def trainer():
    servicer = FakeTrainer()
    server = start_server(lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, s),
                          "127.0.0.1:0", service_names=["splitrl.v1.Trainer"])
    yield server, servicer
    server.stop(0)


@pytest.fixture(scope="module")
def sampler(tmp_path_factory, arith_model, reward, trainer):
    cfg = {
        "run_name": "test-sampler",
        "model": {"path": str(arith_model)},
        "sampling": {"max_new_tokens": 6},
        "sampler": {"max_batch_size": 8, "max_sequence_length": 48,
                    "max_chunk_bytes": MAX_CHUNK, "sampler_id": "sampler-under-test",
                    "mesh": {"axes": {"tensor": 2}, "strategy": "tp"}, "http_port": 0,
                    "served_model_name": "tiny-arith"},
        "services": {"host": "127.0.0.1", "sampler_port": 0, "metrics_port": 0,
                     "reward_address": reward[0].address, "auth": {"token": TOKEN},
                     "trainer_address": trainer[0].address, "heartbeat_s": 0.2},
    }
    path = tmp_path_factory.mktemp("cfg") / "sampler.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = SamplerProcess(path, devices=2)
    channel = make_channel(proc.address, auth=AuthConfig(token=TOKEN))
    yield proc, sampler_pb2_grpc.SamplerStub(channel)
    channel.close()
    assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


def _info(stub, digests=True) -> sampler_pb2.SamplerInfo:
    return stub.GetInfo(sampler_pb2.GetInfoRequest(include_digests=digests), timeout=30)


def _served(stub):
    info = _info(stub)
    return info.weight_version, {p.name: p.digest for p in info.params}


def _random_params(info, seed):
    rng = np.random.default_rng(seed)
    return {p.name: rng.standard_normal(tuple(p.shape)).astype(wire.numpy_dtype(p.dtype))
            for p in info.params}


def _push_messages(info, params, version):
    return list(wire.iter_push_messages(params, version, max_chunk_bytes=info.max_chunk_bytes,
                                        target_shardings=wire.layouts_from_info(info),
                                        sender="pytest"))


def _prompts():
    """A text, a token-id and a chat prompt (also the shapes Rollout uses: one compile)."""
    return [common_pb2.Prompt(prompt_id="a", text="1+2=", reference="3", metadata={"task": "add"},
                              columns_json='{"level": 2}'),
            common_pb2.Prompt(prompt_id="b", token_ids=[5, 6, 7], reference="x"),
            common_pb2.Prompt(prompt_id="c", messages=[
                common_pb2.ChatMessage(role="user", content="2+2=")])]


SAMPLING = common_pb2.SamplingParams(temperature=1.0, has_seed=True, seed=7)


def _generate(stub):
    request = sampler_pb2.GenerateRequest(prompts=_prompts(), sampling=SAMPLING, n=2)
    return stub.Generate(request, timeout=120)


def test_getinfo_reports_the_tensor_parallel_layout_on_two_devices(sampler):
    _, stub = sampler
    info = _info(stub, digests=False)
    assert info.sampler_id == "sampler-under-test"
    assert list(info.mesh.axis_names) == ["tensor"] and list(info.mesh.axis_sizes) == [2]
    assert info.mesh.device_count == 2 and info.weight_version == 0
    assert info.max_chunk_bytes == MAX_CHUNK and info.max_batch_size == 8
    assert info.model_fingerprint.startswith("sha256:") and info.architecture
    assert json.loads(info.model_config_json)["architectures"] == [info.architecture]
    split = [p.name for p in info.params if "tensor" in p.partition]
    assert split, "tp strategy should split some parameters over the tensor axis"
    assert all(p.digest == "" for p in info.params)


def test_push_from_a_four_device_fsdp_sender_is_bitwise_equal_with_the_samplers_layout(
        sampler, arith_model):
    proc, stub = sampler
    before = {p.name: list(p.partition) for p in _info(stub, digests=False).params}
    out = subprocess.run(
        [sys.executable, str(HERE / "sampler_helpers.py"), "push", proc.address, str(arith_model),
         "1", "11", TOKEN], env=subprocess_env(4), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    sent = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\npush figures: {sent['bytes']} bytes in {sent['chunks']} chunks "
          f"({sent['region_chunks']} region chunks), client {sent['seconds']:.3f} s, "
          f"server {sent['server_seconds']:.3f} s, swap {sent['swap_seconds'] * 1e6:.0f} us")
    assert sent["version"] == 1 and sent["devices"] == 4
    assert any("fsdp" in p for p in sent["sender_partitions"].values())
    assert sent["region_chunks"] > 0
    info = _info(stub)
    assert info.weight_version == 1
    served = {p.name: p.digest for p in info.params}
    assert served == sent["digests"]
    assert {p.name: list(p.partition) for p in info.params} == before
    assert before != sent["sender_partitions"]


def test_bad_pushes_each_get_their_own_error_and_leave_the_weights_serving(sampler):
    _, stub = sampler
    info = _info(stub, digests=False)
    version, digests = _served(stub)
    assert version == 1
    params = _random_params(info, seed=3)

    def rejected(messages, code, *fragments):
        with pytest.raises(grpc.RpcError) as e:
            stub.PushWeights(iter(messages), timeout=60, metadata=AUTH)
        assert e.value.code() == code, e.value.details()
        for fragment in fragments:
            assert fragment in e.value.details(), e.value.details()
        assert _served(stub) == (version, digests)

    msgs = _push_messages(info, params, 2)
    victim = msgs[len(msgs) // 2].chunk
    victim.data = bytes([victim.data[0] ^ 0xFF]) + victim.data[1:]
    rejected(msgs, grpc.StatusCode.DATA_LOSS, victim.name, "checksum")

    msgs = _push_messages(info, params, 2)
    msgs[1].chunk.shape[0] += 1
    rejected(msgs, grpc.StatusCode.INVALID_ARGUMENT, msgs[1].chunk.name, "shape is")

    msgs = _push_messages(info, params, 2)
    msgs[1].chunk.name = "model.layers.7.mlp.up_proj.weight"
    rejected(msgs, grpc.StatusCode.INVALID_ARGUMENT, "unknown parameter name",
             "'model.layers.7.mlp.up_proj.weight'")

    rejected(_push_messages(info, params, 1), grpc.StatusCode.FAILED_PRECONDITION,
             "version 1 is not newer than the serving version 1")

    msgs = _push_messages(info, params, 2)
    rejected(msgs[:-3], grpc.StatusCode.INVALID_ARGUMENT, "incomplete push")

    big = list(wire.iter_push_messages(params, 2, max_chunk_bytes=4 * MAX_CHUNK))
    rejected(big, grpc.StatusCode.RESOURCE_EXHAUSTED, f"max_chunk_bytes {MAX_CHUNK}")


def test_generate_keeps_answering_while_a_push_is_in_progress(sampler):
    _, stub = sampler
    warm = _generate(stub)
    assert warm.weight_version == 1 and len(warm.outputs[0].completions) == 2
    info = _info(stub, digests=False)
    params = _random_params(info, seed=5)
    msgs = _push_messages(info, params, 2)
    half, resume = len(msgs) // 2, threading.Event()
    progress = {"sent": 0}

    def slow_stream():
        for i, message in enumerate(msgs):
            if i == half:
                resume.wait(60)
            progress["sent"] = i + 1
            yield message

    replies = []
    pusher = threading.Thread(
        target=lambda: replies.append(stub.PushWeights(slow_stream(), timeout=120,
                                                       metadata=AUTH)))
    pusher.start()
    while progress["sent"] < half:
        time.sleep(0.01)
    during = [_generate(stub) for _ in range(3)]
    assert pusher.is_alive() and progress["sent"] == half
    assert all(r.weight_version == 1 for r in during)
    assert _served(stub)[0] == 1
    resume.set()
    pusher.join(60)
    assert replies and replies[0].version == 2
    after = _generate(stub)
    assert after.weight_version == 2
    digests = {p.name: p.digest for p in _info(stub).params}
    assert digests == {n: wire.array_digest(a) for n, a in params.items()}


def test_rollout_streams_scored_groups(sampler, reward):
    _, stub = sampler
    request = sampler_pb2.RolloutRequest(request_id="r1", group_size=2, min_version=2,
                                         sampling=SAMPLING, prompts=_prompts())
    groups = list(stub.Rollout(request, timeout=120))
    assert sorted(g.prompt_id for g in groups) == ["a", "b", "c"]
    generated = _generate(stub)
    for g, out in zip(sorted(groups, key=lambda g: g.prompt_id), generated.outputs, strict=True):
        assert g.request_id == "r1" and g.sampler_id == "sampler-under-test"
        assert g.weight_version == 2 and len(g.completions) == 2
        # Same seed, same weights: Rollout and Generate sample the same completions.
        assert [list(c.token_ids) for c in g.completions] == [
            list(c.token_ids) for c in out.completions]
        assert list(g.prompt_token_ids) == list(out.prompt_token_ids)
        assert g.timings.generate_s > 0 and g.timings.score_s >= 0
        for c in g.completions:
            assert len(c.token_ids) == len(c.logprobs) >= 1
            assert c.finish_reason in ("stop", "length")
            assert c.rewards["length"] == len(c.text) and c.total_reward == 0.5 * len(c.text)
            assert c.reward_reasons["length"] == "ok"
    a = next(g for g in groups if g.prompt_id == "a")
    assert a.reference == "3" and dict(a.metadata) == {"task": "add"}
    assert reward[1].calls >= 1
    # What the reward functions get: each prompt's group, its columns, chat messages, the
    # completion's token ids and the weight version that generated it.
    items = {(i.prompt, i.completion, tuple(i.completion_ids)): i for i in reward[1].items}
    by_prompt = {g.prompt_id: g for g in groups}
    for prompt_id, columns, messages in (("a", '{"level": 2}', []),
                                         ("c", "", [("user", "2+2=")])):
        group_ids = set()
        for c in by_prompt[prompt_id].completions:
            scored = next(i for (_, text, ids), i in items.items()
                          if text == c.text and list(ids) == list(c.token_ids))
            group_ids.add(scored.group_id)
            assert scored.columns_json == columns and scored.weight_version == 2
            assert [(m.role, m.content) for m in scored.prompt_messages] == messages
        assert len(group_ids) == 1 and group_ids != {""}


def test_a_prompt_with_its_own_seed_samples_the_same_in_any_request(sampler):
    _, stub = sampler

    def tokens(prompts, request_seed):
        sampling = common_pb2.SamplingParams(temperature=1.0, has_seed=True, seed=request_seed)
        reply = stub.Generate(sampler_pb2.GenerateRequest(prompts=prompts, sampling=sampling,
                                                          n=2), timeout=120, metadata=AUTH)
        return {o.prompt_id: [list(c.token_ids) for c in o.completions] for o in reply.outputs}

    seeded = _prompts()
    for i, prompt in enumerate(seeded):
        prompt.seed, prompt.has_seed = 1000 + i, True
    together = tokens(seeded, 7)
    # Alone, in another position and under another request seed: the same samples.
    assert tokens([seeded[2]], 8)["c"] == together["c"]
    assert tokens([seeded[2], seeded[0]], 9) == {k: together[k] for k in ("a", "c")}
    # Without their own seeds the prompts follow the request's seed (and their index).
    unseeded = tokens(_prompts(), 7)
    assert unseeded != together


@pytest.mark.parametrize(("change", "code", "fragment"), [
    ({"prompts": []}, "INVALID_ARGUMENT", "prompts: expected at least one prompt"),
    ({"prompts": [common_pb2.Prompt()]}, "INVALID_ARGUMENT", "prompts[0]: set exactly one"),
    ({"prompts": [common_pb2.Prompt(token_ids=[1, 10_000])]}, "INVALID_ARGUMENT",
     "prompts[0].token_ids: ids must be in [0,"),
    ({"prompts": [common_pb2.Prompt(token_ids=[3] * 45)]}, "INVALID_ARGUMENT",
     "exceeds the sampler's max_sequence_length 48"),
    ({"prompts": [common_pb2.Prompt(text="1+1=" * 500_000)]}, "INVALID_ARGUMENT",
     "prompts[0].text: 2000000 characters cannot fit the sampler's max_sequence_length 48 "
     "(refused before tokenizing"),
    ({"sampling": common_pb2.SamplingParams(temperature=-1.0)}, "INVALID_ARGUMENT",
     "sampling.temperature"),
    ({"sampling": common_pb2.SamplingParams(top_p=1.5)}, "INVALID_ARGUMENT", "sampling.top_p"),
    ({"group_size": 0}, "INVALID_ARGUMENT", "group_size: expected 1 <= group_size"),
    ({"group_size": 9}, "INVALID_ARGUMENT", "max_batch_size 8, got 9"),
    ({"min_version": 99}, "FAILED_PRECONDITION", "min_version is 99"),
])
def test_invalid_rollout_requests_name_the_field(sampler, change, code, fragment):
    _, stub = sampler
    request = sampler_pb2.RolloutRequest(request_id="bad", group_size=2,
                                         prompts=[common_pb2.Prompt(text="1+1=")])
    for key, value in change.items():
        field = getattr(request, key)
        if isinstance(value, list):
            del field[:]
            field.extend(value)
        elif hasattr(field, "CopyFrom"):
            field.CopyFrom(value)
        else:
            setattr(request, key, value)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Rollout(request, timeout=30))
    assert e.value.code().name == code
    assert fragment in e.value.details(), e.value.details()


def test_a_dead_reward_service_is_unavailable(sampler, reward):
    _, stub = sampler
    reward[0].stop(0)
    request = sampler_pb2.RolloutRequest(request_id="r2", group_size=2,
                                         prompts=[common_pb2.Prompt(text="1+1=")])
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Rollout(request, timeout=60))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert cause_of(e.value) is Cause.REWARD_UNAVAILABLE  # what the trainer acts on
    assert "reward service at" in e.value.details() and "unavailable" in e.value.details()
    assert _generate(stub).weight_version == 2  # generation itself is unaffected


def test_push_without_the_token_is_unauthenticated(sampler):
    proc, stub = sampler
    info = _info(stub, digests=False)
    with make_channel(proc.address) as channel:  # no auth: no token on its calls
        with pytest.raises(grpc.RpcError) as e:
            sampler_pb2_grpc.SamplerStub(channel).PushWeights(
                iter(_push_messages(info, _random_params(info, 1), 9)), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _served(stub)[0] == 2


def test_metrics_report_tokens_version_and_pushes(sampler):
    proc, _ = sampler
    port = proc.listening["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("splitrl_sampler_") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["splitrl_sampler_weight_version"] == 2
    assert values["splitrl_sampler_tokens_generated_total"] > 0
    assert values["splitrl_sampler_push_bytes_total"] > 0
    assert values['splitrl_sampler_pushes_total{code="OK"}'] == 2
    assert values['splitrl_sampler_pushes_total{code="DATA_LOSS"}'] == 1
    assert 0 < values["splitrl_sampler_batch_occupancy"] <= 1


def test_the_sampler_registers_with_the_trainer_and_heartbeats(sampler, trainer):
    proc, _ = sampler
    fake = trainer[1]
    assert fake.registered and fake.registered[0] == ("sampler-under-test", proc.address)
    deadline = time.monotonic() + 10
    while 2 not in fake.heartbeats and time.monotonic() < deadline:
        time.sleep(0.1)
    assert 2 in fake.heartbeats  # the weight version it serves now


def _openai(proc, token=TOKEN):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{proc.listening['http_port']}/v1",
                         api_key=token, max_retries=0, timeout=120)


def test_openai_client_completions_return_the_tokens_of_grpc_generate(sampler):
    proc, stub = sampler
    greedy = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=5)
    want = stub.Generate(sampler_pb2.GenerateRequest(
        prompts=[common_pb2.Prompt(text="1+2="), common_pb2.Prompt(text="7+5=")],
        sampling=greedy), timeout=120)
    client = _openai(proc)
    got = client.completions.create(model="tiny-arith", prompt=["1+2=", "7+5="], temperature=0,
                                    max_tokens=5)
    assert [c.token_ids for c in got.choices] == [
        list(o.completions[0].token_ids) for o in want.outputs]
    assert [c.text for c in got.choices] == [o.completions[0].text for o in want.outputs]
    assert [c.finish_reason for c in got.choices] == [
        o.completions[0].finish_reason for o in want.outputs]
    assert got.usage.completion_tokens == sum(len(c.token_ids) for c in got.choices)
    assert got.weight_version == want.weight_version


def test_openai_client_chat_completions_return_the_tokens_of_grpc_generate(sampler):
    proc, stub = sampler
    messages = [{"role": "user", "content": "2+2="}]
    want = stub.Generate(sampler_pb2.GenerateRequest(
        prompts=[common_pb2.Prompt(messages=[common_pb2.ChatMessage(**messages[0])])],
        sampling=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=4), n=2),
        timeout=120).outputs[0]
    got = _openai(proc).chat.completions.create(model="tiny-arith", messages=messages,
                                                temperature=0, max_completion_tokens=4, n=2)
    assert [c.token_ids for c in got.choices] == [list(c.token_ids) for c in want.completions]
    assert [c.message.content for c in got.choices] == [c.text for c in want.completions]
    assert got.prompt_token_ids == [list(want.prompt_token_ids)]
    assert [m.id for m in _openai(proc).models.list()] == ["tiny-arith"]


def test_openai_http_refusals_are_typed(sampler):
    import openai

    proc, _ = sampler
    with pytest.raises(openai.AuthenticationError) as e:
        _openai(proc, token="wrong").completions.create(model="tiny-arith", prompt="1+2=")
    assert e.value.status_code == 401 and e.value.code == "UNAUTHENTICATED"
    with pytest.raises(openai.AuthenticationError):
        _openai(proc, token="wrong").models.list()
    client = _openai(proc)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="1+2=")
    assert (e.value.code, e.value.param) == ("NOT_FOUND", "model")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-arith", prompt="1+2=", stream=True)
    assert (e.value.code, e.value.param) == ("INVALID_ARGUMENT", "stream")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-arith", prompt="1+2=", temperature=-1)
    assert (e.value.code, e.value.param) == ("INVALID_ARGUMENT", "temperature")
    with pytest.raises(openai.BadRequestError) as e:  # the sampler's own check, as for gRPC
        client.completions.create(model="tiny-arith", prompt="1+2=", n=99)
    assert e.value.code == "INVALID_ARGUMENT"


def test_sigterm_finishes_the_push_in_flight_then_exits(sampler):
    proc, stub = sampler
    info = _info(stub, digests=False)
    msgs = _push_messages(info, _random_params(info, 8), 3)
    resume, replies = threading.Event(), []

    def held():
        yield from msgs[:2]
        resume.wait(60)
        yield from msgs[2:]

    log_size = proc.log_path.stat().st_size
    pusher = threading.Thread(target=lambda: replies.append(
        stub.PushWeights(held(), timeout=60, metadata=AUTH)))
    pusher.start()
    deadline = time.monotonic() + 30  # the push is in flight: the sampler has its header
    while ('"push_version": 3' not in proc.log_path.read_text()[log_size:]
           and time.monotonic() < deadline):
        time.sleep(0.05)
    proc.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while check_health(proc.address, timeout_s=1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not check_health(proc.address, timeout_s=1)
    resume.set()
    pusher.join(60)
    assert replies and replies[0].version == 3
    assert proc.proc.wait(30) == 0
    assert '"event": "stopped"' in proc.proc.stdout.read()
