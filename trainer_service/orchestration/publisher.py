"""Pushes the trainer's weights to every sampler, resharded for each sampler's layout.

After an update the trainer pushes version ``v`` to all samplers (``push_all``; in the
background with ``push_all_async`` when the run allows staleness). Per sampler the stream is
planned from that sampler's ``GetInfo`` layout (:func:`splitrl.wire.layouts_from_info`): the
trainer's shards (e.g. fsdp over 4 devices) are cut along the sampler's block boundaries (e.g.
tensor parallel over 2) and cast to the dtype it serves, so neither side assembles a tensor it
does not need whole. ``trainer.push`` (docs/weight-sync.md) chooses how the bytes travel:

- **bulk** (default): the sampler's data plane (``GetInfo.data_address``), a TCP/TLS stream at
  close to wire speed. Samplers with the same layout form one **relay chain** (healthy ones in
  address order; a suspect one gets its own), so the trainer sends each byte once however many
  samplers there are. Hops that a failed relay cut off are pushed again directly, chain by
  chain, until each sampler has its own answer.
- **delta**: a sampler known to serve the last push (its weights id) gets only the elements that
  changed (``splitrl.wire``'s SPARSE chunks, chosen chunk by chunk when smaller); anyone else
  (new, reset, after a failure) gets a full push.
- **grpc**: ``PushWeights``, for samplers without a data plane (or ``transport: grpc``).

- **adapters** (LoRA runs, ``lora=``): the pushed params are the adapters' factors, sent whole
  in float32 with ``PushHeader.lora`` naming the rank, alpha, targets and the base checkpoint's
  fingerprint; each sampler merges them into its own copy of that base (never a delta).

A sampler that answers FAILED_PRECONDITION (it serves a newer version, or another base) is
pushed again at once as a full reset to exactly our weights. One that answers
INVALID_ARGUMENT refuses what any push of ours would be (parameters it does not have, a
negative version): waiting cannot help, so it is refused and dropped from the pool at once,
with its reason on the console. Sampler state changes only through the pool (``mark_ready``,
``report_ok``, ``report_failure``, ``weights_unknown``, ``remove``).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass
from typing import NamedTuple

import grpc
import jax

from splitrl.config import AuthConfig, PushConfig
from splitrl.dataplane.link import PushLink, status_code
from splitrl.models.lora import LoraSpec
from splitrl.v1 import sampler_pb2
from splitrl.wire import (
    adapter_header,
    adapter_layouts,
    build_shard_lists,
    iter_push_frames,
    iter_push_messages,
    layouts_from_info,
    push_header,
)
from trainer_service.orchestration.delta_base import DeltaBase, dtype_profile
from trainer_service.orchestration.membership import READY, SUSPECT, SamplerHandle, SamplerPool

log = logging.getLogger(__name__)


class _Served(NamedTuple):
    """What a sampler serves, as one GetInfo reply says: worked out once per reply."""

    info: sampler_pb2.SamplerInfo
    layouts: dict  # {name: TargetLayout}
    profile: tuple  # its dtype profile: samplers with equal ones take the same bytes
    digest: str  # of the profile, in push ids
    chain_key: tuple  # model, mesh and every parameter's dtype and partition: one relay chain


@dataclass
class PushResult:
    address: str
    version: int
    ok: bool
    bytes: int = 0  # payload bytes the sampler received (a delta: fewer than full_bytes)
    seconds: float = 0.0
    error: str = ""
    egress_bytes: int = 0  # bytes the trainer itself sent for it (0: a relay brought them)
    full_bytes: int = 0  # the weights in the sampler's dtype: what a full push carries
    transport: str = ""  # "bulk", "grpc" or "" (nothing sent)
    delta: bool = False
    # Not finished when push_all returned: a straggler (its push goes on in the background)
    # or a sampler still busy with an earlier push (skipped this time).
    background: bool = False
    # The status the push ended with (OK when ok; INVALID_ARGUMENT also for layouts that do
    # not match, found before anything is sent); None when nothing was attempted.
    code: grpc.StatusCode | None = None


# Refusals that every later push would get too: the sampler is dropped, never retried.
_PERMANENT = frozenset({grpc.StatusCode.INVALID_ARGUMENT})


def push_metrics(results: list[PushResult]) -> dict[str, float]:
    """A finished push in numbers: its own time, the bytes the samplers received, what full
    pushes would have carried, what the trainer sent, and how many samplers failed or were
    left to finish in the background."""
    pushed = [r for r in results if r.ok]
    background = [r for r in results if r.background]
    return {
        "push/seconds": max((r.seconds for r in pushed), default=0.0),
        "push/mb": sum(r.bytes for r in pushed) / 2**20,
        "push/full_mb": sum(r.full_bytes for r in pushed) / 2**20,
        "push/egress_mb": sum(r.egress_bytes for r in results) / 2**20,
        "push/delta": float(sum(r.delta for r in pushed)),
        "push/failed": float(len(results) - len(pushed) - len(background)),
        "push/background": float(len(background)),
    }


class PushInFlight:
    """A ``push_all`` running in the background (:meth:`WeightPublisher.push_all_async`)."""

    def __init__(self, future: Future, version: int):
        self._future = future
        self.version = version
        self.started = time.monotonic()

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> list[PushResult]:
        return self._future.result(timeout)


def _with_reset(messages: Iterator[sampler_pb2.WeightPushMessage], reset: bool):
    for message in messages:
        if reset and message.HasField("header"):
            message.header.reset = True
        yield message


@functools.partial(jax.jit, static_argnums=1)
def _device_copy(params, dtypes: tuple[tuple[str, str | None], ...]):
    """New device arrays (never donated by the learner) in the dtypes the samplers serve."""
    cast = dict(dtypes)
    return {n: (a.astype(cast[n]) if cast[n] is not None else a.copy())
            for n, a in params.items()}


class WeightPublisher:
    def __init__(self, pool: SamplerPool, *, metadata: tuple = (), auth: AuthConfig | None = None,
                 push: PushConfig | None = None, timeout_s: float | None = None,
                 max_workers: int = 8, lora: LoraSpec | None = None,
                 base_fingerprint: str | None = None):
        self.pool = pool
        # LoRA: pushes carry the adapters (the params given are the adapters), for this base.
        self.lora = None if lora is None else adapter_header(lora, base_fingerprint or "")
        self.metadata = metadata
        self.auth = auth
        self.config = push or PushConfig()
        self.timeout_s = timeout_s or self.config.timeout_s
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="push")
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="push-async")
        self._incarnation = uuid.uuid4().hex[:12]  # push ids of two trainer runs never collide
        self._lineage = 0  # rollbacks so far: a version pushed again after one is other bytes
        self._bases: dict[tuple, DeltaBase] = {}
        self._served: dict[str, _Served] = {}  # per sampler address
        self.history: list[PushResult] = []

    # -- public API ---------------------------------------------------------------------------

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
            return self._push_group([handle], params, version, reset)[0]

    def push_all(
        self, params: Mapping, version: int, *, reset: bool = False,
        handles: list[SamplerHandle] | None = None,
    ) -> list[PushResult]:
        """Push to every sampler that can take weights; returns one result per sampler. With
        ``reset`` the samplers take ``version`` even if they serve a newer one (a rollback).

        A slow or stopped sampler does not hold the trainer up: once one sampler has the push,
        the others get ``straggler_wait_s`` to finish; a push still running then goes on in
        the background (its result reaches the pool when it ends), and a sampler whose earlier
        push still runs is skipped (it catches up at the next push after its own ends). Its
        result says ``background``. A reset waits for everyone: it replaces what they serve."""
        if reset:
            self._lineage += 1
        targets = handles if handles is not None else [
            h for h in self.pool.all() if h.info is not None]
        busy = [] if reset else [h for h in targets if h.push_lock.locked()]
        build_shard_lists(params.values())  # before the push threads read them at once
        futures = {self._executor.submit(self._push_locked, group, params, version, reset): group
                   for group in self._plan([h for h in targets if h not in busy])}
        results = self._collect(futures, version, patient=reset)
        results += [PushResult(h.address, version, False, error="an earlier push still runs",
                               background=True) for h in busy]
        self.history.extend(r for r in results if not r.background)
        if results:
            log.info("weights pushed", extra={
                "version": version, "samplers": sum(r.ok for r in results),
                **{k.split("/", 1)[1]: round(v, 3) for k, v in push_metrics(results).items()}})
        return results

    def _collect(self, futures: dict[Future, list[SamplerHandle]], version: int, *,
                 patient: bool) -> list[PushResult]:
        """The results of ``futures`` (one per group of samplers pushed together): all of
        them, or (not ``patient``) those finished ``straggler_wait_s`` after the first
        success; the others are left running and reported as ``background``."""
        results: list[PushResult] = []
        pending = set(futures)
        first_ok: float | None = None
        while pending:
            timeout = None
            if first_ok is not None and not patient:
                timeout = max(0.0, first_ok + self.config.straggler_wait_s - time.monotonic())
            done, pending = wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
            for future in done:
                group_results = future.result()
                results += group_results
                if first_ok is None and any(r.ok for r in group_results):
                    first_ok = time.monotonic()
            if not done:  # the wait ran out: the rest are stragglers
                break
        for future in pending:
            group = futures[future]
            log.warning("push still running; the trainer goes on without it", extra={
                "samplers": [h.address for h in group],
                "waited_s": self.config.straggler_wait_s})
            future.add_done_callback(self._straggler_done)
            results += [PushResult(h.address, version, False, background=True,
                                   error="still pushing in the background") for h in group]
        return results

    def _straggler_done(self, future: Future) -> None:
        """A push that outlived ``push_all`` ended (its samplers' state was recorded by the
        push itself)."""
        if future.cancelled():
            return
        results = future.result()
        self.history.extend(results)
        log.info("background push finished", extra={
            "results": [(r.address, r.version, r.ok, r.error) for r in results]})

    def push_all_async(
        self, params: Mapping, version: int, *, reset: bool = False,
        handles: list[SamplerHandle] | None = None,
    ) -> PushInFlight:
        """:meth:`push_all` in the background; the caller may update ``params`` meanwhile.

        The push reads a device copy of ``params`` made here (in the dtypes the samplers serve
        where they all agree: a float32 trainer feeding bfloat16 samplers copies half the
        bytes), so the learner may donate its buffers to the next update at once.
        """
        snapshot = self.snapshot(params, handles)
        future = self._background.submit(self.push_all, snapshot, version, reset=reset,
                                          handles=handles)
        return PushInFlight(future, version)

    def snapshot(self, params: Mapping, handles: list[SamplerHandle] | None = None) -> Mapping:
        """``params`` as a push may read them after the learner moved on: device arrays are
        copied on their devices (cast where every sampler serves one dtype); host arrays are
        already a copy."""
        if not any(isinstance(a, jax.Array) for a in params.values()):
            return params
        infos = [h.info for h in (handles if handles is not None else self.pool.all())
                 if h.info is not None]
        served: dict[str, set[str]] = {}
        for info in infos:
            for p in info.params:
                served.setdefault(p.name, set()).add(p.dtype)
        dtypes = {n: (next(iter(served[n])) if len(served.get(n, ())) == 1
                      and served[n] != {str(a.dtype)} else None) for n, a in params.items()}
        return _device_copy(dict(params), tuple(sorted(dtypes.items())))

    def close(self) -> None:
        self._background.shutdown(wait=True, cancel_futures=True)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- planning -----------------------------------------------------------------------------

    def _layouts(self, handle: SamplerHandle, params: Mapping) -> dict:
        """How ``handle`` receives ``params``: its served layout, or whole float32 adapters."""
        if self.lora is not None:
            return adapter_layouts(_info(handle), params)
        return self._served_by(handle).layouts

    def _served_by(self, handle: SamplerHandle) -> _Served:
        served = self._served.get(handle.address)
        if served is None or served.info is not handle.info:
            info = _info(handle)
            layouts = layouts_from_info(info)
            profile = dtype_profile(layouts)
            digest = hashlib.sha256(repr(profile).encode()).hexdigest()[:8]
            chain_key = (info.model_fingerprint, tuple(info.mesh.axis_names),
                         tuple(info.mesh.axis_sizes),
                         tuple((p.name, p.dtype, tuple(p.partition)) for p in info.params))
            served = self._served[handle.address] = _Served(info, layouts, profile, digest,
                                                            chain_key)
        return served

    def _bulk(self, handle: SamplerHandle) -> bool:
        return self.config.transport == "bulk" and bool(_info(handle).data_address)

    def _plan(self, targets: list[SamplerHandle]) -> list[list[SamplerHandle]]:
        """Groups pushed together: a relay chain per layout of healthy bulk samplers; everyone
        else alone (gRPC samplers, suspect ones: a stalled relay would hold up its chain)."""
        chains: dict[tuple, list[SamplerHandle]] = {}
        alone: list[list[SamplerHandle]] = []
        for handle in sorted(targets, key=lambda h: h.address):
            if not (self.config.relay and self._bulk(handle)) or handle.state == SUSPECT:
                alone.append([handle])
                continue
            chains.setdefault(self._served_by(handle).chain_key, []).append(handle)
        return list(chains.values()) + alone

    # -- pushing ------------------------------------------------------------------------------

    def _push_locked(self, group: list[SamplerHandle], params: Mapping, version: int,
                     reset: bool) -> list[PushResult]:
        with ExitStack() as stack:
            for handle in group:  # address order (from _plan): no two pushes deadlock
                stack.enter_context(handle.push_lock)
            return self._push_group(group, params, version, reset)

    def _push_group(self, group: list[SamplerHandle], params: Mapping, version: int,
                    reset: bool) -> list[PushResult]:
        """Push to ``group`` (push locks held) until every member has its own answer."""
        results: dict[str, PushResult] = {}
        pending = [h for h in group if h.info is not None]
        for handle in group:
            if handle.info is None:
                results[handle.address] = PushResult(handle.address, version, False,
                                                     error="no GetInfo yet")
        resets: list[SamplerHandle] = []
        while pending:
            if self._bulk(pending[0]):
                round_results = self._push_bulk(pending, params, version, reset)
            else:
                round_results = [self._push_grpc(pending[0], params, version, reset)]
            pending = []
            for handle, result, relay_failure in round_results:
                if relay_failure:
                    pending.append(handle)  # cut off by a relay: try again without it
                elif (not result.ok and not reset and handle not in resets
                      and result.code == grpc.StatusCode.FAILED_PRECONDITION):
                    resets.append(handle)
                else:
                    results[handle.address] = result
        if resets:  # it serves a newer version or another base: roll it to exactly ours
            for result in self._push_group(resets, params, version, True):
                results[result.address] = result
        for handle in group:
            self._record(handle, results[handle.address])
        return [results[h.address] for h in group]

    def _record(self, handle: SamplerHandle, result: PushResult) -> None:
        if result.ok:
            self.pool.report_ok(handle)
            self.pool.mark_ready(handle, result.version, self._push_id(handle, result.version))
        elif result.transport:  # something was attempted and failed
            self.pool.weights_unknown(handle)
            if result.code in _PERMANENT:
                self.pool.refuse(handle, f"it refused push version {result.version}: "
                                         f"{result.error}")
            else:
                self.pool.report_failure(handle, f"push failed: {result.error}")
                log.warning("weight push failed", extra=result.__dict__)

    def _push_id(self, handle: SamplerHandle, version: int) -> str:
        """Names the bytes of ``version`` in ``handle``'s dtypes, for this trainer run."""
        digest = self._served_by(handle).digest
        return f"{self._incarnation}.{self._lineage}-v{version}-{digest}"

    def _push_bulk(self, chain: list[SamplerHandle], params: Mapping, version: int,
                   reset: bool) -> list[tuple[SamplerHandle, PushResult, bool]]:
        """One relay chain over the data plane; ``(handle, result, relay_failure)`` per hop."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        layouts = self._layouts(chain[0], params)
        push_id = self._push_id(chain[0], version)
        base, use_delta, base_id = None, False, ""
        if self.config.delta and self.lora is None:
            base = self._bases.setdefault(self._served_by(chain[0]).profile, DeltaBase())
            if not base.claim():
                base = None  # another chain of this profile is reading it: go full
            elif (not reset and base.push_id is not None
                  and all(h.weights_id == base.push_id for h in chain)):
                use_delta, base_id = True, base.push_id
        try:
            try:
                header = push_header(params, version, target_shardings=layouts,
                                     sender="trainer", reset=reset, push_id=push_id,
                                     base_id=base_id)
                if self.lora is not None:
                    header.lora.CopyFrom(self.lora)
            except ValueError as e:  # layouts do not match: a different model
                return [(h, PushResult(h.address, version, False, error=f"INCOMPATIBLE: {e}",
                                       transport="bulk",
                                       code=grpc.StatusCode.INVALID_ARGUMENT), False)
                        for h in chain]
            frames = iter_push_frames(
                params, version, max_chunk_bytes=min(_info(h).max_chunk_bytes for h in chain),
                target_shardings=layouts,
                base=base.block if use_delta and base is not None else None,
                sink=base.keep if base is not None else None)
            link = PushLink([_data_address(h) for h in chain], header, auth=self.auth,
                            idle_timeout_s=self.config.idle_timeout_s)
            outcomes, sent_all = link.run(frames, deadline=deadline)
            if sent_all and base is not None:
                base.complete(push_id, version)
        finally:
            if base is not None:
                base.release()
        seconds = time.monotonic() - start
        out = []
        for i, (handle, o) in enumerate(zip(chain, outcomes, strict=True)):
            code = status_code(o.code)
            ok = code == grpc.StatusCode.OK and o.version == version
            out.append((handle, PushResult(
                handle.address, o.version if ok else version, ok, o.bytes_received, seconds,
                "" if ok else f"{code.name}: {o.message}",
                egress_bytes=link.bytes_sent if i == 0 else 0, full_bytes=header.total_bytes,
                transport="bulk", delta=use_delta, code=code), o.relay_failure))
        return out

    def _push_grpc(self, handle: SamplerHandle, params: Mapping, version: int,
                   reset: bool) -> tuple[SamplerHandle, PushResult, bool]:
        start = time.monotonic()
        layouts = self._layouts(handle, params)
        try:
            messages = iter_push_messages(
                params, version, max_chunk_bytes=_info(handle).max_chunk_bytes,
                target_shardings=layouts, sender="trainer",
                push_id=self._push_id(handle, version))
            first = next(messages)  # the header: checks the layouts
            if self.lora is not None:
                first.header.lora.CopyFrom(self.lora)
            reply = handle.stub.PushWeights(
                _with_reset(itertools.chain([first], messages), reset), timeout=self.timeout_s,
                metadata=self.metadata)
        except grpc.RpcError as e:
            return handle, PushResult(handle.address, version, False,
                                      seconds=time.monotonic() - start,
                                      error=f"{e.code().name}: {e.details()}",
                                      transport="grpc", code=e.code()), False
        except ValueError as e:  # layouts do not match: a different model
            return handle, PushResult(handle.address, version, False,
                                      error=f"INCOMPATIBLE: {e}", transport="grpc",
                                      code=grpc.StatusCode.INVALID_ARGUMENT), False
        return handle, PushResult(handle.address, reply.version, True, reply.bytes_received,
                                  time.monotonic() - start, egress_bytes=reply.bytes_received,
                                  full_bytes=first.header.total_bytes, transport="grpc",
                                  code=grpc.StatusCode.OK), False


def _data_address(handle: SamplerHandle) -> str:
    """Where to reach ``handle``'s data plane: the host we reach its gRPC server at (a pod IP
    from DNS, a compose service name) and the port it advertises; its own idea of its host
    name may not resolve from here."""
    host = handle.address.rpartition(":")[0]
    port = _info(handle).data_address.rpartition(":")[2]
    return f"{host}:{port}"


def _info(handle: SamplerHandle) -> sampler_pb2.SamplerInfo:
    """What ``handle`` said of itself (GetInfo): the publisher pushes only to samplers that did."""
    assert handle.info is not None, f"{handle.address} has not described itself yet"
    return handle.info
