"""splitrl.distributed: which jax.distributed.initialize call a trainer process makes."""

from __future__ import annotations

import pytest

from splitrl import distributed
from splitrl.config import ConfigError, load_config

COORD = "trainer.distributed.coordinator_address=trainer-0.trainer-workers:8476"


def test_single_process_by_default_even_on_a_one_pod_job():
    assert distributed.plan(load_config(), {}).mode == "single"
    cfg = load_config(None, [COORD, "trainer.distributed.num_processes=1"])
    assert distributed.plan(cfg, {"JOB_COMPLETION_INDEX": "0"}).mode == "single"


def test_indexed_job_pod_gets_its_rank_from_the_completion_index():
    cfg = load_config(None, [COORD, "trainer.distributed.num_processes=4"])
    p = distributed.plan(cfg, {"JOB_COMPLETION_INDEX": "2"})
    assert (p.mode, p.coordinator_address, p.num_processes, p.process_id) == (
        "explicit",
        "trainer-0.trainer-workers:8476",
        4,
        2,
    )


def test_environment_can_supply_every_field():
    env = {
        "SPLITRL_COORDINATOR": "10.0.0.1:1234",
        "SPLITRL_NUM_PROCESSES": "2",
        "SPLITRL_PROCESS_ID": "1",
    }
    p = distributed.plan(load_config(), env)
    assert (p.coordinator_address, p.num_processes, p.process_id) == ("10.0.0.1:1234", 2, 1)


def test_config_wins_over_the_environment():
    cfg = load_config(None, [COORD, "trainer.distributed.num_processes=4",
                             "trainer.distributed.process_id=3"])
    p = distributed.plan(cfg, {"JOB_COMPLETION_INDEX": "1", "SPLITRL_NUM_PROCESSES": "8"})
    assert (p.num_processes, p.process_id) == (4, 3)


def test_multi_host_tpu_slice_with_nothing_configured_lets_jax_detect():
    env = {"TPU_WORKER_HOSTNAMES": "t-0,t-1,t-2,t-3"}
    assert distributed.plan(load_config(), env).mode == "auto"
    assert distributed.plan(load_config(), {"TPU_WORKER_HOSTNAMES": "localhost"}).mode == "single"


@pytest.mark.parametrize(
    ("overrides", "env", "message"),
    [
        (["trainer.distributed.num_processes=4"], {"JOB_COMPLETION_INDEX": "0"},
         "trainer.distributed.coordinator_address: required"),
        ([COORD], {}, "trainer.distributed.num_processes: required"),
        ([COORD, "trainer.distributed.num_processes=4"], {},
         "trainer.distributed.process_id: required"),
        ([COORD, "trainer.distributed.num_processes=2"], {"JOB_COMPLETION_INDEX": "2"},
         "process_id: expected a value < num_processes (2), got 2"),
        ([COORD, "trainer.distributed.num_processes=2"], {"JOB_COMPLETION_INDEX": "x"},
         "JOB_COMPLETION_INDEX: expected an integer"),
    ],
)
def test_partial_setups_fail_naming_the_missing_key(overrides, env, message):
    with pytest.raises(ConfigError) as e:
        distributed.plan(load_config(None, overrides), env)
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.distributed.coordinator_address=trainer-0", "expected 'host:port'"),
        ("trainer.distributed.num_processes=0", "trainer.distributed.num_processes"),
        ("trainer.distributed.process_id=-1", "trainer.distributed.process_id"),
    ],
)
def test_config_validation_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_maybe_initialize_calls_jax_distributed_with_the_plan(monkeypatch):
    import jax

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    assert distributed.maybe_initialize(load_config(), {}).mode == "single"
    assert calls == []
    cfg = load_config(None, [COORD, "trainer.distributed.num_processes=4"])
    distributed.maybe_initialize(cfg, {"JOB_COMPLETION_INDEX": "3"})
    distributed.maybe_initialize(load_config(), {"TPU_WORKER_HOSTNAMES": "a,b"})
    assert calls == [
        {
            "coordinator_address": "trainer-0.trainer-workers:8476",
            "num_processes": 4,
            "process_id": 3,
            "initialization_timeout": 300,
        },
        {"initialization_timeout": 300},
    ]
