"""Shared gRPC plumbing over real sockets: health, the auth token on every method, channels
that carry it, undecodable requests. TLS and mutual TLS: test_auth.py."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitrl.auth import AUTH_METADATA_KEY, auth_metadata
from splitrl.config import AuthConfig
from splitrl.serving import (
    UNREACHABLE,
    check_health,
    health_status,
    make_channel,
    start_server,
)

SERVICE = "test.Echo"


def _register(server: grpc.Server) -> None:
    """test.Echo with one method of each kind, on raw bytes."""
    def unary_unary(request, context):
        return b"ok:" + request

    def unary_stream(request, context):
        yield b"ok:" + request

    def stream_unary(requests, context):
        return b"ok:" + b"".join(requests)

    def stream_stream(requests, context):
        for r in requests:
            yield b"ok:" + r

    handlers = {
        "UnaryUnary": grpc.unary_unary_rpc_method_handler(unary_unary),
        "UnaryStream": grpc.unary_stream_rpc_method_handler(unary_stream),
        "StreamUnary": grpc.stream_unary_rpc_method_handler(stream_unary),
        "StreamStream": grpc.stream_stream_rpc_method_handler(stream_stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _call_each_kind(channel, metadata=()) -> dict[str, object]:
    """Call the four methods; the reply bytes, or the status code of the error."""
    calls = {
        "UnaryUnary": lambda: channel.unary_unary(f"/{SERVICE}/UnaryUnary")(
            b"x", timeout=5, metadata=metadata),
        "UnaryStream": lambda: b"".join(channel.unary_stream(f"/{SERVICE}/UnaryStream")(
            b"x", timeout=5, metadata=metadata)),
        "StreamUnary": lambda: channel.stream_unary(f"/{SERVICE}/StreamUnary")(
            iter([b"x"]), timeout=5, metadata=metadata),
        "StreamStream": lambda: b"".join(channel.stream_stream(f"/{SERVICE}/StreamStream")(
            iter([b"x"]), timeout=5, metadata=metadata)),
    }
    out = {}
    for name, call in calls.items():
        try:
            out[name] = call()
        except grpc.RpcError as e:
            out[name] = e.code()
    return out


def test_with_a_token_every_method_needs_it_and_health_check_stays_open(caplog):
    auth = AuthConfig(token="s3cret")
    server = start_server(_register, "127.0.0.1:0", service_names=[SERVICE], auth=auth)
    try:
        assert check_health(server.address)  # probes need no token (open by default)
        with make_channel(server.address) as channel:
            refused = _call_each_kind(channel)
            assert set(refused.values()) == {grpc.StatusCode.UNAUTHENTICATED}, refused
            wrong = _call_each_kind(channel, ((AUTH_METADATA_KEY, "Bearer wrong"),))
            assert set(wrong.values()) == {grpc.StatusCode.UNAUTHENTICATED}, wrong
            assert set(_call_each_kind(channel, auth_metadata(auth)).values()) == {b"ok:x"}
            with pytest.raises(grpc.RpcError) as err:  # a Watch stream holds a server thread
                next(health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(), timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "Health/Watch needs the auth token" in err.value.details()
            assert "no auth token" in err.value.details()
            assert "grpc.health.v1.Health/Check" in err.value.details()  # says what is open
    finally:
        server.stop(0)
    refusals = [r for r in caplog.records if r.getMessage() == "call refused: not authenticated"]
    assert len(refusals) == 9 and not any(r.exc_info for r in refusals)


def test_channels_from_make_channel_carry_the_token_on_every_kind_of_call():
    auth = AuthConfig(token="s3cret")
    server = start_server(_register, "127.0.0.1:0", service_names=[SERVICE], auth=auth)
    try:
        with make_channel(server.address, auth=auth) as channel:
            assert set(_call_each_kind(channel).values()) == {b"ok:x"}
            # an explicit token is not sent twice (and a wrong explicit one is not replaced)
            assert set(_call_each_kind(channel, auth_metadata(auth)).values()) == {b"ok:x"}
            wrong = _call_each_kind(channel, ((AUTH_METADATA_KEY, "Bearer wrong"),))
            assert set(wrong.values()) == {grpc.StatusCode.UNAUTHENTICATED}
    finally:
        server.stop(0)


def test_open_methods_answer_without_the_token():
    auth = AuthConfig(token="s3cret", open_methods=["grpc.health.v1.Health/Watch"])
    server = start_server(_register, "127.0.0.1:0", service_names=[SERVICE], auth=auth)
    try:
        assert not check_health(server.address, timeout_s=2)  # Check is no longer open
        assert check_health(server.address, auth=auth)
        with make_channel(server.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(),
                                                                timeout=5)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
    finally:
        server.stop(0)


def test_token_from_env_and_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_TOKEN", "from-env")
    assert auth_metadata(AuthConfig(token_env="MY_TOKEN")) == (
        (AUTH_METADATA_KEY, "Bearer from-env"),)
    (tmp_path / "token").write_text("from-file\n")
    assert auth_metadata(AuthConfig(token_env="UNSET_X", token_file=str(tmp_path / "token"))) == (
        (AUTH_METADATA_KEY, "Bearer from-file"),)
    with pytest.raises(FileNotFoundError, match="token_file"):
        auth_metadata(AuthConfig(token_env="UNSET_X", token_file=str(tmp_path / "nope")))


def test_graceful_stop_marks_not_serving():
    server = start_server(_register, "127.0.0.1:0", service_names=[SERVICE])
    server.set_serving(False)
    reply = server.health.Check(health_pb2.HealthCheckRequest(service="test.Echo"), None)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert health_status(server.address, timeout_s=2) == ("NOT_SERVING", "")  # reachable
    server.stop(0)
    assert not check_health(server.address, timeout_s=0.5)
    assert health_status(server.address, timeout_s=0.5)[0] == UNREACHABLE  # the port is closed


def test_busy_calls_cannot_starve_health_checks():
    # 50 long calls against a server of 12 threads: 8 run, the rest are refused at once with
    # RESOURCE_EXHAUSTED, and a health check still answers (it used to queue behind them).
    release, running = threading.Event(), threading.Semaphore(0)

    def register(server):
        def hold(request, context):
            running.release()
            release.wait(60)
            yield b"done"

        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE, {"Hold": grpc.unary_stream_rpc_method_handler(hold)}),))

    server = start_server(register, "127.0.0.1:0", service_names=[SERVICE], max_workers=12)
    outcomes: list = []
    try:
        with make_channel(server.address) as channel:
            hold = channel.unary_stream(f"/{SERVICE}/Hold")

            def call():
                try:
                    outcomes.append(b"".join(hold(b"", timeout=60)))
                except grpc.RpcError as e:
                    outcomes.append(e.code())

            threads = [threading.Thread(target=call) for _ in range(50)]
            for t in threads:
                t.start()
            for _ in range(8):
                assert running.acquire(timeout=30)
            deadline = time.monotonic() + 30
            while outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) < 42:
                assert time.monotonic() < deadline, outcomes
                time.sleep(0.01)
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            release.set()
            for t in threads:
                t.join(30)
    finally:
        release.set()
        server.stop(0)
    assert outcomes.count(b"done") == 8 and len(outcomes) == 50


def _register_typed(server: grpc.Server) -> None:
    """test.Typed: methods that take protobuf messages (ScoreRequest), one of each kind. The
    stream handler turns anything unexpected into INTERNAL, as a careless handler would."""
    from splitrl.v1 import reward_pb2

    def reply(requests) -> reward_pb2.ScoreReply:
        return reward_pb2.ScoreReply(seconds=float(sum(len(r.items) for r in requests)))

    def stream_unary(requests, context):
        try:
            return reply(list(requests))
        except Exception as e:
            context.abort(grpc.StatusCode.INTERNAL, f"handler failed: {e!r}")

    kw = dict(request_deserializer=reward_pb2.ScoreRequest.FromString,
              response_serializer=reward_pb2.ScoreReply.SerializeToString)
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(lambda r, c: reply([r]), **kw),
        "ServerStream": grpc.unary_stream_rpc_method_handler(lambda r, c: iter([reply([r])]),
                                                             **kw),
        "ClientStream": grpc.stream_unary_rpc_method_handler(stream_unary, **kw),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Typed",
                                                                          handlers),))


GARBAGE = b"\x0a\x05ab"  # field 1 (items), length 5, but only 2 bytes follow


def test_an_undecodable_request_is_invalid_argument_in_one_log_line(caplog):
    server = start_server(_register_typed, "127.0.0.1:0", service_names=["test.Typed"])
    calls = {
        "Unary": lambda ch: ch.unary_unary("/test.Typed/Unary")(GARBAGE, timeout=5),
        "ServerStream": lambda ch: list(ch.unary_stream("/test.Typed/ServerStream")(
            GARBAGE, timeout=5)),
        "ClientStream": lambda ch: ch.stream_unary("/test.Typed/ClientStream")(
            iter([b"", GARBAGE]), timeout=5),
    }
    try:
        with make_channel(server.address) as channel:
            for name, call in calls.items():
                with pytest.raises(grpc.RpcError) as err:
                    call(channel)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.value)
                assert "is not a valid splitrl.v1.ScoreRequest (4 bytes" in err.value.details()
            assert "message #1 of the request stream" in err.value.details()
            ok = channel.unary_unary("/test.Typed/Unary")(b"", timeout=5)  # still serving
            assert ok == b""
    finally:
        server.stop(0)
    lines = [r for r in caplog.records if r.name.startswith(("grpc", "splitrl"))
             and r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in lines] == ["undecodable request refused"] * 2, lines
    assert not any(r.exc_info for r in lines)
    assert {r.method for r in lines} == {"/test.Typed/Unary", "/test.Typed/ServerStream"}


def test_health_list_names_every_service_with_its_status():
    server = start_server(_register, "127.0.0.1:0", service_names=[SERVICE])
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            serving = stub.List(health_pb2.HealthListRequest(), timeout=5).statuses
            server.set_serving(False)
            stopped = stub.List(health_pb2.HealthListRequest(), timeout=5).statuses
    finally:
        server.stop(0)
    assert serving[SERVICE].status == health_pb2.HealthCheckResponse.SERVING
    assert serving[""].status == health_pb2.HealthCheckResponse.SERVING
    assert stopped[SERVICE].status == health_pb2.HealthCheckResponse.NOT_SERVING
