"""Fixtures of the ft tests: snapshot servers stopped after each test, and certificates for TLS,
made at test time (nothing secret is stored)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of a throw-away job CA and of server certificates it signed."""

    ca: Path
    """The job CA's certificate: what a client trusts (``ft.tls_ca``)."""
    cert: Path
    """Server certificate naming ``localhost`` and ``127.0.0.1``, signed by ``ca``."""
    key: Path
    """Private key of ``cert`` (and of ``cert_without_ip``)."""
    cert_without_ip: Path
    """Server certificate signed by ``ca`` that names only ``peer.invalid``: no IP address."""
    other_ca: Path
    """An unrelated CA that signed none of the above."""


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    """A CA and server certificates for 127.0.0.1, made once per session (EC keys: milliseconds)."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    root = tmp_path_factory.mktemp("tls")
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def build(subject: str, key, issuer: str, issuer_key, *, ca: bool,
              alt_names: list | None = None) -> x509.Certificate:
        builder = (x509.CertificateBuilder()
                   .subject_name(name(subject)).issuer_name(name(issuer))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            builder = builder.add_extension(
                x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                              content_commitment=False, key_encipherment=False,
                              data_encipherment=False, key_agreement=False,
                              encipher_only=False, decipher_only=False), critical=True)
            builder = builder.add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        else:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt_names),
                                            critical=False)
            builder = builder.add_extension(
                x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            builder = builder.add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write_cert(path: Path, cert: x509.Certificate) -> Path:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    ca_key, other_key, server_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = build("ftlm test job CA", ca_key, "ftlm test job CA", ca_key, ca=True)
    other = build("unrelated CA", other_key, "unrelated CA", other_key, ca=True)
    server = build("ftlm peer", server_key, "ftlm test job CA", ca_key, ca=False, alt_names=[
        x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    no_ip = build("ftlm peer", server_key, "ftlm test job CA", ca_key, ca=False,
                  alt_names=[x509.DNSName("peer.invalid")])
    key_path = root / "server.key"
    key_path.write_bytes(server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return TLSFiles(ca=write_cert(root / "ca.pem", ca),
                    cert=write_cert(root / "server.pem", server), key=key_path,
                    cert_without_ip=write_cert(root / "server-no-ip.pem", no_ip),
                    other_ca=write_cert(root / "other-ca.pem", other))


@pytest.fixture
def make_server():
    """``make(cls=SnapshotServer, **kwargs)``: a started snapshot server, stopped after the test."""
    from ftlm.ft.transport import SnapshotServer
    servers: list = []

    def make(cls: type = SnapshotServer, **kwargs):
        server = cls(**kwargs)
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.stop()
