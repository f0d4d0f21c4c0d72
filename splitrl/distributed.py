"""Multi-host JAX for the trainer: ``maybe_initialize(cfg)`` before anything touches devices.

A trainer that spans several hosts (a multi-host TPU slice, or several CPU/GPU machines) runs one
process per host, and every process must call ``jax.distributed.initialize`` with the same
coordinator and its own rank before JAX sees the global device set. On Kubernetes the trainer is
an indexed Job (``deploy/k8s/base/trainer.yaml``): pod ``i`` gets ``JOB_COMPLETION_INDEX=i`` and
the stable DNS name ``trainer-i.trainer-workers``, so process 0's name is the coordinator.

Resolution, first match wins, each field on its own:

- ``trainer.distributed.coordinator_address`` / ``num_processes`` / ``process_id`` in the config;
- ``process_id`` from ``JOB_COMPLETION_INDEX`` (indexed Job), else ``SPLITRL_PROCESS_ID``;
  ``num_processes`` from ``SPLITRL_NUM_PROCESSES``; coordinator from ``SPLITRL_COORDINATOR``;
- on a multi-host Cloud TPU slice (``TPU_WORKER_HOSTNAMES`` lists several hosts, as GKE sets it
  for TPU pods) with nothing configured, ``jax.distributed.initialize()`` detects everything.

One process (``num_processes: 1``, or nothing configured): no-op. A partial configuration (a
coordinator but no process count, or several processes but no rank) is an error naming the key.

What the processes then do (process 0 leads the run, the others follow its train steps) is in
``trainer_service/multihost.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from splitrl.config import Config, ConfigError

log = logging.getLogger(__name__)

INDEX_ENV = "JOB_COMPLETION_INDEX"
PROCESS_ID_ENV = "SPLITRL_PROCESS_ID"
NUM_PROCESSES_ENV = "SPLITRL_NUM_PROCESSES"
COORDINATOR_ENV = "SPLITRL_COORDINATOR"
TPU_HOSTS_ENV = "TPU_WORKER_HOSTNAMES"


@dataclass(frozen=True)
class DistributedPlan:
    """What ``maybe_initialize`` will do: nothing, let JAX auto-detect, or explicit arguments."""

    mode: str  # "single" | "auto" | "explicit"
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0
    initialization_timeout_s: int = 300


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment {name}: expected an integer, got {raw!r}") from None
    if value < 0:
        raise ConfigError(f"environment {name}: expected an integer >= 0, got {value}")
    return value


def plan(cfg: Config, env: Mapping[str, str] | None = None) -> DistributedPlan:
    """Resolve the trainer's process group from the config and ``env`` (default: os.environ)."""
    env = os.environ if env is None else env
    d = cfg.trainer.distributed
    coordinator = d.coordinator_address or env.get(COORDINATOR_ENV) or None
    num = d.num_processes if d.num_processes is not None else _env_int(env, NUM_PROCESSES_ENV)
    pid = d.process_id
    if pid is None:
        pid = _env_int(env, INDEX_ENV)
    if pid is None:
        pid = _env_int(env, PROCESS_ID_ENV)
    timeout = d.initialization_timeout_s

    if num == 1:
        return DistributedPlan("single", initialization_timeout_s=timeout)
    if coordinator is None and num is None:
        tpu_hosts = [h for h in env.get(TPU_HOSTS_ENV, "").split(",") if h.strip()]
        mode = "auto" if len(tpu_hosts) > 1 else "single"
        return DistributedPlan(mode, initialization_timeout_s=timeout)
    if coordinator is None:
        raise ConfigError(
            f"trainer.distributed.coordinator_address: required for num_processes={num} "
            f"(or set {COORDINATOR_ENV})"
        )
    if num is None:
        raise ConfigError(
            f"trainer.distributed.num_processes: required with coordinator_address "
            f"{coordinator!r} (or set {NUM_PROCESSES_ENV})"
        )
    if pid is None:
        if num > 1:
            raise ConfigError(
                "trainer.distributed.process_id: required for a multi-process trainer "
                f"(or run as an indexed Job, which sets {INDEX_ENV})"
            )
        pid = 0
    if pid >= num:
        raise ConfigError(
            f"trainer.distributed.process_id: expected a value < num_processes ({num}), got {pid}"
        )
    return DistributedPlan("explicit", coordinator, num, pid, timeout)


def maybe_initialize(cfg: Config, env: Mapping[str, str] | None = None) -> DistributedPlan:
    """Call ``jax.distributed.initialize`` when the trainer spans several processes.

    Call it first thing in the trainer process, before any JAX computation. Returns the plan it
    carried out (``mode == "single"`` means nothing was done).
    """
    p = plan(cfg, env)
    if p.mode == "single":
        return p
    import jax

    if p.mode == "auto":
        log.info("jax.distributed: auto-detecting the multi-host TPU slice")
        jax.distributed.initialize(initialization_timeout=p.initialization_timeout_s)
    else:
        log.info(
            "jax.distributed: initializing",
            extra={
                "coordinator": p.coordinator_address,
                "num_processes": p.num_processes,
                "process_id": p.process_id,
            },
        )
        jax.distributed.initialize(
            coordinator_address=p.coordinator_address,
            num_processes=p.num_processes,
            process_id=p.process_id,
            initialization_timeout=p.initialization_timeout_s,
        )
    return p
