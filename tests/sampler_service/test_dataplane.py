"""Weight pushes to a real sampler process over the bulk data plane, and the deadlines and
sanity checks both transports share (a silent push, a push its sender gave up on).

One sampler process (2 emulated devices, tensor parallel, token auth, a 5 s push idle deadline)
serves the module; tests run in file order and each states the weight version it expects.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
import yaml
from sampler_helpers import SamplerProcess

from splitrl import wire
from splitrl.config import AuthConfig
from splitrl.dataplane.frames import OPEN, PREAMBLE, PREFIX
from splitrl.dataplane.link import PushLink, status_code
from splitrl.serving import make_channel
from splitrl.v1 import dataplane_pb2, sampler_pb2, sampler_pb2_grpc

MAX_CHUNK = 16 * 1024
TOKEN = "data-plane-token"
AUTH = AuthConfig(token=TOKEN)
# The sampler's push idle deadline: what the silent-push test waits out (twice), and longer than
# any pause of a push the other tests make (the sender-gave-up test's sampler is stopped for a
# moment while its gRPC stream idles; the gap must end in a cancel, not in this deadline).
IDLE_S = 5.0
# A bound on the silent-push test's own waits, so a sampler that never hangs up fails the test
# instead of stalling it; never the assertion (the sampler's deadline always comes first).
GUARD_S = 60.0
STEPS = 1000


@pytest.fixture(scope="module")
def sampler(tmp_path_factory, arith_model):
    cfg = {
        "model": {"path": str(arith_model)},
        "sampler": {"max_batch_size": 4, "max_sequence_length": 32,
                    "max_chunk_bytes": MAX_CHUNK, "push_idle_timeout_s": IDLE_S,
                    "mesh": {"axes": {"tensor": 2}, "strategy": "tp"},
                    "register_with_trainer": False, "shutdown_grace_s": 1},
        "services": {"host": "127.0.0.1", "sampler_port": 0, "metrics_port": 0,
                     "reward_address": "", "auth": {"token": TOKEN}},
        "trainer": {"steps": STEPS},
    }
    path = tmp_path_factory.mktemp("cfg") / "sampler.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = SamplerProcess(path, devices=2)
    channel = make_channel(proc.address, auth=AUTH)
    stub = sampler_pb2_grpc.SamplerStub(channel)
    yield proc, stub, stub.GetInfo(sampler_pb2.GetInfoRequest(), timeout=60)
    channel.close()
    assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


def _served(stub) -> tuple[int, dict[str, str]]:
    info = stub.GetInfo(sampler_pb2.GetInfoRequest(include_digests=True), timeout=30)
    return info.weight_version, {p.name: p.digest for p in info.params}


def _random_params(info, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {p.name: (0.02 * rng.standard_normal(tuple(p.shape))).astype(wire.numpy_dtype(p.dtype))
            for p in info.params}


def _bulk_push(info, params, version, *, auth=AUTH, mutate=None, reset=False,
               max_chunk_bytes=MAX_CHUNK, timeout_s=60.0) -> dataplane_pb2.PushOutcome:
    """One push over the data plane, as the trainer's publisher sends it; ``mutate(i, chunk,
    payload) -> (chunk, payload)`` may damage frame ``i`` on the way."""
    layouts = wire.layouts_from_info(info)
    header = wire.push_header(params, version, target_shardings=layouts, sender="pytest",
                              reset=reset, push_id=f"pytest-{version}")
    frames = wire.iter_push_frames(params, version, max_chunk_bytes=max_chunk_bytes,
                                   target_shardings=layouts)
    if mutate is not None:
        frames = (mutate(i, chunk, payload) for i, (chunk, payload) in enumerate(frames))
    link = PushLink([info.data_address], header, auth=auth, idle_timeout_s=30.0)
    (outcome,), _ = link.run(frames, deadline=time.monotonic() + timeout_s)
    return outcome


def _metric(proc, name: str) -> float:
    port = proc.listening["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_bulk_push_is_bitwise_equal_and_names_the_weights_it_serves(sampler):
    _, stub, info = sampler
    assert info.data_address and info.weights_id == "" and info.weight_version == 0
    params = _random_params(info, seed=1)
    outcome = _bulk_push(info, params, 1)
    assert status_code(outcome.code) == grpc.StatusCode.OK, outcome.message
    assert outcome.version == 1 and outcome.bytes_received == sum(
        a.nbytes for a in params.values())
    version, digests = _served(stub)
    assert version == 1
    assert digests == {n: wire.array_digest(a) for n, a in params.items()}
    assert stub.GetInfo(sampler_pb2.GetInfoRequest(), timeout=30).weights_id == "pytest-1"


def _flip(target: int):
    def mutate(i, chunk, payload):
        if i == target:
            data = bytearray(payload)
            data[0] ^= 0xFF
            payload = memoryview(data)
        return chunk, payload
    return mutate


def _nan(name: str):
    def mutate(i, chunk, payload):
        if chunk.name == name and chunk.offset == 0:
            data = np.frombuffer(bytes(payload), np.float32).copy()
            data[0] = np.nan
            chunk.checksum = wire.checksum(data.view(np.uint8))
            payload = memoryview(data.view(np.uint8))
        return chunk, payload
    return mutate


def _reshape(i, chunk, payload):
    if i == 0:
        chunk.shape[0] += 1
    return chunk, payload


@pytest.mark.parametrize(("case", "code", "fragments"), [
    ("corrupt", grpc.StatusCode.DATA_LOSS, ["checksum mismatch", "corrupted in transit"]),
    ("stale", grpc.StatusCode.FAILED_PRECONDITION, ["version 1 is not newer than the serving"]),
    ("no token", grpc.StatusCode.UNAUTHENTICATED, ["carried no auth token"]),
    ("wrong token", grpc.StatusCode.UNAUTHENTICATED, ["carried a wrong auth token"]),
    ("oversized", grpc.StatusCode.RESOURCE_EXHAUSTED, [f"max_chunk_bytes {MAX_CHUNK}"]),
    ("misshapen", grpc.StatusCode.INVALID_ARGUMENT, ["shape is"]),
    ("nan", grpc.StatusCode.INVALID_ARGUMENT, ["non-finite", "model.embed_tokens.weight"]),
    ("negative", grpc.StatusCode.INVALID_ARGUMENT, ["push version -1 is negative"]),
])
def test_bad_bulk_pushes_get_their_status_and_the_old_weights_keep_serving(
        sampler, case, code, fragments):
    _, stub, info = sampler
    before = _served(stub)
    assert before[0] == 1
    params = _random_params(info, seed=2)
    kw = {
        "corrupt": dict(mutate=_flip(3)),
        "stale": dict(version=1),
        "no token": dict(auth=None),
        "wrong token": dict(auth=AuthConfig(token="not-it")),
        "oversized": dict(max_chunk_bytes=4 * MAX_CHUNK),
        "misshapen": dict(mutate=_reshape),
        "nan": dict(mutate=_nan("model.embed_tokens.weight")),
        "negative": dict(version=-1, reset=True),
    }[case]
    version = kw.pop("version", 2)
    outcome = _bulk_push(info, params, version, **kw)
    assert status_code(outcome.code) == code, outcome.message
    for fragment in fragments:
        assert fragment in outcome.message, outcome.message
    assert _served(stub) == before


def test_a_silent_push_is_abandoned_at_the_idle_deadline_on_both_transports(sampler):
    proc, stub, info = sampler
    # Data plane: OPEN, then nothing. The sampler hangs up after its idle deadline.
    host, port = info.data_address.rsplit(":", 1)
    header = wire.push_header(_random_params(info, 3), 2, push_id="silent")
    opened = dataplane_pb2.BulkOpen(authorization=f"Bearer {TOKEN}", header=header)
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=GUARD_S) as sock:
        body = opened.SerializeToString()
        sock.sendall(PREAMBLE + PREFIX.pack(OPEN, len(body), 0) + body)
        assert sock.recv(1) == b""  # closed by the sampler, not by our timeout
    assert time.monotonic() - started >= IDLE_S * 0.9

    # gRPC: a header, then nothing.
    release = threading.Event()

    def header_then_silence():
        yield sampler_pb2.WeightPushMessage(header=header)
        release.wait(GUARD_S)

    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.PushWeights(header_then_silence(), timeout=GUARD_S)
    finally:
        release.set()
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "sampler.push_idle_timeout_s" in e.value.details()
    # The push lock was released both times: the next push goes through.
    outcome = _bulk_push(info, _random_params(info, 4), 2)
    assert status_code(outcome.code) == grpc.StatusCode.OK, outcome.message
    assert _served(stub)[0] == 2


def _wait_for(predicate, timeout_s: float, what: str):
    """The first true value of ``predicate()``, polled until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _push_started(proc, log_size: int) -> dict | None:
    """The sampler's "weight push started" log record after ``log_size``, if there is one."""
    for line in proc.log_path.read_text()[log_size:].splitlines():
        if '"weight push started"' in line:
            return json.loads(line)
    return None


