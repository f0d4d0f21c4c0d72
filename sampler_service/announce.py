"""Dynamic membership, sampler side: register with the trainer, then heartbeat.

A sampler started mid-run (a new process, ``docker compose up --scale``, ``kubectl scale``)
announces its reachable address to ``services.trainer_address``; the trainer pushes it the
current weights and then gives it work. If a heartbeat says the trainer does not know us
(the trainer restarted), the sampler registers again. A trainer that is down is retried
quietly: samplers may start before it.
"""

from __future__ import annotations

import logging
import socket
import threading

import grpc

from splitrl.config import Config
from splitrl.serving import auth_metadata, make_channel
from splitrl.v1 import trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)


def advertised_address(cfg: Config, port: int) -> str:
    """``host:port`` the trainer should dial to reach this sampler."""
    host = cfg.services.advertise_host
    if not host:
        host = cfg.services.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
    return f"{host}:{port}"


class Announcer:
    def __init__(self, cfg: Config, address: str, sampler_id: str):
        self.address = address
        self.sampler_id = sampler_id
        self.interval_s = cfg.services.heartbeat_s
        self.metadata = auth_metadata(cfg.services.auth)
        self._channel = make_channel(cfg.services.trainer_address, auth=cfg.services.auth)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="announce", daemon=True)
        self.registered = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._channel.close()

    def _register(self) -> None:
        reply = self._stub.RegisterSampler(
            trainer_pb2.RegisterSamplerRequest(sampler_id=self.sampler_id, address=self.address),
            timeout=5.0,
            metadata=self.metadata,
        )
        self.registered = reply.accepted
        self.interval_s = reply.heartbeat_interval_s or self.interval_s
        log.info("registered with trainer", extra={"address": self.address,
                                                   "trainer_version": reply.weight_version})

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.registered:
                    self._register()
                else:
                    reply = self._stub.Heartbeat(
                        trainer_pb2.HeartbeatRequest(
                            sampler_id=self.sampler_id, address=self.address
                        ),
                        timeout=5.0,
                        metadata=self.metadata,
                    )
                    if not reply.known:
                        self.registered = False
                        continue
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                grpc.StatusCode.INVALID_ARGUMENT):
                    log.error("trainer refused registration", extra={"error": e.details()})
                self.registered = False
            self._stop.wait(self.interval_s)
