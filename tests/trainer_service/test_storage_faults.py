"""Storage faults, in-process: a corrupt checkpoint falls back to the newest intact one, a save
that fails in the background is reported by the step after it (with its cause), appended
JSON-lines files survive a torn last line and a full disk.

Full disks are real: a small tmpfs mounted for the test (root only; skipped with the reason
otherwise), and ENOSPC injected at the write call where a mount is not possible."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from splitrl.jsonl import JsonlAppender, drop_torn_tail, read_jsonl
from trainer_service.learning.checkpoints import (
    Checkpointer,
    NoIntactCheckpoint,
    SaveFailed,
    storage_cause,
)


def _state(seed: int) -> dict:
    """256 KiB of incompressible float32: two checkpoints fill the small disk."""
    return {"w": jax.random.normal(jax.random.key(seed), (256, 256), jnp.float32)}


def _abstract():
    return {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32,
                                      sharding=jax.sharding.SingleDeviceSharding(
                                          jax.devices()[0]))}


def _save_steps(directory: Path, steps, keep: int = 3) -> None:
    with Checkpointer(directory, every=1, keep=keep, async_save=False) as ckpt:
        for step in steps:
            ckpt.save(step, _state(step), weight_version=step,
                      data_cursor={"drawn": 4 * step, "unfinished": []})


def _largest_data_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def test_a_truncated_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path):
    directory = tmp_path / "checkpoints"
    _save_steps(directory, (5, 10, 15))
    data = _largest_data_file(directory / "15")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])  # a crash mid-copy

    with Checkpointer(directory, every=5, keep=3) as ckpt:
        seen = []
        restored, skipped = ckpt.restore_newest(_abstract(), seen.append)
        assert restored.step == 10 and restored.data_cursor["drawn"] == 40
        np.testing.assert_array_equal(np.asarray(restored.state["w"]),
                                      np.asarray(_state(10)["w"]))
        assert [s for s, _ in skipped] == [15]
        assert skipped[0][1].startswith("ValueError: OUT_OF_RANGE: Error reading")  # the cause
        assert [m["step"] for m in seen] == [15, 10]  # every candidate's metadata was checked
        assert ckpt.all_steps() == [5, 10]  # the unreadable step is out of the way ...
    assert (tmp_path / "checkpoints.unreadable" / "15").is_dir()  # ... and kept for a look


def test_garbled_metadata_is_skipped_and_a_refusal_of_the_run_is_not(tmp_path):
    directory = tmp_path / "checkpoints"
    _save_steps(directory, (5, 10))
    (directory / "10" / "meta" / "metadata").write_text('{"step": 10, "weight_')
    with Checkpointer(directory, every=5, keep=3) as ckpt:
        assert ckpt.newest_readable_meta()["step"] == 5  # what the launcher's preflight reads

        def refuse(meta):
            raise ValueError(f"checkpoint at step {meta['step']} belongs to another config")

        with pytest.raises(ValueError, match="step 5 belongs to another config"):
            ckpt.restore_newest(_abstract(), refuse)  # refused, not skipped past


def test_no_intact_checkpoint_is_an_error_naming_the_directory_and_the_way_out(tmp_path):
    directory = tmp_path / "checkpoints"
    _save_steps(directory, (5,))
    (directory / "5" / "meta" / "metadata").write_text("garbage")
    with Checkpointer(directory, every=5, keep=3) as ckpt:
        with pytest.raises(NoIntactCheckpoint, match=str(directory)) as caught:
            ckpt.restore_newest(_abstract())
        assert "step 5" in str(caught.value) and "another trainer.run_dir" in str(caught.value)
        assert ckpt.all_steps() == [5]  # left in place: the user decides


def test_a_background_save_that_fills_the_disk_is_reported_by_the_next_check(small_disk):
    disk = small_disk("600k")  # two of these checkpoints fit, not three
    ckpt = Checkpointer(disk / "checkpoints", every=1, keep=3, async_save=True)
    failed = None
    for step in (1, 2, 3):
        ckpt.save(step, _state(step), weight_version=step)
        deadline = time.monotonic() + 120
        try:
            while ckpt.save_pending and time.monotonic() < deadline:
                ckpt.check_saved()  # what the run calls once per step
                time.sleep(0.02)
        except SaveFailed as e:
            failed = e
            break
    assert failed is not None and failed.step == 3  # the save that did not fit, not a later one
    assert failed.cause.startswith("disk full (no space left on device)")
    assert "step 3" in str(failed) and str(disk) in str(failed)
    ckpt.check_saved()  # reported once
    ckpt.close()
    assert Checkpointer(disk / "checkpoints").all_steps() == [1, 2]  # nothing half-done


def test_storage_causes_are_named_from_the_errno():
    assert storage_cause(OSError(errno.ENOSPC, "x")) == "disk full (no space left on device)"
    assert storage_cause(OSError(errno.EDQUOT, "x")) == "disk quota exceeded"
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = PermissionError(errno.EACCES, "denied")
    assert storage_cause(wrapped) == "permission denied"
    assert storage_cause(ValueError("boom")) == "ValueError: boom"


# -- appended files ------------------------------------------------------------------------


def test_a_torn_last_line_is_skipped_when_read_and_dropped_when_reopened(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "loss": 0.')  # killed mid-write
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    out = JsonlAppender(path)
    assert out.dropped == len('{"step": 3, "loss": 0.')
    out.write({"step": 3})
    out.close()
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}, {"step": 3}]
    assert drop_torn_tail(path) == 0


def test_damage_before_the_last_line_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "trained_prompts.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="trained_prompts.jsonl, line 2"):
        read_jsonl(path)


def test_a_write_that_fills_the_disk_leaves_no_half_line(small_disk):
    path = small_disk("600k") / "metrics.jsonl"
    out = JsonlAppender(path)
    record = {"step": 0, "payload": "x" * 4000}
    with pytest.raises(OSError) as caught:
        for step in range(1000):
            out.write({**record, "step": step})
    assert caught.value.errno == errno.ENOSPC
    assert storage_cause(caught.value) == f"disk full (no space left on device) writing {path}"
    out.close()
    records = read_jsonl(path)
    assert records and records[-1]["step"] == len(records) - 1
    assert path.read_bytes().endswith(b"\n")  # every line whole


def test_a_failed_write_is_cut_back_where_no_small_disk_can_be_mounted(tmp_path, monkeypatch):
    """ENOSPC injected at the write call: a short write, then the error."""
    path = tmp_path / "metrics.jsonl"
    out = JsonlAppender(path)
    out.write({"step": 1})
    real_write = os.write

    def full_disk(fd, data):
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError):
        out.write({"step": 2, "loss": 0.5})
    monkeypatch.undo()
    out.close()
    assert path.read_text() == json.dumps({"step": 1}) + "\n"
