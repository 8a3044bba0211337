"""Live state transfer between replica groups: snapshot, serve over HTTP, fetch and verify.

A healthy peer takes a CPU `Snapshot` of its replicated state at a step boundary
(`snapshot_state`), publishes it on its `SnapshotServer` and keeps training; a restarted group
calls `fetch_snapshot`, which downloads the chunks in parallel, verifies every chunk's digest and
rebuilds the tensors. Bytes travel as described in `ftlm.ft.framing`; nothing is ever unpickled.

The protocol: the header (safetensors: the tensors, and in its metadata the step, meta and chunk
size) is answered as soon as a snapshot is published; each chunk's answer is the raw bytes with the
chunk's XXH3-128 digest in its `X-Ftlm-Digest` header, computed by the source when it first serves
that chunk (and kept: later pulls are checked against that first digest). So no request waits for a
hash of the whole state, and a receiver verifies each chunk as it lands, naming the chunk that is
corrupt. The server writes chunks with `socket.sendall` straight from the snapshot's buffer, one
thread per connection (`ftlm.ft.bulk_http`), and the receiver reads them with `recv_into` straight
into its destination buffer: no copy in user space on either side. A snapshot's buffer is never
written after `snapshot_state` returns, so digests and served bytes are always consistent.

Two servers answer the same protocol (`ftlm.ft.snapshot_routes`): `SnapshotServer` from threads
of this process, and `ftlm.ft.serve_process.ProcessSnapshotServer` from a process of its own at
a low CPU priority, reading snapshots taken into shared memory (`snapshot_state(...,
shared=True)`), so that serving never holds the training process's interpreter lock.

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

import http.client
import ipaddress
import json
import logging
import os
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ftlm.errors import FaultError
from ftlm.ft.framing import (
    DEFAULT_MAX_TOTAL_BYTES, DIGEST, DIGEST_HEX, MAX_WIRE_HEADER_BYTES, ChunkEntry, ExpectedLayout,
    FramingError, Header, LayoutMismatch, TensorEntry, canonical_json, chunk_digest,
    decode_header, expected_layout, layout, state_digest, tensors_from_buffer,
)
from ftlm.ft.http_client import Endpoint, EndpointError
from ftlm.ft.priority import background_priority
from ftlm.ft.shared_buffer import SharedBuffer
from ftlm.ft.snapshot_reserve import SnapshotReserve, allocate_snapshot_buffer
from ftlm.ft.snapshot_routes import SnapshotRoutes
from ftlm.observe.iostats import timed_io

__all__ = ["ExpectedLayout", "Snapshot", "SnapshotServer", "TransferError", "default_max_bytes",
           "expected_layout", "fetch_snapshot", "list_snapshots", "on_this_host", "snapshot_state",
           "state_digest"]

_MAX_HEADER_BYTES = MAX_WIRE_HEADER_BYTES
log = logging.getLogger(__name__)


class TransferError(FaultError):
    """Fetching a snapshot from a peer failed; the message names the source, the step and why."""


@dataclass(frozen=True, eq=False)
class Snapshot:
    """An immutable CPU copy of replicated state at one step: one flat byte buffer + layout
    (`ftlm.ft.framing.layout`: safetensors' order, no holes)."""

    step: int
    meta: dict[str, Any]
    tensors: tuple[TensorEntry, ...]
    buffer: torch.Tensor  # flat uint8 on CPU (pinned when taken from CUDA); never written again
    shared: SharedBuffer | None = None  # the shared memory `buffer` lives in, when it does

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


def snapshot_pinned(tensors: Mapping[str, torch.Tensor], *, shared: bool) -> bool:
    """Whether a snapshot of ``tensors`` goes through pinned host memory (CUDA tensors, not
    shared memory)."""
    return (any(t.is_cuda for t in tensors.values()) and torch.cuda.is_available()
            and not shared)


def snapshot_state(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                   step: int, *, shared: bool = False,
                   reserve: SnapshotReserve | None = None) -> Snapshot:
    """Copy `tensors` (any devices) and `meta` into a new Snapshot of `step`, right now.

    Call at a step boundary; training may mutate the tensors as soon as this returns. CUDA tensors
    go through one pinned host buffer with asynchronous copies and one synchronize per device.
    `shared`: the buffer is anonymous shared memory (`ftlm.ft.shared_buffer`) that the snapshot
    server process maps (`ProcessSnapshotServer`); CUDA tensors are then copied into it without
    pinning (synchronously). `reserve`: take the buffer it prepared ahead when it fits
    (`ftlm.ft.snapshot_reserve`), else allocate one now.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    meta_copy = json.loads(canonical_json(meta))  # deep copy, and proof that meta is JSON data
    entries, total = layout(tensors)
    devices = {t.device for t in tensors.values() if t.is_cuda}
    pinned = snapshot_pinned(tensors, shared=shared)
    got = reserve.take(total, shared=shared, pinned=pinned) if reserve is not None else None
    if got is None:
        got = allocate_snapshot_buffer(total, shared=shared, pinned=pinned)
    buffer, memory = got.buffer, got.memory
    # The entries cover the buffer without a hole, so no byte of stale process memory is sent.
    for entry, t in zip(entries, tensors.values()):
        if entry.nbytes == 0:
            continue
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        # copy_ always copies, so the snapshot never aliases the live tensors.
        buffer[entry.offset:entry.offset + entry.nbytes].copy_(src, non_blocking=pinned)
    for device in devices:
        torch.cuda.synchronize(device)
    return Snapshot(step, meta_copy, entries, buffer, memory)


def encoded_header(snapshot: Snapshot, chunk_bytes: int) -> tuple[bytes, int]:
    """The header a server answers for `snapshot` cut in chunks of `chunk_bytes` (safetensors:
    length prefix and JSON), and how many chunks that makes."""
    header = Header(snapshot.step, snapshot.meta, snapshot.total_bytes, snapshot.tensors,
                    chunk_bytes)
    return header.encode(), len(header.chunks)


class SnapshotServer(SnapshotRoutes):
    """Serves published snapshots from threads of this process (`ftlm.ft.snapshot_routes`).

    Its connection threads share the training process's interpreter lock and cores: where cores
    are short, `ftlm.ft.serve_process.ProcessSnapshotServer` serves from a process of its own.
    """

    shared_memory = False
    """Whether `publish` needs snapshots taken with `snapshot_state(..., shared=True)`."""

    def publish(self, snapshot: Snapshot) -> None:
        """Make `snapshot` available by its step (replacing one of the same step), keep newest.

        Cheap: the header names the chunk size only; each chunk's digest is computed when that
        chunk is first served (`chunk_digest`, on the serving thread) and kept for later pulls.
        """
        header, chunks = encoded_header(snapshot, self.chunk_bytes)
        self.add(snapshot.step, header, snapshot.view(), chunks)


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


def on_this_host(url: str) -> bool:
    """Whether the host of ``url`` is this machine: a loopback address, or an address a socket
    here can bind (one of this machine's interfaces). A name that does not resolve is not."""
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, addr in infos:
        ip = str(addr[0]).split("%")[0]
        try:
            if ipaddress.ip_address(ip).is_loopback:
                return True
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((ip, 0))
            return True
        except (OSError, ValueError):
            continue
    return False


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
