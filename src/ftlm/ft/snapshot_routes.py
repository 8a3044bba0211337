"""The snapshot endpoints a source serves, whichever process serves them.

`SnapshotRoutes` holds the published snapshots (raw bytes plus the encoded header that describes
them) and answers the transfer protocol of `ftlm.ft.transport` over a `BulkHTTPServer`: the job
token, the routes, the error answers, each chunk's digest computed when it is first served and
kept, and the throttle. Two servers are built on it: `ftlm.ft.transport.SnapshotServer` serves
from threads of the training process, and the snapshot server process (`ftlm.ft.serve_child`,
owned by `ftlm.ft.serve_process.ProcessSnapshotServer`) serves from a process of its own. So
this module imports no torch: that process starts in a fraction of a second.

Not responsible for: taking snapshots or encoding their headers (`ftlm.ft.transport`), sockets
and HTTP parsing (`ftlm.ft.bulk_http`), or where the bytes live (a tensor of the training process,
or shared memory mapped by the server process).
"""

from __future__ import annotations

import hmac
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ftlm.errors import ConfigError
from ftlm.ft.bulk_http import CLOSE, BulkHTTPServer, Request, Response, json_response
from ftlm.ft.digest import DIGEST, chunk_digest

__all__ = ["SnapshotRoutes"]

log = logging.getLogger("ftlm.ft.transport")


@dataclass(eq=False)
class _Published:
    data: memoryview  # read-only bytes of the whole snapshot; keeps its buffer alive
    header: bytes  # the encoded header (ftlm.ft.framing.Header.encode)
    digests: list[str | None]  # per chunk, computed when the chunk is first served


def _json_error(status: int, message: str) -> Response:
    return json_response(status, {"error": message})


def _parse_index(text: str) -> int | None:
    # isdigit() rejects signs, spaces and non-ASCII digits; the length cap keeps int() cheap.
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        return None
    return int(text)


