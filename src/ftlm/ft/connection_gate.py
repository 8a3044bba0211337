"""Connection-level defences of ftlm's HTTP servers (the coordinator, ``ftlm serve``): a cap on
open connections, a deadline on every request, and logging that summarises abuse instead of
echoing it.

Why it is built this way. aiohttp parses HTTP carefully and bounds what it
parses (``max_line_size``, ``max_field_size``, ``max_headers``, ``client_max_size``: the
coordinator sets them), but it has no cap on connections and no deadline for a request that
arrives slowly: a client that opens a connection and sends a header byte every few seconds
(slowloris) holds a file descriptor for as long as it likes, and 20,000 of them exhausted the
process's descriptors while aiohttp logged a traceback per malformed request. aiohttp's
keep-alive timer happens to close a connection that has not completed a request in time, but
that is an implementation detail of one aiohttp version, so nothing here relies on it.

So the coordinator creates its listening socket itself with ``loop.create_server`` (the call
``aiohttp.web.TCPSite`` makes) and a protocol factory that wraps each of aiohttp's per-connection
``RequestHandler`` s in a ``_GatedProtocol``:

* **Cap.** A connection beyond ``limit`` is answered ``503`` and closed in ``connection_made``,
  before aiohttp sees a byte of it; connections already open (the members' keep-alive heartbeat
  connections) keep working. The count is exact because asyncio pairs every ``connection_made``
  with one ``connection_lost``. ``fd_budget`` keeps the cap below the descriptor limit.
* **Deadline.** A connection that is not inside a request must complete the headers of its next
  request within ``read_timeout`` of connecting or of its previous answer, else ``sweep`` (a few
  times per deadline) closes it. The coordinator brackets each request with ``started`` and
  ``finished`` and gives the body the same time when it reads it. Quorum long-polls are inside a
  request, so they are never cut.
* **TLS.** asyncio calls ``connection_made`` after the handshake, so a handshake in progress is
  not counted; ``ssl_handshake_timeout = read_timeout`` bounds how long each may take.
* **Logs.** ``AbuseLog`` counts refusals (over the cap, too slow, malformed HTTP, 4xx answers,
  event-loop accept errors) and writes one summary line per interval, never one per connection;
  ``CountingLogger`` is what aiohttp's handlers log to instead of ``aiohttp.server``.

The inference server (``ftlm.serve.server``) builds its listener the same way; its generation
requests are inside a request too, bounded by its own ``request_timeout``.

Not responsible for: authentication, parsing bodies or deciding anything (``ftlm.ft.coordinator``,
``ftlm.serve.server``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["AbuseLog", "ConnectionGate", "CountingLogger", "fd_budget"]

_BUSY_BODY = b'{"error": "the server is at its connection limit; try again"}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
         b"Content-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


class AbuseLog:
    """Counts what misbehaving clients did and logs one summary line per ``interval`` seconds.

    The first problem after a quiet interval is logged at the next ``flush`` (so it is seen at
    once); later ones are folded into the next line. Each kind keeps its first example. The
    caller flushes periodically (the coordinator's connection sweep does).
    """

    def __init__(self, logger: logging.Logger, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._logger = logger
        self._clock = clock
        self._counts: Counter[str] = Counter()
        self._examples: dict[str, str] = {}
        self._first = 0.0  # when the oldest problem not yet logged happened
        self._logged_at = -math.inf  # when the last summary line was written
        self._bug_logged_at = -math.inf

    def note(self, what: str, example: str = "") -> None:
        """Count one occurrence of ``what`` (e.g. "HTTP 401"); ``example`` is shown once."""
        if not self._counts:
            self._first = self._clock()
        self._counts[what] += 1
        if example and what not in self._examples:
            self._examples[what] = " ".join(str(example).split())[:160]

    def bug(self, message: str, exc: BaseException) -> None:
        """An unexpected exception while answering: logged with its traceback at most once per
        interval (a request that triggers it again and again must not flood the log)."""
        self.note("internal error", f"{type(exc).__name__}: {exc}")
        now = self._clock()
        if now - self._bug_logged_at >= self.interval:
            self._bug_logged_at = now
            self._logger.error("%s", message, exc_info=exc)

    def flush(self, force: bool = False) -> str | None:
        """Log the summary if an interval passed (or ``force``); returns the line, or None."""
        now = self._clock()
        if not self._counts or (not force and now - self._logged_at < self.interval):
            return None
        parts = [f"{what} x{n}" + (f" (e.g. {self._examples[what]})" if what in self._examples else "")
                 for what, n in self._counts.most_common()]
        line = f"refused in the last {max(now - self._first, 0.0):.1f} s: " + "; ".join(parts)
        self._logger.warning("%s", line)
        self._counts.clear()
        self._examples.clear()
        self._logged_at = now
        return line


class CountingLogger(logging.Logger):
    """The logger aiohttp's request handlers get: every record (aiohttp writes a traceback for
    each malformed request) becomes one count in an ``AbuseLog`` instead of a log entry."""

    def __init__(self, abuse: AbuseLog) -> None:
        super().__init__("ftlm.ft.coordinator.http", logging.DEBUG)
        self.abuse = abuse

    def handle(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        self.abuse.note("malformed HTTP", f"{type(exc).__name__}: {exc}" if exc else record.getMessage())


def loop_exception_handler(abuse: AbuseLog) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """An event-loop exception handler that counts OS-level errors (a failed ``accept`` when
    descriptors run out, a transport reset) and leaves everything else to asyncio's default."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError):
            abuse.note("socket error", f"{context.get('message', '')}: {exc}")
        else:
            loop.default_exception_handler(context)

    return handle