def test_a_push_its_sender_gave_up_on_is_never_applied(sampler):
    proc, stub, info = sampler
    before = _served(stub)
    assert before[0] == 2
    pid = proc.proc.pid
    cancelled = _metric(proc, 'splitrl_sampler_pushes_total{code="CANCELLED"}')

    # gRPC: the whole stream is in the sampler's handler when the sampler stops; the sender
    # gives up (cancels the call, as a trainer's deadline does; a fixed deadline here would
    # race the sampler's start of the handler on a busy machine); the sampler resumes and must
    # not swap the push in.
    messages = list(wire.iter_push_messages(
        _random_params(info, 5), 3, max_chunk_bytes=MAX_CHUNK,
        target_shardings=wire.layouts_from_info(info), sender="pytest"))
    release = threading.Event()
    log_size = proc.log_path.stat().st_size

    def held():
        yield from messages
        release.wait(60)  # the stream stays open: the push is never complete

    call = stub.PushWeights.future(held())
    _wait_for(lambda: _push_started(proc, log_size), 30, "the sampler to start receiving the push")
    time.sleep(0.5)  # let it take in the rest (the outcome below must not depend on it)
    os.kill(pid, signal.SIGSTOP)
    try:
        assert call.cancel()
    finally:
        release.set()
        os.kill(pid, signal.SIGCONT)
    _wait_for(lambda: _metric(proc, 'splitrl_sampler_pushes_total{code="CANCELLED"}')
              > cancelled, 30, "the sampler to drop the push")
    assert _served(stub) == before

    # Data plane: the sampler is stopped while the push waits in its socket; the trainer's
    # deadline passes and it hangs up; the sampler resumes and must not swap the push in.
    cancelled = _metric(proc, 'splitrl_sampler_pushes_total{code="CANCELLED"}')
    os.kill(pid, signal.SIGSTOP)
    try:
        outcome = _bulk_push(info, _random_params(info, 6), 3, timeout_s=3.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert status_code(outcome.code) == grpc.StatusCode.UNAVAILABLE
    assert "deadline" in outcome.message
    _wait_for(lambda: _metric(proc, 'splitrl_sampler_pushes_total{code="CANCELLED"}')
              > cancelled, 30, "the sampler to drop the push")
    assert _served(stub) == before
