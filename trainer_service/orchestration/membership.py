"""Which samplers exist right now: static addresses, DNS names and self-registration.

Three sources feed one pool, so the same trainer works as local processes, in docker compose
and on Kubernetes:

- ``services.sampler_addresses``: a fixed list;
- ``services.sampler_dns``: ``name:port`` resolved on every refresh; compose service names and
  Kubernetes headless Services resolve to one address per replica, so ``--scale sampler=3`` or
  ``kubectl scale`` is picked up with no address written anywhere;
- ``RegisterSampler``/``Heartbeat`` calls from samplers themselves.

A sampler goes ``new`` -> ``syncing`` (the publisher pushes the current weights) -> ``ready``
(the dispatcher may give it work). The pool announces a sampler that joined on a queue
(:meth:`SamplerPool.next_joined`) and never pushes itself: the trainer's join worker
(``join_sync.py``) pushes on its own threads, so a push that waits for a train step or a slow
sampler never holds up DNS refresh and dead-sampler detection of the others. One that fails a
call is ``suspect``; one that stays unreachable for ``services.sampler_timeout_s`` is dropped:
its channel is closed, so its calls in flight fail and the rollout queue hands their prompts to
other samplers.

A sampler must be a SplitRL sampler of this run (``identity.py``): an address that answers
``GetInfo`` with other agreed settings (config, model, tokenizer), another architecture or
other parameter shapes is refused, naming what differs, and a second address of a process
already known (same instance id) is merged into the known entry, not added beside it. A
sampler that refuses our pushes for a reason that will not change is refused too
(:meth:`SamplerPool.refuse`), and so is one whose rollouts keep failing inside it
(:meth:`SamplerPool.report_internal_failure`). When every sampler is refused,
:meth:`SamplerPool.stalled` says why: the trainer reports it (``Status.stalled``, health
NOT_SERVING). A refused sampler whose address comes back is on probation: it gets work again,
but counts as ready only once a rollout of it completes (it answers probes and takes pushes
whether its engine works or not).

No wait is endless: :meth:`SamplerPool.check_usable` raises :class:`NoUsableSampler`, naming
every sampler and why it cannot take work, once no sampler has been ready for
``services.sampler_wait_s``; the run loop calls it while it waits for rollouts. A sampler
that restarts is dropped (unreachable) and joins again: the clock runs only while no other is
ready, and stops when it is ready again.

The pool is the one writer of sampler state: every field of a :class:`SamplerHandle` changes
only inside a pool method, under the pool's lock. The dispatcher and the publisher report what
they saw (``report_ok``, ``report_failure``, ``behind``, ``mark_ready``, ``remove``) and read
handles; the prompts in flight per sampler are the rollout queue's to count.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field

import grpc

from splitrl.config import ServicesConfig
from splitrl.serving import make_channel
from splitrl.v1 import sampler_pb2, sampler_pb2_grpc
from trainer_service.orchestration.identity import ModelIdentity, RefusedSampler

log = logging.getLogger(__name__)

NEW, SYNCING, READY, SUSPECT = "new", "syncing", "ready", "suspect"


class NoUsableSampler(RuntimeError):
    """No sampler could take work for ``services.sampler_wait_s``: the run stops rather than
    wait on. ``samplers`` maps each address the pool knows of (or refused, or dropped) to why
    it cannot take work."""

    def __init__(self, waited_s: float, samplers: dict[str, str]):
        self.waited_s, self.samplers = waited_s, samplers
        why = "; ".join(f"{a}: {r}" for a, r in sorted(samplers.items())) or (
            "none is known (none configured in services.sampler_addresses or "
            "services.sampler_dns, none registered)")
        super().__init__(f"no sampler has been ready to take work for {waited_s:.0f} s "
                         f"(services.sampler_wait_s): {why}")


@dataclass
class SamplerHandle:
    address: str
    source: str
    channel: grpc.Channel
    stub: sampler_pb2_grpc.SamplerStub
    state: str = NEW
    sampler_id: str = ""
    info: sampler_pb2.SamplerInfo | None = None
    weight_version: int = -1
    # The push id of the weights it serves (GetInfo.weights_id, then our pushes): a delta push
    # needs it to equal the publisher's base. "" = unknown.
    weights_id: str = ""
    last_ok: float = field(default_factory=time.monotonic)
    failures: int = 0
    last_error: str = ""  # of its last failed call, for the report when none can take work
    # Rollouts failed INSIDE the sampler (INTERNAL) since its last completed one.
    internal_failures: int = 0
    # One push at a time per sampler (it refuses a second concurrent one with ABORTED).
    push_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def capacity(self) -> int:
        return self.info.max_batch_size if self.info is not None else 1

    def label(self) -> str:
        return self.sampler_id or self.address


def resolve_dns(name_port: str) -> list[str]:
    """All addresses ``host:port`` resolves to (IPv4 first), as ``ip:port`` strings."""
    host, _, port = name_port.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"services.sampler_dns: expected NAME:PORT, got {name_port!r}")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    out = []
    for family, _, _, _, sockaddr in sorted(infos, key=lambda i: i[0] != socket.AF_INET):
        ip = sockaddr[0]
        addr = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if addr not in out:
            out.append(addr)
    return out


class SamplerPool:
    """Thread-safe registry of samplers with a background refresher."""

    def __init__(
        self,
        services: ServicesConfig,
        *,
        max_message_bytes: int,
        identity: ModelIdentity | None = None,
        sync_joins: bool = True,
    ):
        """``sync_joins``: a sampler that joins waits for the trainer's weights (announced by
        :meth:`next_joined`); False: it is ready at once with whatever it serves (evaluation
        tools, which push nothing)."""
        self._cfg = services
        self._identity = identity
        self._max_message_bytes = max_message_bytes
        self._lock = threading.RLock()
        self._samplers: dict[str, SamplerHandle] = {}
        self._dropped: dict[str, tuple[float, str]] = {}  # address -> (when, why) dropped
        self._aliases: dict[str, str] = {}  # another address of a known sampler -> its own
        self._refused: dict[str, tuple[float, str]] = {}  # address -> (when, why)
        # Addresses refused while serving (refuse()): why, until a rollout of theirs completes.
        self._probation: dict[str, str] = {}
        self._ready_at = time.monotonic()  # when a sampler was last seen ready (the wait's clock)
        self._sync_joins = sync_joins
        self._joined: queue.SimpleQueue[SamplerHandle] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.joined = 0
        self.left = 0

    # -- membership -----------------------------------------------------------------------

    def add(self, address: str, source: str, sampler_id: str = "") -> SamplerHandle:
        with self._lock:
            handle = self._samplers.get(self._aliases.get(address, address))
            if handle is not None:  # known already; only a successful call refreshes last_ok
                if sampler_id:
                    handle.sampler_id = sampler_id
                return handle
            self._dropped.pop(address, None)
            channel = make_channel(address, self._max_message_bytes, self._cfg.auth)
            handle = SamplerHandle(
                address=address,
                source=source,
                channel=channel,
                stub=sampler_pb2_grpc.SamplerStub(channel),
                sampler_id=sampler_id,
            )
            self._samplers[address] = handle
        log.info("sampler discovered", extra={"address": address, "source": source})
        return handle

    def get(self, address: str) -> SamplerHandle | None:
        with self._lock:
            return self._samplers.get(self._aliases.get(address, address))

    def register(self, address: str, sampler_id: str = "") -> SamplerHandle:
        """A sampler announced itself at ``address``: check it is a sampler of our model
        (RefusedSampler says why not) and add it, or return its entry if the process is known
        under another address. Nothing is pushed here; the next refresh syncs it."""
        info = self._get_info(address)
        reason = self._identity.mismatch(info) if self._identity else None
        if reason:
            assert self._identity is not None  # the reason is its answer
            self._refuse(address, reason)
            raise RefusedSampler(f"{address} is not a sampler of this run: {reason}",
                                 keys=self._identity.differing_keys(info))
        with self._lock:
            twin = self._instance(info.instance_id)
            if twin is not None and twin.address != address:
                self._aliases[address] = twin.address
                log.info("sampler already known under another address",
                         extra={"address": address, "known_as": twin.address})
                return twin
            self._refused.pop(address, None)
        return self.add(address, "registered", sampler_id)

    def _get_info(self, address: str) -> sampler_pb2.SamplerInfo:
        channel = make_channel(address, self._max_message_bytes, self._cfg.auth)
        try:
            return sampler_pb2_grpc.SamplerStub(channel).GetInfo(sampler_pb2.GetInfoRequest(),
                                                                 timeout=5.0)
        except grpc.RpcError as e:
            raise RefusedSampler(f"{address} did not answer GetInfo as a SplitRL sampler "
                                 f"({e.code().name}: {e.details()})") from None
        finally:
            channel.close()

    def _instance(self, instance_id: str) -> SamplerHandle | None:
        if not instance_id:
            return None
        return next((h for h in self._samplers.values()
                     if h.info is not None and h.info.instance_id == instance_id), None)

    def _refuse(self, address: str, reason: str) -> None:
        with self._lock:
            repeated = self._refused.get(address, (None, ""))[1] == reason
            self._refused[address] = (time.monotonic(), reason)
        # An error, once per address and reason (a configured address is retried).
        (log.info if repeated else log.error)(f"sampler {address} refused: {reason}",
                                              extra={"address": address})

    def refuse(self, handle: SamplerHandle, reason: str) -> None:
        """``handle`` refuses what every push of ours would be (``reason``): drop it and keep
        it out until it is restarted (a configured address is tried again after
        ``services.sampler_timeout_s``; a sampler that registers again is checked again)."""
        self._refuse(handle.address, reason)
        with self._lock:
            self._probation[handle.address] = reason
        self.remove(handle, reason)

    def stalled(self) -> str:
        """Why no sampler can take work and waiting will not help (every sampler known was
        refused); "" while some sampler is usable or may still become so."""
        with self._lock:
            if any(h.state in (SYNCING, READY, SUSPECT) and h.address not in self._probation
                   for h in self._samplers.values()):
                return ""
            refused = sorted({**{a: r for a, (_, r) in self._refused.items()},
                              **self._probation}.items())
        if not refused:
            return ""
        address, reason = refused[0]
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        return f"every sampler was refused: {address}: {reason}{more}"

    def remove(self, handle: SamplerHandle, why: str) -> None:
        with self._lock:
            if self._samplers.get(handle.address) is not handle:
                return
            del self._samplers[handle.address]
            self._dropped[handle.address] = (time.monotonic(), why)
            self._aliases = {a: c for a, c in self._aliases.items() if c != handle.address}
            self.left += 1
        handle.channel.close()  # its calls in flight fail; the queue re-dispatches them
        log.warning("sampler dropped", extra={"address": handle.address, "why": why})

    def _forget(self, handle: SamplerHandle, why: str) -> None:
        """Remove an entry that is not a sampler of ours (refused, or an alias): not a
        sampler leaving the run."""
        with self._lock:
            if self._samplers.get(handle.address) is not handle:
                return
            del self._samplers[handle.address]
        handle.channel.close()
        log.info("sampler entry removed", extra={"address": handle.address, "why": why})

    def all(self) -> list[SamplerHandle]:
        with self._lock:
            return list(self._samplers.values())

    def ready(self) -> list[SamplerHandle]:
        return [h for h in self.all() if h.state == READY]

    def report_failure(self, handle: SamplerHandle, error: Exception | str) -> None:
        """A call to ``handle`` failed: stop giving it work until a probe succeeds."""
        with self._lock:
            handle.failures += 1
            handle.last_error = str(error)
            if handle.state == READY:
                handle.state = SUSPECT
        log.warning("sampler call failed", extra={"address": handle.address, "error": str(error)})

    def report_internal_failure(self, handle: SamplerHandle, error: str) -> None:
        """A rollout failed inside ``handle`` (INTERNAL: its engine, not the network): suspect
        as any failure, and refused once ``services.sampler_max_internal_failures`` rollouts in
        a row failed so. It still answers probes, so suspect alone would hand it work again
        and again, every prompt failing, with the run waiting for groups that never come."""
        self.report_failure(handle, error)
        with self._lock:
            handle.internal_failures += 1
            failed = handle.internal_failures
        if failed >= self._cfg.sampler_max_internal_failures:
            self.refuse(handle, f"its last {failed} rollouts failed inside it; the last: {error}")

    def report_ok(self, handle: SamplerHandle) -> None:
        """``handle`` answered (a heartbeat, a push): alive. Not that its engine works: only a
        completed rollout says that (:meth:`report_rollout_ok`)."""
        with self._lock:
            handle.last_ok = time.monotonic()
            handle.failures = 0

    def report_rollout_ok(self, handle: SamplerHandle) -> None:
        """A rollout of ``handle`` completed: its count of failures inside it starts again,
        and a sampler on probation (refused before) is ready as any other."""
        self.report_ok(handle)
        with self._lock:
            handle.internal_failures = 0
            if self._probation.pop(handle.address, None) is not None:
                log.info("sampler refused before completed a rollout: ready again",
                         extra={"address": handle.address})
        self._see_ready()

    # -- the wait for a usable sampler ----------------------------------------------------

    def unready_s(self) -> float:
        """Seconds since a sampler was last ready to take work (0 while one is)."""
        with self._lock:
            return self._see_ready() - self._ready_at

    def _see_ready(self) -> float:
        """Restart the wait's clock if a sampler is ready now (one on probation is not,
        until a rollout of it completes); returns now. Called wherever readiness may have
        changed, so the clock does not depend on a wait asking."""
        with self._lock:
            now = time.monotonic()
            if any(h.state == READY and h.address not in self._probation
                   for h in self._samplers.values()):
                self._ready_at = now
            return now

    def check_usable(self) -> None:
        """Raise :class:`NoUsableSampler` once no sampler has been ready for
        ``services.sampler_wait_s``; a waiting run loop calls it on every poll."""
        waited = self.unready_s()
        if waited > self._cfg.sampler_wait_s:
            raise NoUsableSampler(waited, self.not_ready())

    def not_ready(self) -> dict[str, str]:
        """Why each sampler the pool knows of, refused or dropped cannot take work."""
        with self._lock:
            out = {a: f"dropped: {why}" for a, (_, why) in self._dropped.items()}
            out.update((a, f"refused: {why}") for a, (_, why) in self._refused.items())
            for h in self._samplers.values():
                if h.address in self._probation:
                    why = (f"refused: {self._probation[h.address]}; taken back, no rollout "
                           f"of it has completed since")
                elif h.state == NEW:
                    why = f"has not answered a probe ({h.last_error or 'never reached'})"
                elif h.state == SYNCING:
                    why = "receiving the trainer's weights"
                elif h.state == SUSPECT:
                    why = f"its last call failed: {h.last_error}"
                else:
                    continue
                out[h.address] = why
            return out

    # -- probing --------------------------------------------------------------------------

    def _probe(self, handle: SamplerHandle) -> None:
        try:
            info = handle.stub.GetInfo(sampler_pb2.GetInfoRequest(), timeout=5.0)
        except grpc.RpcError as e:
            with self._lock:
                handle.last_error = f"GetInfo: {e.code().name}"
            if time.monotonic() - handle.last_ok > self._cfg.sampler_timeout_s:
                self.remove(handle, f"unreachable for {self._cfg.sampler_timeout_s:.0f}s: "
                                    f"{e.code().name}")
            elif handle.state == READY:
                self.report_failure(handle, e.code().name)
            return
        reason = self._identity.mismatch(info) if self._identity else None
        if reason:
            self._refuse(handle.address, reason)
            self._forget(handle, f"not a sampler of this run's model: {reason}")
            return
        joined = False
        with self._lock:
            twin = self._instance(info.instance_id)
            if twin is not None and twin is not handle:
                self._aliases[handle.address] = twin.address
                merged = True
            else:
                merged = False
        if merged:
            assert twin is not None  # merged with it
            self._forget(handle, f"the same sampler process as {twin.address}")
            return
        with self._lock:
            restarted = (handle.info is not None and info.instance_id
                         and handle.info.instance_id != info.instance_id)
            if restarted:  # a new process at the same address: it holds none of our weights
                handle.state = NEW
            handle.info = info
            handle.sampler_id = info.sampler_id or handle.sampler_id
            self._refused.pop(handle.address, None)  # it passed the check this time
            handle.last_ok = time.monotonic()
            if handle.state == NEW:
                # Afterwards the version is tracked from our own pushes (a probe's reply may
                # be older than a push that completed meanwhile).
                handle.weight_version = info.weight_version
                handle.weights_id = info.weights_id
                handle.state = SYNCING
                self.joined += 1
                joined = True
            elif handle.state == SUSPECT:
                handle.state = READY
        if joined:
            log.info("sampler joined", extra={"address": handle.address, "id": info.sampler_id,
                                              "restarted": bool(restarted)})
            if self._sync_joins:
                self._joined.put(handle)
            else:
                self.mark_ready(handle, info.weight_version, info.weights_id)

    def next_joined(self, timeout_s: float) -> SamplerHandle | None:
        """The next sampler that joined and waits for the current weights (oldest first), or
        None after ``timeout_s``. Each join is handed out once; the pushed weights make it
        ready (:meth:`mark_ready`)."""
        try:
            return self._joined.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def refresh(self) -> None:
        """Resolve DNS, probe every sampler, drop the dead ones, announce the new ones
        (:meth:`next_joined`)."""
        candidates = [(a, "static") for a in self._cfg.sampler_addresses]
        if self._cfg.sampler_dns:
            candidates += [(a, "dns") for a in resolve_dns(self._cfg.sampler_dns)]
        now = time.monotonic()
        for address, source in candidates:
            # A configured address that was dropped or refused is tried again after a
            # back-off (it may be restarted, or replaced); registration re-adds at once.
            dropped = self._dropped.get(address, (None,))[0]
            refused = self._refused.get(address, (None,))[0]
            if address in self._aliases:
                continue
            if all(t is None or now - t > self._cfg.sampler_timeout_s
                   for t in (dropped, refused)):
                self.add(address, source)
        for handle in self.all():
            self._probe(handle)
        self._see_ready()

    def behind(self, handle: SamplerHandle, required_version: int) -> None:
        """The sampler refused a request needing ``required_version``: it lost our weights
        (e.g. it restarted at the same address). Treat it as new, so the next refresh pushes
        it the current weights before it gets work."""
        with self._lock:
            handle.weight_version = min(handle.weight_version, required_version - 1)
            if handle.state != SYNCING:
                handle.state = NEW

    def mark_ready(self, handle: SamplerHandle, version: int, weights_id: str = "") -> None:
        """A push of ``version`` (named ``weights_id``) was applied: the sampler may get work."""
        with self._lock:
            handle.weight_version = version
            handle.weights_id = weights_id
            if handle.state in (SYNCING, NEW, SUSPECT):
                handle.state = READY
        self._see_ready()

    def weights_unknown(self, handle: SamplerHandle) -> None:
        """A push failed: the sampler may or may not have applied it, so no delta is computed
        against what it serves until a full push succeeds."""
        with self._lock:
            handle.weights_id = ""

    def start(self, interval_s: float | None = None) -> None:
        """Refresh every ``interval_s`` (``services.heartbeat_s``) in the background; the
        wait for a usable sampler counts from here."""
        interval = interval_s or self._cfg.heartbeat_s
        with self._lock:
            self._ready_at = time.monotonic()

        def loop():
            while not self._stop.is_set():
                try:
                    self.refresh()
                except Exception:  # a refresh must never kill the trainer
                    log.exception("sampler refresh failed")
                self._stop.wait(interval)

        self._thread = threading.Thread(target=loop, name="sampler-pool", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for handle in self.all():
            handle.channel.close()
