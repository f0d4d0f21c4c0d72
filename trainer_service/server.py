"""The trainer process: the run loop plus a gRPC server for ``Status`` and sampler membership.

``splitrl trainer --config FILE [a.b=c ...]`` calls :func:`main`. Process 0 (the only one
without ``trainer.distributed``) runs the leader's loop, ``run.LeaderRun``; every other process
a follower's, ``follower.FollowerRun``.

Multi-host (``trainer.distributed``): every process serves the standard gRPC health service on
the trainer port (SERVING while its run is healthy: Kubernetes probes every pod), but only
process 0, the leader, serves the Trainer API; the others answer it with FAILED_PRECONDITION.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time

import grpc
from prometheus_client import Gauge

from splitrl.agreement import DIFFERING_KEYS
from splitrl.config import Config
from splitrl.logs import configure_logging
from splitrl.metrics import start_metrics_server
from splitrl.serving import start_server
from splitrl.v1 import trainer_pb2, trainer_pb2_grpc
from trainer_service.orchestration.identity import RefusedSampler

log = logging.getLogger(__name__)

SERVICE_NAME = "splitrl.v1.Trainer"
# The exit code of a run that stopped because no sampler could take work for
# services.sampler_wait_s (1: another failure; 2: cannot start; 3: the reward error policy).
EXIT_NO_SAMPLER = 4

STEP = Gauge("splitrl_trainer_step", "Train steps done")
VERSION = Gauge("splitrl_trainer_weight_version", "Weight version of the policy")
REWARD = Gauge("splitrl_trainer_reward_mean", "Mean total reward of the last step's groups")
ACCURACY = Gauge("splitrl_trainer_accuracy_mean", "Mean accuracy reward of the last step")
SAMPLERS = Gauge("splitrl_trainer_samplers_ready", "Samplers ready for work")
TOKENS_PER_S = Gauge("splitrl_trainer_tokens_per_second", "Completion tokens trained per second")
WAIT_S = Gauge("splitrl_trainer_wait_rollouts_seconds", "Time the last step waited for rollouts")


def _valid_address(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, run):
        self.run = run

    def Status(self, request, context):
        status = self.run.status
        now = time.monotonic()
        inflight = self.run.queue.inflight_by_sampler()
        samplers = [
            trainer_pb2.SamplerStatus(
                sampler_id=h.sampler_id,
                address=h.address,
                weight_version=h.weight_version,
                healthy=h.state == "ready",
                inflight_prompts=inflight.get(h.address, 0),
                last_seen_s=now - h.last_ok,
            )
            for h in self.run.pool.all()
        ]
        return trainer_pb2.StatusReply(
            run_id=self.run.cfg.run_name,
            state=status.state,
            step=status.step,
            total_steps=status.total_steps,
            weight_version=status.version,
            samplers=samplers,
            tokens_per_second=status.tokens_per_s,
            steps_per_second=status.steps_per_s,
            data_cursor_json=json.dumps(status.data_cursor),
            last_metrics={k: float(v) for k, v in status.last_metrics.items()},
            stalled=self.run.pool.stalled(),
        )

    def RegisterSampler(self, request, context):
        if not _valid_address(request.address):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"address: expected HOST:PORT reachable from the trainer, got {request.address!r}",
            )
        try:  # a sampler of this run, once per process (it is asked for its GetInfo)
            self.run.pool.register(request.address, request.sampler_id)
        except RefusedSampler as e:  # the differing settings as a field, beside the words
            context.set_trailing_metadata(((DIFFERING_KEYS, ",".join(e.keys)),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return trainer_pb2.RegisterSamplerReply(
            accepted=True,
            heartbeat_interval_s=self.run.cfg.services.heartbeat_s,
            weight_version=self.run.version,
        )

    def Heartbeat(self, request, context):
        handle = self.run.pool.get(request.address)
        if handle is not None:
            self.run.pool.report_ok(handle)
        return trainer_pb2.HeartbeatReply(known=handle is not None,
                                          weight_version=self.run.version)


class FollowerServicer(trainer_pb2_grpc.TrainerServicer):
    """The Trainer API on a follower process: every call is refused with a pointer to the
    leader (process 0 holds the samplers, the data and the run's status)."""

    def __init__(self, process_index: int):
        self.message = (f"trainer process {process_index} is a follower, not the leader: "
                        "ask process 0 (services.trainer_address, the Service 'trainer')")

    def _refuse(self, request, context):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.message)

    Status = RegisterSampler = Heartbeat = _refuse


