"""A snapshot buffer allocated ahead of need, so that a rejoin's copy does not pay for the memory.

Writing a snapshot into memory the process never touched costs far more than the copy itself:
the kernel allocates and zeroes every page on its first write (1 GiB into a new memfd: 0.6-0.9 s
of CPU on a 2-core Xeon, against 0.15-0.22 s into pages that are there already). A source copies
its snapshot while its step's forward and backward run, and its update waits for the copy, so
that cost lands on the step every healthy group waits for. ``SnapshotReserve``
prepares one buffer of the state's size on a thread of its own while no peer needs a snapshot;
``snapshot_state(..., reserve=)`` takes it when one does, and the manager prepares the next one
once that snapshot is released.

The thread runs at the training thread's priority and holds the interpreter lock only between
system calls (``posix_fallocate``, ``madvise`` through ctypes and torch's fill release it). Not at
nice 19: on busy cores a starved thread that asks for the interpreter lock makes the thread that
holds it wait until the starved one has run (CPython's forced switching), and ``mmap``'s own
``MAP_POPULATE`` holds the lock throughout: a ticking thread of the process was 40-112 s late
with the reserve made at nice 19 against two CPU hogs (at most 20 ms without it).

A buffer is handed out once and never reused: the next one is new memory, so a transfer still
reading an old snapshot never sees its bytes change (the chunk digests stay true).

Opt-in (``ft.snapshot_reserve = true``; off by default). Memory: one more host copy of the rank's
replicated state (parameters and optimizer state) while no peer recovers; the reserve becomes
the snapshot when one does, and the next is prepared only once no snapshot is published. The
preparation costs 0.5-0.6 s of CPU per GiB: free on a host with idle cores (a GPU node), but on
a box whose cores all train it only moves that CPU to a later step, and the 82M rejoin stall on
2 cores measured no better with the reserve (BENCHMARKS, transfer section). No reserve is made
where the memory available to this process (the host's, or its cgroup's limit in a container)
is under twice its size: a reserve must never be what gets a pod OOM-killed; the process says so
once and allocates on demand.

Not responsible for: what goes into the buffer (``ftlm.ft.transport.snapshot_state``), or when a
snapshot is released (the manager and the snapshot server decide).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from ftlm.ft.shared_buffer import SharedBuffer

__all__ = ["SnapshotBuffer", "SnapshotReserve", "allocate_snapshot_buffer", "available_memory"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class SnapshotBuffer:
    """A flat uint8 host buffer for one snapshot, and the shared memory it lives in (if any)."""

    buffer: torch.Tensor
    memory: SharedBuffer | None
    shared: bool
    pinned: bool

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def fits(self, nbytes: int, *, shared: bool, pinned: bool) -> bool:
        return (self.nbytes, self.shared, self.pinned) == (nbytes, shared, pinned)


def allocate_snapshot_buffer(nbytes: int, *, shared: bool, pinned: bool,
                             prefault: bool = False) -> SnapshotBuffer:
    """``nbytes`` of host memory: anonymous shared memory (``shared``), pinned memory for CUDA
    copies (``pinned``), or plain memory. ``prefault``: every page is allocated now, so that
    writing the snapshot later costs the copy alone."""
    memory = SharedBuffer(nbytes, prefault=prefault) if shared else None
    if memory is not None and nbytes:
        buffer = torch.frombuffer(memory.memory, dtype=torch.uint8)  # keeps the mapping alive
    else:
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        if prefault and nbytes:
            buffer.zero_()  # the first write allocates the pages: here, not under the copy
    return SnapshotBuffer(buffer, memory, shared, pinned)


def available_memory() -> int | None:
    """Bytes this process may still allocate: the host's ``MemAvailable``, or less where a cgroup
    (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) limits it; None where neither is known."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f:
                text = f.read().strip()
            if text == "max":
                continue
            with open(usage) as f:
                found.append(max(0, int(text) - int(f.read().strip())))
        except (OSError, ValueError):
            continue
    return min(found) if found else None


class SnapshotReserve:
    """At most one prepared snapshot buffer, made on a background thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: SnapshotBuffer | None = None
        self._making = False
        self._closed = False
        self._failed = False
        self._thread: threading.Thread | None = None

    @property
    def idle(self) -> bool:
        """Nothing prepared and nothing being prepared: ``prepare`` would start a buffer."""
        with self._lock:
            return self._ready is None and not self._making and not self._closed and not self._failed

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._ready is not None

    def prepare(self, nbytes: int, *, shared: bool, pinned: bool) -> bool:
        """Start preparing a buffer of this kind unless one is ready or being made; returns
        whether a preparation started."""
        with self._lock:
            if self._closed or self._making or self._failed:
                return False
            if self._ready is not None and self._ready.fits(nbytes, shared=shared, pinned=pinned):
                return False
            available = available_memory()
            if available is not None and 2 * nbytes > available:
                self._failed = True
                log.warning("no snapshot reserve: it needs %d bytes and only %d are available to "
                            "this process (host or cgroup); snapshots will allocate their memory "
                            "when a peer asks (ft.snapshot_reserve = false says this up front)",
                            nbytes, available)
                return False
            self._ready, self._making = None, True
            self._thread = threading.Thread(target=self._make, args=(nbytes, shared, pinned),
                                            name="ftlm-snapshot-reserve", daemon=True)
            self._thread.start()
            return True

    def _make(self, nbytes: int, shared: bool, pinned: bool) -> None:
        made: SnapshotBuffer | None = None
        try:
            made = allocate_snapshot_buffer(nbytes, shared=shared, pinned=pinned, prefault=True)
        except (OSError, RuntimeError, ValueError) as e:
            # Snapshots are then allocated when needed, as with ft.snapshot_reserve = false.
            log.warning("could not reserve %d bytes for the next snapshot (%s); snapshots will "
                        "allocate their memory when a peer asks", nbytes, e)
        with self._lock:
            self._making = False
            if made is None:
                self._failed = True
            elif not self._closed:
                self._ready = made

    def take(self, nbytes: int, *, shared: bool, pinned: bool) -> SnapshotBuffer | None:
        """The prepared buffer if it is of this kind (it is then no longer held here), else None
        (a buffer of another kind is dropped). Never waits for one being prepared."""
        with self._lock:
            got, self._ready = self._ready, None
        if got is not None and got.fits(nbytes, shared=shared, pinned=pinned):
            return got
        return None

    def wait(self, timeout: float) -> bool:
        """Wait until no buffer is being prepared; whether one is ready (tests, benchmarks)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return self.ready

    def close(self) -> None:
        """Drop the prepared buffer and any being made."""
        with self._lock:
            self._closed = True
            self._ready = None
