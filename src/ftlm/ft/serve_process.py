"""Serving snapshots from a process of its own, so that serving never slows training much.

A source serves its snapshot to a recovering peer while it keeps training. Served from threads of
the training process (``ftlm.ft.transport.SnapshotServer``), the transfer shares the process's
interpreter lock and, at the training thread's priority, its cores: on 2 cores a source's steps
took 4-5x as long while it served (``bench.serve_impact``); at a low priority a serving thread
preempted while it held the lock stalled the heartbeat for up to seconds
(``bench.transfer_priority``). ``ProcessSnapshotServer`` serves the same protocol from a child
process (``ftlm.ft.serve_child``) at CPU priority ``nice``: it shares no lock with training, so
a low priority only means that the OS runs training first.

The snapshot is written once, by the training process, into anonymous shared memory
(``snapshot_state(..., shared=True)``, ``ftlm.ft.shared_buffer``); ``publish`` passes its
descriptor to the child, which maps the same pages. Nothing is copied, and nothing has a name
that could outlive the processes. The child is started with ``subprocess`` (exec, never a fork
of the torch process); it inherits the listening socket bound here, so ``start()`` returns the
URL at once and requests wait in the backlog while the child imports (a fraction of a second).

Control is asynchronous: ``publish`` and ``retain`` write a frame and return, so the training
process never waits for a low-priority process; ``sync()`` waits until the child applied every
frame sent before (tests, benchmarks). The child reports the bytes and seconds it sent every
``REPORT_SECONDS``; they are added to this process's ``transfer_sent`` tally, which the rank's
metrics export.

Not responsible for: the endpoints (``ftlm.ft.snapshot_routes``), the child's own loop
(``ftlm.ft.serve_child``), or choosing the server kind (``make_snapshot_server``, from
``ft.snapshot_server``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ftlm
from ftlm.errors import ConfigError
from ftlm.ft import shared_buffer
from ftlm.ft.config import SNAPSHOT_SERVERS, FTConfig
from ftlm.ft.serve_child import recv_frame, send_frame
from ftlm.ft.snapshot_routes import check_settings, server_url
from ftlm.ft.tls import server_context
from ftlm.observe.iostats import count_io

if TYPE_CHECKING:
    from ftlm.ft.transport import Snapshot, SnapshotServer

__all__ = ["ProcessSnapshotServer", "make_snapshot_server"]

log = logging.getLogger("ftlm.ft.serve_process")

REQUESTED_EXITS = frozenset({signal.SIGTERM})
"""Signals whose exit of the serving process is a stop request (logged at info, not error)."""
REAP_SECONDS = 5.0
"""Most seconds the control reader waits, after the end of the channel, for the exit status."""

class ProcessSnapshotServer:
    """Serves published snapshots from a child process at CPU priority ``nice`` (0-19).

    The same endpoints, token check, TLS (``tls_cert``/``tls_key`` files, loaded by the child),
    connection cap, read timeout and throttle as ``SnapshotServer``; ``on_chunk(step, index)``
    is called in this process, on a thread of its own, before the child serves each chunk, and
    the chunk waits for it (a test and fault-injection hook: without one, serving costs this
    process nothing per chunk). Snapshots must be taken with ``snapshot_state(..., shared=True)``.
    Single use: ``start()`` once, ``stop()`` once or more; start it from a thread that outlives
    it (the main thread) for ``PR_SET_PDEATHSIG`` to apply.
    """

    shared_memory = True
    """Whether `publish` needs snapshots taken with `snapshot_state(..., shared=True)`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str = "",
                 chunk_bytes: int = 4 << 20, keep: int = 2,
                 throttle_bytes_per_s: float | None = None,
                 on_chunk: Callable[[int, int], None] | None = None,
                 tls_cert: str = "", tls_key: str = "",
                 max_connections: int = 64, read_timeout: float = 10.0,
                 nice: int = 19) -> None:
        check_settings(chunk_bytes, keep, throttle_bytes_per_s, max_connections, read_timeout)
        if not shared_buffer.supported():
            raise ConfigError("ft.snapshot_server='process' needs anonymous shared memory "
                              "(Linux); on this platform set ft.snapshot_server = 'thread'")
        if tls_cert or tls_key:
            server_context(tls_cert, tls_key)  # a bad file is a ConfigError here, not in the child
        self.host, self.port, self.token = host, port, token
        self.chunk_bytes, self.keep = chunk_bytes, keep
        self.on_chunk = on_chunk
        self._settings = {"op": "settings", "token": token, "chunk_bytes": chunk_bytes,
                          "keep": keep, "throttle_bytes_per_s": throttle_bytes_per_s,
                          "hook": on_chunk is not None, "tls_cert": tls_cert, "tls_key": tls_key,
                          "max_connections": max_connections, "read_timeout": read_timeout,
                          "nice": nice, "stop_timeout": 5.0}
        self._tls = bool(tls_cert)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._synced = threading.Condition()
        self._seq = self._acked = 0
        self._steps: list[int] = []  # what the child serves once it applied every frame sent
        self._stopping = False
        self._exited = threading.Event()
        self._process: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._reader: threading.Thread | None = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("ProcessSnapshotServer has no URL before start()")
        return self._url

    @property
    def pid(self) -> int:
        """The serving process's id (after ``start()``)."""
        if self._process is None:
            raise RuntimeError("ProcessSnapshotServer has no process before start()")
        return self._process.pid

    def start(self) -> str:
        """Bind, start the serving process and return the URL; the process starts serving once
        it has imported (requests wait in the listening socket's backlog until then)."""
        if self._process is not None:
            raise RuntimeError("ProcessSnapshotServer.start() may be called once")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            listener = socket.create_server((self.host, self.port), family=family, backlog=128)
        except OSError as e:
            raise OSError(f"ProcessSnapshotServer could not listen on {self.host}:{self.port}: "
                          f"{e}") from e
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            host, port = listener.getsockname()[:2]
            deathsig = threading.current_thread() is threading.main_thread()
            env = dict(os.environ)
            package_root = str(Path(ftlm.__file__).resolve().parent.parent)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root,
                                                            env.get("PYTHONPATH")) if p)
            self._process = subprocess.Popen(
                [sys.executable, "-m", "ftlm.ft.serve_child", str(theirs.fileno()),
                 str(listener.fileno()), str(os.getpid()), str(int(deathsig))],
                pass_fds=(theirs.fileno(), listener.fileno()), stdin=subprocess.DEVNULL,
                env=env)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()  # the child holds them now; the port closes when the child ends
            listener.close()
        self._control = mine
        self._url = server_url(host, port, self._tls)
        self._reader = threading.Thread(target=self._read, name="ftlm-serve-control",
                                        daemon=True)
        self._reader.start()
        self._send(self._settings)
        return self._url

    def steps(self) -> list[int]:
        """Steps published and not dropped, ascending (served once the child applied them)."""
        with self._lock:
            return list(self._steps)

    def publish(self, snapshot: Snapshot) -> None:
        """Serve `snapshot` by its step (replacing one of the same step), keep the newest `keep`.

        Writes one frame and returns: the child maps the snapshot's shared memory when it reads
        the frame (pullers asking before then get 404 and ask again, as before any publish)."""
        from ftlm.ft.transport import encoded_header
        if self._stopping:
            raise RuntimeError("ProcessSnapshotServer is stopped; publish to a running server")
        if snapshot.shared is None:
            raise ValueError("ProcessSnapshotServer serves snapshots in shared memory: take "
                             "them with snapshot_state(..., shared=True)")
        header, chunks = encoded_header(snapshot, self.chunk_bytes)
        with self._lock:
            # latin-1: the header is bytes (a binary length prefix), carried in a JSON frame.
            self._send({"op": "publish", "step": snapshot.step, "header": header.decode("latin-1"),
                        "total_bytes": snapshot.total_bytes, "chunks": chunks},
                       fd=snapshot.shared.fd)
            self._steps = sorted({*self._steps, snapshot.step})[-self.keep:]

    def retain(self, steps: set[int] | frozenset[int]) -> None:
        """Drop every published snapshot whose step is not in ``steps``; the child unmaps it
        once no chunk of it is being sent. No frame when nothing changes (called every step)."""
        with self._lock:
            kept = [s for s in self._steps if s in steps]
            if kept == self._steps:
                return
            self._send({"op": "retain", "steps": kept})
            self._steps = kept

    def sync(self, timeout: float = 10.0) -> None:
        """Wait until the child applied every publish and retain sent before this call."""
        with self._synced:
            self._seq += 1
            seq = self._seq
        self._send({"op": "sync", "seq": seq})
        with self._synced:
            if not self._synced.wait_for(lambda: self._acked >= seq or self._exited.is_set(),
                                         timeout):
                raise TimeoutError(f"the snapshot server process (pid {self.pid}) did not "
                                   f"answer within {timeout}s")
        if self._acked < seq:
            raise RuntimeError(self._gone())

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the serving process (in-flight transfers are cut) and wait for it; a process
        that does not end within ``timeout`` is killed. Safe from any thread, also from inside
        ``on_chunk``; later calls return at once."""
        with self._lock:
            already, self._stopping = self._stopping, True
        process = self._process
        if already or process is None:
            return
        try:
            self._send({"op": "stop"})
        except RuntimeError:  # it is gone already
            pass
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the snapshot server process (pid %d) did not stop within %.1f s: "
                        "killing it", process.pid, timeout)
            process.kill()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:  # at nice 19 on busy cores even dying is slow
                log.warning("the snapshot server process (pid %d) was killed and has not "
                            "ended within %.1f s; it ends when the scheduler runs it",
                            process.pid, timeout)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout)  # it reads the last io report, then end of file
        if self._control is not None:
            self._control.close()

    # -- the control channel -------------------------------------------------------------------

    def _gone(self) -> str:
        code = self._process.poll() if self._process is not None else None
        return (f"the snapshot server process (pid {self.pid}) exited (status {code}); this "
                f"rank can serve no snapshot until it restarts")

    def _send(self, message: dict[str, Any], fd: int | None = None) -> None:
        if self._control is None:
            raise RuntimeError("ProcessSnapshotServer is not started; call start() first")
        if self._exited.is_set():
            raise RuntimeError(self._gone())
        try:
            send_frame(self._control, self._send_lock, message, fd)
        except OSError as e:  # the child is gone (EPIPE), whether or not the reader noticed
            raise RuntimeError(self._gone()) from e

    def _read(self) -> None:
        """The child's frames: io reports, on_chunk requests, sync answers; then end of file."""
        assert self._control is not None
        while True:
            try:
                got = recv_frame(self._control)
            except (OSError, ValueError):
                got = None
            if got is None:
                break
            message, fds = got
            for fd in fds:
                os.close(fd)
            op = message.get("op")
            if op == "io":
                count_io("transfer_sent", message["bytes"], message["seconds"])
            elif op == "chunk":
                threading.Thread(target=self._hook, args=(message,), name="ftlm-serve-hook",
                                 daemon=True).start()
            elif op == "synced":
                with self._synced:
                    self._acked = max(self._acked, message["seq"])
                    self._synced.notify_all()
        with self._synced:
            self._exited.set()
            self._synced.notify_all()
        if self._stopping:
            return
        try:  # its status says whether it was asked to end (reaped here, or by stop())
            code = self._process.wait(REAP_SECONDS) if self._process is not None else None
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and -code in REQUESTED_EXITS:
            # A graceful stop (Slurm's or torchrun's SIGTERM, Ctrl-C) reaches every process of
            # the rank, this one too: expected, while the rank finishes its step and leaves.
            log.info("%s: %s, as asked", self._gone(), signal.Signals(-code).name)
        else:
            log.error("%s", self._gone())

    def _hook(self, message: dict[str, Any]) -> None:
        assert self.on_chunk is not None
        try:
            self.on_chunk(message["step"], message["index"])
        finally:
            try:
                self._send({"op": "chunk_done", "id": message["id"]})
            except RuntimeError:  # stopped meanwhile: the child cut that chunk
                pass


def make_snapshot_server(config: FTConfig, *, host: str, token: str,
                         on_chunk: Callable[[int, int], None] | None = None,
                         ) -> SnapshotServer | ProcessSnapshotServer:
    """The snapshot server ``config.snapshot_server`` names (keeping 2 snapshots): ``process``,
    a child process at CPU priority ``serve_nice``, or ``thread``, threads of this process at
    ``transfer_nice``."""
    common = dict(host=host, token=token, chunk_bytes=config.transfer_chunk_bytes, keep=2,
                  on_chunk=on_chunk)
    if config.snapshot_server == "process":
        return ProcessSnapshotServer(**common, tls_cert=config.tls_cert, tls_key=config.tls_key,
                                     nice=config.serve_nice)
    if config.snapshot_server == "thread":
        from ftlm.ft.transport import SnapshotServer
        tls = server_context(config.tls_cert, config.tls_key) if config.tls_cert else None
        return SnapshotServer(**common, ssl_context=tls, thread_nice=config.transfer_nice)
    raise ConfigError(f"ft.snapshot_server={config.snapshot_server!r}; valid: "
                      f"{', '.join(SNAPSHOT_SERVERS)}")
