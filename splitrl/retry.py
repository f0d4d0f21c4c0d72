"""Waiting and retrying, in one place.

- RPCs: every channel from ``splitrl.serving.make_channel`` carries gRPC's own retry policy
  (:data:`SERVICE_CONFIG`, gRPC's service config): a call to an idempotent method that fails
  with UNAVAILABLE (a peer restarting, a connection reset) or RESOURCE_EXHAUSTED (a server
  busy with as many calls as it takes) is retried with exponential back-off
  by gRPC itself, before our code sees an error. Rollouts and weight pushes are not retried
  there: the rollout queue and the weight publisher decide what to do with a failed one.
- Waiting for a condition (a service healthy, a sampler ready): :func:`wait_until`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Idempotent unary methods: answering twice is harmless (reads, registration, heartbeats, and
# scoring, which is a function of its input).
RETRIED_METHODS = [
    {"service": "grpc.health.v1.Health", "method": "Check"},
    {"service": "splitrl.v1.Sampler", "method": "GetInfo"},
    {"service": "splitrl.v1.Reward", "method": "Score"},
    {"service": "splitrl.v1.Reward", "method": "ListRewardFunctions"},
    {"service": "splitrl.v1.Trainer", "method": "Status"},
    {"service": "splitrl.v1.Trainer", "method": "RegisterSampler"},
    {"service": "splitrl.v1.Trainer", "method": "Heartbeat"},
]
SERVICE_CONFIG = json.dumps({"methodConfig": [{
    "name": RETRIED_METHODS,
    "retryPolicy": {
        "maxAttempts": 3,
        "initialBackoff": "0.1s",
        "maxBackoff": "1s",
        "backoffMultiplier": 2,
        # RESOURCE_EXHAUSTED: a server whose threads are all busy (splitrl.serving's limit).
        "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
    },
}]})


def wait_until(condition: Callable[[], T], *, timeout_s: float, what: str,
               interval_s: float = 0.2, stop: threading.Event | None = None,
               check: Callable[[], None] | None = None) -> T:
    """Poll ``condition`` until it returns something true, and return that.

    ``check`` runs before each poll and may raise to give up early (a process that exited);
    ``stop`` being set raises InterruptedError; past ``timeout_s`` a TimeoutError names
    ``what`` was awaited.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if check is not None:
            check()
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        if stop is not None:
            if stop.wait(interval_s):
                raise InterruptedError(f"stopped while waiting: {what}")
        else:
            time.sleep(interval_s)
