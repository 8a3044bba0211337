"""TLS contexts for ftlm's HTTP servers and clients (live state transfer, coordinator).

Two functions, one per side:

* `server_context(cert_file, key_file)`: what a server (SnapshotServer, the coordinator) passes
  to its listening socket so that it serves https://.
* `client_context(ca_file)`: what a client passes to its connections so that it talks only to a
  server whose certificate chains to `ca_file` and names the host it dialled.

Both read PEM files, refuse anything older than TLS 1.2, and turn an unreadable or mismatched
file into a ConfigError that names the path. The contexts are plain `ssl.SSLContext` objects:
`http.client.HTTPSConnection(context=...)`, `aiohttp`'s `web.TCPSite(ssl_context=...)` and
`ClientSession(connector=TCPConnector(ssl=...))` all take them as they are.

Not responsible for: making or rotating certificates (an operator, cert-manager or a test
fixture does that), client certificates (every request already carries the job token), or
deciding whether a component uses TLS (the ``ft.tls_*`` config fields do).
"""

from __future__ import annotations

import ssl
from pathlib import Path

from ftlm.errors import ConfigError

__all__ = ["client_context", "server_context"]


def _readable(path: str | Path, what: str) -> str:
    if not Path(path).is_file():
        raise ConfigError(f"TLS {what} {str(path)!r} does not exist or is not a file")
    return str(path)


def server_context(cert_file: str | Path, key_file: str | Path) -> ssl.SSLContext:
    """A server-side context presenting the PEM certificate chain `cert_file` with `key_file`.

    `cert_file` may hold the server certificate followed by intermediates. Raises ConfigError
    when a file is missing, is not PEM, or the key does not belong to the certificate.
    """
    cert, key = _readable(cert_file, "certificate"), _readable(key_file, "key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, ValueError) as e:
        raise ConfigError(f"TLS certificate {cert!r} with key {key!r} cannot be used ({e}); give "
                          f"a PEM certificate and the PEM private key that belongs to it") from None
    return context


def client_context(ca_file: str | Path, *, check_hostname: bool = True) -> ssl.SSLContext:
    """A client-side context trusting only the PEM CA certificate(s) in `ca_file`.

    The server's certificate must chain to that CA (always) and, with `check_hostname` (the
    default), name the host in the URL: a DNS name or, for an IP address such as a pod IP, an
    IP-address subjectAltName.

    `check_hostname=False` still verifies the chain but accepts any name. Use it only with a CA
    private to the job, when peers are reached at addresses their certificates cannot name
    (Kubernetes pod IPs are assigned after certificates are issued): any certificate that CA
    signed then proves "a member of this job", which is what the transfer needs, and the job
    token still guards every request.
    """
    ca = _readable(ca_file, "CA file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and hostname checks on
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_verify_locations(cafile=ca)
    except (ssl.SSLError, ValueError) as e:
        raise ConfigError(f"TLS CA file {ca!r} cannot be used ({e}); give the PEM certificate "
                          f"of the CA that signed the servers' certificates") from None
    context.check_hostname = check_hostname
    return context