class StallWatch:
    """Health NOT_SERVING while the run cannot make progress and waiting will not help
    (``SamplerPool.stalled``: every sampler refused), with one console line saying why; back
    to SERVING when a usable sampler arrives. A probe (``splitrl health``, Kubernetes) sees it
    within ``interval_s``."""

    def __init__(self, run, server, interval_s: float):
        self._run, self._server = run, server
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(interval_s,),
                                        name="stall-watch", daemon=True)
        self._thread.start()

    def _loop(self, interval_s: float) -> None:
        reported = ""
        while not self._stop.wait(interval_s):
            reason = self._run.pool.stalled()
            if reason == reported:
                continue
            self._server.set_serving(not reason)
            if reason:
                log.error("the run cannot make progress: %s; health is NOT_SERVING until a "
                          "sampler of this run registers (the run stops after "
                          "services.sampler_wait_s without one)", reason)
            else:
                log.info("a usable sampler is back; health is SERVING")
            reported = reason

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _progress_bar(total: int, initial: int):
    """A console progress bar when a person is watching (stderr is a terminal)."""
    if not sys.stderr.isatty():
        return None, lambda step, metrics: None
    from tqdm import tqdm

    bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def update(step, metrics):
        bar.n = step
        bar.set_postfix(
            reward=f"{metrics.get('reward/mean', 0):.3f}",
            acc=f"{metrics.get('accuracy/mean', 0):.3f}",
            samplers=int(metrics.get("samplers/ready", 0)),
            refresh=True,
        )

    return bar, update


def _export_metrics(step: int, metrics: dict) -> None:
    STEP.set(step)
    REWARD.set(metrics.get("reward/mean", 0.0))
    ACCURACY.set(metrics.get("accuracy/mean", 0.0))
    SAMPLERS.set(metrics.get("samplers/ready", 0.0))
    TOKENS_PER_S.set(metrics.get("throughput/tokens_per_s", 0.0))
    WAIT_S.set(metrics.get("time/wait_rollouts_s", 0.0))


def _progress(run, update):
    """After each step: the Prometheus gauges, then the console's bar."""

    def progress(step, metrics):
        VERSION.set(run.version)
        _export_metrics(step, metrics)
        update(step, metrics)

    return progress


def main(cfg: Config) -> int:
    configure_logging("trainer", cfg.run_name)
    from splitrl.distributed import maybe_initialize

    maybe_initialize(cfg)
    from trainer_service.follower import FollowerRun
    from trainer_service.learning.checkpoints import (
        NoIntactCheckpoint,
        SaveFailed,
        storage_cause,
    )
    from trainer_service.learning.multihost import HostGroup
    from trainer_service.orchestration.evaluation import accuracy_line
    from trainer_service.orchestration.membership import NoUsableSampler
    from trainer_service.orchestration.reward_checks import RewardFunctionFailed
    from trainer_service.run import LeaderRun

    hosts = HostGroup.current()  # process 0 leads; one process: the leader, alone
    run: LeaderRun | FollowerRun
    try:
        run = LeaderRun(cfg, hosts) if hosts.is_leader else FollowerRun(cfg, hosts)
    except (ValueError, FileNotFoundError, NoIntactCheckpoint) as e:  # cannot be used
        log.critical("trainer cannot start: %s", e)  # on stderr, one JSON line
        return 2
    leader = run if isinstance(run, LeaderRun) else None
    servicer = TrainerServicer(leader) if leader else FollowerServicer(hosts.index)
    port = cfg.services.trainer_address.rsplit(":", 1)[1]
    server = start_server(
        lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, s),
        f"{cfg.services.host}:{port}",
        service_names=[SERVICE_NAME],
        auth=cfg.services.auth,
    )
    start_metrics_server(cfg.services.metrics_port)
    stall_watch = StallWatch(leader, server, cfg.services.heartbeat_s) if leader else None

    def on_signal(signum, _frame):
        if not leader:  # stopping alone would leave the others waiting in a collective
            log.warning("signal received; a follower stops when the leader says so (a second "
                        "signal kills it)", extra={"signal": signal.Signals(signum).name})
            signal.signal(signum, signal.SIG_DFL)
            return
        name = signal.Signals(signum).name
        log.warning("signal received; stopping after the current step",
                    extra={"signal": name})
        leader.stop_reason = leader.stop_reason or f"{name} received"
        leader.stop_event.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    bar = None
    try:
        if leader:
            bar, update = _progress_bar(cfg.trainer.steps, leader.step)
            summary = leader.run(progress=_progress(leader, update))
        else:
            summary = run.run()
    except RewardFunctionFailed:  # logged where it was raised, with the reasons
        return 3
    except SaveFailed:  # logged where it was caught, with the cause and the way out
        return 1
    except NoUsableSampler:  # logged where it was caught, with every sampler and why
        return EXIT_NO_SAMPLER
    except Exception as e:  # the root cause, as the console's "last errors" show it first
        cause = storage_cause(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        log.critical("trainer failed: %s", cause, exc_info=True)
        return 1
    finally:
        if bar is not None:
            bar.close()
        if stall_watch is not None:
            stall_watch.stop()
        threading.Thread(target=server.stop, args=(5.0,), daemon=True).start()
    log.info("run finished", extra={**summary, "state": run.status.state})
    line = accuracy_line(summary)
    if line:
        print(line, flush=True)
    return 0 if run.status.state in ("done", "stopped") else 1
