"""The trainer's weight publisher against real sampler processes over the bulk data plane:
relay chains, delta pushes, a reset, a sampler joining mid-way, a relay killed mid-push, a
push in the background while the learner donates its buffers, and bf16 serving from f32.

Three sampler processes (2 emulated devices each, tensor parallel, serving bfloat16, token auth)
serve the module; this process is the trainer (float32 weights, fsdp over 4 devices). Tests run
in file order; the last one kills a sampler.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import yaml

from splitrl import wire
from splitrl.config import AuthConfig, PushConfig, ServicesConfig
from splitrl.mesh import param_shardings
from splitrl.v1 import sampler_pb2
from tests.sampler_service.sampler_helpers import SamplerProcess
from trainer_service.orchestration.membership import SamplerPool
from trainer_service.orchestration.publisher import WeightPublisher

pytestmark = pytest.mark.slow  # three sampler processes

TOKEN = "publisher-token"
AUTH = AuthConfig(token=TOKEN)
SAMPLERS = 3


@pytest.fixture(scope="module")
def samplers(tmp_path_factory, arith_model):
    cfg = {
        "model": {"path": str(arith_model)},
        "sampler": {"dtype": "bfloat16", "max_batch_size": 4, "max_sequence_length": 32,
                    "max_chunk_bytes": 16 * 1024, "push_idle_timeout_s": 20,
                    "mesh": {"axes": {"tensor": 2}, "strategy": "tp"},
                    "register_with_trainer": False, "shutdown_grace_s": 1},
        "services": {"host": "127.0.0.1", "sampler_port": 0, "reward_address": "",
                     "auth": {"token": TOKEN}},
        "trainer": {"steps": 100},
    }
    directory = tmp_path_factory.mktemp("samplers")

    def start(i):
        path = directory / f"sampler-{i}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return SamplerProcess(path, devices=2)

    with ThreadPoolExecutor(SAMPLERS) as pool:
        procs = list(pool.map(start, range(SAMPLERS)))
    yield procs
    for proc in procs:
        proc.stop()


@pytest.fixture(scope="module")
def params(arith_model):
    """The trainer's float32 weights, fsdp over 4 devices."""
    from flax import nnx

    from splitrl.models import from_pretrained, hf_from_state

    mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    flat = hf_from_state(nnx.state(from_pretrained(arith_model, jnp.float32), nnx.Param))
    shardings = param_shardings(mesh, {n: a.shape for n, a in flat.items()}, "fsdp")
    return {n: jax.device_put(a, shardings[n]) for n, a in flat.items()}


def _pool(addresses) -> SamplerPool:
    pool = SamplerPool(ServicesConfig(sampler_addresses=list(addresses), sampler_timeout_s=300,
                                      auth=AUTH), max_message_bytes=1 << 22)
    pool.refresh()
    return pool


def _served(proc) -> dict[str, str]:
    from splitrl.serving import make_channel
    from splitrl.v1 import sampler_pb2_grpc

    with make_channel(proc.address, auth=AUTH) as channel:
        info = sampler_pb2_grpc.SamplerStub(channel).GetInfo(
            sampler_pb2.GetInfoRequest(include_digests=True), timeout=60)
    return {"version": info.weight_version, "weights_id": info.weights_id,
            "digests": {p.name: p.digest for p in info.params}}


def _bf16_digests(params) -> dict[str, str]:
    return {n: wire.array_digest(np.asarray(a).astype(ml_dtypes.bfloat16))
            for n, a in params.items()}


@jax.jit
def _train_like(params, key):
    """A small update of every weight, as an Adam step at lr 1e-5 makes (f32 master weights):
    most bf16 roundings stay the same."""
    keys = jax.random.split(key, len(params))
    return {n: a + 1e-5 * jax.random.normal(k, a.shape, a.dtype)
            for (n, a), k in zip(sorted(params.items()), keys, strict=True)}


def test_twenty_delta_pushes_with_a_reset_and_a_late_joiner_end_bitwise_equal(samplers, params):
    first, joiner = samplers[:2], samplers[2]
    pool = _pool([p.address for p in first])
    publisher = WeightPublisher(pool, auth=AUTH, push=PushConfig(timeout_s=120))
    history, results = {}, []
    key = jax.random.key(0)
    version, current = 0, params
    try:
        for push in range(20):
            if push == 9:  # the trainer resumed from its checkpoint of version 6
                version, current = 6, history[6]
                pushed = publisher.push_all(current, version, reset=True)
            else:
                if push == 13:  # a sampler joins: the trainer syncs it before it gets work
                    pool.add(joiner.address, "registered")
                    pool.refresh()
                    handle = pool.get(joiner.address)
                    assert publisher.push_one(handle, current, version, reset=True).ok
                key, step = jax.random.split(key)
                version, current = version + 1, _train_like(current, step)
                pushed = publisher.push_all(current, version)
            history[version] = current
            assert all(r.ok for r in pushed), [r.error for r in pushed if not r.ok]
            results.append((version, pushed))
    finally:
        publisher.close()
        pool.stop()
    want = _bf16_digests(current)
    for proc in samplers:
        served = _served(proc)
        assert served["version"] == version == 16  # 9 pushes, back to 6, 10 more
        assert served["digests"] == want, proc.address
    # Deltas did the work: every push after the first that was not a reset or a join, and the
    # trainer sent each byte once (a chain of all samplers).
    deltas = [v for v, pushed in results if all(r.delta for r in pushed)]
    full = [v for v, pushed in results if not any(r.delta for r in pushed)]
    assert len(deltas) >= 16 and len(full) <= 3, (deltas, full)
    for _, pushed in results:
        wire_bytes = max(r.bytes for r in pushed)
        egress = sum(r.egress_bytes for r in pushed)
        assert egress < 1.1 * wire_bytes + 64 * 1024  # one stream: payload + frame headers
        if pushed[0].delta:
            assert wire_bytes < pushed[0].full_bytes
    ratio = np.mean([max(r.bytes for r in p) / p[0].full_bytes for v, p in results
                     if v in deltas])
    print(f"\ndelta pushes: {len(deltas)}, full: {full}; wire bytes per delta / full: {ratio:.3f}")


