"""gRPC plumbing shared by the three services: servers, channels, health, auth, shutdown.

Every server gets the same treatment so that operators see one behaviour everywhere:
message-size limits set on both ends (gRPC's default 4 MiB receive limit is smaller than a
weight chunk plus framing), the standard ``grpc.health.v1`` service (what compose health checks
and Kubernetes' native gRPC probes call), an optional shared-token check on mutating RPCs
(UNAUTHENTICATED without it), optional TLS, and a graceful stop that marks the service
NOT_SERVING, lets in-flight calls finish, then exits.
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitrl.config import AuthConfig

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def grpc_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def resolve_token(auth: AuthConfig | None) -> str | None:
    """The shared token from the config, else the environment variable, else the file."""
    if auth is None:
        return None
    if auth.token:
        return auth.token
    if auth.token_env and os.environ.get(auth.token_env):
        return os.environ[auth.token_env]
    if auth.token_file:
        path = Path(auth.token_file)
        if not path.is_file():
            raise FileNotFoundError(f"services.auth.token_file {str(path)!r} does not exist")
        return path.read_text().strip() or None
    return None


class _TokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls to protected methods that lack ``authorization: Bearer <token>``."""

    def __init__(self, token: str, protected_methods: Iterable[str]):
        self._expected = f"Bearer {token}".encode()
        self._protected = frozenset(protected_methods)

        def deny(request, context):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong auth token: send metadata 'authorization: Bearer <token>' "
                "with the token from services.auth (token, token_env or token_file)",
            )

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream_unary = grpc.stream_unary_rpc_method_handler(deny)
        self._deny_unary_stream = grpc.unary_stream_rpc_method_handler(deny)
        self._deny_stream_stream = grpc.stream_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method not in self._protected:
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY and hmac.compare_digest(value.encode(), self._expected):
                return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return self._deny_stream_stream
        if handler.request_streaming:
            return self._deny_stream_unary
        if handler.response_streaming:
            return self._deny_unary_stream
        return self._deny_unary


@dataclass
class Server:
    """A started gRPC server with its health servicer."""

    grpc_server: grpc.Server
    port: int
    address: str
    health: health.HealthServicer
    service_names: list[str]

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def stop(self, grace_s: float | None = 10.0) -> None:
        """Stop taking new calls, let in-flight calls finish (up to ``grace_s``), then exit."""
        self.set_serving(False)
        self.grpc_server.stop(grace_s).wait()

    def wait(self) -> None:
        self.grpc_server.wait_for_termination()


def _server_credentials(auth: AuthConfig | None) -> grpc.ServerCredentials | None:
    if auth is None or not auth.tls_cert:
        return None
    if not auth.tls_key:
        raise ValueError("services.auth.tls_cert is set but services.auth.tls_key is not")
    key = Path(auth.tls_key).read_bytes()
    cert = Path(auth.tls_cert).read_bytes()
    ca = Path(auth.tls_ca).read_bytes() if auth.tls_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca)


def start_server(
    register: Callable[[grpc.Server], None],
    address: str,
    *,
    service_names: list[str],
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    auth: AuthConfig | None = None,
    protected_methods: Iterable[str] = (),
    max_workers: int = 16,
) -> Server:
    """Start a server on ``address`` ("host:port"; port 0 picks a free one)."""
    token = resolve_token(auth)
    interceptors = [_TokenInterceptor(token, protected_methods)] if token else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        options=grpc_options(max_message_bytes),
        interceptors=interceptors,
        maximum_concurrent_rpcs=None,
    )
    register(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    creds = _server_credentials(auth)
    port = (
        server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    )
    if port == 0:
        raise OSError(f"could not bind gRPC server to {address!r}")
    server.start()
    host = address.rsplit(":", 1)[0]
    running = Server(server, port, f"{host}:{port}", health_servicer, list(service_names))
    running.set_serving(True)
    log.info("grpc server listening", extra={"address": running.address, "auth": bool(token)})
    return running


def serve_until_signal(server: Server, grace_s: float = 10.0) -> None:
    """Block until SIGTERM/SIGINT, then stop gracefully (in-flight calls finish)."""
    done = threading.Event()

    def on_signal(signum, _frame):
        log.info("signal received, stopping", extra={"signal": signal.Signals(signum).name})
        done.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        done.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    server.stop(grace_s)
    log.info("server stopped")


class _TokenPlugin(grpc.AuthMetadataPlugin):
    def __init__(self, token: str):
        self._token = token

    def __call__(self, context, callback):
        callback(((AUTH_METADATA_KEY, f"Bearer {self._token}"),), None)


def auth_metadata(auth: AuthConfig | None) -> tuple[tuple[str, str], ...]:
    """Metadata to send on calls to a server that requires the shared token."""
    token = resolve_token(auth)
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()


def make_channel(
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    auth: AuthConfig | None = None,
) -> grpc.Channel:
    """A channel with matching size limits; TLS when ``auth.tls_ca`` is configured.

    The auth token is not attached here (insecure channels cannot carry call credentials);
    pass ``metadata=auth_metadata(auth)`` on mutating calls.
    """
    options = grpc_options(max_message_bytes)
    if auth is not None and auth.tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(auth.tls_ca).read_bytes())
        return grpc.secure_channel(address, creds, options=options)
    return grpc.insecure_channel(address, options=options)


def check_health(
    address: str, service: str = "", timeout_s: float = 3.0, auth: AuthConfig | None = None
) -> bool:
    """True if ``address`` answers the standard health check with SERVING (over TLS when
    ``auth.tls_ca`` is set)."""
    with make_channel(address, auth=auth) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
