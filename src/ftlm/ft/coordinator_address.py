"""Where a coordinator can be reached, and whether a ``Host`` header names this machine.

Responsible for: the URL of a server bound to a host and port (a wildcard bind described as every
address of this machine), and the loopback check of a ``Host`` header (a page that rebinds its
own DNS name to 127.0.0.1 is refused by a coordinator bound to loopback).

Not responsible for: binding or serving (``ftlm.ft.coordinator``), nor deciding what is loopback
(``ftlm.ft.config.is_loopback``).
"""

from __future__ import annotations

import functools
import socket

from ftlm.ft.config import is_loopback

LOCAL_ALIAS = {"0.0.0.0": "127.0.0.1", "::": "::1"}  # how this machine reaches a wildcard bind


def url_of(scheme: str, host: str, port: int) -> str:
    """``scheme://host:port``, an IPv6 address in brackets."""
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def describe_address(scheme: str, host: str, port: int, addresses: list[str] | None = None) -> str:
    """Where people can reach a server bound to ``host``: its URL, or for a wildcard bind
    (0.0.0.0, ::) the words "all interfaces" and a URL per address of this machine
    (``addresses``, default: its name and what the name resolves to, and loopback)."""
    if host not in LOCAL_ALIAS:
        return url_of(scheme, host, port)
    if addresses is None:
        addresses = _host_addresses(socket.AF_INET if host == "0.0.0.0" else socket.AF_UNSPEC)
    found = [LOCAL_ALIAS[host], *addresses]
    urls = dict.fromkeys(url_of(scheme, a, port) for a in found)
    return f"all interfaces ({host}) port {port}: " + ", ".join(urls)


@functools.lru_cache(maxsize=256)
def loopback_host(host: str) -> bool:
    """Whether a Host header names this machine (cached: parsing addresses on every request was
    a twentieth of the coordinator's time at 1,000 groups; bounded, headers are untrusted)."""
    return is_loopback(_host_name(host))


def _host_name(host: str) -> str:
    """The name or address of a Host header, without its port."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, _, port = host.rpartition(":")
    return name if name and port.isdigit() else host


def _host_addresses(family: int) -> list[str]:
    """This machine's name and the addresses of ``family`` it resolves to (best effort, for people)."""
    name = socket.gethostname()
    found = [name]
    try:
        found += [str(info[4][0]) for info in socket.getaddrinfo(name, None, family, socket.SOCK_STREAM)]
    except OSError:
        pass
    return found


