"""Prometheus metrics: each service defines its own collectors and exposes them over HTTP."""

from __future__ import annotations

import logging

from prometheus_client import start_http_server

log = logging.getLogger(__name__)


def start_metrics_server(port: int | None, host: str = "0.0.0.0") -> int | None:
    """Serve ``/metrics`` on ``port`` (0 = any free port; None = disabled). Returns the port."""
    if port is None:
        return None
    server, _thread = start_http_server(port, addr=host)
    bound = server.server_address[1]
    log.info("metrics server listening", extra={"metrics_port": bound})
    return bound
