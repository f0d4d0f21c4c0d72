"""One entry per sampler process, and only samplers of this run's model: the pool's identity
checks over real gRPC (scripted samplers, see `scripted_sampler.py`), at registration and when
a configured address is probed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from splitrl.config import ServicesConfig
from splitrl.retry import wait_until
from splitrl.serving import check_health, start_server
from splitrl_app.launch.demo import demo_config_path
from splitrl_app.launch.ports import free_port
from tests.trainer_service.scripted_sampler import Script, ScriptedSampler
from trainer_service.orchestration.identity import ModelIdentity, RefusedSampler
from trainer_service.orchestration.join_sync import JoinSync
from trainer_service.orchestration.membership import SamplerPool
from trainer_service.orchestration.publisher import WeightPublisher
from trainer_service.server import EXIT_NO_SAMPLER, StallWatch

OURS = ModelIdentity.of("ScriptedForCausalLM",
                        {"model.embed_tokens.weight": np.zeros((16, 8), np.float32)})


@pytest.fixture
def sampler():
    running = ScriptedSampler("s", Script()).start()
    yield running
    running.stop()


def pool(addresses=()):
    services = ServicesConfig(sampler_addresses=list(addresses), sampler_timeout_s=30.0)
    return SamplerPool(services, max_message_bytes=4 << 20, identity=OURS)


def test_a_second_address_of_a_known_sampler_is_merged_not_added(sampler):
    p = pool([sampler.address])
    p.refresh()
    assert [h.address for h in p.all()] == [sampler.address]
    alias = "ipv4:" + sampler.address  # another target that reaches the same process
    handle = p.register(alias, "s")
    assert handle.address == sampler.address and len(p.all()) == 1
    assert p.get(alias) is handle  # heartbeats under the alias find it
    p.stop()


def test_an_alias_configured_beside_the_address_is_merged_when_probed(sampler):
    p = pool([sampler.address, "ipv4:" + sampler.address])
    p.refresh()  # both probed: the same instance, one entry kept
    assert [h.address for h in p.all()] == [sampler.address]
    p.refresh()  # and the alias is not added again
    assert len(p.all()) == 1 and p.left == 0
    p.stop()


def test_a_sampler_of_another_model_is_refused_with_the_reason():
    other = ScriptedSampler("other", Script(shapes={"model.embed_tokens.weight": (32, 8)}))
    other.start()
    try:
        p = pool()
        with pytest.raises(RefusedSampler, match=r"1 shapes differ, e\.g\. "
                           r"model\.embed_tokens\.weight: \[32, 8\] instead of \[16, 8\]"):
            p.register(other.address)
        assert p.all() == []
        configured = pool([other.address])
        configured.refresh()  # a configured address is checked when probed
        assert configured.all() == []
        p.stop()
        configured.stop()
    finally:
        other.stop()
    assert OURS.mismatch(other.GetInfo(None, None)) is not None


def test_a_sampler_of_another_config_is_refused_naming_the_keys_and_the_run_is_stalled():
    """Services started by hand with different configs: refused at registration (not at the
    first push), every differing key named; with no usable sampler the pool says why, until
    one of this run arrives."""
    settings = {"sampling.stop_token_ids": "[]", "tokenizer": "sha256:aa",
                "model.vocab_size": "16"}
    ours = ModelIdentity.of("ScriptedForCausalLM",
                            {"model.embed_tokens.weight": np.zeros((16, 8), np.float32)},
                            settings=settings)
    other = ScriptedSampler("other", Script(agreed={**settings, "sampling.stop_token_ids": "[5]",
                                                    "tokenizer": "sha256:bb"})).start()
    good = ScriptedSampler("good", Script(agreed=settings)).start()
    p = SamplerPool(ServicesConfig(sampler_timeout_s=30.0), max_message_bytes=4 << 20,
                    identity=ours)
    try:
        assert p.stalled() == ""  # no sampler yet is not a refusal: they may be starting
        with pytest.raises(RefusedSampler, match=r"sampling.stop_token_ids: trainer \[\], "
                                                 r"sampler \[5\]; tokenizer: trainer sha256:aa, "
                                                 "sampler sha256:bb") as caught:
            p.register(other.address)
        assert caught.value.keys == ["sampling.stop_token_ids", "tokenizer"]
        assert p.stalled().startswith(f"every sampler was refused: {other.address}: its "
                                      "settings differ")
        # A probe sees it: the trainer's health is NOT_SERVING while it is stalled.
        server = start_server(lambda s: None, "127.0.0.1:0", service_names=["splitrl.v1.Trainer"])
        watch = StallWatch(SimpleNamespace(pool=p), server, interval_s=0.05)
        try:
            assert wait_until(lambda: not check_health(server.address), timeout_s=10,
                              what="NOT_SERVING")
            p.register(good.address)
            p.refresh()  # probed: it syncs, so the run can go on
            assert [h.address for h in p.all()] == [good.address] and p.stalled() == ""
            assert wait_until(lambda: check_health(server.address), timeout_s=10,
                              what="SERVING again")
        finally:
            watch.stop()
            server.stop(0)
    finally:
        p.stop()
        other.stop()
        good.stop()


def test_an_address_that_is_not_a_sampler_is_refused():
    server = start_server(lambda s: None, "127.0.0.1:0", service_names=[])  # health only
    try:
        with pytest.raises(RefusedSampler, match="did not answer GetInfo as a SplitRL sampler "
                                                 r"\(UNIMPLEMENTED"):
            pool().register(server.address)
    finally:
        server.stop(0)


def test_a_sampler_restarted_at_the_same_address_is_synced_again(sampler):
    services = ServicesConfig(sampler_addresses=[sampler.address], sampler_timeout_s=30.0)
    p = SamplerPool(services, max_message_bytes=4 << 20, identity=OURS)
    p.refresh()
    handle = p.all()[0]
    assert p.next_joined(0) is handle and p.next_joined(0) is None  # announced once
    p.mark_ready(handle, 7)
    sampler.instance_id = "a-new-process"  # what a restart at the same address reports
    p.refresh()
    assert p.next_joined(0) is handle  # announced again: the weights are pushed again
    assert handle.weight_version == 0 and handle.state != "ready"
    p.stop()


def test_a_join_push_in_progress_does_not_delay_detecting_a_dead_sampler():
    """A join push waits for the params, held through a train step (then takes a full push):
    meanwhile the pool still probes, and a sampler that dies is dropped after
    ``services.sampler_timeout_s`` as usual, not after the push."""
    joining, dying = (ScriptedSampler(name, Script()).start() for name in ("joining", "dying"))
    services = ServicesConfig(sampler_addresses=[joining.address, dying.address],
                              sampler_timeout_s=1.0, heartbeat_s=0.1)
    p = SamplerPool(services, max_message_bytes=4 << 20, identity=OURS)
    publisher = WeightPublisher(p)
    train_step = threading.Lock()
    train_step.acquire()  # a train step holds the params for as long as this test needs
    waiting = threading.Event()

    def current_weights():
        waiting.set()
        with train_step:
            return {}, 1

    joins = JoinSync(p, publisher, current_weights, workers=1)
    p.start()
    joins.start()
    try:
        assert waiting.wait(30), "no join push started"
        wait_until(lambda: len(p.all()) == 2, timeout_s=30, what="both samplers known")
        dying.stop()
        # Dropped while the join push is held (it is held until the test ends): detection
        # does not wait for a push. Usually within the timeout plus a probe (a refused
        # connection fails at once); the bound below only ends the wait of a failing test.
        wait_until(lambda: dying.address not in [h.address for h in p.all()], timeout_s=60,
                   what="the dead sampler dropped")
        assert p.get(joining.address).state == "syncing"  # its push is still under way
    finally:
        train_step.release()
        joins.stop()
        p.stop()
        publisher.close()
        joining.stop()


def test_a_trainer_whose_every_sampler_is_refused_stops_after_sampler_wait_s(arith_model,
                                                                            tmp_path):
    """A real trainer process whose only sampler serves another model: it does not wait
    forever but stops after services.sampler_wait_s with its own exit code, naming the sampler
    and why, in the log and in summary.json. (Waiting mid-run ends the same way, from the
    wait for a step's groups: test_dispatch.py.)"""
    other = ScriptedSampler("other", Script(shapes={"model.embed_tokens.weight": (32, 8)}))
    other.start()
    run_dir = tmp_path / "run"
    try:
        trainer = subprocess.run(
            [sys.executable, "-m", "splitrl", "trainer", "--config", str(demo_config_path()),
             f"model.path={arith_model}", f"trainer.run_dir={run_dir}",
             "trainer.mesh.axes={fsdp: 1}", "trainer.eval_before=false",
             f"services.sampler_addresses=[{other.address}]",
             f"services.trainer_address=127.0.0.1:{free_port()}",
             "services.heartbeat_s=0.2", "services.sampler_wait_s=1"],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    finally:
        other.stop()
    assert trainer.returncode == EXIT_NO_SAMPLER, trainer.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "failed" and summary["step"] == 0
    assert summary["reason"].startswith("no sampler has been ready to take work for ")
    assert f"(services.sampler_wait_s): {other.address}: refused: " in summary["reason"]
    assert "no step was checkpointed: the same command starts again from step 0" in (
        trainer.stderr)
