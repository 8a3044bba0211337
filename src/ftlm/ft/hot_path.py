"""The coordinator's lean HTTP/1.1 path for its two hot endpoints, heartbeat and quorum.

At 2,000 groups the coordinator answers thousands of heartbeats and quorum long-polls a second,
and the answers of a step all fall due at its last ask. Through aiohttp each message cost about
0.2 ms of the coordinator's one event-loop thread (request objects, middleware, a task per
request, response objects), so a step's answers left one after another over 0.3-0.4 s. This
module answers the common, well-formed case of ``POST /v1/heartbeat`` and ``POST /v1/quorum``
straight from the connection's ``asyncio.Protocol``: the request is cut from the bytes received,
a quorum long-poll waits as a plain callback with a timer (no task, no future), and the answer is
written in one ``transport.write`` when the state machine decides it.

It is a strict subset, and aiohttp stays the reference. A request is served here only if it is
``POST <hot path> HTTP/1.1`` with a complete, plainly formed header block (token names, no line
folding, no control characters, at most ``MAX_HEADERS`` lines of at most ``MAX_FIELD`` bytes, one
of each header that matters), a ``Content-Length`` body (no ``Transfer-Encoding``, no ``Expect``,
no ``Upgrade``) that arrived with its headers, and it passes every check the aiohttp path makes
(the server's ``admits``: Host, Origin, Sec-Fetch-Site, the bearer token, the content type, the
body size) and the same strict JSON decoding and field validation. Anything else, a refusal or an
error included, is handed over whole, from the first byte of that request, to aiohttp's own
handler, which keeps the connection from then on and answers it exactly as before (the 4xx codes,
the abuse counts, the 408 of a body that does not arrive). So no check is weaker here: a request
either passes all of them and is answered here, or is not answered here at all.

Not responsible for: what the answers say (the coordinator's ``Membership``), the cap on
connections and the deadline of idle ones (``ftlm.ft.connection_gate``, which wraps this protocol
and is told when a request starts and ends), TLS (below the protocol), or any other endpoint.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["HOT_PATHS", "HotPathProtocol", "HotServer", "json_content_type", "response_bytes"]

HOT_PATHS = ("/v1/heartbeat", "/v1/quorum")
MAX_HEADERS = 64
"""Most header lines served here (aiohttp's ``max_headers`` on the fallback path)."""
MAX_FIELD = 8190
"""Longest header line served here (aiohttp's ``max_field_size``)."""
_MAX_HEAD = 16384
"""Bytes of an unfinished header block after which the request goes to aiohttp (its limits apply)."""
_PREFIXES = tuple(f"POST {p} HTTP/1.1\r\n".encode() for p in HOT_PATHS)
_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_BLOCK = re.compile(rb"(?:" + _TOKEN + rb":[^\x00-\x08\x0a-\x1f\x7f]*\r\n)*")
"""Header lines as this path serves them: a token, a colon, a value without control characters."""
_PAIR = re.compile(rb"(" + _TOKEN + rb"):[ \t]*([^\x00-\x08\x0a-\x1f\x7f]*?)[ \t]*\r\n")
_SINGLE = frozenset({b"host", b"authorization", b"content-type", b"content-length", b"origin",
                     b"sec-fetch-site", b"connection", b"transfer-encoding", b"expect", b"upgrade"})
"""The headers that matter here; each may appear once (twice: aiohttp judges the request)."""
_NOT_HERE = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
_JSON_TYPES = frozenset({"application/json", "application/json; charset=utf-8", "application/json;charset=utf-8"})
_REASONS = {200: "OK", 409: "Conflict", 500: "Internal Server Error", 503: "Service Unavailable",
            504: "Gateway Timeout"}


_STATUS_LINES = {status: b"HTTP/1.1 %d %s\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: "
                 % (status, reason.encode()) for status, reason in _REASONS.items()}


def response_bytes(status: int, body: bytes, close: bool = False) -> bytes:
    """A complete HTTP/1.1 answer with a JSON body (one formatting of the bytes: a step's answers
    are written one after another)."""
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d Error\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: " % status
    return b"%s%d\r\n%s\r\n%s" % (line, len(body), b"Connection: close\r\n" if close else b"", body)


class HotServer(Protocol):
    """What the protocol needs from the coordinator (all called on the event loop thread)."""

    def admits(self, headers: dict[str, str]) -> bool:
        """Whether a request with these headers (lower-case names) passes every check of the
        aiohttp path; False sends it there to be answered."""

    def serve(self, path: str, body: bytes, conn: HotPathProtocol) -> bool:
        """Answer (now or later, through ``conn.respond``) a request whose body is ``body``; False
        when the body is not acceptable (the request then goes to aiohttp, which answers the 400)."""

    read_timeout: float
    """Seconds a body may take to arrive after its headers (then 408, and the connection closes)."""

    def note(self, status: int) -> None:
        """Count a refusal this path answered itself (only 408) in the abuse summary."""

    def started(self, transport: Any) -> Any:
        """A request begins on ``transport`` (the connection gate's ``started``); returns a token."""

    def finished(self, token: Any) -> None:
        """The request begun with ``token`` is answered (the gate's ``finished``)."""


class HotPathProtocol(asyncio.Protocol):
    """One connection: hot requests are answered here, the first other one hands it to aiohttp.

    ``on_lost`` callbacks registered by a waiting request run when the connection closes before
    it is answered (the coordinator withdraws the asker's quorum request then).
    """

    def __init__(self, server: HotServer, make_fallback: Callable[[], asyncio.Protocol]) -> None:
        self.server = server
        self._make_fallback = make_fallback
        self.fallback: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self._buf = b""
        self._token: Any = None  # the gate's token while a request is being answered
        self._close_after = False
        self._paused = False  # the transport asked us to stop writing
        self._serving = False  # inside ``server.serve`` (an answer given there must not recurse)
        self._busy = False  # a request is being answered (at most one at a time, in order)
        self._reading_paused = False
        # The last header block admitted on this connection and its headers: a member sends the
        # same lines every time (the parse and the checks were a fifth of a heartbeat's cost).
        self._seen_block = b""
        self._seen_headers: dict[str, str] = {}
        self._body_timer: asyncio.TimerHandle | None = None  # while a body is awaited
        self.on_lost: Callable[[], None] | None = None

    # -------------------------------------------------------------------------- asyncio events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.fallback is not None:
            self.fallback.data_received(data)
            return
        self._buf = self._buf + data if self._buf else data
        self._next()

    def eof_received(self) -> bool | None:
        if self.fallback is not None:
            return self.fallback.eof_received()
        return None

    def pause_writing(self) -> None:
        if self.fallback is not None:
            self.fallback.pause_writing()
        else:
            self._paused = True

    def resume_writing(self) -> None:
        if self.fallback is not None:
            self.fallback.resume_writing()
            return
        self._paused = False
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.fallback is not None:
            self.fallback.connection_lost(exc)
            return
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        lost, self.on_lost = self.on_lost, None
        token, self._token = self._token, None
        self._busy = False
        if lost is not None:
            lost()
        if token is not None:
            self.server.finished(token)
        self._buf = b""

    # ---------------------------------------------------------------------------- answering

    def respond(self, status: int, body: bytes) -> None:
        """Write the answer of the request in progress; then serve what came in meanwhile. Does
        nothing when no request is in progress (it was answered, or the connection is gone)."""
        if not self._busy:
            return
        transport, token = self.transport, self._token
        self._busy, self._token, self.on_lost = False, None, None
        if transport is None or transport.is_closing():
            return
        transport.write(response_bytes(status, body, self._close_after))
        if token is not None:
            self.server.finished(token)
        if self._close_after:
            transport.close()
        elif self._buf and not self._serving:
            self._next()

    def _next(self) -> None:
        """Serve the complete requests in the buffer, one at a time, or hand the connection to
        aiohttp at the first one this path does not serve."""
        while self._buf:
            if self._busy or self._paused or self.transport is None:
                if len(self._buf) > _MAX_HEAD and self.transport is not None and not self._reading_paused:
                    self._reading_paused = True  # sending while not reading its answers: wait
                    self.transport.pause_reading()
                return
            if self._reading_paused:
                self._reading_paused = False
                self.transport.resume_reading()
            buf = self._buf
            path = _hot_path(buf)
            if path is None:
                self._hand_over()
                return
            if path == "":
                return  # the request line is still arriving
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    self._hand_over()
                return
            begin = len(_PREFIXES[HOT_PATHS.index(path)])
            headers: dict[str, str] | None
            if buf[begin:end] == self._seen_block:
                headers = self._seen_headers  # admitted before, byte for byte
            else:
                headers = _headers(buf, begin, end)
                if headers is None or _content_length(headers) is None or not self.server.admits(headers):
                    self._hand_over()  # unusual or refused: aiohttp's job
                    return
                self._seen_block, self._seen_headers = buf[begin:end], headers
            length = int(headers["content-length"])
            start = end + 4
            if len(buf) < start + length:  # the body is on its way (http.client sends it apart)
                if self._body_timer is None:  # no idle deadline now; the body's own instead
                    self._token = self.server.started(self.transport)
                    self._body_timer = asyncio.get_running_loop().call_later(
                        self.server.read_timeout, self._body_late)
                return
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            else:
                self._token = self.server.started(self.transport)
            self._close_after = "close" in headers.get("connection", "").lower()
            self._buf = buf[start + length:]
            self._busy = True
            self._serving = True
            try:
                served = self.server.serve(path, buf[start:start + length], self)
            finally:
                self._serving = False
            if not served:  # a body aiohttp refuses (400): it answers it, from its first byte
                token, self._token = self._token, None
                self._busy = False
                if token is not None:
                    self.server.finished(token)
                self._buf = buf
                self._hand_over()
                return
            if self._close_after and not self._busy:
                return

    def _body_late(self) -> None:
        """The body did not arrive within ``read_timeout`` of its headers: 408, as aiohttp's path."""
        self._body_timer = None
        self._busy, self._close_after = True, True
        self.server.note(408)
        self.respond(408, b'{"error": "request body not received within %g s"}' % self.server.read_timeout)

    def _hand_over(self) -> None:
        """From the first byte of the current request on, aiohttp answers this connection."""
        if self.transport is None or self.transport.is_closing():
            return
        fallback = self.fallback = self._make_fallback()
        fallback.connection_made(self.transport)
        buf, self._buf = self._buf, b""
        if self._paused:
            fallback.pause_writing()
        if buf:
            fallback.data_received(buf)


def _hot_path(buf: bytes) -> str | None:
    """Which hot path the request at the start of ``buf`` asks for; "" while its first line is
    still arriving and could be one; None when it is not one."""
    for prefix, path in zip(_PREFIXES, HOT_PATHS):
        if buf.startswith(prefix):
            return path
        if len(buf) < len(prefix) and prefix.startswith(buf):
            return ""
    return None


def _headers(buf: bytes, begin: int, end: int) -> dict[str, str] | None:
    """The header block ``buf[begin:end]`` as {lower-case name: value} of the headers that
    matter here; None when any line is outside what this path serves (aiohttp then parses and
    judges it). Two passes of compiled patterns over the block, not a loop over its lines."""
    block = buf[begin:end + 2]  # each line with its CRLF
    if len(block) > MAX_FIELD or block.count(b"\n") > MAX_HEADERS or _BLOCK.fullmatch(block) is None:
        return None
    headers: dict[bytes, bytes] = {}
    for name, value in _PAIR.findall(block):
        key = name.lower()
        if key in _SINGLE:
            if key in _NOT_HERE or key in headers:
                return None
            headers[key] = value
    return {k.decode("ascii"): v.decode("latin-1") for k, v in headers.items()}


def _content_length(headers: dict[str, str]) -> int | None:
    value = headers.get("content-length")
    if value is None or not (value.isascii() and value.isdigit()) or len(value) > 12:
        return None
    return int(value)


def json_content_type(value: str | None) -> bool:
    """Whether a Content-Type header is one of the plain spellings of ``application/json``."""
    return value is not None and value.lower() in _JSON_TYPES
