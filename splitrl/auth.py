"""Who may call what: the shared token, the open-method list, TLS and mutual TLS.

One policy for every transport a SplitRL process serves. The gRPC servers apply it through
``splitrl.serving`` (an interceptor calls :meth:`CallGuard.check` before any handler runs);
a transport that is not gRPC (a bulk data plane) applies the same rules by calling
:meth:`CallGuard.check` with the call's name and headers, and by taking its TLS from
:func:`ssl_context` (sockets) or :func:`load_tls` (PEM bytes, e.g. for Arrow Flight): the same
certificate, key, CA and client-certificate requirement.

- **Token** (``services.auth.token`` / ``token_env`` / ``token_file``): when one is set, every
  method except ``services.auth.open_methods`` needs ``authorization: Bearer <token>``.
- **TLS** (``tls_cert`` + ``tls_key`` on servers, ``tls_ca`` on clients): encrypted channels,
  servers verified against the CA (name: the address's host, or ``tls_server_name``).
- **Mutual TLS** (``tls_client_auth``): servers also require a client certificate signed by
  ``tls_ca``; every client channel presents ``tls_cert``/``tls_key``. A peer without one is
  refused in the TLS handshake, before any method (open or not) is reached.

The threat model (who can reach which port, what each credential allows) is docs/security.md.
"""

from __future__ import annotations

import hmac
import os
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from splitrl.config import AuthConfig

AUTH_METADATA_KEY = "authorization"


class AuthError(Exception):
    """A call is refused; ``code`` is the gRPC status to answer with (UNAUTHENTICATED)."""

    code = grpc.StatusCode.UNAUTHENTICATED

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def rpc_methods() -> list[str]:
    """Every RPC a SplitRL process serves, as ``package.Service/Method``: the three services'
    descriptors plus the standard health service. ``open_methods`` must name some of these."""
    from grpc_health.v1 import health_pb2

    from splitrl.v1 import reward_pb2, sampler_pb2, trainer_pb2

    names = []
    for module in (sampler_pb2, reward_pb2, trainer_pb2, health_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            names += [f"{service.full_name}/{m.name}" for m in service.methods]
    return names


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


def auth_metadata(auth: AuthConfig | None) -> tuple[tuple[str, str], ...]:
    """The metadata that carries the token (empty without one). Channels from
    ``splitrl.serving.make_channel`` add it to every call by themselves."""
    token = resolve_token(auth)
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()


def _method_name(method: str) -> str:
    """``/pkg.Service/Method`` (gRPC's spelling) or ``pkg.Service/Method`` -> the latter."""
    return method[1:] if method.startswith("/") else method


class CallGuard:
    """Decides whether a call may proceed: open methods always, the rest with the token.

    Without a token every method is open at this layer (mutual TLS, when configured, has
    already refused peers without a valid certificate in the handshake).
    """

    def __init__(self, auth: AuthConfig | None):
        self.token = resolve_token(auth)
        self.open_methods = frozenset(auth.open_methods) if auth is not None else frozenset()
        self._expected = f"Bearer {self.token}".encode() if self.token else b""

    @property
    def enabled(self) -> bool:
        return self.token is not None

    def is_open(self, method: str) -> bool:
        return not self.enabled or _method_name(method) in self.open_methods

    def check(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        """Raise :class:`AuthError` unless ``method`` is open or ``metadata`` (pairs of header
        name and value) carries the token. Constant-time comparison."""
        if self.is_open(method):
            return
        sent = False
        for key, value in metadata or ():
            if key.lower() != AUTH_METADATA_KEY:
                continue
            sent = True
            raw = value if isinstance(value, bytes) else value.encode()
            if hmac.compare_digest(raw, self._expected):
                return
        what = "a wrong auth token" if sent else "no auth token"
        raise AuthError(
            f"{_method_name(method)} needs the auth token and the call carried {what}: send "
            f"metadata '{AUTH_METADATA_KEY}: Bearer <token>' with the token of services.auth "
            "(token, token_env or token_file). Open without a token (services.auth."
            f"open_methods): {', '.join(sorted(self.open_methods)) or 'none'}"
        )


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes and switches read from ``services.auth``; one source for gRPC and any other
    transport (``ssl.SSLContext``, Arrow Flight's ``tls_certificates``/``root_certificates``)."""

    cert: bytes | None  # this process's certificate chain (server side; client side in mTLS)
    key: bytes | None
    ca: bytes | None  # verifies servers, and clients when client_auth
    client_auth: bool  # servers require a client certificate signed by ca
    server_name: str | None  # the name clients expect in server certificates


def _read(key: str, path: str | None) -> bytes | None:
    if not path:
        return None
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"services.auth.{key} {path!r} does not exist")
    return file.read_bytes()


def load_tls(auth: AuthConfig | None) -> TlsMaterial | None:
    """The TLS files of ``auth`` (None when neither a certificate nor a CA is configured)."""
    if auth is None or not (auth.tls_cert or auth.tls_ca):
        return None
    return TlsMaterial(cert=_read("tls_cert", auth.tls_cert), key=_read("tls_key", auth.tls_key),
                       ca=_read("tls_ca", auth.tls_ca), client_auth=auth.tls_client_auth,
                       server_name=auth.tls_server_name)


def server_credentials(auth: AuthConfig | None) -> grpc.ServerCredentials | None:
    """TLS for a server (None: plaintext). With ``tls_client_auth`` the handshake requires a
    client certificate that ``tls_ca`` signed."""
    tls = load_tls(auth)
    if tls is None or tls.cert is None:
        return None
    return grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca,
                                       require_client_auth=tls.client_auth)


def channel_credentials(auth: AuthConfig | None) -> grpc.ChannelCredentials | None:
    """TLS for a client channel (None: plaintext, when neither ``tls_ca`` nor ``tls_cert`` is
    set): servers verified against ``tls_ca`` (the system's roots without one); this process's
    certificate presented when ``tls_cert``/``tls_key`` are set (what mutual TLS needs)."""
    tls = load_tls(auth)
    if tls is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key,
                                        certificate_chain=tls.cert)


def _existing(key: str, path: str) -> str:
    if not Path(path).is_file():
        raise FileNotFoundError(f"services.auth.{key} {path!r} does not exist")
    return path


def ssl_context(auth: AuthConfig | None, *, server_side: bool) -> ssl.SSLContext | None:
    """The TLS of ``auth`` for a transport that is not gRPC (plain sockets); None: plaintext.

    Server side: serves ``tls_cert``/``tls_key``; with ``tls_client_auth`` the handshake
    requires a client certificate that ``tls_ca`` signed. Client side: verifies the server
    against ``tls_ca`` (the system's roots without one) and presents ``tls_cert``/``tls_key``
    when set; wrap sockets with ``server_hostname=auth.tls_server_name or host``.
    """
    if auth is None or not (auth.tls_cert or auth.tls_ca):
        return None
    if server_side:
        if not auth.tls_cert:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        if auth.tls_ca:
            context.load_verify_locations(cafile=_existing("tls_ca", auth.tls_ca))
        context.verify_mode = (ssl.CERT_REQUIRED if auth.tls_client_auth
                               else ssl.CERT_OPTIONAL if auth.tls_ca else ssl.CERT_NONE)
    else:
        cafile = _existing("tls_ca", auth.tls_ca) if auth.tls_ca else None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile)
    if auth.tls_cert:
        assert auth.tls_key, "AuthConfig requires tls_key with tls_cert"
        context.load_cert_chain(_existing("tls_cert", auth.tls_cert),
                                _existing("tls_key", auth.tls_key))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
