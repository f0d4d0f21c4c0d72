"""Host buffers a receiver assembles pushes in, reused from one push to the next."""

from __future__ import annotations

import gc
import math
import sys
import threading
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from splitrl.wire._core import ALIGNMENT

# References to a free buffer while :meth:`StagingPool.take` looks at it: the pool's list, the
# loop variable, and ``sys.getrefcount``'s own argument. Any view of the buffer (a block being
# assembled, the numpy array a device array aliases on XLA:CPU, a transfer in flight) holds
# one more: numpy views point at the array that owns the memory.
_FREE_REFS = 3


class StagingPool:
    """64-byte aligned host buffers for the blocks of pushes, reused across pushes.

    Why: a fresh buffer costs a page fault per page the first time the socket writes into it
    (the kernel zeroes each page: about as much again as the copy that fills it; ~430 MB of
    fresh pages per push of the small benchmark model). A buffer is handed out again only once
    nothing refers to it any more: not a push being assembled, not the weights serving (on
    XLA:CPU a device array aliases its host buffer and keeps a reference to it), not a
    generation still holding an older version's arrays, not a transfer to a device in flight.
    Nothing is ever written into memory someone can still read.

    :meth:`trim` (after each push) drops free buffers beyond what the last push took, so the
    pool holds at most one spare set of buffers besides those in use.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[int, list[np.ndarray]] = {}  # nbytes -> owning uint8 arrays
        # id of an owning array -> bytes to skip to its first 64-byte boundary (numpy's
        # ``ctypes.data`` costs more than the rest of a take)
        self._skips: dict[int, int] = {}
        self._taken: Counter[int] = Counter()  # since the last trim
        self._collected = False  # the young-generation collection ran since the last trim
        self.reused = 0  # buffers handed out again (for metrics and tests)
        self.allocated = 0

    def take(self, shape: Sequence[int], dtype) -> np.ndarray:
        """An uninitialised C-order array of ``shape``/``dtype``, 64-byte aligned."""
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            self._taken[nbytes] += 1
            owners = self._owners.setdefault(nbytes, [])
            for attempt in range(2):
                for i in range(len(owners)):
                    raw = owners[i]
                    if sys.getrefcount(raw) == _FREE_REFS:
                        # Taken ones go last, so the next scan meets a free one first
                        # (constant time per take where scanning them all was quadratic).
                        owners.append(owners.pop(i))
                        self.reused += 1
                        return _view(raw, self._skips[id(raw)], nbytes, shape, dtype)
                    del raw
                if attempt or self._collected or not owners:
                    break
                # jax hands back the host buffers of deleted device arrays (XLA:CPU aliases
                # them) only in its garbage-collection callback: run it, once per push.
                self._collected = True
                gc.collect(0)
            raw = np.empty(nbytes + ALIGNMENT, np.uint8)
            owners.append(raw)
            skip = self._skips[id(raw)] = -raw.ctypes.data % ALIGNMENT
            self.allocated += 1
            return _view(raw, skip, nbytes, shape, dtype)

    def prefill(self, blocks: Iterable[tuple[Sequence[int], object]]) -> None:
        """Allocate (and fault in) free buffers for ``blocks`` (``(shape, dtype)`` each) now,
        so that the first push does not pay for fresh pages either."""
        arrays = [self.take(shape, dtype) for shape, dtype in blocks]
        for array in arrays:
            array.reshape(-1).view(np.uint8)[:] = 0

    def trim(self) -> None:
        """Drop free buffers beyond the number of each size taken since the last trim."""
        with self._lock:
            for nbytes, owners in list(self._owners.items()):
                spare = self._taken[nbytes]
                kept = []
                for raw in owners:  # a plain loop: the reference count _FREE_REFS expects
                    if sys.getrefcount(raw) == _FREE_REFS:
                        if not spare:
                            del self._skips[id(raw)]
                            continue
                        spare -= 1
                    kept.append(raw)
                owners[:] = kept
                if not owners:
                    del self._owners[nbytes]
            self._taken.clear()
            self._collected = False

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (free or in use)."""
        with self._lock:
            return sum(n * len(owners) for n, owners in self._owners.items())


def _view(raw: np.ndarray, skip: int, nbytes: int, shape: tuple[int, ...],
          dtype: np.dtype) -> np.ndarray:
    return raw[skip : skip + nbytes].view(dtype).reshape(shape)
