"""The ports `splitrl up` picks for its services stay theirs from the pick to the stop."""

from __future__ import annotations

import socket

import pytest

from splitrl.serving import check_health, start_server
from splitrl_app.launch.ports import free_port, release_port


def test_a_picked_port_is_held_for_its_service_until_released():
    ports = [free_port() for _ in range(64)]
    try:
        # Held, so never handed out twice (binding port 0 and closing repeats a port in about
        # 1 of 1,700 batches of five) and no other bind can take one...
        assert len(set(ports)) == len(ports)
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", ports[0]))
        # ...while the service the port was picked for binds and serves on it.
        server = start_server(lambda s: None, f"127.0.0.1:{ports[1]}", service_names=["x"])
        try:
            assert check_health(f"127.0.0.1:{ports[1]}", "x", timeout_s=10.0)
        finally:
            server.stop(None)
    finally:
        for port in ports:
            release_port(port)
    with socket.socket() as after:
        after.bind(("127.0.0.1", ports[0]))