def test_a_background_push_survives_the_learner_donating_its_buffers(samplers, params):
    pool = _pool([p.address for p in samplers])
    publisher = WeightPublisher(pool, auth=AUTH, push=PushConfig(timeout_s=120))
    donate = jax.jit(lambda p: {n: a * 2.0 for n, a in p.items()}, donate_argnums=0)
    try:
        current = {n: a + 0.0 for n, a in params.items()}  # our own buffers to donate
        want = _bf16_digests(current)
        in_flight = publisher.push_all_async(current, 50, reset=True)
        current = donate(current)  # the next update reuses the buffers at once
        results = in_flight.wait(120)
    finally:
        publisher.close()
        pool.stop()
    assert all(r.ok for r in results), [r.error for r in results]
    for proc in samplers:
        assert _served(proc)["digests"] == want
    assert jax.tree.leaves(current)[0].dtype == jnp.float32


def test_a_stopped_sampler_does_not_hold_the_push_and_catches_up(samplers, params):
    pool = _pool([p.address for p in samplers])
    publisher = WeightPublisher(pool, auth=AUTH, push=PushConfig(
        timeout_s=120, relay=False, straggler_wait_s=0.5))
    stopped = samplers[0]
    versions = {v: {n: a * (1 + v / 1000) for n, a in params.items()} for v in (51, 52, 53)}
    pushes: dict[int, list] = {}

    def push(version):  # in a thread: without the straggler rule it would wait for SIGCONT
        thread = threading.Thread(target=lambda: pushes.setdefault(
            version, publisher.push_all(versions[version], version)))
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), f"push {version} waited for the stopped sampler"
        return {r.address: r for r in pushes[version]}

    try:
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        try:
            first, second = push(51), push(52)
        finally:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        for results, error in ((first, "still pushing in the background"),
                               (second, "an earlier push still runs")):
            assert results[stopped.address].background, results[stopped.address]
            assert results[stopped.address].error == error
            assert all(r.ok for a, r in results.items() if a != stopped.address)
        # Thawed, it finishes version 51 in the background, then catches up at the next push.
        handle = pool.get(stopped.address)
        deadline = time.monotonic() + 60
        while handle.push_lock.locked() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert handle.weight_version == 51 and _served(stopped)["version"] == 51
        third = push(53)
    finally:
        publisher.close()
        pool.stop()
    assert all(r.ok for r in third.values()), [r.error for r in third.values()]
    want = _bf16_digests(versions[53])
    for proc in samplers:
        assert _served(proc)["digests"] == want


def test_a_push_refused_for_good_drops_the_sampler_at_once(samplers, params):
    """A refusal every later push would get too (INVALID_ARGUMENT: here a negative version,
    which no sampler takes) is not retried or waited out: the sampler is refused and dropped
    with the reason, and the pool says the run cannot make progress."""
    target = samplers[1]
    pool = _pool([target.address])
    publisher = WeightPublisher(pool, auth=AUTH, push=PushConfig(timeout_s=120))
    try:
        [result] = publisher.push_all(params, -1)
        assert result.code == grpc.StatusCode.INVALID_ARGUMENT, result
        assert "push version -1 is negative" in result.error
        assert pool.all() == []
        stalled = pool.stalled()
        assert stalled.startswith(f"every sampler was refused: {target.address}: it refused "
                                  "push version -1") and "is negative" in stalled
    finally:
        publisher.close()
        pool.stop()


def test_a_relay_killed_mid_push_costs_the_others_nothing(samplers, params):
    pool = _pool([p.address for p in samplers])
    publisher = WeightPublisher(pool, auth=AUTH, push=PushConfig(timeout_s=120))
    chain = sorted(samplers, key=lambda p: p.address)  # the publisher's chain order
    relay = chain[1]
    others = [p for p in chain if p is not relay]
    current = {n: a * 0.5 for n, a in params.items()}
    results = []
    log_size = chain[0].log_path.stat().st_size
    try:
        os.kill(relay.proc.pid, signal.SIGSTOP)  # takes the head's bytes, answers nothing
        pusher = threading.Thread(target=lambda: results.extend(
            publisher.push_all(current, 60, reset=True)))
        pusher.start()
        deadline = time.monotonic() + 60
        while ('"push_version": 60' not in chain[0].log_path.read_text()[log_size:]
               and time.monotonic() < deadline):
            time.sleep(0.1)
        os.kill(relay.proc.pid, signal.SIGKILL)
        relay.proc.wait(30)
        pusher.join(120)
    finally:
        publisher.close()
        pool.stop()
    by_address = {r.address: r for r in results}
    assert not by_address[relay.address].ok
    for proc in others:
        assert by_address[proc.address].ok, by_address[proc.address].error
        served = _served(proc)
        assert served["version"] == 60 and served["digests"] == _bf16_digests(current)
    # The head relayed, then the trainer sent to the cut-off samplers itself.
    assert sum(r.egress_bytes > 0 for r in results) == 2
