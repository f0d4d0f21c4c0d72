"""Shared gRPC plumbing over real sockets: health, the auth token on protected methods, TLS."""

from __future__ import annotations

import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2

from splitrl.config import AuthConfig
from splitrl.serving import (
    AUTH_METADATA_KEY,
    auth_metadata,
    check_health,
    make_channel,
    start_server,
)

METHOD = "/test.Echo/Mutate"


def _register(server: grpc.Server) -> None:
    handler = grpc.unary_unary_rpc_method_handler(
        lambda request, context: b"ok:" + request,
        request_deserializer=None, response_serializer=None,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Echo", {"Mutate": handler}),)
    )


def _call(channel, metadata=()):
    return channel.unary_unary(METHOD)(b"x", timeout=5, metadata=metadata)


def test_token_guards_protected_methods_and_health_stays_open():
    auth = AuthConfig(token="s3cret")
    server = start_server(_register, "127.0.0.1:0", service_names=["test.Echo"], auth=auth,
                          protected_methods={METHOD})
    try:
        assert check_health(server.address)  # probes need no token
        with make_channel(server.address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                _call(channel)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                _call(channel, ((AUTH_METADATA_KEY, "Bearer wrong"),))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert _call(channel, auth_metadata(auth)) == b"ok:x"
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
    server = start_server(_register, "127.0.0.1:0", service_names=["test.Echo"])
    server.set_serving(False)
    reply = server.health.Check(health_pb2.HealthCheckRequest(service="test.Echo"), None)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    server.stop(0)
    assert not check_health(server.address, timeout_s=0.5)


def test_tls_with_a_self_signed_certificate(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    proc = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {proc.stderr[-200:]}")
    auth = AuthConfig(token="t", tls_cert=str(cert), tls_key=str(key), tls_ca=str(cert))
    server = start_server(_register, "127.0.0.1:0", service_names=["test.Echo"], auth=auth,
                          protected_methods={METHOD})
    try:
        assert check_health(server.address, auth=auth)
        assert not check_health(server.address, timeout_s=1.0)  # plaintext client: refused
        with make_channel(server.address, auth=auth) as channel:
            assert _call(channel, auth_metadata(auth)) == b"ok:x"
    finally:
        server.stop(0)
    with pytest.raises(ValueError, match="tls_key"):
        start_server(_register, "127.0.0.1:0", service_names=[],
                     auth=AuthConfig(tls_cert=str(cert)))
