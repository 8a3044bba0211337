"""Where a coordinator can be reached, and whether a ``Host`` header names this machine.

Responsible for: the URL of a server bound to a host and port (a wildcard bind described as every
address of this machine), and the loopback check of a ``Host`` header (a page that rebinds its
own DNS name to 127.0.0.1 is refused by a coordinator bound to loopback).

Also where a group finds the coordinator now (``CoordinatorAddress``): the URL it started with,
or the address file its launcher rewrites when it starts the coordinator elsewhere, read again
for every new connection. A DNS name (a Kubernetes Service's, a Slurm head node's) needs no file:
``http.client`` resolves it again on every new connection.

Not responsible for: binding or serving (``ftlm.ft.coordinator``), nor deciding what is loopback
(``ftlm.ft.config.is_loopback``), nor writing the address file (the launcher,
``ftlm.launch.coordinator_process``).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
from pathlib import Path

from ftlm.ft.config import is_loopback

log = logging.getLogger(__name__)

ADDRESS_FILE_ENV = "FTLM_COORDINATOR_FILE"
"""The environment variable naming the file that holds the coordinator's current URL."""

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




class CoordinatorAddress:
    """The coordinator's URL as of now: ``url`` (the one the process started with), replaced by
    the first line of ``address_file`` whenever that file holds another well-formed one.

    A missing, empty or half-written file keeps the last URL read (a launcher replaces the
    file atomically, so a reader sees the old address or the new one). Thread-safe.
    """

    def __init__(self, url: str, address_file: str | os.PathLike[str] = "") -> None:
        self.file = Path(address_file) if address_file else None
        self._url = url
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, url: str) -> CoordinatorAddress:
        """``url``, followed through the file ``FTLM_COORDINATOR_FILE`` names, when it names one."""
        return cls(url, os.environ.get(ADDRESS_FILE_ENV, ""))

    def current(self) -> str:
        """The URL to connect to now (the file read again, when there is one)."""
        if self.file is None:
            return self._url
        try:
            text = self.file.read_text().strip()
        except OSError:
            return self._url
        url = text.splitlines()[0].strip() if text else ""
        with self._lock:
            if url.startswith(("http://", "https://")) and url != self._url:
                log.warning("coordinator address changed: %s -> %s (from %s)", self._url, url, self.file)
                self._url = url
            return self._url


def write_address(path: str | os.PathLike[str], url: str) -> None:
    """Replace the address file at ``path`` with ``url`` atomically (readers see the old URL or
    the new one, never a part)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(url + "\n")
    os.replace(tmp, path)
