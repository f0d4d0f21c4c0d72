"""splitrl.auth: the call guard, its config, TLS and mutual TLS over real sockets.

Certificates are made per test module by tests/tls_certs.py: our CA with a certificate it
signed, and an unrelated CA with a look-alike certificate (same names, other signer).
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import yaml
from tls_certs import SERVER_NAME, make_pki

from splitrl.auth import AuthError, CallGuard, load_tls, ssl_context
from splitrl.config import AuthConfig, ConfigError, load_config
from splitrl.serving import check_health, make_channel, start_server

REPO = Path(__file__).resolve().parents[2]
METHOD = "/test.Echo/Mutate"


def _register(server: grpc.Server) -> None:
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"ok:" + request)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Echo", {"Mutate": handler}),))


def _call(auth: AuthConfig | None, address: str):
    """The reply, or the status code the call failed with."""
    with make_channel(address, auth=auth) as channel:
        try:
            return channel.unary_unary(METHOD)(b"x", timeout=5)
        except grpc.RpcError as e:
            return e.code()


# -- the guard ---------------------------------------------------------------------------------


def test_guard_lets_open_methods_through_and_wants_the_token_for_the_rest():
    guard = CallGuard(AuthConfig(token="s3cret"))
    assert guard.enabled
    guard.check("/grpc.health.v1.Health/Check", ())  # open by default, either spelling
    guard.check("splitrl.v1.Trainer/Status", None)
    guard.check("/splitrl.v1.Sampler/Generate", [("authorization", "Bearer s3cret")])
    guard.check("/splitrl.v1.Sampler/Generate", [("Authorization", b"Bearer s3cret")])
    with pytest.raises(AuthError, match="Sampler/Generate needs the auth token and the call "
                                        "carried no auth token") as e:
        guard.check("/splitrl.v1.Sampler/Generate", [("x-other", "1")])
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(AuthError, match="carried a wrong auth token"):
        guard.check("/splitrl.v1.Reward/Score", [("authorization", "Bearer s3cre")])
    with pytest.raises(AuthError, match="Health/Watch"):
        guard.check("/grpc.health.v1.Health/Watch", ())


def test_without_a_token_the_guard_opens_everything():
    guard = CallGuard(AuthConfig(token_env="SPLITRL_TEST_UNSET_TOKEN"))
    assert not guard.enabled
    guard.check("/splitrl.v1.Sampler/PushWeights", ())


def test_auth_config_is_validated_with_the_key_named(tmp_path):
    with pytest.raises(ConfigError, match=r"services\.auth\.open_methods\[1\]: expected one of "
                                          r".*got 'splitrl.v1.Trainer/Stauts'"):
        load_config(None, ["services.auth.open_methods=[grpc.health.v1.Health/Check,"
                           "splitrl.v1.Trainer/Stauts]"])
    with pytest.raises(ConfigError, match=r"services\.auth\.tls_key: expected a file since "
                                          "tls_cert is set"):
        load_config(None, ["services.auth.tls_cert=/x.pem"])
    with pytest.raises(ConfigError, match=r"services\.auth\.tls_client_auth: mutual TLS needs "
                                          "tls_ca"):
        load_config(None, ["services.auth.tls_cert=/x.pem", "services.auth.tls_key=/x.key",
                           "services.auth.tls_client_auth=true"])
    cfg = load_config(None, ["services.auth.open_methods=[]"])
    assert cfg.services.auth.open_methods == []
    with pytest.raises(FileNotFoundError, match="services.auth.tls_ca"):
        load_tls(AuthConfig(tls_ca=str(tmp_path / "missing.pem")))


# -- TLS and mutual TLS ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mtls_server(pki):
    """A server that requires client certificates signed by our CA (and no token)."""
    server = start_server(_register, "127.0.0.1:0", service_names=["test.Echo"],
                          auth=pki.auth())
    yield server
    server.stop(0)


def test_mtls_refuses_a_client_without_a_certificate(pki, mtls_server):
    no_cert = AuthConfig(tls_ca=str(pki.ca), tls_server_name=SERVER_NAME)
    assert _call(no_cert, mtls_server.address) == grpc.StatusCode.UNAVAILABLE
    assert not check_health(mtls_server.address, timeout_s=2, auth=no_cert)
    assert _call(None, mtls_server.address) == grpc.StatusCode.UNAVAILABLE  # plaintext


def test_mtls_refuses_a_certificate_from_another_ca(pki, mtls_server):
    stranger = pki.auth(cert=pki.other_cert, key=pki.other_key)
    assert _call(stranger, mtls_server.address) == grpc.StatusCode.UNAVAILABLE
    assert not check_health(mtls_server.address, timeout_s=2, auth=stranger)


def test_mtls_accepts_a_certificate_from_our_ca(pki, mtls_server):
    assert _call(pki.auth(), mtls_server.address) == b"ok:x"
    assert check_health(mtls_server.address, auth=pki.auth())


def test_tls_without_client_auth_serves_clients_without_a_certificate(pki):
    server = start_server(_register, "127.0.0.1:0", service_names=["test.Echo"],
                          auth=pki.auth(client_auth=False))
    try:
        no_cert = AuthConfig(tls_ca=str(pki.ca), tls_server_name=SERVER_NAME)
        assert _call(no_cert, server.address) == b"ok:x"
        assert _call(None, server.address) == grpc.StatusCode.UNAVAILABLE  # plaintext
        other_ca = AuthConfig(tls_ca=str(pki.other_ca), tls_server_name=SERVER_NAME)
        assert _call(other_ca, server.address) == grpc.StatusCode.UNAVAILABLE  # server unknown
    finally:
        server.stop(0)


def test_mtls_with_a_token_needs_both(pki):
    server = start_server(_register, "127.0.0.1:0", service_names=["test.Echo"],
                          auth=pki.auth(token="s3cret"))
    try:
        assert _call(pki.auth(), server.address) == grpc.StatusCode.UNAUTHENTICATED
        assert _call(pki.auth(token="s3cret"), server.address) == b"ok:x"
        assert check_health(server.address, auth=pki.auth())  # Check is open; the cert is not
    finally:
        server.stop(0)


def test_tls_server_name_is_checked_against_the_server_certificate(pki, mtls_server):
    host_named = pki.auth()
    host_named = AuthConfig(**{**vars(host_named), "tls_server_name": None})  # 127.0.0.1: in SAN
    assert _call(host_named, mtls_server.address) == b"ok:x"
    wrong = AuthConfig(**{**vars(host_named), "tls_server_name": "evil.example"})
    assert _call(wrong, mtls_server.address) == grpc.StatusCode.UNAVAILABLE


def _health_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SPLITRL_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "splitrl", "health", *args, "--timeout", "3"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=60)


def test_splitrl_health_presents_the_configs_certificate(pki, mtls_server, tmp_path):
    config = tmp_path / "splitrl.yaml"
    config.write_text(yaml.safe_dump({"services": {"auth": {
        "tls_ca": str(pki.ca), "tls_cert": str(pki.cert), "tls_key": str(pki.key),
        "tls_client_auth": True, "tls_server_name": SERVER_NAME}}}))
    ok = _health_cli(mtls_server.address, "--config", str(config))
    assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING"), ok.stderr
    flags = _health_cli(mtls_server.address, "--tls-ca", str(pki.ca), "--tls-cert",
                        str(pki.cert), "--tls-key", str(pki.key), "--tls-server-name",
                        SERVER_NAME)
    assert (flags.returncode, flags.stdout.strip()) == (0, "SERVING"), flags.stderr
    # No client certificate: the server is there and refuses the handshake (exit 1), which is
    # not "nothing accepts connections" (exit 3).
    refused = _health_cli(mtls_server.address, "--tls-ca", str(pki.ca))
    assert refused.returncode == 1, refused.stdout
    assert refused.stdout.startswith("UNAVAILABLE: "), refused.stdout
    missing = _health_cli(mtls_server.address, "--tls-ca", str(tmp_path / "nope.pem"))
    assert missing.returncode == 2 and "services.auth.tls_ca" in missing.stderr


# -- the same TLS for a transport that is not gRPC ---------------------------------------------


def _tls_echo_once(server_context: ssl.SSLContext) -> tuple[socket.socket, threading.Thread,
                                                              list]:
    """A TCP server on 127.0.0.1 that completes one TLS handshake and echoes one message."""
    listener = socket.create_server(("127.0.0.1", 0))
    errors: list = []

    def serve():
        conn, _ = listener.accept()
        try:
            with server_context.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(tls.recv(16))
        except (ssl.SSLError, OSError) as e:
            errors.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread, errors


def _tls_exchange(pki, client_auth_config: AuthConfig) -> tuple[bytes | None, list]:
    server_context = ssl_context(pki.auth(), server_side=True)
    listener, thread, server_errors = _tls_echo_once(server_context)
    client_context = ssl_context(client_auth_config, server_side=False)
    reply = None
    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as raw:
            with client_context.wrap_socket(raw, server_hostname=SERVER_NAME) as tls:
                tls.sendall(b"ping")
                reply = tls.recv(16) or None
    except (ssl.SSLError, OSError):
        reply = None
    thread.join(10)
    listener.close()
    return reply, server_errors


def test_ssl_context_gives_a_socket_transport_the_same_mutual_tls(pki):
    reply, errors = _tls_exchange(pki, pki.auth())
    assert reply == b"ping" and not errors
    reply, errors = _tls_exchange(pki, AuthConfig(tls_ca=str(pki.ca)))  # no certificate
    assert reply is None and errors and "certificate" in str(errors[0]).lower()
    reply, errors = _tls_exchange(pki, pki.auth(cert=pki.other_cert, key=pki.other_key))
    assert reply is None and errors and "certificate" in str(errors[0]).lower()
    assert ssl_context(AuthConfig(), server_side=True) is None
    assert ssl_context(AuthConfig(tls_ca=str(pki.ca)), server_side=True) is None
