"""One entry per sampler process, and only samplers of this run's model: the pool's identity
checks over real gRPC (scripted samplers, see `scripted_sampler.py`), at registration and when
a configured address is probed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from splitrl.config import ServicesConfig
from splitrl.retry import wait_until
from splitrl.serving import check_health, start_server
from tests.trainer_service.scripted_sampler import Script, ScriptedSampler
from trainer_service.orchestration.identity import ModelIdentity, RefusedSampler
from trainer_service.orchestration.membership import SamplerPool
from trainer_service.server import StallWatch

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
    settings = {"trainer.steps": "10", "tokenizer": "sha256:aa", "model.vocab_size": "16"}
    ours = ModelIdentity.of("ScriptedForCausalLM",
                            {"model.embed_tokens.weight": np.zeros((16, 8), np.float32)},
                            settings=settings)
    other = ScriptedSampler("other", Script(agreed={**settings, "trainer.steps": "30",
                                                    "tokenizer": "sha256:bb"})).start()
    good = ScriptedSampler("good", Script(agreed=settings)).start()
    p = SamplerPool(ServicesConfig(sampler_timeout_s=30.0), max_message_bytes=4 << 20,
                    identity=ours)
    try:
        assert p.stalled() == ""  # no sampler yet is not a refusal: they may be starting
        with pytest.raises(RefusedSampler, match="tokenizer: trainer sha256:aa, sampler "
                                                 "sha256:bb; trainer.steps: trainer 10, "
                                                 "sampler 30") as caught:
            p.register(other.address)
        assert caught.value.keys == ["tokenizer", "trainer.steps"]
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
    joined = []
    services = ServicesConfig(sampler_addresses=[sampler.address], sampler_timeout_s=30.0)
    p = SamplerPool(services, max_message_bytes=4 << 20, identity=OURS, on_join=joined.append)
    p.refresh()
    handle = p.all()[0]
    p.mark_ready(handle, 7)
    sampler.instance_id = "a-new-process"  # what a restart at the same address reports
    p.refresh()
    assert [h.address for h in joined] == [sampler.address] * 2  # pushed the weights again
    assert handle.weight_version == 0 and handle.state != "ready"
    p.stop()
