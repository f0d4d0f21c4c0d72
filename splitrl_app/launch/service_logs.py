"""Reading the services' log files for the console of ``splitrl up``.

Each service writes one JSON object per line (``splitrl.logs``) to ``<run_dir>/logs/NAME.log``;
what a process prints outside the logger (an uncaught traceback, ``splitrl trainer: cannot
start: ...``) lands there as plain text. The launcher shows a person two things from them:

- :class:`LogFollower`: error-level lines (and lines a service marks ``console: true``, such
  as a checkpoint fallback) as they are written, while the run goes on (a failing reward
  function, a sampler that refuses a request);
- :func:`error_lines`: when a service exits, its root cause (the critical line it logs as
  it gives up) or else its last error lines, so the reason is on the console and not only
  behind "exited with code 1".

The launcher appends every attempt to the same log files and reads each from the offset its
process started at, so a reused run directory never shows an earlier attempt's errors.
"""

from __future__ import annotations

import json
from pathlib import Path

ERROR_LEVELS = ("error", "critical")
TAIL_BYTES = 64 * 1024


def _entry(line: str) -> tuple[str, str] | None:
    """(kind, text) of a log line: kind "fatal" for a critical line (a service's root cause,
    logged once as it gives up), "error" for an error line or a line a service marked for
    the console, "plain" for text outside the logger (a traceback); None for the rest."""
    line = line.rstrip()
    if not line:
        return None
    if not line.startswith("{"):
        return "plain", line
    try:
        entry = json.loads(line)
    except ValueError:
        return "plain", line
    if not isinstance(entry, dict):
        return None
    level = entry.get("level")
    if level not in ERROR_LEVELS and not entry.get("console"):
        return None
    text = str(entry.get("msg", ""))
    exc = str(entry.get("exc") or "").strip().splitlines()
    return ("fatal" if level == "critical" else "error"), (f"{text}: {exc[-1]}" if exc
                                                           else text)


def error_lines(path: Path, limit: int = 12, start: int = 0) -> list[str]:
    """The last ``limit`` error lines of a service log from byte ``start`` on (where this
    attempt's process began writing): its fatal lines (the root cause) when it logged any,
    since what a dying process prints after one is teardown noise; else its error lines
    and plain-text lines such as tracebacks; else its last plain lines."""
    if not path.exists():
        return [f"({path} does not exist)"]
    with path.open("rb") as f:
        f.seek(0, 2)
        f.seek(max(start, f.tell() - TAIL_BYTES))
        lines = f.read().decode("utf-8", errors="replace").splitlines()
    entries = [e for e in (_entry(line) for line in lines) if e]
    fatal = [text for kind, text in entries if kind == "fatal"]
    found = fatal or [text for _, text in entries]
    return found[-limit:] if found else [line for line in lines if line.strip()][-limit:]


class LogFollower:
    """New error lines of several logs since the last call (complete lines only), each log
    read from the offset it is added with (where this attempt began writing it)."""

    def __init__(self, paths: dict[str, Path], starts: dict[str, int] | None = None):
        self.paths: dict[str, Path] = {}
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, str] = {}
        for name, path in paths.items():
            self.add(name, path, (starts or {}).get(name, 0))

    def add(self, name: str, path: Path, start: int = 0) -> None:
        if name not in self.paths:
            self.paths[name] = path
            self._offsets[name] = start
            self._partial[name] = ""

    def new_errors(self) -> list[str]:
        out = []
        for name, path in self.paths.items():
            if not path.exists():
                continue
            with path.open("rb") as f:
                f.seek(self._offsets[name])
                chunk = f.read()
                self._offsets[name] = f.tell()
            text = self._partial[name] + chunk.decode("utf-8", errors="replace")
            *complete, self._partial[name] = text.split("\n")
            for line in complete:
                if line.startswith("{"):  # live: only the logger's error and console lines
                    entry = _entry(line)
                    if entry:
                        out.append(f"[{name}] {entry[1]}")
        return out
