"""The HTTP client of a group process, shared by its two peers: the coordinator and the snapshot
servers of other groups.

Responsible for: reading a peer's URL once (``http(s)://host:port[/base]``), the TLS rule both
sides follow (an ``https://`` URL is verified against the configured CA or else the system's
CAs; a process configured for TLS never talks plain ``http://``, so the job token never travels
in plain text), opening a connection whose timeout bounds the connect, the TLS handshake and
every read, and the bearer-token header. ``http.client`` underneath: no event loop and no thread
of its own; callers keep one connection per thread.

Not responsible for: what is asked and what answers mean (``ftlm.ft.client`` for the coordinator,
``ftlm.ft.transport`` for snapshots), retries, or deadlines across requests.
"""

from __future__ import annotations

import http.client
import ssl
import urllib.parse
from dataclasses import dataclass


class EndpointError(ValueError):
    """A peer URL that cannot be used; the message says why, the caller says whose URL it is.
    ``plain_with_tls``: the URL is ``http://`` in a process configured for TLS."""

    def __init__(self, message: str, plain_with_tls: bool = False) -> None:
        super().__init__(message)
        self.plain_with_tls = plain_with_tls


@dataclass(frozen=True)
class Endpoint:
    """A peer's address, parsed once, with the TLS context and token its requests use."""

    url: str
    """The URL as given, without a trailing slash."""
    host: str
    port: int
    base: str
    """Path prefix of every request (empty for a URL without a path)."""
    ssl_context: ssl.SSLContext | None
    """Set exactly when the URL is ``https://``."""
    token: str = ""

    @classmethod
    def parse(cls, url: str, token: str = "", ssl_context: ssl.SSLContext | None = None) -> Endpoint:
        """``url`` with ``ssl_context`` (a client context with the job's CA; None: plain HTTP
        allowed, ``https://`` checked against the system's CAs). Raises ``EndpointError``."""
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port
        except ValueError as e:
            raise EndpointError(f"bad port in {url!r}: {e}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EndpointError(f"{url!r} must look like http://HOST:PORT or https://HOST:PORT")
        if parts.scheme == "http" and ssl_context is not None:
            raise EndpointError(f"{url!r} is plain http:// but this process is configured for "
                                "TLS (ft.tls_ca): use the peer's https:// URL",
                                plain_with_tls=True)
        if parts.scheme == "https" and ssl_context is None:
            ssl_context = ssl.create_default_context()  # the system's CAs, hostname checked
        port = port or (443 if ssl_context is not None else 80)
        return cls(url.rstrip("/"), parts.hostname, port, parts.path.rstrip("/"), ssl_context,
                   token)

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        """A new connection (connected on first use); ``timeout`` bounds every wait on it."""
        if self.ssl_context is not None:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout,
                                               context=self.ssl_context)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def headers(self, **extra: str) -> dict[str, str]:
        """``extra`` plus the bearer token, when the job has one."""
        if self.token:
            extra["Authorization"] = f"Bearer {self.token}"
        return extra
