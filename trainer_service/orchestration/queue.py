"""The rollout queue: the one owner of every work item, from its draw until it is trained.

An item is, at any moment, in exactly one place, and only this class moves it:

    queued     waiting for a sampler, inside a *unit* (the prompts that go out in one request)
    in flight  in request R on sampler S; its group, once back, is held with R until R ends
               when the lane is reproducible, or buffered at once otherwise
    buffered   its scored group waits to be trained on
    done       taken for training, filtered (dynamic sampling), or dropped (refused twice)

Who calls what; data flows one way and nothing here calls back:

    run loop     add(), set_version(), take(), unfinished() for checkpoints, drain_events()
    dispatcher   claim(), deliver(), finish()

**Lanes.** Training and evaluation items share the queue and the dispatch path; a :class:`Lane`
says how its items are rolled out (group size, sampling, staleness bound, request size).
Evaluation goes first when both have work.

**Reproducible lanes** (a synchronous run, ``trainer.max_staleness == 0``) cut items into
units of a fixed size in draw order when they are added, and a unit keeps its composition for
its whole life: its request is the same whichever sampler takes it and however many samplers
there are, its groups are accepted only when the whole request succeeded (a failed request is
re-sent whole), and :meth:`take` returns groups sorted by draw order. A unit is named by its
first item's draw number (``WorkItem.unit``), which a checkpoint keeps, so a resumed run sends
the same requests. A shortfall is reported only once nothing of the lane is queued or in
flight: how many replacements are drawn, and so how they are cut into units, must not depend on
which request finished first. With per-item seeds and a sampler that honours
``RolloutRequest.reproducible``, a synchronous run is then a function of its config and seed.
Other lanes hand a sampler up to its free capacity (a fair share of the queue), and re-queue
only what a failed request did not return.

**Staleness.** A group generated with weights older than ``version - max_staleness`` (by the
oldest version of any of its tokens) is not trained on: its item is queued again, to be rolled
out with fresh weights. **Dynamic sampling**: with ``filter_zero_variance`` a group whose
completions all scored the same is filtered (done, recorded in the events); :meth:`take` then
reports a shortfall so the loop draws replacements. **Refusals**: a request a sampler refuses as
invalid (INVALID_ARGUMENT) has its items retried one per request; an item refused a second time
is dropped with the reason and counted, never re-dispatched forever.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from splitrl.v1 import common_pb2
from trainer_service.orchestration.rollouts import TRAIN, RolloutGroup, WorkItem

MAX_REFUSALS = 2


@dataclass(frozen=True)
class Lane:
    """How one kind of work item is rolled out."""

    name: str
    group_size: int
    sampling: common_pb2.SamplingParams
    max_staleness: int = 0
    # Reproducible: units of exactly this many prompts in draw order (the last one of an add
    # may be smaller). None: adaptive (a fair share of the queue, up to a sampler's capacity).
    request_size: int | None = None
    filter_zero_variance: bool = False

    @property
    def reproducible(self) -> bool:
        return self.request_size is not None


@dataclass
class Claim:
    """A request the dispatcher is to send: ``items`` of ``lane`` to one sampler."""

    request_id: str
    lane: Lane
    items: list[WorkItem]
    min_version: int


@dataclass
class Failure:
    """Why a request ended without all its groups."""

    message: str
    refused: bool = False  # the sampler refused the request as invalid (INVALID_ARGUMENT)


@dataclass
class Taken:
    """What :meth:`RolloutQueue.take` returns: ``n`` groups in draw order, or the shortfall
    (how many more items must be added before ``n`` usable groups can exist)."""

    groups: list[RolloutGroup]
    shortfall: int = 0


@dataclass
class Events:
    """Items that became done without being trained on, since the last drain."""

    filtered: list[RolloutGroup] = field(default_factory=list)
    dropped: list[tuple[WorkItem, str]] = field(default_factory=list)


@dataclass
class _InFlight:
    sampler: str
    lane: Lane
    items: list[WorkItem]
    received: dict[str, RolloutGroup] = field(default_factory=dict)

    def pending(self) -> list[WorkItem]:
        """Items this request still holds. An adaptive lane hands each group to the buffer as
        it arrives, so a received item is the buffer's (and may be trained) before the call
        ends; a reproducible unit holds all of its items until it completes."""
        if self.lane.reproducible:
            return self.items
        return [i for i in self.items if i.uid not in self.received]


class RolloutQueue:
    """See the module docstring."""

    def __init__(self, lanes: list[Lane]):
        self._lanes = {lane.name: lane for lane in lanes}
        if len(self._lanes) != len(lanes):
            raise ValueError(f"lane names must be unique, got {[lane.name for lane in lanes]}")
        self._order = sorted(self._lanes, key=lambda n: (n == TRAIN, n))  # eval before train
        self._cond = threading.Condition()
        self._units: dict[str, deque[list[WorkItem]]] = {n: deque() for n in self._lanes}
        self._inflight: dict[str, _InFlight] = {}
        self._buffered: dict[str, dict[str, RolloutGroup]] = {n: {} for n in self._lanes}
        self._events = Events()
        self._ids = itertools.count()
        self._closed = False
        self.version = 0
        self.counts: Counter[str] = Counter()

    def lane(self, name: str) -> Lane:
        return self._lanes[name]

    # -- the run loop's side --------------------------------------------------------------

    def add(self, items: list[WorkItem]) -> None:
        """Queue newly drawn (or restored) items, in the order given, behind what is queued."""
        by_lane: dict[str, list[WorkItem]] = {}
        for item in items:
            if item.lane not in self._lanes:
                raise ValueError(f"work item {item.uid}: unknown lane {item.lane!r}")
            by_lane.setdefault(item.lane, []).append(item)
        with self._cond:
            for name, lane_items in by_lane.items():
                self._units[name].extend(self._cut(self._lanes[name], lane_items))
            self.counts["added"] += len(items)
            self._cond.notify_all()

    def set_version(self, version: int) -> None:
        """The trainer's weights are now ``version``: buffered groups that became too stale
        go back to the queue, and samplers must hold ``version - max_staleness``."""
        with self._cond:
            self.version = version
            for name, groups in self._buffered.items():
                lane = self._lanes[name]
                stale = [groups.pop(u) for u in [u for u, g in groups.items()
                                                  if self._stale(lane, g)]]
                self._requeue_stale(lane, stale)
            self._cond.notify_all()

    def take(self, lane: str, n: int, *, stop: threading.Event | None = None,
             timeout_s: float | None = None,
             check: Callable[[], None] | None = None) -> Taken:
        """The ``n`` buffered groups of ``lane`` earliest in draw order, once there are that
        many; or the shortfall: ``n`` minus the groups buffered and the items still queued or
        in flight (items were filtered or dropped), as soon as it is known, or in a
        reproducible lane once nothing is queued or in flight (see the module). Raises
        InterruptedError when ``stop`` is set or the queue is closed, TimeoutError after
        ``timeout_s``; ``check`` runs on every poll while waiting and may raise to give up
        (no sampler left to generate). The items stay here whatever is raised."""
        if n < 1:
            raise ValueError(f"take: n must be >= 1, got {n}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                buffered = self._buffered[lane]
                if len(buffered) >= n:
                    uids = sorted(buffered, key=lambda u: buffered[u].item.seq)[:n]
                    groups = [buffered.pop(u) for u in uids]
                    self.counts["taken"] += n
                    return Taken(groups)
                pending = self._pending(lane)
                shortfall = n - len(buffered) - pending
                if shortfall > 0 and (pending == 0 or not self._lanes[lane].reproducible):
                    return Taken([], shortfall)
                if self._closed or (stop is not None and stop.is_set()):
                    raise InterruptedError("stopped while waiting for rollout groups")
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"waited {timeout_s:.0f}s for {n} {lane} groups, "
                                       f"have {len(buffered)}")
                if check is not None:
                    check()
                self._cond.wait(timeout=0.5)

    def unfinished(self, lane: str = TRAIN) -> list[WorkItem]:
        """Every item of ``lane`` the run loop has not accounted for, in draw order: queued, in
        flight or buffered, or filtered or dropped but not yet drained (so in no audit record
        yet). One consistent snapshot for a checkpoint: nothing drawn is lost on a restart; a
        resumed run rolls them out again, and a synchronous one filters or drops them again."""
        with self._cond:
            return sorted(self._unfinished(lane), key=lambda i: i.seq)

    def outstanding(self, lane: str = TRAIN) -> int:
        """How many items :meth:`unfinished` lists. An item filtered but not yet drained
        counts: the loop draws its replacement when it learns of the shortfall from
        :meth:`take`, never ahead of it (how far filtering had got would decide which draws
        go out together)."""
        with self._cond:
            return len(self._unfinished(lane))

    def drain_events(self, lane: str | None = None) -> Events:
        """The events since the last drain (of ``lane`` only, leaving the others'), each kind
        in draw order (not in the order requests happened to end)."""
        with self._cond:
            mine, rest = Events(), Events()
            for group in self._events.filtered:
                (mine if lane in (None, group.item.lane) else rest).filtered.append(group)
            for item, reason in self._events.dropped:
                (mine if lane in (None, item.lane) else rest).dropped.append((item, reason))
            self._events = rest
            mine.filtered.sort(key=lambda g: g.item.seq)
            mine.dropped.sort(key=lambda d: d[0].seq)
            return mine

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- the dispatcher's side ------------------------------------------------------------

    def claim(self, sampler: str, sampler_version: int, capacity: int,
              ready_samplers: int = 1) -> Claim | None:
        """Items for one request to ``sampler`` (which serves ``sampler_version`` and decodes
        ``capacity`` completions at once), or None. They are in flight from this moment."""
        with self._cond:
            busy = self._inflight_prompts(sampler)
            for name in self._order:
                lane, units = self._lanes[name], self._units[name]
                min_version = self._min_version(lane)
                if not units or sampler_version < min_version:
                    continue
                free = max(1, capacity // lane.group_size) - busy
                if lane.reproducible:
                    if busy and len(units[0]) > free:
                        continue
                    items = units.popleft()
                else:
                    if free <= 0:
                        continue
                    queued = sum(len(u) for u in units)
                    share = -(-queued // max(1, ready_samplers))
                    items = []
                    while units and len(items) < min(free, share):
                        if units[0][0].refusals:  # a suspect prompt goes alone
                            if not items:
                                items = units.popleft()
                            break
                        items.extend(units.popleft())
                request_id = f"{name}-{next(self._ids)}"
                self._inflight[request_id] = _InFlight(sampler, lane, items)
                self.counts["dispatched"] += len(items)
                return Claim(request_id, lane, items, min_version)
        return None

    def deliver(self, request_id: str, group: RolloutGroup) -> None:
        """A scored group of request ``request_id`` came back."""
        with self._cond:
            flight = self._inflight.get(request_id)
            uid = group.item.uid
            if flight is None:
                self.counts["late"] += 1  # its request already ended (e.g. cancelled)
                return
            if uid in flight.received or uid not in {i.uid for i in flight.items}:
                self.counts["unexpected"] += 1
                return
            group.item = next(i for i in flight.items if i.uid == uid)
            flight.received[uid] = group
            if not flight.lane.reproducible:
                self._accept(flight.lane, group)
            self._cond.notify_all()

    def finish(self, request_id: str, failure: Failure | None = None) -> list[WorkItem]:
        """Request ``request_id`` ended (``failure`` if it did not complete). Returns the items
        that go back to the queue or were dropped (empty when everything arrived)."""
        with self._cond:
            flight = self._inflight.pop(request_id, None)
            if flight is None:
                return []
            lane = flight.lane
            missing = [i for i in flight.items if i.uid not in flight.received]
            if not missing and failure is None:
                if lane.reproducible:
                    for item in flight.items:
                        self._accept(lane, flight.received[item.uid])
                self._cond.notify_all()
                return []
            if failure is None:
                failure = Failure(f"the stream ended without groups for {len(missing)} "
                                  f"prompt(s), e.g. {missing[0].uid}")
            # A reproducible unit is all or nothing: its groups are re-generated together.
            lost = flight.items if lane.reproducible else missing
            if failure.refused:
                self._refused(lane, lost, failure.message)
            else:
                for item in lost:
                    item.attempts += 1
                units = self._units[lane.name]
                if lane.reproducible:
                    units.appendleft(list(lost))  # the same unit again, first in line
                else:
                    units.extendleft([i] for i in reversed(lost))
                self.counts["redispatched"] += len(lost)
            self._cond.notify_all()
            return list(lost)

    def inflight_by_sampler(self) -> dict[str, int]:
        """Prompts in flight per sampler address."""
        with self._cond:
            out: dict[str, int] = {}
            for flight in self._inflight.values():
                out[flight.sampler] = out.get(flight.sampler, 0) + len(flight.pending())
            return out

    def has_queued(self) -> bool:
        with self._cond:
            return any(self._units.values())

    def wait_for_work(self, timeout_s: float) -> None:
        """Block until something is queued (or ``timeout_s``); the dispatcher's idle wait."""
        with self._cond:
            if not any(self._units.values()) and not self._closed:
                self._cond.wait(timeout=timeout_s)

    # -- internals (lock held) ------------------------------------------------------------

    @staticmethod
    def _cut(lane: Lane, items: list[WorkItem]) -> list[list[WorkItem]]:
        """Units for ``items``: singletons in an adaptive lane (claims merge them); in a
        reproducible one, restored items keep the unit they had, new ones are cut in draw
        order into units of ``request_size`` named by their first item."""
        if not lane.reproducible:
            return [[i] for i in items]
        units: list[list[WorkItem]] = []
        new: list[WorkItem] = []

        def cut_new():
            for k in range(0, len(new), lane.request_size):
                unit = new[k:k + lane.request_size]
                for item in unit:
                    item.unit = unit[0].seq
                units.append(unit)
            new.clear()

        for item in items:
            if item.unit is None:
                new.append(item)
                continue
            cut_new()
            if units and units[-1][0].unit == item.unit:
                units[-1].append(item)
            else:
                units.append([item])
        cut_new()
        return units

    def _min_version(self, lane: Lane) -> int:
        return self.version - lane.max_staleness

    def _stale(self, lane: Lane, group: RolloutGroup) -> bool:
        return self.version - group.weight_version > lane.max_staleness

    def _unfinished(self, lane: str) -> list[WorkItem]:
        items = [i for unit in self._units[lane] for i in unit]
        items += [i for f in self._inflight.values() if f.lane.name == lane for i in f.pending()]
        items += [g.item for g in self._buffered[lane].values()]
        items += [g.item for g in self._events.filtered if g.item.lane == lane]
        return items + [i for i, _ in self._events.dropped if i.lane == lane]

    def _pending(self, lane: str) -> int:
        queued = sum(len(u) for u in self._units[lane])
        return queued + sum(len(f.pending()) for f in self._inflight.values()
                            if f.lane.name == lane)

    def _inflight_prompts(self, sampler: str) -> int:
        return sum(len(f.pending()) for f in self._inflight.values() if f.sampler == sampler)

    def _accept(self, lane: Lane, group: RolloutGroup) -> None:
        if self._stale(lane, group):
            self._requeue_stale(lane, [group])
        elif lane.filter_zero_variance and group.zero_variance():
            self._events.filtered.append(group)
            self.counts["zero_variance_filtered"] += 1
        elif group.item.uid in self._buffered[lane.name]:
            self.counts["duplicate"] += 1
        else:
            self._buffered[lane.name][group.item.uid] = group

    def _requeue_stale(self, lane: Lane, groups: list[RolloutGroup]) -> None:
        """Too old to train on: first in line again (in draw order), one per unit."""
        for group in sorted(groups, key=lambda g: g.item.seq, reverse=True):
            group.item.attempts += 1
            group.item.unit = group.item.seq
            self._units[lane.name].appendleft([group.item])
            self.counts["stale_dropped"] += 1

    def _refused(self, lane: Lane, items: list[WorkItem], message: str) -> None:
        """Refused as invalid: retry each item alone (the request may hold one bad prompt);
        an item refused a second time is dropped."""
        retry = []
        for item in items:
            item.refusals += 1
            item.unit = item.seq  # alone from now on, also after a restore
            if item.refusals >= MAX_REFUSALS:
                self._events.dropped.append((item, message))
                self.counts["dropped_refused"] += 1
            else:
                retry.append(item)
        self._units[lane.name].extendleft([i] for i in reversed(retry))
        self.counts["redispatched"] += len(retry)
