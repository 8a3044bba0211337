"""Live state transfer between replica groups: snapshot, serve over HTTP, fetch and verify.

A healthy peer takes a CPU `Snapshot` of its replicated state at a step boundary
(`snapshot_state`), publishes it on its `SnapshotServer` and keeps training; a restarted group
calls `fetch_snapshot`, which downloads the chunks in parallel, verifies every chunk's sha256 and
rebuilds the tensors. Bytes travel as described in `ftlm.ft.framing`; nothing is ever unpickled.

Chunk hashes are computed lazily, once per published snapshot, on the server's own hashing
thread (started by `publish`), so the training thread pays only for the memory copy; header
requests wait for the hashes. A snapshot's buffer is never written after `snapshot_state`
returns, so lazy hashes and served bytes are always consistent.

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

import asyncio
import concurrent.futures
import hashlib
import hmac
import http.client
import json
import os
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from ftlm.errors import ConfigError, FtlmError
from ftlm.ft.framing import (
    DEFAULT_MAX_TOTAL_BYTES, MAX_HEADER_BYTES, ChunkEntry, ExpectedLayout, FramingError, Header,
    LayoutMismatch, TensorEntry, canonical_json, chunk_table, decode_header, expected_layout,
    layout, state_digest, tensors_from_buffer,
)

__all__ = ["ExpectedLayout", "Snapshot", "SnapshotServer", "TransferError", "default_max_bytes",
           "expected_layout", "fetch_snapshot", "list_snapshots", "snapshot_state",
           "state_digest"]

_MAX_HEADER_BYTES = MAX_HEADER_BYTES
_WRITE_PIECE = 256 << 10  # bytes per socket write; small enough for smooth throttling


class TransferError(FtlmError):
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
    hashes: concurrent.futures.Future  # -> tuple[ChunkEntry, ...]
    header_json: bytes | None = field(default=None)


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _parse_index(text: str) -> int | None:
    # isdigit() rejects signs, spaces and non-ASCII digits; the length cap keeps int() cheap.
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        return None
    return int(text)


class SnapshotServer:
    """Serves published snapshots over HTTP(S) from a background thread with its own event loop.

    Endpoints: `GET /v1/snapshots`, `GET /v1/snapshot/{step}/header`,
    `GET /v1/snapshot/{step}/chunk/{index}`. Single use: `start()` once, `stop()` once or more.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str = "",
                 chunk_bytes: int = 4 << 20, keep: int = 2,
                 throttle_bytes_per_s: float | None = None,
                 on_chunk: Callable[[int, int], None] | None = None,
                 shutdown_grace_s: float = 0.5,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        if chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if keep < 1:
            raise ConfigError(f"keep must be >= 1 (snapshots kept), got {keep}")
        if throttle_bytes_per_s is not None and not throttle_bytes_per_s > 0:
            raise ConfigError(f"throttle_bytes_per_s must be > 0 or None, got "
                              f"{throttle_bytes_per_s}")
        self.host, self.port, self.token = host, port, token
        self.chunk_bytes, self.keep = chunk_bytes, keep
        self.throttle_bytes_per_s = throttle_bytes_per_s
        self.on_chunk = on_chunk  # test hook: called (step, index) before serving each chunk
        self.ssl_context = ssl_context  # serves https:// when set (ftlm.ft.tls.server_context)
        self._grace = shutdown_grace_s
        self._lock = threading.Lock()
        self._published: dict[int, _Published] = {}
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, "ftlm-snapshot-hash")
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None
        self._throttle_free_at = 0.0  # loop time at which the throttle has sent all reserved bytes
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
        """Make `snapshot` available by its step (replacing one of the same step), keep newest."""
        if self._stopping.is_set():
            raise RuntimeError("SnapshotServer is stopped; publish to a running server")
        hashes = self._hasher.submit(chunk_table, snapshot.view(), self.chunk_bytes,
                                     self._stopping.is_set)
        with self._lock:
            self._published[snapshot.step] = _Published(snapshot, hashes)
            for old in sorted(self._published)[:-self.keep]:
                self._published.pop(old).hashes.cancel()

    def retain(self, steps: set[int] | frozenset[int]) -> None:
        """Drop every published snapshot whose step is not in ``steps``, freeing its memory once
        no chunk of it is being written (a pull of a dropped step gets 404 and starts over)."""
        with self._lock:
            for step in [s for s in self._published if s not in steps]:
                self._published.pop(step).hashes.cancel()

    def start(self, timeout: float = 10.0) -> str:
        """Bind and serve in a background thread; return the URL (with the OS-chosen port)."""
        if self._thread is not None:
            raise RuntimeError("SnapshotServer.start() may be called once")
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()),
                                        name="ftlm-snapshot-server", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            self.stop()
            raise TimeoutError(f"SnapshotServer did not start within {timeout}s")
        if self._start_error is not None:
            self.stop()
            raise OSError(f"SnapshotServer could not listen on {self.host}:{self.port}: "
                          f"{self._start_error}") from self._start_error
        return self.url

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving; in-flight transfers are cut after a short grace. Safe from any thread.

        From the server's own thread (e.g. inside `on_chunk`) it only requests the stop, since
        that thread cannot wait for itself; a later call from another thread joins it.
        """
        self._stopping.set()
        own_thread = threading.current_thread() is self._thread
        loop, stop_requested = self._loop, self._stop_requested
        if loop is not None and stop_requested is not None:
            if own_thread:
                stop_requested.set()
            else:
                try:
                    loop.call_soon_threadsafe(stop_requested.set)
                except RuntimeError:  # the loop has already closed
                    pass
        self._hasher.shutdown(wait=not own_thread, cancel_futures=True)
        if self._thread is not None and not own_thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"SnapshotServer thread did not stop within {timeout}s")

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        app = web.Application(middlewares=[self._authorize], client_max_size=4096)
        app.add_routes([
            web.get("/v1/snapshots", self._list),
            web.get("/v1/snapshot/{step}/header", self._header),
            web.get("/v1/snapshot/{step}/chunk/{index}", self._chunk),
        ])
        runner = web.AppRunner(app, shutdown_timeout=self._grace, access_log=None)
        try:
            await runner.setup()
            await web.TCPSite(runner, self.host, self.port, ssl_context=self.ssl_context).start()
            host, port = runner.addresses[0][:2]
            scheme = "https" if self.ssl_context is not None else "http"
            self._url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
        except Exception as e:  # reported to start() in the caller's thread
            self._start_error = e
            self._started.set()
            await runner.cleanup()
            return
        self._started.set()
        try:
            if not self._stopping.is_set():
                await self._stop_requested.wait()
        finally:
            await runner.cleanup()

    @web.middleware
    async def _authorize(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if self.token:
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, f"Bearer {self.token}".encode()):
                return _json_error(401, "missing or wrong job token: send "
                                        "'Authorization: Bearer <token>' with the job's FTLM_TOKEN")
        return await handler(request)

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response({"steps": self.steps()})

    def _lookup(self, request: web.Request) -> tuple[int, _Published] | web.Response:
        step = _parse_index(request.match_info["step"])
        if step is None:
            return _json_error(400, f"step must be a non-negative integer, got "
                                    f"{request.match_info['step'][:40]!r}")
        with self._lock:
            published, available = self._published.get(step), sorted(self._published)
        if published is None:
            return _json_error(404, f"snapshot of step {step} is not available on this server "
                                    f"(available steps: {available})")
        return step, published

    async def _header(self, request: web.Request) -> web.Response:
        found = self._lookup(request)
        if isinstance(found, web.Response):
            return found
        step, published = found
        if not published.hashes.done():
            # The checksums of a large state take a while: answer at once and let the joiner
            # ask again (within its wait_available), never hold its socket past its timeout.
            return _json_error(425, f"snapshot of step {step} is still being prepared "
                                    "(checksums); ask again shortly")
        try:
            chunks = await asyncio.wrap_future(published.hashes)
        except (asyncio.CancelledError, InterruptedError):
            if not published.hashes.done():
                raise  # this handler itself was cancelled (server shutting down)
            return _json_error(404 if not self._stopping.is_set() else 503,
                               f"snapshot of step {step} was evicted or the server is stopping")
        if published.header_json is None:
            snap = published.snapshot
            header = Header(snap.step, snap.meta, snap.total_bytes, snap.tensors, chunks)
            published.header_json = json.dumps(header.to_json()).encode()
        return web.Response(body=published.header_json, content_type="application/json")

    async def _chunk(self, request: web.Request) -> web.StreamResponse:
        found = self._lookup(request)
        if isinstance(found, web.Response):
            return found
        step, published = found
        index = _parse_index(request.match_info["index"])
        total = published.snapshot.total_bytes
        count = -(-total // self.chunk_bytes)
        if index is None:
            return _json_error(400, f"chunk index must be a non-negative integer, got "
                                    f"{request.match_info['index'][:40]!r}")
        if index >= count:
            return _json_error(404, f"step {step} has {count} chunks; "
                                    f"index {index} is out of range")
        if self.on_chunk is not None:
            self.on_chunk(step, index)
        if self._stopping.is_set():
            request.transport.close()  # a stopping server drops the connection, like a dead peer
            return _json_error(503, "server is stopping")
        offset = index * self.chunk_bytes
        data = published.snapshot.view()[offset:min(offset + self.chunk_bytes, total)]
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = len(data)
        await response.prepare(request)
        for start in range(0, len(data), _WRITE_PIECE):
            piece = data[start:start + _WRITE_PIECE]
            await self._pace(len(piece))
            if self._stopping.is_set():
                request.transport.close()
                break
            await response.write(piece)
        return response

    async def _pace(self, nbytes: int) -> None:
        """Reserve nbytes of the shared byte budget, then sleep until the reservation ends.

        Ending (not starting) each reservation before writing means that B bytes are never all
        written before B / rate seconds have passed, whatever the number of connections.
        """
        if self.throttle_bytes_per_s is None:
            return
        now = asyncio.get_running_loop().time()
        seconds = nbytes / self.throttle_bytes_per_s
        self._throttle_free_at = max(now, self._throttle_free_at) + seconds
        await asyncio.sleep(self._throttle_free_at - now)


# ---------------------------------------------------------------------------------------------
# Client


class _Problem(Exception):
    """A failure already described in words; fetch_snapshot adds the source and the step."""


@dataclass(frozen=True)
class _Source:
    host: str
    port: int
    base: str
    token: str
    timeout: float
    ssl_context: ssl.SSLContext | None  # set exactly when the URL is https://

    @classmethod
    def parse(cls, url: str, token: str, timeout: float,
              ssl_context: ssl.SSLContext | None) -> _Source:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise _Problem(f"source URL must look like http(s)://host:port, got {url!r}")
        if parts.scheme == "http" and ssl_context is not None:
            # Never fall back to plain text when this group was told to use TLS.
            raise _Problem("this group requires TLS (a client TLS context is set) but the source "
                           "URL is plain http://; give the source group ft.tls_cert and "
                           "ft.tls_key so that it serves https://")
        if parts.scheme == "https" and ssl_context is None:
            ssl_context = ssl.create_default_context()  # the system's CAs, hostname checked
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as e:
            raise _Problem(f"source URL {url!r} has a bad port: {e}") from None
        return cls(parts.hostname, port, parts.path.rstrip("/"), token, timeout, ssl_context)

    def connect(self) -> http.client.HTTPConnection:
        # The timeout bounds the connect, the TLS handshake and every single read, so no wait
        # below is unbounded.
        if self.ssl_context is not None:
            return http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout,
                                               context=self.ssl_context)
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def get(self, conn: http.client.HTTPConnection, path: str) -> http.client.HTTPResponse:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        conn.request("GET", self.base + path, headers=headers)
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
            if status not in (404, 425) or remaining <= 0:  # 425: published, still hashing
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
    target = buffer[chunk.offset:chunk.offset + chunk.nbytes]
    received = 0
    while received < chunk.nbytes:
        n = response.readinto(target[received:])
        if not n:
            raise _Problem(f"chunk {chunk.index}: truncated body, {received} of "
                           f"{chunk.nbytes} bytes arrived")
        received += n
    digest = hashlib.sha256(target).hexdigest()
    if digest != chunk.sha256:
        raise _Problem(f"checksum mismatch in chunk {chunk.index} (bytes [{chunk.offset}, "
                       f"{chunk.offset + chunk.nbytes})): sha256 {digest}, header says "
                       f"{chunk.sha256}")


def _download(source: _Source, header: Header, buffer: memoryview, parallel: int,
              progress: Callable[[int, int], None] | None) -> None:
    """Fetch all chunks into `buffer` with `parallel` threads, one HTTP connection each."""
    lock = threading.Lock()
    pending = iter(header.chunks)
    failed = threading.Event()
    errors: list[BaseException] = []
    done = [0]

    def worker() -> None:
        conn = None
        try:
            while not failed.is_set():
                with lock:
                    chunk = next(pending, None)
                if chunk is None:
                    return
                conn = conn or source.connect()
                _fetch_chunk(source, conn, header.step, chunk, buffer)
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
                   max_bytes: int | None = None,
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
        _download(source, header, buffer, parallel, progress)
        try:
            # The buffer is this call's alone: the tensors are views into it, not a second copy.
            return tensors_from_buffer(buffer, header.tensors, copy=False), header.meta
        except (MemoryError, RuntimeError) as e:
            raise _Problem(f"cannot rebuild {len(header.tensors)} tensors of "
                           f"{header.total_bytes} bytes ({type(e).__name__})") from None
    except (_Problem, FramingError, OSError, http.client.HTTPException) as e:
        raise TransferError(f"fetching the snapshot of step {step} from {url} failed: "
                            f"{_describe(e, timeout)}") from e
