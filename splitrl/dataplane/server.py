"""The listening side of the data plane: accept, TLS, preamble, then a handler per connection."""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Callable

from splitrl.auth import ssl_context
from splitrl.config import AuthConfig
from splitrl.dataplane.frames import PREAMBLE, FrameStream, split_address

log = logging.getLogger(__name__)


class DataServer:
    """Serves ``handler(stream)`` for every connection to ``address`` ("host:port", port 0 picks
    a free one), each on its own thread, under the TLS (and mutual TLS) of ``auth``. The token
    check is the handler's: it travels in the first frame."""

    def __init__(self, address: str, handler: Callable[[FrameStream], None], *,
                 auth: AuthConfig | None, idle_timeout_s: float, max_connections: int = 32):
        host, port = split_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(max_connections)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self.handler = handler
        self.idle_timeout_s = idle_timeout_s
        self._tls = ssl_context(auth, server_side=True)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, name="data-accept",
                                          daemon=True)

    @property
    def tls(self) -> bool:
        return self._tls is not None

    def start(self) -> DataServer:
        self._acceptor.start()
        log.info("data plane listening", extra={"address": f"{self.host}:{self.port}",
                                                "tls": self.tls})
        return self

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # closed by stop()
            if not self._slots.acquire(blocking=False):
                log.warning("data plane connection refused: too many open",
                            extra={"peer": f"{peer[0]}:{peer[1]}"})
                conn.close()
                continue
            thread = threading.Thread(target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"),
                                      name="data-conn", daemon=True)
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.idle_timeout_s)
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)
            preamble = b""
            while len(preamble) < len(PREAMBLE):
                data = conn.recv(len(PREAMBLE) - len(preamble))
                if not data:
                    break
                preamble += data
            if preamble != PREAMBLE:
                log.warning("data plane connection refused: not a SplitRL data-plane stream",
                            extra={"peer": peer, "first_bytes": preamble.hex()})
                return
            self.handler(FrameStream(conn, idle_timeout_s=self.idle_timeout_s, peer=peer))
        except (OSError, ssl.SSLError) as e:
            log.warning("data plane connection failed", extra={"peer": peer, "error": repr(e)})
        except Exception:  # a handler bug must not take the server down
            log.exception("data plane handler failed", extra={"peer": peer})
        finally:
            try:
                conn.close()
            except OSError:
                pass
            self._slots.release()
            with self._lock:
                self._threads.discard(threading.current_thread())

    def stop(self, grace_s: float | None = 10.0) -> None:
        """Stop accepting; let connections in progress finish for up to ``grace_s`` (None: no
        grace, as for a gRPC server, whose ``on_stop`` hook this is)."""
        self._stopping.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(0 if grace_s is None else grace_s)
