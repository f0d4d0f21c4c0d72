"""Frames on a TCP (or TLS) stream: the bulk data plane's framing, connections and deadlines.

A frame is a 16-byte prefix (kind, meta length, payload length), ``meta`` (a serialized
protobuf message) and ``payload`` (raw bytes); see ``protos/splitrl/v1/dataplane.proto``. A
payload goes from a numpy buffer to the socket and from the socket into its final place with no
copy in Python (``sendmsg`` of the prefix and the payload's memoryview; ``recv_into``).

Every read and write has a deadline (``idle_timeout_s``): a peer that sends nothing (or takes
nothing) for that long is gone, and the stream raises :class:`PeerGone`. So does a closed or
reset connection. A malformed stream raises :class:`splitrl.wire.WireError`.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import time
from collections.abc import Sequence

import grpc
from google.protobuf.message import DecodeError, Message

from splitrl.auth import ssl_context
from splitrl.config import AuthConfig
from splitrl.wire import WireError

PREAMBLE = b"SPLRLDP1"
OPEN, CHUNK, END, REPORT, DECISION, KEEPALIVE = 1, 2, 3, 4, 5, 6
KIND_NAMES = {OPEN: "OPEN", CHUNK: "CHUNK", END: "END", REPORT: "REPORT", DECISION: "DECISION",
              KEEPALIVE: "KEEPALIVE"}
PREFIX = struct.Struct("<BxxxIQ")
MAX_META_BYTES = 1 << 20


_IOV_MAX = 1024  # buffers per sendmsg/recvmsg_into call (Linux's IOV_MAX)


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """The views that remain after the first ``n`` bytes of ``views``."""
    for i, view in enumerate(views):
        if n < len(view):
            return [view[n:], *views[i + 1:]] if n else views[i:]
        n -= len(view)
    return []


class PeerGone(Exception):
    """The other end closed, reset, or said nothing within the deadline."""


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError names a malformed one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"data address {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


class FrameStream:
    """One connection of the data plane; counts the bytes it moves."""

    def __init__(self, sock: socket.socket, *, idle_timeout_s: float, peer: str):
        self.sock = sock
        self.peer = peer
        self.idle_timeout_s = idle_timeout_s
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._peeked = b""  # a byte readable() took off a TLS stream to see data was there
        # A blocking socket whose deadlines are the kernel's (SO_RCVTIMEO/SO_SNDTIMEO): one
        # call moves a whole payload (MSG_WAITALL), where Python's own timeouts would make the
        # socket non-blocking and every call return what happens to be buffered.
        sock.settimeout(None)
        self.set_timeout(idle_timeout_s)

    def set_timeout(self, seconds: float) -> None:
        """How long one send or receive may make no progress before the peer counts as gone."""
        seconds = max(seconds, 1e-3)
        value = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)

    # -- writing ----------------------------------------------------------------------------

    def send(self, kind: int, meta: Message | None = None, payload=None) -> None:
        """One frame: ``meta`` serialized, then ``payload`` (a bytes-like object) as is."""
        body = meta.SerializeToString() if meta is not None else b""
        views = [memoryview(payload).cast("B")] if payload is not None else []
        size = sum(len(v) for v in views)
        self.send_raw(PREFIX.pack(kind, len(body), size) + body, views)

    def send_raw(self, head: bytes, payload: Sequence[memoryview]) -> None:
        """A frame whose prefix and meta are already encoded, its payload gathered from the
        ``payload`` views in order (a relay forwarding a chunk from where it landed)."""
        views = [memoryview(head), *(v for v in payload if len(v))]
        try:
            if self.tls:  # SSL sockets have no sendmsg
                for view in views:
                    self.sock.sendall(view)
            else:
                while views:
                    views = _advance(views, self.sock.sendmsg(views[:_IOV_MAX]))
        except (TimeoutError, OSError) as e:
            raise PeerGone(f"{self.peer}: send failed: {_why(e)}") from None
        self.bytes_sent += len(head) + sum(len(v) for v in payload)

    # -- reading ----------------------------------------------------------------------------

    def recv_head(self) -> tuple[int, bytes, int, bytes]:
        """The next frame's ``(kind, meta bytes, payload length, encoded prefix + meta)``;
        read its payload next (:meth:`recv_into` / :meth:`recv_payload` / :meth:`skip`)."""
        prefix = self._recv_exact(PREFIX.size)
        kind, meta_len, payload_len = PREFIX.unpack(prefix)
        if kind not in KIND_NAMES:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{self.peer}: unknown frame kind {kind} (expected one of "
                            f"{sorted(KIND_NAMES.values())}); is the peer a SplitRL data plane "
                            "of the same version?")
        if meta_len > MAX_META_BYTES:
            raise WireError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{self.peer}: {KIND_NAMES[kind]} frame meta of {meta_len} bytes, "
                            f"more than {MAX_META_BYTES}")
        meta = self._recv_exact(meta_len) if meta_len else b""
        return kind, meta, payload_len, prefix + meta

    def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly from the stream."""
        self.recv_scatter([view])

    def recv_scatter(self, views: Sequence[memoryview]) -> None:
        """Fill ``views`` exactly, in order, from the stream (one ``recvmsg_into`` for many
        views where the socket allows it)."""
        total = sum(len(v) for v in views)
        pending = [v for v in views if len(v)]
        if self._peeked and pending:
            pending[0][0:1], self._peeked = self._peeked, b""
            pending = _advance(pending, 1)
        try:
            while pending:
                if self.tls:  # SSL sockets have no recvmsg_into
                    got = self.sock.recv_into(pending[0])
                else:
                    got = self.sock.recvmsg_into(pending[:_IOV_MAX], 0, socket.MSG_WAITALL)[0]
                if not got:
                    raise PeerGone(f"{self.peer}: connection closed mid-frame")
                pending = _advance(pending, got)
        except (TimeoutError, OSError) as e:
            raise PeerGone(f"{self.peer}: receive failed: {_why(e)}") from None
        self.bytes_received += total

    def recv_payload(self, n: int) -> bytearray:
        buf = bytearray(n)
        self.recv_into(memoryview(buf))
        return buf

    def skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            k = min(n, len(scratch))
            self.recv_into(scratch[:k])
            n -= k

    def readable(self, timeout_s: float) -> bool:
        """True once a frame (or EOF) can be read, False after ``timeout_s`` of silence. On TLS
        the socket may be readable with protocol records only (a session ticket): a byte of
        data is read to be sure, and kept for the next read."""
        if self._peeked or (isinstance(self.sock, ssl.SSLSocket) and self.sock.pending()):
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            ready, _, _ = select.select([self.sock], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                return False
            if not self.tls:
                return True
            self.sock.setblocking(False)
            try:
                self._peeked = self.sock.recv(1) or b""
                return True  # a byte, or EOF (the next read says PeerGone)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                continue  # records without data
            except OSError:
                return True  # reset: the next read says so
            finally:
                self.sock.settimeout(None)

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        got = 0
        view = memoryview(buf)
        if self._peeked and n:
            view[0:1], self._peeked, got = self._peeked, b"", 1
        while got < n:
            try:
                k = self.sock.recv_into(view[got:], n - got, 0 if self.tls else socket.MSG_WAITALL)
            except (TimeoutError, OSError) as e:
                raise PeerGone(f"{self.peer}: receive failed: {_why(e)}") from None
            if not k:
                raise PeerGone(f"{self.peer}: connection closed" + (" mid-frame" if got else ""))
            got += k
        self.bytes_received += n
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def parse_meta(cls: type[Message], meta: bytes, what: str) -> Message:
    message = cls()
    try:
        message.ParseFromString(meta)
    except (DecodeError, ValueError) as e:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"{what} is not a valid {cls.DESCRIPTOR.full_name} ({len(meta)} bytes: "
                        f"{e})") from None
    return message


