"""Append-only JSON-lines files that a crash or a full disk leaves readable.

A run appends one JSON object per line to ``metrics.jsonl``, ``trained_prompts.jsonl`` (the
audit trail) and its services' logs. A process killed mid-write, or a write that hits a full
disk, can leave the last line torn (no newline, half an object). Such a file must never break
a plot or an audit for good, so:

- :class:`JsonlAppender` drops a torn last line when it opens the file (the line was never
  complete, so nothing it said was ever read), writes each record as one ``write`` of a whole
  line, and if that write fails (``ENOSPC``, ``EDQUOT``...) cuts the file back to its last
  complete line before re-raising;
- :func:`read_jsonl` skips a torn last line (a writer may still be appending it, or died doing
  so) and refuses a damaged line anywhere else, naming the file and line.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def drop_torn_tail(path: str | os.PathLike) -> int:
    """Cut ``path`` back to the end of its last complete line; returns the bytes dropped
    (0 when the file ends with a newline, is empty or does not exist)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with path.open("rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        # Search backwards for the last newline, a block at a time.
        end, block = size, 64 * 1024
        keep = 0
        while end > 0:
            start = max(0, end - block)
            f.seek(start)
            chunk = f.read(end - start)
            at = chunk.rfind(b"\n")
            if at >= 0:
                keep = start + at + 1
                break
            end = start
        f.truncate(keep)
    return size - keep


class JsonlAppender:
    """Appends records to a JSON-lines file, one complete line per write (see the module)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        dropped = drop_torn_tail(self.path)
        if dropped:
            log.warning("dropped a torn last line (a crash or a full disk interrupted its "
                        "write)", extra={"file": str(self.path), "bytes": dropped})
        self.dropped = dropped
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, data)
            if written != len(data):  # a short write: the disk filled up during it
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            os.ftruncate(self._fd, size)  # never leave half a line behind
            raise OSError(e.errno, e.strerror, str(self.path)) from e

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of ``path`` ([] if it does not exist), without a torn last line. A line
    that is not JSON elsewhere raises ValueError naming the file and the line number."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(errors="replace")
    # What follows the last newline is a torn line (or one still being written): skipped.
    lines = text.split("\n")[:-1]
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as e:
            raise ValueError(f"{path}, line {number}: not a JSON record ({e}); the file was "
                             "changed by something other than the run") from None
    return records
