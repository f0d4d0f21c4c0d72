"""Reading the services' log files for the console of ``splitrl up``.

Each service writes one JSON object per line (``splitrl.logs``) to ``<run_dir>/logs/NAME.log``;
what a process prints outside the logger (an uncaught traceback, ``splitrl trainer: cannot
start: ...``) lands there as plain text. The launcher shows a person two things from them:

- :class:`LogFollower`: error-level lines as they are written, while the run goes on (a
  failing reward function, a sampler that refuses a request);
- :func:`error_lines`: when a service exits, its last error lines, so the reason is on the
  console and not only behind "exited with code 1".
"""

from __future__ import annotations

import json
from pathlib import Path

ERROR_LEVELS = ("error", "critical")
TAIL_BYTES = 64 * 1024


def _error_text(line: str) -> str | None:
    """The message of a JSON error line, None for any other JSON line; plain text as is."""
    line = line.rstrip()
    if not line:
        return None
    if not line.startswith("{"):
        return line
    try:
        entry = json.loads(line)
    except ValueError:
        return line
    if not isinstance(entry, dict) or entry.get("level") not in ERROR_LEVELS:
        return None
    text = str(entry.get("msg", ""))
    exc = str(entry.get("exc") or "").strip().splitlines()
    return f"{text}: {exc[-1]}" if exc else text


def error_lines(path: Path, limit: int = 12) -> list[str]:
    """The last ``limit`` error lines of a service log (JSON errors and plain-text lines such
    as tracebacks); the last plain lines when there are none."""
    if not path.exists():
        return [f"({path} does not exist)"]
    with path.open("rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - TAIL_BYTES))
        lines = f.read().decode("utf-8", errors="replace").splitlines()
    found = [text for text in (_error_text(line) for line in lines) if text]
    return found[-limit:] if found else [line for line in lines if line.strip()][-limit:]


class LogFollower:
    """New error lines of several logs since the last call (complete lines only)."""

    def __init__(self, paths: dict[str, Path]):
        self.paths = dict(paths)
        self._offsets = {name: 0 for name in self.paths}
        self._partial = {name: "" for name in self.paths}

    def add(self, name: str, path: Path) -> None:
        if name not in self.paths:
            self.paths[name] = path
            self._offsets[name] = 0
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
                if line.startswith("{"):  # live: only the logger's error lines
                    message = _error_text(line)
                    if message:
                        out.append(f"[{name}] {message}")
        return out
