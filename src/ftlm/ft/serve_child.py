"""The snapshot server process: serves what its parent publishes, at a low CPU priority.

Started by ``ftlm.ft.serve_process.ProcessSnapshotServer`` as ``python -m ftlm.ft.serve_child
CONTROL_FD LISTEN_FD PARENT_PID DEATHSIG``: it inherits the listening socket its parent bound and
one end of a Unix socket pair, the control channel. Over that channel (length-prefixed JSON
frames, ``send_frame``/``recv_frame``) the parent sends the settings first, then ``publish``
(step, header, sizes, and the snapshot's shared memory descriptor attached to the frame),
``retain``, ``sync`` and ``stop``; this process answers ``synced``, asks ``chunk`` before it
serves a chunk when the parent has an ``on_chunk`` hook (and waits for ``chunk_done``), and
reports the bytes and seconds it sent (``io``) for the parent's metrics.

It lowers its own CPU priority (``ftlm.ft.priority``) before it starts any thread, so every
thread of it runs at ``nice``: the OS scheduler, not a shared interpreter lock, decides whether
training or serving runs. It dies with its parent: by ``PR_SET_PDEATHSIG`` (Linux; when the
parent started it from its main thread, since the signal follows the thread that started a
child), and in any case when the control channel reaches end of file, which the kernel causes
when the parent process ends however it ends.

It imports no torch (``ftlm.ft.snapshot_routes`` is torch-free), so it starts in a fraction of a
second and adds tens of MB, not hundreds.

Not responsible for: the HTTP endpoints themselves (``ftlm.ft.snapshot_routes``), or starting,
stopping and owning this process (``ftlm.ft.serve_process``).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import mmap
import os
import signal
import socket
import struct
import sys
import threading
from typing import Any

# Imported at the parent's CPU priority, before this process lowers its own: at nice 19 on
# busy cores, the imports alone would take seconds.
from ftlm.ft.priority import background_priority
from ftlm.ft.snapshot_routes import SnapshotRoutes
from ftlm.ft.tls import server_context
from ftlm.observe.iostats import io_totals

_LENGTH = struct.Struct(">I")
MAX_FRAME = 256 << 20
"""Largest control frame (a publish frame carries the snapshot's header, at most 64 MiB)."""
REPORT_SECONDS = 0.25
"""How often the serving process reports the bytes it sent to its parent (when it sent any)."""

log = logging.getLogger("ftlm.ft.serve_child")


# -- the control channel (both ends) ---------------------------------------------------------------

def send_frame(sock: socket.socket, lock: threading.Lock, message: dict[str, Any],
               fd: int | None = None) -> None:
    """Send one JSON frame, with descriptor ``fd`` attached to its first byte when given."""
    data = json.dumps(message).encode()
    if len(data) > MAX_FRAME:
        raise ValueError(f"control frame of {len(data)} bytes exceeds {MAX_FRAME}")
    frame = _LENGTH.pack(len(data)) + data
    with lock:
        sent = 0 if fd is None else socket.send_fds(sock, [frame], [fd])
        sock.sendall(frame[sent:])


def _recv_exact(sock: socket.socket, n: int, got: bytes = b"") -> bytes | None:
    parts, have = [got], len(got)
    while have < n:
        more = sock.recv(n - have)
        if not more:
            return None
        parts.append(more)
        have += len(more)
    return b"".join(parts)


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The next frame and the descriptors attached to it; None at end of file."""
    # Reading the first bytes of a frame with recvmsg receives the descriptors attached to it;
    # every read stops at a frame's end, so a descriptor is never read past.
    first, fds, _, _ = socket.recv_fds(sock, _LENGTH.size, 4)
    if not first:
        for fd in fds:
            os.close(fd)
        return None
    head = _recv_exact(sock, _LENGTH.size, first)
    (length,) = _LENGTH.unpack(head) if head is not None else (None,)
    body = _recv_exact(sock, length) if length is not None and length <= MAX_FRAME else None
    if body is None:
        for fd in fds:
            os.close(fd)
        return None
    return json.loads(body), fds


# -- the serving process ---------------------------------------------------------------------------

def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it ends (Linux), and exit now if the
    parent is already gone (it died before the request took effect)."""
    if sys.platform.startswith("linux"):
        try:
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no libc to call: the control channel still tells
            pass
    if os.getppid() != parent_pid:
        os._exit(0)


class _Serving:
    """This process's snapshot routes, driven by its parent's control frames."""

    def __init__(self, control: socket.socket, settings: dict[str, Any],
                 listener: socket.socket) -> None:
        self.control, self.send_lock = control, threading.Lock()
        self.stopped = threading.Event()
        self._answers: dict[int, threading.Event] = {}  # chunk request id -> parent's answer
        self._ids = itertools.count()
        tls = settings["tls_cert"]
        self.routes = SnapshotRoutes(
            token=settings["token"], chunk_bytes=settings["chunk_bytes"], keep=settings["keep"],
            throttle_bytes_per_s=settings["throttle_bytes_per_s"],
            on_chunk=self._ask_parent if settings["hook"] else None,
            ssl_context=server_context(tls, settings["tls_key"]) if tls else None,
            max_connections=settings["max_connections"], read_timeout=settings["read_timeout"],
            listener=listener)
        self.stop_timeout = settings["stop_timeout"]
        self._reported = (0, 0.0)

    def send(self, message: dict[str, Any]) -> None:
        send_frame(self.control, self.send_lock, message)

    def run(self) -> None:
        self.routes.start()
        reporter = threading.Thread(target=self._report_io, name="ftlm-serve-io", daemon=True)
        reporter.start()
        try:
            while (got := recv_frame(self.control)) is not None:
                message, fds = got
                if message["op"] == "stop":
                    break
                try:
                    self._apply(message, fds)
                except Exception:  # noqa: BLE001 - e.g. a mapping the host cannot make
                    log.exception("could not apply the parent's %r frame; serving on",
                                  message["op"])
        finally:
            self.routes.stop(self.stop_timeout)
            self.stopped.set()
            reporter.join(self.stop_timeout)
            try:
                self._send_io()  # the last bytes sent
            except OSError:  # the parent is gone: nobody to report to
                pass

    def _apply(self, message: dict[str, Any], fds: list[int]) -> None:
        op = message["op"]
        try:
            if op == "publish":
                total = message["total_bytes"]
                # Read-only and shared: the parent's pages, never copied; unmapped when the
                # last view of them (a published entry, a chunk being sent) is gone.
                data = (memoryview(mmap.mmap(fds[0], total, prot=mmap.PROT_READ)) if total
                        else memoryview(b""))
                self.routes.add(message["step"], message["header"].encode("latin-1"), data,
                                message["chunks"])
            elif op == "retain":
                self.routes.retain(set(message["steps"]))
            elif op == "chunk_done":
                answer = self._answers.pop(message["id"], None)
                if answer is not None:
                    answer.set()
            elif op == "sync":
                self.send({"op": "synced", "seq": message["seq"]})
            else:
                log.error("unknown control frame %r from the parent", op)
        finally:
            for fd in fds:
                os.close(fd)  # a mapping outlives its descriptor

    def _ask_parent(self, step: int, index: int) -> None:
        """The parent's ``on_chunk`` hook, run there; this chunk waits for it (or for a stop)."""
        answer, key = threading.Event(), next(self._ids)
        self._answers[key] = answer
        self.send({"op": "chunk", "id": key, "step": step, "index": index})
        while not answer.wait(0.1):
            if self.routes.stopping.is_set():
                return

    def _send_io(self) -> None:
        nbytes, seconds = io_totals()["transfer_sent"]
        if nbytes != self._reported[0]:
            self.send({"op": "io", "bytes": nbytes - self._reported[0],
                       "seconds": seconds - self._reported[1]})
            self._reported = (nbytes, seconds)

    def _report_io(self) -> None:
        while not self.stopped.wait(REPORT_SECONDS):
            try:
                self._send_io()
            except OSError:
                return


def main(argv: list[str] | None = None) -> int:
    control_fd, listen_fd, parent_pid, deathsig = (int(a) for a in (argv or sys.argv[1:]))
    if deathsig:
        _die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s ftlm-serve[{os.getpid()}] %(levelname)s "
                               f"%(name)s: %(message)s")
    control = socket.socket(fileno=control_fd)
    got = recv_frame(control)
    if got is None or got[0].get("op") != "settings":
        return 0  # the parent went away before it sent the settings
    settings = got[0]
    background_priority(settings["nice"])  # before any thread: they all inherit it
    _Serving(control, settings, socket.socket(fileno=listen_fd)).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
