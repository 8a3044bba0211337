"""A small threaded HTTP/1.1 server for bulk GETs: answers go from memory to the socket with
``socket.sendall``, one thread per connection.

Why not aiohttp, which the coordinator uses: serving a snapshot
from aiohttp moved 0.65-0.87 GB/s against 2.5 GB/s for a raw loopback socket. One event-loop
thread wrote every byte of every connection in 256 KiB pieces, each write a Python call, a
transport buffer and a drain, and the loop held the GIL between them, so four connections were
barely faster than one. Here each connection's thread hands whole megabytes of the snapshot's own
buffer to the kernel (no copy in user space; the GIL is released for the whole ``sendall``), so the
connections run in parallel on every core.

Responsible for: listening (TCP, optional TLS with a bounded handshake), a cap on open
connections (a connection over it is answered 503 and closed), a deadline on every request head
(a client that does not complete one within ``read_timeout`` of connecting or of its previous
answer is closed: slowloris), parsing request heads within size limits, keep-alive, writing
answers (optionally paced by a caller's byte budget, each piece bounded by ``write_timeout``),
stopping (every connection cut, every thread joined within a timeout) and one summary log line
per interval about refused clients (``ftlm.ft.connection_gate.AbuseLog``), never one per client.

Not responsible for: routing, authentication or what answers say (the ``handle`` callable given
to it: ``ftlm.ft.transport.SnapshotServer``), or request bodies: the transport only GETs, so a
request that announces a body is answered 400 and closed.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from ftlm.ft.connection_gate import AbuseLog
from ftlm.ft.priority import background_priority
from ftlm.observe.iostats import timed_io

__all__ = ["CLOSE", "BulkHTTPServer", "Request", "Response", "json_response"]

MAX_HEAD_BYTES = 16 << 10
"""Largest request head (request line plus headers) read before answering 431."""
MAX_HEADERS = 64
"""Most header lines a request may carry."""
SEND_PIECE = 4 << 20
"""Bytes per ``sendall`` of an unpaced body: each piece must be sent within ``write_timeout``."""
PACED_PIECE = 256 << 10
"""Bytes per piece of a paced body (small enough for a smooth throttle)."""


@dataclass(frozen=True)
class Request:
    """One parsed request head."""

    method: str
    path: str  # the target without its query string
    headers: Mapping[str, str]  # names in lower case


@dataclass(frozen=True)
class Response:
    """An answer: a status, a body (bytes or a read-only view of a larger buffer) and headers."""

    status: int
    body: bytes | memoryview = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    paced: bool = False  # the body goes through the server's `pace` (a throttle), if it has one


CLOSE = Response(0)
"""Answer nothing and close the connection (what a source that is stopping does)."""


def json_response(status: int, obj: Any) -> Response:
    return Response(status, json.dumps(obj).encode())


def _head(status: int, content_type: str, length: int, headers: tuple[tuple[str, str], ...],
          keep_alive: bool) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    lines = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {content_type}",
             f"Content-Length: {length}", *(f"{k}: {v}" for k, v in headers)]
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _parse_head(raw: bytes) -> tuple[Request, bool]:
    """The request and whether the client keeps the connection open; raises _BadRequest."""
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0") or not parts[1].startswith("/"):
        raise _BadRequest(400, f"malformed request line {lines[0][:80]!r}")
    if len(lines) - 1 > MAX_HEADERS:
        raise _BadRequest(431, f"more than {MAX_HEADERS} header lines")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise _BadRequest(400, f"malformed header line {line[:80]!r}")
        headers[name.lower()] = value.strip()
    if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
        raise _BadRequest(400, "request bodies are not accepted")
    connection = headers.get("connection", "").lower()
    keep_alive = parts[2] == "HTTP/1.1" and connection != "close"
    return Request(parts[0], parts[1].partition("?")[0], headers), keep_alive


class BulkHTTPServer:
    """Serves ``handle(request) -> Response`` on a listening socket, one thread per connection.

    ``pace(nbytes) -> bool``, when given, is called before each piece of a body and may sleep (a
    throttle); it returns False to cut the connection. Single use: ``start()`` once, ``stop()``
    once or more, from any thread (from one of the server's own threads it cuts every connection,
    its own included, and leaves the joining to a later call from another thread).
    """

    def __init__(self, handle: Callable[[Request], Response], *, host: str = "127.0.0.1",
                 port: int = 0, ssl_context: ssl.SSLContext | None = None,
                 max_connections: int = 64, read_timeout: float = 10.0,
                 write_timeout: float = 60.0, pace: Callable[[int], bool] | None = None,
                 name: str = "ftlm-bulk-http", logger: logging.Logger | None = None,
                 thread_nice: int = 0, listener: socket.socket | None = None) -> None:
        self.handle, self.host, self.port = handle, host, port
        self.ssl_context = ssl_context
        self.max_connections, self.read_timeout = max_connections, read_timeout
        self.write_timeout, self.pace, self.name = write_timeout, pace, name
        self.thread_nice = thread_nice  # CPU priority of the connection threads (ftlm.ft.priority)
        self.abuse = AbuseLog(logger or logging.getLogger(__name__))
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._open: dict[threading.Thread, socket.socket] = {}  # connection thread -> its socket
        # A listening socket bound elsewhere (the serving process gets its parent's): host and
        # port are then ignored.
        self._given_listener = listener
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); the port is the OS's choice when 0 was asked for."""
        if self._listener is None:
            raise RuntimeError("BulkHTTPServer has no address before start()")
        host, port = self._listener.getsockname()[:2]
        return host, port

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)

    def start(self) -> tuple[str, int]:
        """Bind and start accepting; return the bound (host, port). Raises OSError if it cannot."""
        if self._acceptor is not None:
            raise RuntimeError("BulkHTTPServer.start() may be called once")
        if self._given_listener is not None:
            self._listener = self._given_listener
        else:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            self._listener = socket.create_server((self.host, self.port), family=family,
                                                  backlog=128)
        self._listener.settimeout(0.5)  # the accept loop also flushes the abuse log
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"{self.name}-accept",
                                          daemon=True)
        self._acceptor.start()
        return self.address

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, cut every connection and (from another thread) join all threads."""
        self.stopping.set()
        listener = self._listener
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() on Linux
            except OSError:
                pass
        with self._lock:
            sockets, threads = list(self._open.values()), list(self._open)
        for sock in sockets:
            _cut(sock)
        me = threading.current_thread()
        if me is self._acceptor or me in threads:
            return
        deadline = time.monotonic() + timeout
        for thread in [self._acceptor, *threads]:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    raise TimeoutError(f"{thread.name} did not stop within {timeout}s")
        if listener is not None:
            listener.close()
        self.abuse.flush(force=True)

    # -- accepting -----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self.stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                self.abuse.flush()
                continue
            except OSError as e:
                if self.stopping.is_set():
                    return
                self.abuse.note("socket error", f"accept: {e}")
                self.stopping.wait(0.05)  # e.g. out of descriptors: do not spin
                continue
            with self._lock:
                admitted = len(self._open) < self.max_connections and not self.stopping.is_set()
                if admitted:
                    thread = threading.Thread(target=self._serve, args=(conn,),
                                              name=f"{self.name}-conn", daemon=True)
                    self._open[thread] = conn
            if not admitted:
                self.abuse.note(f"connections over the limit of {self.max_connections}")
                self._refuse(conn)
                continue
            thread.start()

    def _refuse(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(1.0)
            conn.sendall(_head(503, "application/json", len(_BUSY), (), False) + _BUSY)
            conn.shutdown(socket.SHUT_WR)
            # Drop a request that already arrived without waiting for more: closing with unread
            # bytes would reset the connection, and the client would lose the 503 with it.
            conn.settimeout(0)
            for _ in range(16):
                if not conn.recv(65536):
                    break
        except OSError:  # BlockingIOError included: nothing more to drop
            pass
        finally:
            conn.close()

    # -- one connection ------------------------------------------------------------------------

    def _serve(self, conn: socket.socket) -> None:
        background_priority(self.thread_nice)
        me = threading.current_thread()
        sock = conn
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no delayed-ACK stalls
            if self.ssl_context is not None:
                conn.settimeout(self.read_timeout)  # bounds the handshake
                sock = self.ssl_context.wrap_socket(conn, server_side=True,
                                                    do_handshake_on_connect=False)
                with self._lock:  # `conn` is detached now: `stop` must cut the TLS socket
                    self._open[me] = sock
                if self.stopping.is_set():  # set before `stop` looked at the open sockets
                    return
                sock.do_handshake()
            pending = b""
            while not self.stopping.is_set():
                head, pending = self._read_head(sock, pending)
                if head is None:
                    return
                try:
                    request, keep_alive = _parse_head(head)
                except _BadRequest as e:
                    self.abuse.note("malformed HTTP", str(e))
                    self._write(sock, json_response(e.status, {"error": str(e)}), False)
                    return
                try:
                    response = self.handle(request)
                except Exception as e:  # noqa: BLE001 - a handler bug: answer 500, serve on
                    self.abuse.bug(f"{self.name}: handling {request.method} {request.path[:80]} "
                                   f"failed", e)
                    self._write(sock, json_response(500, {"error": f"internal error: "
                                                                   f"{type(e).__name__}"}), False)
                    return
                if response is CLOSE or not self._write(sock, response, keep_alive):
                    return
                if not keep_alive:
                    return
        except (OSError, ValueError):  # a cut, reset or timed-out connection, a TLS failure
            pass
        finally:
            with self._lock:
                self._open.pop(me, None)
            try:
                sock.close()
            except OSError:
                pass

    def _read_head(self, sock: socket.socket, pending: bytes) -> tuple[bytes | None, bytes]:
        """The next request head (without its blank line) and the bytes after it, or None when
        the client closed, fell silent past ``read_timeout``, or sent no HTTP (answered 400)."""
        deadline = time.monotonic() + self.read_timeout
        data = bytearray(pending)
        while True:
            end = data.find(b"\r\n\r\n")
            if 0 <= end <= MAX_HEAD_BYTES:
                return bytes(data[:end]), bytes(data[end + 4:])
            if data and not (65 <= data[0] <= 90):  # a method is upper-case letters
                # e.g. a TLS ClientHello sent to a plain server: answer at once, do not wait.
                self.abuse.note("malformed HTTP", f"request starting with byte {data[0]:#04x}")
                self._write(sock, json_response(400, {"error": "not an HTTP request"}), False)
                return None, b""
            if end > MAX_HEAD_BYTES or len(data) > MAX_HEAD_BYTES:
                self.abuse.note("malformed HTTP", f"request head over {MAX_HEAD_BYTES} bytes")
                self._write(sock, json_response(431, {"error": f"request head over "
                                                                f"{MAX_HEAD_BYTES} bytes"}), False)
                return None, b""
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if data:
                    self.abuse.note(f"connections without a complete request within "
                                    f"{self.read_timeout:g} s")
                return None, b""
            sock.settimeout(remaining)
            try:
                got = sock.recv(65536)
            except TimeoutError:
                continue  # the deadline check above decides
            if not got:
                return None, b""
            data += got

    @timed_io("transfer_sent", lambda ok, self, sock, response, keep_alive:
              memoryview(response.body).nbytes if ok and response.paced else 0)
    def _write(self, sock: socket.socket, response: Response, keep_alive: bool) -> bool:
        """Send ``response``; False when the connection must close (cut, paced out, timed out)."""
        body = memoryview(response.body).cast("B")
        head = _head(response.status, response.content_type, body.nbytes, response.headers,
                     keep_alive)
        sock.settimeout(self.write_timeout)
        pace = self.pace if response.paced else None
        if body.nbytes <= 64 << 10 and pace is None:  # one segment for small answers
            sock.sendall(head + body.tobytes())
            return True
        sock.sendall(head)
        piece = SEND_PIECE if pace is None else PACED_PIECE
        for start in range(0, body.nbytes, piece):
            part = body[start:start + piece]
            if pace is not None and not pace(part.nbytes):
                return False
            if self.stopping.is_set():
                return False
            sock.sendall(part)  # straight from the caller's buffer; releases the GIL
        return True


_BUSY = b'{"error": "the server is at its connection limit; try again"}'


def _cut(sock: socket.socket) -> None:
    """Wake whoever blocks in ``sock`` (recv, sendall, a TLS handshake) with an error."""
    try:
        # The plain socket's shutdown, also for an SSLSocket: its own would unwrap TLS, which
        # must not happen under the thread that is using it.
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass
