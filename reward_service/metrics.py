"""Prometheus collectors of the reward service (served by ``splitrl.metrics``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ITEMS = Counter("splitrl_reward_items_total", "Items scored (rate() gives items/s)")
REQUESTS = Counter("splitrl_reward_requests_total", "Score requests", ["code"])
OUTCOMES = Counter(
    "splitrl_reward_function_outcomes_total",
    "Function calls by outcome (ok, none, timeout, error, nonfinite, cancelled)",
    ["function", "outcome"],
)
TIMEOUTS = Counter("splitrl_reward_timeouts_total", "Items that hit a time limit", ["function"])
ERRORS = Counter(
    "splitrl_reward_errors_total", "Items whose function raised, died or returned a non-number",
    ["function"],
)
WORKER_RESTARTS = Counter("splitrl_reward_worker_restarts_total", "Workers killed and replaced")
REQUEST_SECONDS = Histogram(
    "splitrl_reward_request_seconds", "Time to score one request",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
ITEMS_PER_SECOND = Gauge("splitrl_reward_items_per_second", "Throughput of the last request")
WORKERS = Gauge("splitrl_reward_workers", "Scoring worker processes")


def record_event(kind: str, function: str) -> None:
    """Called by the worker pool for every abnormal outcome and worker replacement."""
    if kind == "timeout":
        TIMEOUTS.labels(function).inc()
    elif kind in ("error", "nonfinite"):
        ERRORS.labels(function).inc()
    elif kind == "restart":
        WORKER_RESTARTS.inc()
