"""Structured logs: one JSON object per line, with the run, service, step and weight version.

Services call :func:`configure_logging` once at start-up and then use ``logging.getLogger``
as usual; fields passed in ``extra={...}`` become keys of the JSON object, and
:func:`set_context` adds keys (step, weight_version) to every later line of the process.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_CONTEXT: dict[str, Any] = {}
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_CONTEXT,
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def set_context(**fields: Any) -> None:
    """Add (or with None, remove) keys that every later log line of this process carries."""
    for key, value in fields.items():
        if value is None:
            _CONTEXT.pop(key, None)
        else:
            _CONTEXT[key] = value


def configure_logging(
    service: str, run_id: str | None = None, level: int | str = "INFO", stream=None
) -> None:
    """Route the root logger to JSON lines on ``stream`` (stderr by default)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    set_context(service=service, run=run_id)
    for noisy in ("absl", "jax._src", "urllib3", "httpx", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.Formatter.converter = time.gmtime