def expect(stream: FrameStream, kinds: Sequence[int], what: str) -> tuple[int, bytes, int]:
    """The next frame, which must be one of ``kinds`` with no payload."""
    kind, meta, payload_len, _ = stream.recv_head()
    if kind not in kinds or payload_len:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"{stream.peer}: expected {what} ({'/'.join(KIND_NAMES[k] for k in kinds)}"
                        f" without payload), got {KIND_NAMES[kind]} with {payload_len} payload "
                        "bytes")
    return kind, meta, payload_len


def _why(error: BaseException) -> str:
    if isinstance(error, TimeoutError | BlockingIOError | ssl.SSLWantReadError
                  | ssl.SSLWantWriteError):
        return "no progress within the idle deadline"
    return f"{type(error).__name__}: {error}"


def connect(address: str, *, auth: AuthConfig | None, idle_timeout_s: float,
            connect_timeout_s: float = 10.0) -> FrameStream:
    """Open a data-plane stream to ``address`` with the TLS of ``auth`` (PeerGone if it cannot
    be reached) and send the preamble."""
    host, port = split_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    except OSError as e:
        raise PeerGone(f"{address}: cannot connect: {_why(e)}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    context = ssl_context(auth, server_side=False)
    if context is not None:
        assert auth is not None  # ssl_context is None without auth
        try:
            sock = context.wrap_socket(sock, server_hostname=auth.tls_server_name or host)
        except (OSError, ssl.SSLError) as e:
            sock.close()
            raise PeerGone(f"{address}: TLS handshake failed: {_why(e)}") from None
    stream = FrameStream(sock, idle_timeout_s=idle_timeout_s, peer=address)
    try:
        stream.sock.sendall(PREAMBLE)
    except OSError as e:
        stream.close()
        raise PeerGone(f"{address}: send failed: {_why(e)}") from None
    stream.bytes_sent += len(PREAMBLE)
    return stream
