"""One entry per sampler process, and only samplers of this run's model: the pool's identity
checks over real gRPC (scripted samplers, see `scripted_sampler.py`), at registration and when
a configured address is probed."""

from __future__ import annotations

import numpy as np
import pytest

from splitrl.config import ServicesConfig
from splitrl.serving import start_server
from tests.trainer_service.scripted_sampler import Script, ScriptedSampler
from trainer_service.orchestration.identity import ModelIdentity, RefusedSampler
from trainer_service.orchestration.membership import SamplerPool

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
