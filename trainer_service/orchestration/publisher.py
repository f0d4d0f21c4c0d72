"""Pushes the trainer's weights to every sampler, resharded for each sampler's layout.

After an update the trainer pushes version ``v`` to all samplers concurrently. For each
sampler the stream is planned from that sampler's ``GetInfo`` layout
(:func:`splitrl.wire.layouts_from_info`): the trainer's shards (e.g. fsdp over 4 devices) are
cut along the sampler's block boundaries (e.g. tensor parallel over 2) and sent as regions in
bounded chunks, so neither side assembles a tensor it does not need whole. Bytes and seconds
of every push are recorded for the metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from splitrl.v1 import sampler_pb2
from splitrl.wire import iter_push_messages, layouts_from_info
from trainer_service.orchestration.membership import READY, SamplerHandle, SamplerPool

log = logging.getLogger(__name__)


@dataclass
class PushResult:
    address: str
    version: int
    ok: bool
    bytes: int = 0
    seconds: float = 0.0
    error: str = ""


def _with_reset(messages: Iterator[sampler_pb2.WeightPushMessage], reset: bool):
    for message in messages:
        if reset and message.HasField("header"):
            message.header.reset = True
        yield message


class WeightPublisher:
    def __init__(self, pool: SamplerPool, *, metadata: tuple = (), timeout_s: float = 300.0,
                 max_workers: int = 8):
        self.pool = pool
        self.metadata = metadata
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="push")
        self.history: list[PushResult] = []

    def push_one(
        self, handle: SamplerHandle, params: Mapping, version: int, *, reset: bool = False,
        unless_current: bool = False,
    ) -> PushResult:
        """Push ``params`` as ``version`` to one sampler; on success it becomes ready.

        Pushes to one sampler are serialised. With ``unless_current`` nothing is sent when the
        sampler already holds ``version`` or newer from us (a join racing a regular push).
        """
        with handle.push_lock:
            if unless_current and handle.state == READY and handle.weight_version >= version:
                return PushResult(handle.address, handle.weight_version, True)
            return self._push_locked(handle, params, version, reset)

    def _push_locked(
        self, handle: SamplerHandle, params: Mapping, version: int, reset: bool
    ) -> PushResult:
        start = time.monotonic()
        if handle.info is None:
            return PushResult(handle.address, version, False, error="no GetInfo yet")
        try:
            messages = iter_push_messages(
                params,
                version,
                max_chunk_bytes=handle.info.max_chunk_bytes,
                target_shardings=layouts_from_info(handle.info),
                sender="trainer",
            )
            reply = handle.stub.PushWeights(
                _with_reset(messages, reset), timeout=self.timeout_s, metadata=self.metadata
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and not reset:
                # The sampler already serves this version or newer (e.g. another trainer
                # incarnation pushed it). Roll it to exactly our weights.
                return self._push_locked(handle, params, version, reset=True)
            self.pool.report_failure(handle, f"push failed: {e.code().name}: {e.details()}")
            result = PushResult(handle.address, version, False,
                                seconds=time.monotonic() - start,
                                error=f"{e.code().name}: {e.details()}")
            log.warning("weight push failed", extra=result.__dict__)
            return result
        except ValueError as e:  # layouts do not match: a different model
            self.pool.remove(handle, f"incompatible model: {e}")
            return PushResult(handle.address, version, False, error=str(e))
        self.pool.report_ok(handle)
        self.pool.mark_ready(handle, reply.version)
        return PushResult(handle.address, version, True, reply.bytes_received,
                          time.monotonic() - start)

    def push_all(
        self, params: Mapping, version: int, *, reset: bool = False,
        handles: list[SamplerHandle] | None = None,
    ) -> list[PushResult]:
        """Push to every sampler that can take weights, concurrently; returns per-sampler."""
        targets = handles if handles is not None else [
            h for h in self.pool.all() if h.info is not None
        ]
        futures = [self._executor.submit(self.push_one, h, params, version, reset=reset)
                   for h in targets]
        results = [f.result() for f in futures]
        self.history.extend(results)
        ok = [r for r in results if r.ok]
        if ok:
            log.info(
                "weights pushed",
                extra={
                    "version": version,
                    "samplers": len(ok),
                    "failed": len(results) - len(ok),
                    "mb": round(sum(r.bytes for r in ok) / 2**20, 2),
                    "seconds": round(max(r.seconds for r in ok), 3),
                },
            )
        return results

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
