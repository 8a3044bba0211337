"""Live state transfer between replica groups: snapshot, serve over HTTP, fetch and verify.

A healthy peer takes a CPU `Snapshot` of its replicated state at a step boundary
(`snapshot_state`), publishes it on its `SnapshotServer` and keeps training; a restarted group
calls `fetch_snapshot`, which downloads the chunks in parallel, verifies every chunk's digest and
rebuilds the tensors. Bytes travel as described in `ftlm.ft.framing`; nothing is ever unpickled.

The protocol: the header (JSON: tensors, meta, total size, chunk size) is answered as soon as a
snapshot is published; each chunk's answer is the raw bytes with the chunk's XXH3-128 digest in
its `X-Ftlm-Digest` header, computed by the source when it first serves that chunk (and kept:
later pulls are checked against that first digest). So no request waits for a hash of the whole
state, and a receiver verifies each chunk as it lands, naming the chunk that is corrupt. The
server writes chunks with `socket.sendall` straight from the snapshot's buffer, one thread per
connection (`ftlm.ft.bulk_http`), and the receiver reads them with `recv_into` straight into its
destination buffer: no copy in user space on either side. A snapshot's buffer is never written
after `snapshot_state` returns, so digests and served bytes are always consistent.

A receiver bounds what a peer can make it allocate: `fetch_snapshot(..., expected=)` takes the
`ExpectedLayout` of the receiver's own state (`expected_layout(tensors)`) and refuses a header
that describes other tensors or another size before allocating the snapshot buffer; a hard cap
(`default_max_bytes`) applies always. Every failure, however malformed the peer's answer,
surfaces as one TransferError naming the source.

TLS is optional: a server given an `ssl.SSLContext` (`ftlm.ft.tls.server_context`) serves
https://, and `fetch_snapshot` verifies such a source with a client context
(`ftlm.ft.tls.client_context`); without TLS, bind to 127.0.0.1 or a trusted network. The job
token guards every request either way.

Not responsible for: choosing the source peer, deciding the step to fetch, buffering gradients or
replaying them (the manager and `ftlm.ft.catchup` do that), or making certificates.
"""

from __future__ import annotations

import hmac
import http.client
import json
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ftlm.errors import ConfigError, FaultError
from ftlm.ft.bulk_http import CLOSE, BulkHTTPServer, Request, Response, json_response
from ftlm.ft.framing import (
    DEFAULT_MAX_TOTAL_BYTES, DIGEST, DIGEST_HEX, MAX_HEADER_BYTES, ChunkEntry, ExpectedLayout,
    FramingError, Header, LayoutMismatch, TensorEntry, canonical_json, chunk_digest,
    decode_header, expected_layout, layout, state_digest, tensors_from_buffer,
)
from ftlm.ft.http_client import Endpoint, EndpointError
from ftlm.ft.priority import background_priority
from ftlm.observe.iostats import timed_io

__all__ = ["ExpectedLayout", "Snapshot", "SnapshotServer", "TransferError", "default_max_bytes",
           "expected_layout", "fetch_snapshot", "list_snapshots", "snapshot_state",
           "state_digest"]

_MAX_HEADER_BYTES = MAX_HEADER_BYTES
log = logging.getLogger(__name__)


class TransferError(FaultError):
    """Fetching a snapshot from a peer failed; the message names the source, the step and why."""


@dataclass(frozen=True, eq=False)
class Snapshot:
    """An immutable CPU copy of replicated state at one step: one flat byte buffer + layout."""

    step: int
    meta: dict[str, Any]
    tensors: tuple[TensorEntry, ...]
    buffer: torch.Tensor  # flat uint8 on CPU (pinned when taken from CUDA); never written again

    @property
    def total_bytes(self) -> int:
        return self.buffer.numel()

    def view(self) -> memoryview:
        """Read-only bytes of the whole buffer (no copy)."""
        return memoryview(self.buffer.numpy()).toreadonly()

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Fresh tensors and meta equal to what a peer's `fetch_snapshot` would return."""
        meta = json.loads(canonical_json(self.meta))
        return tensors_from_buffer(self.buffer.numpy(), self.tensors), meta


