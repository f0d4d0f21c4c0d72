"""The trainer's memory of its last push (the base of the next delta)."""

from __future__ import annotations

import numpy as np

from trainer_service.orchestration.delta_base import DeltaBase


def test_blocks_are_kept_reused_and_cut_from_a_whole_tensor_until_complete():
    base = DeltaBase()
    assert base.claim() and not base.claim()  # one push at a time
    whole = np.arange(16, dtype=np.float32).reshape(4, 4)
    base.keep("w", ((0, 4), (0, 4)), whole, fresh=False)
    assert base.push_id is None  # half-written until complete()
    base.complete("p1", 1)
    base.release()
    kept = base.block("w", ((0, 4), (0, 4)))
    assert kept is not whole and np.array_equal(kept, whole)  # a copy: the caller's may change

    # The next push reads shards: their bases are cut from the whole block ...
    assert base.claim()
    assert np.array_equal(base.block("w", ((2, 4), (0, 4))), whole[2:])
    shard = whole[2:] + 1
    base.keep("w", ((0, 2), (0, 4)), whole[:2] + 1, fresh=True)
    base.keep("w", ((2, 4), (0, 4)), shard, fresh=True)
    base.complete("p2", 2)
    base.release()
    # ... and once that push is complete only its own blocks remain.
    assert base.block("w", ((0, 4), (0, 4))) is None
    assert base.block("w", ((2, 4), (0, 4))) is shard  # a cast's result is kept as is
    assert base.nbytes == whole.nbytes


def test_a_view_of_device_memory_is_copied_into_last_times_buffer():
    base = DeltaBase()
    assert base.claim()
    first = np.zeros(8, np.float32)
    base.keep("b", ((0, 8),), first[:], fresh=False)
    buffer = base.block("b", ((0, 8),))
    base.complete("p1", 1)
    base.keep("b", ((0, 8),), np.ones(8, np.float32)[:], fresh=False)
    assert base.block("b", ((0, 8),)) is buffer and buffer.sum() == 8
