"""Checks that keep a browser on another site away from a local HTTP server (pure functions).

Responsible for: deciding, from a request's method and headers, whether it must be refused
before any handler sees it, and with what status and message: a ``Host`` that is not this
machine when the server listens on loopback only (a page that rebinds its own DNS name to
127.0.0.1), an ``Origin`` other than the server's own, a POST a browser marks ``Sec-Fetch-Site:
cross-site``, and a POST whose body is not ``application/json`` (an HTML form or a ``text/plain``
fetch from another site can send one without a CORS preflight; a JSON body cannot). The
coordinator (``ftlm.ft.coordinator``) and the inference server (``ftlm.serve.server``) both
answer with these.

Not responsible for: authentication (each server checks its own token between the two checks
below), sizes, or HTTP itself.
"""

from __future__ import annotations

from collections.abc import Mapping

from ftlm.ft.config import is_loopback
from ftlm.ft.coordinator_address import loopback_host


def foreign_request(method: str, headers: Mapping[str, str], *, bound: str, scheme: str,
                    who: str, url: str) -> tuple[int, str] | None:
    """``(status, message)`` when the request comes from another site or names another host;
    None when it may go on. ``bound`` is the address the server listens on, ``who`` names it in
    messages ("the coordinator"), ``url`` is where people should open it."""
    host = headers.get("Host")
    if is_loopback(bound) and host is not None and not loopback_host(host):
        return 403, (f"Host {host[:80]!r} is not this machine: {who} listens on {bound} only; "
                     f"open it as {url}/")
    origin = headers.get("Origin")
    if origin is not None and not same_origin(origin, host, scheme):
        return 403, (f"cross-origin request refused (Origin {origin[:80]!r}): only {who}'s own "
                     "page may call it")
    site = headers.get("Sec-Fetch-Site", "same-origin")
    if method not in ("GET", "HEAD") and site not in ("same-origin", "none"):
        return 403, f"{site[:40]} request refused: only {who}'s own page may call it"
    return None


def non_json_post(method: str, content_type: str) -> tuple[int, str] | None:
    """``(415, message)`` for a POST whose body is not declared JSON; None otherwise."""
    if method == "POST" and content_type != "application/json":
        return 415, (f"POST bodies must be JSON sent with 'Content-Type: application/json' "
                     f"(got {content_type[:60]!r})")
    return None


def same_origin(origin: str, host: str | None, scheme: str) -> bool:
    """Whether ``origin`` is ``scheme://host`` (default ports ignored)."""
    if host is None:
        return False
    default = ":443" if scheme == "https" else ":80"
    mine = f"{scheme}://{host}".lower().removesuffix(default)
    return origin.strip().lower().removesuffix(default) == mine