def snapshot_state(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                   step: int) -> Snapshot:
    """Copy `tensors` (any devices) and `meta` into a new Snapshot of `step`, right now.

    Call at a step boundary; training may mutate the tensors as soon as this returns. CUDA tensors
    go through one pinned host buffer with asynchronous copies and one synchronize per device.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    meta_copy = json.loads(canonical_json(meta))  # deep copy, and proof that meta is JSON data
    entries, total = layout(tensors)
    devices = {t.device for t in tensors.values() if t.is_cuda}
    pinned = bool(devices) and torch.cuda.is_available()
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
    end = 0
    for entry, t in zip(entries, tensors.values()):
        buffer[end:entry.offset].zero_()  # alignment padding: never send stale process memory
        end = entry.offset + entry.nbytes
        if entry.nbytes == 0:
            continue
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        # copy_ always copies, so the snapshot never aliases the live tensors.
        buffer[entry.offset:entry.offset + entry.nbytes].copy_(src, non_blocking=pinned)
    for device in devices:
        torch.cuda.synchronize(device)
    return Snapshot(step, meta_copy, entries, buffer)


@dataclass(eq=False)
class _Published:
    snapshot: Snapshot
    header_json: bytes
    digests: list[str | None]  # per chunk, computed when the chunk is first served


def _json_error(status: int, message: str) -> Response:
    return json_response(status, {"error": message})


def _parse_index(text: str) -> int | None:
    # isdigit() rejects signs, spaces and non-ASCII digits; the length cap keeps int() cheap.
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        return None
    return int(text)


class SnapshotServer:
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
                 thread_nice: int = 0) -> None:
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
            name="ftlm-snapshot-server", logger=log, thread_nice=thread_nice)
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("SnapshotServer has no URL before start()")
        return self._url

    def steps(self) -> list[int]:
        """Steps currently available, ascending."""
        with self._lock:
            return sorted(self._published)

    def publish(self, snapshot: Snapshot) -> None:
        """Make `snapshot` available by its step (replacing one of the same step), keep newest.

        Cheap: the header names the chunk size only; each chunk's digest is computed when that
        chunk is first served (`chunk_digest`, on the serving thread) and kept for later pulls.
        """
        if self._http.stopping.is_set():
            raise RuntimeError("SnapshotServer is stopped; publish to a running server")
        header = Header(snapshot.step, snapshot.meta, snapshot.total_bytes, snapshot.tensors,
                        self.chunk_bytes)
        published = _Published(snapshot, json.dumps(header.to_json()).encode(),
                               [None] * len(header.chunks))
        with self._lock:
            self._published[snapshot.step] = published
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
            raise OSError(f"SnapshotServer could not listen on {self.host}:{self.port}: "
                          f"{e}") from e
        scheme = "https" if self.ssl_context is not None else "http"
        self._url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
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
        return Response(200, found[1].header_json)

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
        snap = published.snapshot
        offset = index * self.chunk_bytes
        data = snap.view()[offset:min(offset + self.chunk_bytes, snap.total_bytes)]
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


# ---------------------------------------------------------------------------------------------
# Client


class _Problem(Exception):
    """A failure already described in words; fetch_snapshot adds the source and the step."""


@dataclass(frozen=True)
class _Source:
    endpoint: Endpoint
    timeout: float

    @classmethod
    def parse(cls, url: str, token: str, timeout: float,
              ssl_context: ssl.SSLContext | None) -> _Source:
        try:
            return cls(Endpoint.parse(url, token, ssl_context), timeout)
        except EndpointError as e:
            if e.plain_with_tls:  # never fall back to plain text when told to use TLS
                raise _Problem("this group requires TLS (a client TLS context is set) but the "
                               "source URL is plain http://; give the source group ft.tls_cert "
                               "and ft.tls_key so that it serves https://") from None
            raise _Problem(f"source URL: {e}") from None

    @property
    def ssl_context(self) -> ssl.SSLContext | None:
        return self.endpoint.ssl_context

    def connect(self) -> http.client.HTTPConnection:
        # The timeout bounds the connect, the TLS handshake and every single read, so no wait
        # below is unbounded.
        return self.endpoint.connect(self.timeout)

    def get(self, conn: http.client.HTTPConnection, path: str) -> http.client.HTTPResponse:
        conn.request("GET", self.endpoint.base + path, headers=self.endpoint.headers())
        return conn.getresponse()


def _read_small(response: http.client.HTTPResponse, limit: int) -> bytes:
    body = response.read(limit + 1)
    if len(body) > limit:
        raise _Problem(f"response body exceeds {limit} bytes")
    return body


def _status_problem(status: int, body: bytes) -> _Problem:
    try:
        message = json.loads(body)["error"]
        if not isinstance(message, str):
            raise TypeError
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        message = body[:200].decode("utf-8", "replace")
    message = " ".join(message.split())[:300]  # one line, whatever the peer sent
    if status == 401:
        return _Problem(f"HTTP 401 Unauthorized: the source rejected the token ({message}); "
                        f"give both groups the same job token (FTLM_TOKEN)")
    return _Problem(f"HTTP {status}: {message}")


def _get(source: _Source, conn: http.client.HTTPConnection, path: str,
         first: bool = False) -> tuple[int, bytes]:
    """GET a small answer; `first`: the first request to this source, which names a TLS mix-up."""
    try:
        response = source.get(conn, path)
    except (http.client.RemoteDisconnected, ConnectionResetError) as e:
        if not first or source.ssl_context is not None:
            raise
        raise _Problem(f"the source closed the connection without answering "
                       f"({type(e).__name__}); a source that serves https:// does that to "
                       f"plain http:// requests: use its https:// URL and a CA") from None
    return response.status, _read_small(response, _MAX_HEADER_BYTES)


def _get_json(source: _Source, conn: http.client.HTTPConnection, path: str) -> tuple[int, Any]:
    status, body = _get(source, conn, path, first=True)
    if status != 200:
        return status, body
    try:
        return 200, json.loads(body)
    except (ValueError, RecursionError) as e:
        raise _Problem(f"{path} did not return valid JSON: {str(e)[:200]}") from None


def _describe(error: BaseException, timeout: float) -> str:
    if isinstance(error, _Problem):
        return str(error)
    if isinstance(error, LayoutMismatch):
        return f"the source's state does not match this group's: {error}"
    if isinstance(error, FramingError):
        return f"invalid header from the source: {error}"
    if isinstance(error, ssl.SSLCertVerificationError):
        return (f"TLS: the source's certificate did not verify ({error.verify_message}); give "
                f"this group the CA that signed the source's certificate (ft.tls_ca)")
    if isinstance(error, ssl.SSLError):
        return (f"TLS handshake failed ({error.reason or error}); is the source serving plain "
                f"http:// rather than https://?")
    if isinstance(error, (socket.timeout, TimeoutError)):
        return f"timed out: no progress for {timeout}s"
    if isinstance(error, ConnectionRefusedError):
        return "connection refused (no SnapshotServer listening at that address)"
    if isinstance(error, http.client.IncompleteRead):
        return "truncated body: the connection closed before all bytes arrived"
    if isinstance(error, (ConnectionError, http.client.RemoteDisconnected)):
        return f"connection closed by the source mid-transfer ({type(error).__name__})"
    return f"{type(error).__name__}: {str(error)[:200]}"


def default_max_bytes() -> int:
    """Hard cap on a snapshot's size: DEFAULT_MAX_TOTAL_BYTES or this host's memory if smaller.

    A buffer larger than physical memory can never be received, so a header that claims one is
    refused outright instead of failing (or swapping) in the allocation.
    """
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system that reports it
        return DEFAULT_MAX_TOTAL_BYTES
    return min(DEFAULT_MAX_TOTAL_BYTES, physical) if physical > 0 else DEFAULT_MAX_TOTAL_BYTES


def list_snapshots(url: str, token: str = "", timeout: float = 10.0,
                   ssl_context: ssl.SSLContext | None = None) -> list[int]:
    """Steps that the SnapshotServer at `url` can serve now, ascending."""
    try:
        source = _Source.parse(url, token, timeout, ssl_context)
        conn = source.connect()
        try:
            status, body = _get_json(source, conn, "/v1/snapshots")
        finally:
            conn.close()
        if status != 200:
            raise _status_problem(status, body)
        steps = body.get("steps") if isinstance(body, dict) else None
        if not isinstance(steps, list) or not all(type(s) is int for s in steps):
            raise _Problem(f"/v1/snapshots returned no list of integer steps: {body!r:.200}")
        return steps
    except (_Problem, OSError, http.client.HTTPException) as e:
        raise TransferError(f"listing snapshots at {url} failed: {_describe(e, timeout)}") from e


def _wait_for_header(source: _Source, step: int, wait_available: float, max_bytes: int,
                     expected: ExpectedLayout | None) -> Header:
    """Poll the header until the source has published `step` or `wait_available` runs out."""
    deadline = time.monotonic() + wait_available
    delay = 0.02
    conn = source.connect()
    first = True
    try:
        while True:
            status, body = _get(source, conn, f"/v1/snapshot/{step}/header", first)
            first = False
            if status == 200:
                header = decode_header(body, max_bytes, expected)
                if header.step != step:
                    raise _Problem(f"asked for step {step}, the header describes {header.step}")
                return header
            remaining = deadline - time.monotonic()
            if status not in (404, 425) or remaining <= 0:  # 425 Too Early: published, not ready
                problem = _status_problem(status, body)
                if status in (404, 425):
                    problem = _Problem(f"not available after waiting {wait_available}s: {problem}")
                raise problem
            # The source may publish this step a moment after we ask (it is one step ahead).
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.5)
    finally:
        conn.close()


def _fetch_chunk(source: _Source, conn: http.client.HTTPConnection, step: int,
                 chunk: ChunkEntry, buffer: memoryview) -> None:
    response = source.get(conn, f"/v1/snapshot/{step}/chunk/{chunk.index}")
    if response.status != 200:
        raise _status_problem(response.status, _read_small(response, 1 << 16))
    length = response.getheader("Content-Length")
    if length != str(chunk.nbytes):
        raise _Problem(f"chunk {chunk.index}: the source sends {length} bytes, "
                       f"the header says {chunk.nbytes}")
    claimed = response.getheader("X-Ftlm-Digest") or ""
    algorithm, _, expected = claimed.partition("=")
    if algorithm != DIGEST or not DIGEST_HEX.fullmatch(expected):
        raise _Problem(f"chunk {chunk.index}: the source sent no valid digest (X-Ftlm-Digest: "
                       f"{claimed[:80]!r}; expected '{DIGEST}=' and 32 hex digits)")
    target = buffer[chunk.offset:chunk.offset + chunk.nbytes]
    received = 0
    while received < chunk.nbytes:
        # Straight into the destination: http.client hands reads this large to recv_into.
        n = response.readinto(target[received:])
        if not n:
            raise _Problem(f"chunk {chunk.index}: truncated body, {received} of "
                           f"{chunk.nbytes} bytes arrived")
        received += n
    digest = chunk_digest(target)
    if digest != expected:
        raise _Problem(f"checksum mismatch in chunk {chunk.index} (bytes [{chunk.offset}, "
                       f"{chunk.offset + chunk.nbytes})): {DIGEST} {digest}, the source says "
                       f"{expected}")


@timed_io("transfer_received", lambda _, source, header, *rest: header.total_bytes)
def _download(source: _Source, header: Header, buffer: memoryview, parallel: int,
              progress: Callable[[int, int], None] | None, thread_nice: int = 0) -> None:
    """Fetch all chunks into `buffer` with `parallel` threads, one HTTP connection each."""
    lock = threading.Lock()
    pending = iter(header.chunks)
    failed = threading.Event()
    errors: list[BaseException] = []
    done = [0]

    def worker() -> None:
        background_priority(thread_nice)
        conn = None
        try:
            while not failed.is_set():
                with lock:
                    chunk = next(pending, None)
                if chunk is None:
                    return
                conn = conn or source.connect()
                try:
                    _fetch_chunk(source, conn, header.step, chunk, buffer)
                except (OSError, http.client.HTTPException) as e:  # name the chunk
                    raise _Problem(f"chunk {chunk.index}: {_describe(e, source.timeout)}") from e
                with lock:  # under the lock so that reports are monotonic
                    done[0] += chunk.nbytes
                    if progress is not None:
                        progress(done[0], header.total_bytes)
        except BaseException as e:  # reported by the caller's thread below
            with lock:
                errors.append(e)
            failed.set()
        finally:
            if conn is not None:
                conn.close()

    threads = [threading.Thread(target=worker, name=f"ftlm-fetch-{i}", daemon=True)
               for i in range(min(parallel, len(header.chunks)))]
    for t in threads:
        t.start()
    for t in threads:
        # Bounded: every socket operation of a worker times out after source.timeout.
        t.join()
    if errors:
        raise errors[0]
    if done[0] != header.total_bytes:
        raise _Problem(f"received {done[0]} bytes, expected {header.total_bytes}")


def _allocate(nbytes: int) -> memoryview:
    """An uninitialised host buffer (every byte is written by a verified chunk before use).

    torch.empty rather than bytearray: no zero-fill pass, so pages are committed as chunks
    arrive; an allocation the host cannot make becomes a _Problem, not a MemoryError.
    """
    try:
        return memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())
    except (MemoryError, RuntimeError) as e:
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise _Problem(f"cannot allocate {nbytes} bytes for the snapshot ({reason})") from None


def fetch_snapshot(url: str, step: int, token: str = "", parallel: int = 4,
                   timeout: float = 30.0, wait_available: float = 10.0,
                   progress: Callable[[int, int], None] | None = None,
                   *, expected: ExpectedLayout | None = None,
                   ssl_context: ssl.SSLContext | None = None,
                   max_bytes: int | None = None, thread_nice: int = 0,
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Download, verify and rebuild the snapshot of `step` served at `url`.

    Waits up to `wait_available` s for the source to publish `step`; `timeout` bounds every
    connect and read; `progress(bytes_done, total_bytes)` is called from worker threads after each
    verified chunk. Returns CPU tensors (views into one buffer of this call's, which they keep
    alive: nothing else holds or writes it), and the meta dict. Any failure
    raises TransferError and returns nothing partial.

    `expected` (`expected_layout` of the receiver's own tensors) makes the receiver refuse a
    header whose tensor names, dtypes, shapes or total size differ from its own state, before it
    allocates anything; without it only the hard cap `max_bytes` (default `default_max_bytes()`)
    bounds the allocation. `ssl_context` (`ftlm.ft.tls.client_context`) verifies an https://
    source; with it, a plain http:// URL is refused rather than used without TLS.
    `thread_nice` lowers the CPU priority of the pulling threads (`ftlm.ft.priority`).
    """
    if parallel < 1 or not timeout > 0 or wait_available < 0:
        raise ValueError(f"need parallel >= 1, timeout > 0, wait_available >= 0; got "
                         f"{parallel}, {timeout}, {wait_available}")
    if expected is not None and not isinstance(expected, ExpectedLayout):
        raise TypeError(f"expected must be an ExpectedLayout (see expected_layout), got "
                        f"{type(expected).__name__}")
    cap = default_max_bytes() if max_bytes is None else max_bytes
    try:
        source = _Source.parse(url, token, timeout, ssl_context)
        header = _wait_for_header(source, step, wait_available, cap, expected)
        buffer = _allocate(header.total_bytes)
        _download(source, header, buffer, parallel, progress, thread_nice)
        try:
            # The buffer is this call's alone: the tensors are views into it, not a second copy.
            return tensors_from_buffer(buffer, header.tensors, copy=False), header.meta
        except (MemoryError, RuntimeError) as e:
            raise _Problem(f"cannot rebuild {len(header.tensors)} tensors of "
                           f"{header.total_bytes} bytes ({type(e).__name__})") from None
    except (_Problem, FramingError, OSError, http.client.HTTPException) as e:
        raise TransferError(f"fetching the snapshot of step {step} from {url} failed: "
                            f"{_describe(e, timeout)}") from e