class SnapshotRoutes:
    """Serves published snapshots over HTTP(S), one thread per connection (`ftlm.ft.bulk_http`).

    Endpoints: `GET /v1/snapshots`, `GET /v1/snapshot/{step}/header`,
    `GET /v1/snapshot/{step}/chunk/{index}`; a chunk's answer carries its digest in the
    `X-Ftlm-Digest: xxh3_128=<hex>` header. At most `max_connections` connections are open (one
    more is answered 503), and a client that does not send a complete request within
    `read_timeout` of connecting or of its last answer is closed. Single use: `start()` once,
    `stop()` once or more.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str = "",
                 chunk_bytes: int = 4 << 20, keep: int = 2,
                 throttle_bytes_per_s: float | None = None,
                 on_chunk: Callable[[int, int], None] | None = None,
                 ssl_context: ssl.SSLContext | None = None,
                 max_connections: int = 64, read_timeout: float = 10.0,
                 thread_nice: int = 0, listener: socket.socket | None = None) -> None:
        check_settings(chunk_bytes, keep, throttle_bytes_per_s, max_connections, read_timeout)
        self.host, self.port, self.token = host, port, token
        self.chunk_bytes, self.keep = chunk_bytes, keep
        self.throttle_bytes_per_s = throttle_bytes_per_s
        self.on_chunk = on_chunk  # test hook: called (step, index) before serving each chunk
        self.ssl_context = ssl_context  # serves https:// when set (ftlm.ft.tls.server_context)
        self._lock = threading.Lock()
        self._published: dict[int, _Published] = {}
        self._throttle_free_at = 0.0  # monotonic time at which the throttle has sent all bytes
        self._http = BulkHTTPServer(
            self._handle, host=host, port=port, ssl_context=ssl_context,
            max_connections=max_connections, read_timeout=read_timeout,
            pace=self._pace if throttle_bytes_per_s is not None else None,
            name="ftlm-snapshot-server", logger=log, thread_nice=thread_nice, listener=listener)
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError(f"{type(self).__name__} has no URL before start()")
        return self._url

    @property
    def stopping(self) -> threading.Event:
        return self._http.stopping

    def steps(self) -> list[int]:
        """Steps currently available, ascending."""
        with self._lock:
            return sorted(self._published)

    def add(self, step: int, header: bytes, data: memoryview, chunk_count: int) -> None:
        """Serve `data` (described by `header`, cut in `chunk_count` chunks) as the snapshot
        of `step`, replacing one of the same step; keep the newest `keep`. Cheap: each chunk's
        digest is computed when that chunk is first served, on the serving thread."""
        if self._http.stopping.is_set():
            raise RuntimeError(f"{type(self).__name__} is stopped; publish to a running server")
        published = _Published(data, header, [None] * chunk_count)
        with self._lock:
            self._published[step] = published
            for old in sorted(self._published)[:-self.keep]:
                del self._published[old]

    def retain(self, steps: set[int] | frozenset[int]) -> None:
        """Drop every published snapshot whose step is not in ``steps``, freeing its memory once
        no chunk of it is being written (a pull of a dropped step gets 404 and starts over)."""
        with self._lock:
            for step in [s for s in self._published if s not in steps]:
                del self._published[step]

    def start(self) -> str:
        """Bind and serve from background threads; return the URL (with the OS-chosen port)."""
        try:
            host, port = self._http.start()
        except OSError as e:
            raise OSError(f"{type(self).__name__} could not listen on {self.host}:{self.port}: "
                          f"{e}") from e
        self._url = server_url(host, port, self.ssl_context is not None)
        return self._url

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and cut in-flight transfers (their pullers get an error at once).

        Safe from any thread; from a serving thread (e.g. inside `on_chunk`) it cuts and returns,
        and a later call from another thread joins the threads.
        """
        self._http.stop(timeout)

    # -- answering -----------------------------------------------------------------------------

    def _handle(self, request: Request) -> Response:
        if self.token:
            got = request.headers.get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(got, f"Bearer {self.token}".encode()):
                self._http.abuse.note("HTTP 401")
                return _json_error(401, "missing or wrong job token: send "
                                        "'Authorization: Bearer <token>' with the job's FTLM_TOKEN")
        if request.method != "GET":
            return _json_error(405, f"method {request.method[:20]!r} not allowed; use GET")
        parts = request.path.split("/")
        if parts[:2] == ["", "v1"]:
            if parts[2:] == ["snapshots"]:
                return json_response(200, {"steps": self.steps()})
            if len(parts) == 5 and parts[2] == "snapshot" and parts[4] == "header":
                return self._header(parts[3])
            if len(parts) == 6 and parts[2] == "snapshot" and parts[4] == "chunk":
                return self._chunk(parts[3], parts[5])
        return _json_error(404, f"no such endpoint {request.path[:80]!r}; see SnapshotServer")

    def _lookup(self, step_text: str) -> tuple[int, _Published] | Response:
        step = _parse_index(step_text)
        if step is None:
            return _json_error(400, f"step must be a non-negative integer, got "
                                    f"{step_text[:40]!r}")
        with self._lock:
            published, available = self._published.get(step), sorted(self._published)
        if published is None:
            return _json_error(404, f"snapshot of step {step} is not available on this server "
                                    f"(available steps: {available})")
        return step, published

    def _header(self, step_text: str) -> Response:
        found = self._lookup(step_text)
        if isinstance(found, Response):
            return found
        return Response(200, found[1].header, "application/octet-stream")

    def _chunk(self, step_text: str, index_text: str) -> Response:
        found = self._lookup(step_text)
        if isinstance(found, Response):
            return found
        step, published = found
        index = _parse_index(index_text)
        count = len(published.digests)
        if index is None:
            return _json_error(400, f"chunk index must be a non-negative integer, got "
                                    f"{index_text[:40]!r}")
        if index >= count:
            return _json_error(404, f"step {step} has {count} chunks; "
                                    f"index {index} is out of range")
        if self.on_chunk is not None:
            self.on_chunk(step, index)
        if self._http.stopping.is_set():
            return CLOSE  # a stopping server drops the connection, like a dead peer
        offset = index * self.chunk_bytes
        data = published.data[offset:offset + self.chunk_bytes]
        digest = published.digests[index]
        if digest is None:
            # Once per chunk and snapshot: later pulls compare against this first digest, so a
            # snapshot buffer corrupted after it was first served is caught too.
            digest = published.digests[index] = chunk_digest(data)
        return Response(200, data, "application/octet-stream",
                        (("X-Ftlm-Digest", f"{DIGEST}={digest}"),), paced=True)

    def _pace(self, nbytes: int) -> bool:
        """Reserve nbytes of the shared byte budget, then sleep until the reservation ends;
        False when the server stops meanwhile.

        Ending (not starting) each reservation before writing means that B bytes are never all
        written before B / rate seconds have passed, whatever the number of connections.
        """
        assert self.throttle_bytes_per_s is not None
        with self._lock:
            now = time.monotonic()
            self._throttle_free_at = max(now, self._throttle_free_at) + nbytes / self.throttle_bytes_per_s
            wait = self._throttle_free_at - now
        return not self._http.stopping.wait(wait)


def check_settings(chunk_bytes: int, keep: int, throttle_bytes_per_s: float | None,
                   max_connections: int, read_timeout: float) -> None:
    """Raise ConfigError naming the first setting of a snapshot server that is out of range."""
    if chunk_bytes < 1:
        raise ConfigError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if keep < 1:
        raise ConfigError(f"keep must be >= 1 (snapshots kept), got {keep}")
    if throttle_bytes_per_s is not None and not throttle_bytes_per_s > 0:
        raise ConfigError(f"throttle_bytes_per_s must be > 0 or None, got "
                          f"{throttle_bytes_per_s}")
    if max_connections < 1 or not read_timeout > 0:
        raise ConfigError(f"need max_connections >= 1 and read_timeout > 0, got "
                          f"{max_connections} and {read_timeout}")


def server_url(host: str, port: int, tls: bool) -> str:
    """The base URL of a server listening at (host, port)."""
    return f"{'https' if tls else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"
