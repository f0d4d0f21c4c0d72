"""gRPC plumbing shared by the three services: servers, channels, health, auth, shutdown.

Every server gets the same treatment so that operators see one behaviour everywhere:
message-size limits set on both ends (gRPC's default 4 MiB receive limit is smaller than a
weight chunk plus framing), the standard ``grpc.health.v1`` service (what compose health checks
and Kubernetes' native gRPC probes call), the auth policy of ``splitrl.auth`` on every method
(with a token set, UNAUTHENTICATED without it except ``services.auth.open_methods``), optional
TLS or mutual TLS, undecodable requests answered INVALID_ARGUMENT in one log line, and a
graceful stop that marks the service NOT_SERVING, lets in-flight calls finish, then exits.

Every channel from :func:`make_channel` carries the same credentials: TLS (and this process's
certificate for mutual TLS) and the token on every call.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import grpc.experimental
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitrl.auth import (
    AUTH_METADATA_KEY,
    AuthError,
    CallGuard,
    channel_credentials,
    resolve_token,
    server_credentials,
)
from splitrl.config import AuthConfig
from splitrl.retry import SERVICE_CONFIG
from splitrl.wire_error import WireError

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Cheap calls that must answer even when every other thread of a server is busy (a
# liveness probe that queues behind 50 rollouts gets the pod restarted).
LIGHT_METHODS = frozenset({
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/List",
    "/splitrl.v1.Sampler/GetInfo",
    "/splitrl.v1.Trainer/Status",
    "/splitrl.v1.Reward/ListRewardFunctions",
})
RESERVED_WORKERS = 4  # threads only LIGHT_METHODS may use


class _HealthServicer(health.HealthServicer):
    """grpcio-health's servicer, plus ``List`` (grpc.health.v1 added it in 2024; the package
    answers it with UNIMPLEMENTED and a logged traceback): a snapshot of every registered
    service's status, what ``grpcurl ... grpc.health.v1.Health/List`` shows an operator."""

    def List(self, request, context):  # noqa: N802 (the gRPC method's name)
        with self._lock:
            statuses = dict(self._server_status)
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in statuses.items()})


def grpc_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


class _Undecodable:
    """What a request deserializer hands the handler when the bytes are not the message."""

    __slots__ = ("message_type", "size", "error")

    def __init__(self, message_type: str, size: int, error: Exception):
        self.message_type, self.size, self.error = message_type, size, error

    def describe(self, where: str) -> str:
        return (f"{where} is not a valid {self.message_type} ({self.size} bytes: "
                f"{self.error}); is the client built from the same protos/splitrl/v1?")


def _tolerant(deserializer: Callable[[bytes], object]) -> Callable[[bytes], object]:
    """Wrap a request deserializer so that undecodable bytes reach our code as an
    :class:`_Undecodable` (gRPC's own handling answers INTERNAL and logs a traceback)."""
    owner = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    message_type = owner.full_name if owner is not None else "request message"

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # DecodeError, invalid UTF-8 in a string field, ...
            return _Undecodable(message_type, len(data), e)

    return deserialize


def _refuse_undecodable(method: str, bad: _Undecodable, where: str, context) -> None:
    log.warning("undecodable request refused", extra={
        "method": method, "peer": context.peer(), "message_type": bad.message_type,
        "bytes": bad.size, "error": str(bad.error)})
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.describe(where))


def _decoding_handler(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` with undecodable requests answered INVALID_ARGUMENT in one log line."""
    if handler.request_deserializer is None:
        return handler
    deserializer = _tolerant(handler.request_deserializer)
    serializer = handler.response_serializer
    if not handler.request_streaming:
        if handler.response_streaming:
            inner = handler.unary_stream

            def unary_stream(request, context):
                if isinstance(request, _Undecodable):
                    _refuse_undecodable(method, request, "the request", context)
                yield from inner(request, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream, deserializer, serializer)
        inner = handler.unary_unary

        def unary_unary(request, context):
            if isinstance(request, _Undecodable):
                _refuse_undecodable(method, request, "the request", context)
            return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, serializer)

    inner_stream = handler.stream_stream if handler.response_streaming else handler.stream_unary

    def refuse_if_bad(bad, context) -> None:
        if bad:  # whatever the handler made of it, the status names the bad message
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad[0].describe(bad[1]))

    def stream_unary(request_iterator, context):
        bad: list = []
        try:
            return inner_stream(_checked_stream(request_iterator, bad), context)
        except Exception:
            refuse_if_bad(bad, context)
            raise

    def stream_stream(request_iterator, context):
        bad: list = []
        try:
            yield from inner_stream(_checked_stream(request_iterator, bad),
                                    context)
        except Exception:
            refuse_if_bad(bad, context)
            raise

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream_stream, deserializer, serializer)
    return grpc.stream_unary_rpc_method_handler(stream_unary, deserializer, serializer)


def _checked_stream(messages, bad: list):
    """Yield the request stream's messages; an undecodable one ends it with the wire's error
    and is recorded in ``bad``. The only request stream is the weight push, whose handler
    answers a WireError with its status and logs it in one line."""
    for i, message in enumerate(messages):
        if isinstance(message, _Undecodable):
            where = f"message #{i} of the request stream"
            bad[:] = [message, where]
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT, message.describe(where))
        yield message


_BEHAVIOUR = {
    (False, False): "unary_unary", (False, True): "unary_stream",
    (True, False): "stream_unary", (True, True): "stream_stream",
}


class _GuardInterceptor(grpc.ServerInterceptor):
    """Every call of a server passes here: refused (UNAUTHENTICATED, one log line, the request
    never decoded) unless :class:`CallGuard` lets it through; then undecodable requests are
    answered INVALID_ARGUMENT in one log line instead of gRPC's INTERNAL and a traceback."""

    _FACTORIES = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }

    def __init__(self, guard: CallGuard, limit: int):
        self._guard = guard
        self._limit = limit
        self._slots = threading.BoundedSemaphore(limit)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:  # no such method: gRPC answers UNIMPLEMENTED
            return None
        method = handler_call_details.method
        try:
            self._guard.check(method, handler_call_details.invocation_metadata)
        except AuthError as e:
            return self._deny(handler, method, e)
        handler = _decoding_handler(method, handler)
        return handler if method in LIGHT_METHODS else self._limited(handler, method)

    def _limited(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """``handler`` holding one of the server's ``limit`` slots for other than light calls
        while it runs; without a free slot the call is RESOURCE_EXHAUSTED at once, so the
        reserved threads stay free for health checks and GetInfo."""
        kind = (handler.request_streaming, handler.response_streaming)
        inner = getattr(handler, _BEHAVIOUR[kind])
        slots, limit = self._slots, self._limit

        def take_slot(context) -> None:
            if not slots.acquire(blocking=False):
                log.warning("call refused: server busy", extra={"method": method, "limit": limit})
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{method}: this server already runs {limit} calls (its other "
                              "threads are kept for health checks); retry later")

        if handler.response_streaming:
            def behaviour(request, context):
                take_slot(context)
                try:
                    yield from inner(request, context)
                finally:
                    slots.release()
        else:
            def behaviour(request, context):
                take_slot(context)
                try:
                    return inner(request, context)
                finally:
                    slots.release()

        return self._FACTORIES[kind](behaviour, handler.request_deserializer,
                                     handler.response_serializer)

    def _deny(self, handler: grpc.RpcMethodHandler, method: str, error: AuthError):
        def deny(_request, context):  # no deserializer: an unauthenticated request is not read
            log.warning("call refused: not authenticated",
                        extra={"method": method, "peer": context.peer()})
            context.abort(error.code, error.message)

        return self._FACTORIES[(handler.request_streaming, handler.response_streaming)](deny)

@dataclass
class Server:
    """A started gRPC server with its health servicer."""

    grpc_server: grpc.Server
    port: int
    address: str
    health: health.HealthServicer
    service_names: list[str]
    # Called with the grace period when the server stops (e.g. a side channel to close too).
    on_stop: list[Callable[[float | None], None]] = field(default_factory=list)

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
        for hook in self.on_stop:
            hook(grace_s)

    def wait(self) -> None:
        self.grpc_server.wait_for_termination()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def start_server(
    register: Callable[[grpc.Server], None],
    address: str,
    *,
    service_names: list[str],
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    auth: AuthConfig | None = None,
    max_workers: int = 64,
) -> Server:
    """Start a server on ``address`` ("host:port"; port 0 picks a free one).

    Every method, the health service's included, is subject to ``auth`` (see
    ``splitrl.auth``): with a token set, only ``auth.open_methods`` answer without it.
    A call holds a thread while it runs; all but ``RESERVED_WORKERS`` of the ``max_workers``
    threads serve any method, the rest only ``LIGHT_METHODS`` (beyond that, calls are
    RESOURCE_EXHAUSTED at once instead of queueing in front of a health check).
    """
    if max_workers <= RESERVED_WORKERS:
        raise ValueError(f"max_workers must exceed the {RESERVED_WORKERS} reserved threads, "
                         f"got {max_workers}")
    guard = CallGuard(auth)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        options=grpc_options(max_message_bytes),
        interceptors=[_GuardInterceptor(guard, max_workers - RESERVED_WORKERS)],
        maximum_concurrent_rpcs=None,
    )
    register(server)
    health_servicer = _HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    creds = server_credentials(auth)
    port = (
        server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    )
    if port == 0:
        raise OSError(f"could not bind gRPC server to {address!r}")
    server.start()
    host = address.rsplit(":", 1)[0]
    running = Server(server, port, f"{host}:{port}", health_servicer, list(service_names))
    running.set_serving(True)
    mutual = bool(creds) and auth is not None and auth.tls_client_auth
    log.info("grpc server listening", extra={
        "address": running.address, "auth": guard.enabled, "tls": bool(creds),
        "mutual_tls": mutual, "open_methods": sorted(guard.open_methods) if guard.enabled
        else "all"})
    if not (guard.enabled or mutual or _is_loopback(host)):
        log.warning("no auth configured: every RPC is open to anyone who can reach this port "
                    "(set services.auth.token_env/token_file, or tls_client_auth; see "
                    "docs/security.md)", extra={"address": running.address})
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


def exit_without_teardown(code: int) -> None:
    """Leave the process now with ``code``, skipping the interpreter's teardown: jax's exit
    hook clearing every backend and compilation cache, and the finalisation of jax, flax and
    XLA's client, which free nothing the OS does not free at once and delay whoever waits for
    the process (a launcher, a test, an orchestrator's restart); bench/startup_tricks.py
    measures it. Only for a process whose service has closed everything it owns (servers
    stopped, checkpoints written, metrics and logs flushed): ``splitrl trainer/sampler/up/demo``
    and ``python -m sampler_service``. Log handlers, stdout and stderr are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


LAUNCHER_PID_ENV = "SPLITRL_LAUNCHER_PID"


def stop_with_launcher(poll_s: float = 1.0, hard_exit_after_s: float = 120.0) -> bool:
    """When ``SPLITRL_LAUNCHER_PID`` names this process's parent (``splitrl up`` sets it for
    the services it starts), SIGTERM this process once that parent is gone, so a launcher
    killed with -9 (or a CI runner's timeout) leaves no sampler, trainer or reward service
    behind holding ports and CPU. SIGTERM takes each service's graceful path (the trainer
    checkpoints); if that has not ended the process ``hard_exit_after_s`` later, it exits.
    Polls ``getppid`` rather than ``prctl(PR_SET_PDEATHSIG)``: the same on Linux and macOS, and
    safe with the launcher's threads. Returns whether the watch started."""
    named = os.environ.get(LAUNCHER_PID_ENV, "")
    launcher = int(named) if named.isdigit() else None
    if launcher is None or launcher != os.getppid():
        return False  # started by hand, by compose or by Kubernetes: nothing to follow

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        log.warning("the launcher that started this service is gone; stopping",
                    extra={"launcher_pid": launcher})
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(hard_exit_after_s)
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
    return True


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")),
    grpc.ClientCallDetails,
):
    pass


class _TokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call of a channel (unless the caller
    passed one). An interceptor, not call credentials, because gRPC refuses call credentials
    on a plaintext channel."""

    def __init__(self, token: str):
        self._pair = (AUTH_METADATA_KEY, f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = list(details.metadata or ())
        if any(key == AUTH_METADATA_KEY for key, _ in metadata):
            return details
        return _CallDetails(details.method, details.timeout, [*metadata, self._pair],
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def make_channel(
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    auth: AuthConfig | None = None,
    *,
    balanced: bool = False,
) -> grpc.Channel:
    """A channel with matching size limits and the credentials of ``auth``: TLS when
    ``tls_ca`` or ``tls_cert`` is set (presenting this process's certificate when it has one:
    mutual TLS), and the token on every call when one is configured. Idempotent calls that
    fail with UNAVAILABLE are retried by gRPC (``splitrl.retry.SERVICE_CONFIG``).

    ``balanced``: calls go round-robin over every address the name resolves to (replicas of a
    stateless service behind one DNS name: compose's ``--scale``, a headless Service), instead
    of gRPC's default of sticking to the first."""
    options: list[tuple[str, int | str]] = list(grpc_options(max_message_bytes))
    if balanced:
        options.append(("grpc.lb_policy_name", "round_robin"))
    # Services start concurrently, so a peer is often dialled before it listens; gRPC's default
    # reconnect back-off (1 s growing to 120 s) would then keep the channel failing long after
    # the peer is up. Redial within a second on loopback or a cluster network.
    options += [("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000)]
    options += [("grpc.enable_retries", 1), ("grpc.service_config", SERVICE_CONFIG)]
    # A server stream (Rollout) is read on the thread that iterates it: without this option
    # the first call on an idle channel starts a polling thread that exits with the channel's
    # last call, on the critical path of every synchronous step's first request.
    options.append((grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1))
    creds = channel_credentials(auth)
    if creds is not None:
        if auth is not None and auth.tls_server_name:  # creds come from auth
            options.append(("grpc.ssl_target_name_override", auth.tls_server_name))
        channel = grpc.secure_channel(address, creds, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    token = resolve_token(auth)
    return grpc.intercept_channel(channel, _TokenClientInterceptor(token)) if token else channel


UNREACHABLE = "UNREACHABLE"


def check_health(
    address: str, service: str = "", timeout_s: float = 3.0, auth: AuthConfig | None = None
) -> bool:
    """True if ``address`` answers the standard health check with SERVING (with the
    credentials of ``auth``, as every channel)."""
    return health_status(address, service, timeout_s, auth)[0] == "SERVING"


def health_status(
    address: str, service: str = "", timeout_s: float = 3.0, auth: AuthConfig | None = None
) -> tuple[str, str]:
    """(status, detail) of the standard health check at ``address``: the answer's name
    (SERVING, NOT_SERVING, SERVICE_UNKNOWN); :data:`UNREACHABLE` when nothing there accepts a
    TCP connection (refused, no route, unknown host); else the gRPC code of a call that reached
    a listener and failed (UNAVAILABLE for a refused TLS handshake, UNAUTHENTICATED,
    UNIMPLEMENTED for a server without the health service, DEADLINE_EXCEEDED), with what gRPC
    said. gRPC reports a closed port and a failed handshake alike (UNAVAILABLE), so that code
    is told apart by trying the TCP connection itself."""
    with make_channel(address, auth=auth) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                refused = _tcp_refused(address, timeout_s)
                if refused is not None:
                    return UNREACHABLE, refused
            return e.code().name, e.details() or ""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), ""


def _tcp_refused(address: str, timeout_s: float) -> str | None:
    """Why no TCP connection to ``host:port`` can be made, or None when one can (or the
    address is not of that form, e.g. a ``unix:`` socket)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        return e.strerror or str(e)
    return None
