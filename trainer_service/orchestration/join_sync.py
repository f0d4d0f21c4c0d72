"""Samplers that join get the trainer's current weights, pushed on threads of their own.

The sampler pool announces a sampler that joined (:meth:`SamplerPool.next_joined`); a worker
here reads the current weights, asks the publisher for a reset push (whatever the sampler
served before, its own checkpoint or another run's weights of the same model, is replaced),
and the push marks it ready. Such a push waits for the params (held through a train step) and
then takes as long as a full push: on the pool's refresh thread it stopped DNS refresh and
dead-sampler detection for every sampler meanwhile, so it runs here. Data flows one way: the
pool announces, this worker pushes, the publisher reports the result to the pool.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from trainer_service.orchestration.membership import SamplerHandle, SamplerPool
from trainer_service.orchestration.publisher import PushResult, WeightPublisher

log = logging.getLogger(__name__)


class JoinSync:
    """``workers`` threads, each pushing to one joined sampler at a time: a sampler that stops
    reading holds its own push (until ``trainer.push.timeout_s``), not the other joins.
    ``current_weights()`` returns ``(params, version)`` as the publisher reads them."""

    def __init__(self, pool: SamplerPool, publisher: WeightPublisher,
                 current_weights: Callable[[], tuple[Mapping, int]], workers: int = 2,
                 poll_s: float = 0.2):
        self.pool = pool
        self.publisher = publisher
        self.current_weights = current_weights
        self._workers = workers
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self._workers):
            thread = threading.Thread(target=self._loop, name=f"join-sync-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _loop(self) -> None:
        while not self._stop.is_set():
            handle = self.pool.next_joined(self._poll_s)
            if handle is None:
                continue
            try:
                self.sync(handle)
            except Exception:  # the next join (or the next regular push) tries again
                log.exception("sampler sync failed", extra={"address": handle.address})

    def sync(self, handle: SamplerHandle) -> PushResult:
        """Push the current weights to ``handle`` as a reset, unless it serves them already."""
        params, version = self.current_weights()
        served = ("the weights of its own model.path" if not handle.weights_id
                  else f"weights version {handle.weight_version} ({handle.weights_id})")
        result = self.publisher.push_one(handle, params, version, reset=True,
                                         unless_current=True)
        # One line: what it served before, and that it now serves the trainer's weights.
        log.info("sampler synced", extra={"address": handle.address, "served_before": served,
                                          "ok": result.ok, "version": version,
                                          "error": result.error})
        return result

    def stop(self) -> None:
        """Stop taking joins; a push under way ends by its own deadline (daemon threads)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2 * self._poll_s + 1)
