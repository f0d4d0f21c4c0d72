"""What the trainer remembers of its last push, so the next one can be a delta.

A delta chunk is computed against the bytes a sampler serves, so the trainer keeps those bytes:
one host copy of every sender block as last pushed, per *dtype profile* (the dtypes a sampler
serves, e.g. all bfloat16), named by the push id the samplers that took it now serve. A push
that reads a base overwrites it block by block as it goes (after each tensor's chunks are sent),
so memory stays at one copy and, after the first push, nothing is allocated; a push that stops
half-way leaves the base invalid (the next one is full).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np

from splitrl.wire import Bounds, TargetLayout


class DeltaBase:
    """The blocks of one profile's last push; used by one push at a time (:meth:`claim`)."""

    def __init__(self):
        self.push_id: str | None = None  # None: the blocks are not one whole push
        self.version = -1
        self._blocks: dict[tuple[str, Bounds], np.ndarray] = {}
        self._kept: set[tuple[str, Bounds]] = set()  # blocks kept by the push in progress
        self._lock = threading.Lock()

    def claim(self) -> bool:
        """Take the base for one push (False: another push is using it)."""
        if not self._lock.acquire(blocking=False):
            return False
        self._kept = set()
        return True

    def release(self) -> None:
        self._lock.release()

    def block(self, name: str, bounds: Bounds) -> np.ndarray | None:
        """The base of one sender block: kept as is, or cut from a kept block that contains it
        (the last push read the tensor whole, e.g. a sampler synced from a host copy)."""
        found = self._blocks.get((name, bounds))
        if found is not None:
            return found
        for (other, outer), block in self._blocks.items():
            if other == name and len(outer) == len(bounds) and all(
                    o0 <= b0 and b1 <= o1 for (b0, b1), (o0, o1) in zip(bounds, outer,
                                                                        strict=True)):
                return block[tuple(slice(b0 - o0, b1 - o0) for (b0, b1), (o0, _) in
                                   zip(bounds, outer, strict=True))]
        return None

    def keep(self, name: str, bounds: Bounds, host: np.ndarray, fresh: bool) -> None:
        """Remember ``host`` (one block as sent). A block the sender made (``fresh``: a cast) is
        kept as is; anything else (a view of device memory, the caller's array) is copied, into
        last time's buffer when it fits."""
        self.push_id = None  # part old push, part new until complete()
        key = (name, bounds)
        self._kept.add(key)
        old = self._blocks.get(key)
        if fresh:
            self._blocks[key] = host
        elif old is not None and old.shape == host.shape and old.dtype == host.dtype \
                and old.flags.writeable and old.flags.owndata:
            np.copyto(old, host)
        else:
            self._blocks[key] = np.array(host, copy=True)

    def complete(self, push_id: str, version: int) -> None:
        """Every block of the push named ``push_id`` is kept (blocks of a tensor cut another
        way by an earlier push are dropped)."""
        for stale in set(self._blocks) - self._kept:
            del self._blocks[stale]
        self._kept = set()
        self.push_id, self.version = push_id, version

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._blocks.values())


def dtype_profile(layouts: Mapping[str, TargetLayout]) -> tuple[tuple[str, str], ...]:
    """The dtypes a sampler serves, per parameter: samplers with equal profiles take the same
    bytes (whatever their mesh), so they share a base."""
    return tuple(sorted((name, layout.dtype or "") for name, layout in layouts.items()))