def fd_budget(wanted: int, reserve: int = 256) -> int:
    """How many connections this process can hold: ``wanted`` if the descriptor limit allows,
    raising the soft ``RLIMIT_NOFILE`` towards the hard limit when needed, else fewer (>= 8)."""
    try:
        import resource
    except ImportError:  # not a Unix: no limit to read
        return wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    need = wanted + reserve
    if soft != infinite and soft < need:
        target = need if hard == infinite else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == infinite:
        return wanted
    return max(8, min(wanted, soft - reserve))


class _GatedProtocol(asyncio.Protocol):
    """One connection: admitted (then everything goes to aiohttp's handler) or refused."""

    def __init__(self, gate: ConnectionGate, inner: asyncio.Protocol) -> None:
        self.gate = gate
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.admitted = False
        self.busy = 0  # requests being answered on this connection
        self.deadline = 0.0  # when an idle connection must have sent its next request
        self.partial = False  # bytes arrived since the last answer (a request in the making)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.gate._admit(self):
            self.admitted = True
            self.inner.connection_made(transport)
        else:
            transport.write(_BUSY)  # type: ignore[attr-defined]
            transport.close()

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            if not self.busy:
                self.partial = True
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.admitted:
            self.admitted = False
            self.gate._release(self)
            self.inner.connection_lost(exc)


class ConnectionGate:
    """Admits at most ``limit`` connections and closes those that do not send a request in time.

    Used from the event loop thread only. ``factory(make_handler)`` is the protocol factory for
    ``loop.create_server``; the server calls ``started``/``finished`` around each request and
    ``sweep`` periodically.
    """

    def __init__(self, limit: int, read_timeout: float, abuse: AbuseLog,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.read_timeout = read_timeout
        self.abuse = abuse
        self._clock = clock
        self._open: dict[Any, _GatedProtocol] = {}  # transport -> its connection

    @property
    def open(self) -> int:
        """Connections admitted and not yet closed."""
        return len(self._open)

    def factory(self, make_handler: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _GatedProtocol(self, make_handler())

    def started(self, transport: Any) -> _GatedProtocol | None:
        """A request's headers arrived on ``transport``: no deadline while it is answered."""
        conn = self._open.get(transport)
        if conn is not None:
            conn.busy += 1
            conn.partial = False
        return conn

    def finished(self, conn: _GatedProtocol) -> None:
        """The request is answered: the connection has ``read_timeout`` for its next one."""
        conn.busy -= 1
        if not conn.busy:
            conn.deadline = self._clock() + self.read_timeout

    def sweep(self) -> None:
        """Close every idle connection past its deadline; count those that were mid-request."""
        now = self._clock()
        for conn in list(self._open.values()):
            if not conn.busy and now >= conn.deadline and conn.transport is not None:
                if conn.partial:
                    self.abuse.note(f"connections without a complete request within "
                                    f"{self.read_timeout:g} s")
                conn.transport.close()

    def close_all(self) -> None:
        for conn in list(self._open.values()):
            if conn.transport is not None:
                conn.transport.close()

    def _admit(self, conn: _GatedProtocol) -> bool:
        if len(self._open) >= self.limit:
            self.abuse.note(f"connections over the limit of {self.limit}")
            return False
        conn.deadline = self._clock() + self.read_timeout
        self._open[conn.transport] = conn
        return True

    def _release(self, conn: _GatedProtocol) -> None:
        self._open.pop(conn.transport, None)
