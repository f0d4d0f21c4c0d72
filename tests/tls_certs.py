"""Certificates for the TLS and mutual-TLS tests, made with ``cryptography`` (no openssl CLI).

    pki = make_pki(tmp_path)       # a CA, a certificate it signed, and a stranger from another CA
    auth = pki.auth(token="t")     # services.auth for mutual TLS with that certificate

Every certificate is valid for serverAuth and clientAuth (one per process, as SplitRL uses it)
and names ``SERVER_NAME``, ``localhost`` and 127.0.0.1.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from splitrl.config import AuthConfig

SERVER_NAME = "splitrl.test"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _ca(common_name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(common_name, _name(common_name), key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key, ca_cert, common_name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName(SERVER_NAME), x509.DNSName("localhost"),
             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (_builder(common_name, ca_cert.subject, key.public_key())
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def _write(directory: Path, stem: str, key, cert) -> tuple[Path, Path]:
    key_path, cert_path = directory / f"{stem}.key", directory / f"{stem}.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@dataclass(frozen=True)
class Pki:
    ca: Path  # the run's CA
    cert: Path  # signed by ca
    key: Path
    other_ca: Path  # an unrelated CA
    other_cert: Path  # signed by other_ca: looks right, is not ours
    other_key: Path

    def auth(self, token: str | None = None, *, client_auth: bool = True,
             cert: Path | None = None, key: Path | None = None) -> AuthConfig:
        return AuthConfig(token=token, tls_ca=str(self.ca), tls_cert=str(cert or self.cert),
                          tls_key=str(key or self.key), tls_client_auth=client_auth,
                          tls_server_name=SERVER_NAME)

    def overrides(self, token: str | None = None) -> list[str]:
        """``services.auth.*`` dotted overrides for mutual TLS (and the token)."""
        out = [f"services.auth.tls_ca={self.ca}", f"services.auth.tls_cert={self.cert}",
               f"services.auth.tls_key={self.key}", "services.auth.tls_client_auth=true",
               f"services.auth.tls_server_name={SERVER_NAME}"]
        return out + ([f"services.auth.token={token}"] if token else [])


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("splitrl test CA")
    other_ca_key, other_ca_cert = _ca("some other CA")
    key, cert = _write(directory, "service", *_leaf(ca_key, ca_cert, "splitrl service"))
    other_key, other_cert = _write(directory, "stranger",
                                   *_leaf(other_ca_key, other_ca_cert, "splitrl service"))
    ca = directory / "ca.pem"
    ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    other_ca = directory / "other-ca.pem"
    other_ca.write_bytes(other_ca_cert.public_bytes(serialization.Encoding.PEM))
    return Pki(ca, cert, key, other_ca, other_cert, other_key)
