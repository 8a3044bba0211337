"""A cross-replica process group that is rebuilt for every new quorum and can be abandoned.

torch.distributed process groups are fixed-membership and a collective with a dead peer blocks
until its timeout. ``ReconfigurablePG`` builds a fresh gloo (CPU) or NCCL (CUDA) group for each
quorum id under its own store prefix and gives every operation one contract, whatever the backend:
it is *issued* without blocking and *awaited* by polling ``Work.is_completed()`` against a deadline
and an abort event (``await_work``). Polling matters for NCCL, whose ``Work.wait()`` returns once
the kernel is queued on the stream, so a wait-based deadline never fires there; NCCL groups are
also built with non-blocking communicators, so that ``abort()`` cannot itself hang. When the
deadline passes or the coordinator reports a member dead, the group is aborted and dropped, never
reused. Errors surface as ``CollectiveError`` for the manager to turn into a failed step; nothing
here decides policy.

Not here: the control traffic inside a replica group (quorum broadcast, commit vote), which the
manager keeps on a gloo group of its own ranks, never on NCCL.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A cross-replica operation failed, timed out or was aborted."""


def _run_bounded(fn: Callable[[], Any], timeout: float, abort: threading.Event, what: str) -> Any:
    """Run ``fn`` on a daemon thread; return its result, or raise when it fails, times out or
    ``abort`` is set first. An abandoned thread ends by itself at the transport's own timeout."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the waiting thread
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, name=f"ftlm-{what}", daemon=True).start()
    # Wake on completion at once; check the abort flag every few ms, so the abort path never
    # waits for the collective's own timeout (and no helper thread outlives the operation).
    deadline = time.monotonic() + timeout
    while not done.wait(0.005):
        if abort.is_set() or time.monotonic() >= deadline:
            break
    if done.is_set():
        if "error" in box:
            raise CollectiveError(f"{what} failed: {box['error']}") from box["error"]
        return box.get("value")
    if abort.is_set():
        raise CollectiveError(f"{what} aborted: a member of the quorum was reported dead")
    raise CollectiveError(f"{what} timed out after {timeout:.1f} s")


class Work(Protocol):
    """What ``await_work`` needs from an issued collective (``torch.distributed.Work``)."""

    def is_completed(self) -> bool: ...

    def wait(self) -> Any: ...


def await_work(work: Work, timeout: float, abort: threading.Event, what: str) -> None:
    """Wait until ``work`` completed, polling; raise ``CollectiveError`` on error, on ``timeout``
    seconds passing, or on ``abort`` being set first. The caller aborts the group on a raise.

    The poll starts tight and backs off to 5 ms, so a fast collective costs well under a
    millisecond of latency and a long one no busy core.
    """
    deadline = time.monotonic() + timeout
    pause = 0.0001
    while not work.is_completed():
        if abort.is_set():
            raise CollectiveError(f"{what} aborted: a member of the quorum was reported dead")
        if time.monotonic() >= deadline:
            raise CollectiveError(f"{what} timed out after {timeout:.1f} s")
        abort.wait(pause)
        pause = min(pause * 2, 0.005)
    if (why := completed_error(work, what)) is not None:
        raise CollectiveError(why)


def completed_error(work: Work, what: str) -> str | None:
    """Why completed ``work`` failed (its backend's error, named by ``what``), or None."""
    try:
        work.wait()  # completed: returns at once, raising the collective's own error if any
    except Exception as e:  # noqa: BLE001 - any backend error is a failed collective
        return f"{what} failed: {e}"
    return None


def _build_group(backend: str, store: Any, rank: int, world: int, timeout: timedelta) -> Any:
    """A gloo or NCCL process group on ``store``; NCCL with non-blocking communicators."""
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        # Our own deadline (await_work) aborts first; NCCL's watchdog timeout only backs it up.
        opts._timeout = timeout * 2
        config = getattr(opts, "config", None)
        if config is not None and hasattr(config, "blocking"):
            config.blocking = 0  # init and abort return at once instead of waiting on peers
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


class PendingAllreduce:
    """An issued all-reduce of one bucket; ``wait`` completes it (see ``allreduce_start``)."""

    def __init__(self, work: Work | None, flat: torch.Tensor | None, tensors: list[torch.Tensor],
                 divisor: int, timeout: float, what: str) -> None:
        self.work, self.flat, self.tensors = work, flat, tensors
        self.divisor, self.timeout, self.what = divisor, timeout, what

    def failed(self) -> str | None:
        """Why this operation failed, if it already ended failing (a peer's process ended and
        its sockets closed); None while it runs or once it succeeded. Never blocks."""
        if self.work is None or not self.work.is_completed():
            return None
        return completed_error(self.work, self.what)

    def wait(self, abort: threading.Event) -> None:
        """Wait (bounded, abortable), divide, write back; raises ``CollectiveError``. Integer
        tensors (quantised codes) are summed, not divided: their mean would be truncated."""
        if self.work is None:  # a group of one: the sum is the tensors themselves
            if self.divisor != 1 and self.tensors and self.tensors[0].is_floating_point():
                for t in self.tensors:
                    t.div_(self.divisor)
            return
        await_work(self.work, self.timeout, abort, self.what)
        flat = self.flat
        if self.divisor != 1 and flat.is_floating_point():
            flat.div_(self.divisor)
        offset = 0
        for t in self.tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


class ReconfigurablePG:
    """The cross-replica group of one shard rank; ``configure`` once per quorum id.

    ``factory(backend, store, rank, world, timeout)`` builds the process group (tests inject one
    that hangs); any object with ``allreduce([tensor]) -> Work`` and ``abort()`` will do.
    """

    def __init__(self, backend: str, timeout: float,
                 factory: Callable[[str, Any, int, int, timedelta], Any] = _build_group):
        self.backend = backend
        self.timeout = timeout
        self.factory = factory
        self.pg: Any = None
        self.rank = 0
        self.world = 1
        self.key = ""
        self._flats: dict[int, torch.Tensor] = {}  # bucket buffers by slot, reused across steps
        self._works: list[Work] = []  # operations issued on the current group, maybe in flight
        self._graveyard: list[tuple[Any, list[Work]]] = []  # aborted groups with work in flight

    def configure(self, store_addr: str, key: str, rank: int, world: int,
                  abort: threading.Event) -> None:
        """Join the group named ``key`` (e.g. ``q7``) of ``world`` members as ``rank``."""
        self.abort_current()
        self.rank, self.world, self.key = rank, world, key
        if world == 1:
            return
        host, _, port = store_addr.rpartition(":")
        td = timedelta(seconds=self.timeout)

        def build() -> Any:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=td)
            return self.factory(self.backend, dist.PrefixStore(f"ftlm/{key}", store), rank, world, td)

        # Joining waits on the store for the other members: bounded on a helper thread, once per
        # new quorum (not per step).
        self.pg = _run_bounded(build, self.timeout, abort, f"joining group {key}")

    def _bucket(self, tensors: list[torch.Tensor], slot: int) -> torch.Tensor:
        """``tensors`` flattened into the buffer of ``slot`` (allocated again only when it must
        grow or change dtype/device): one buffer per bucket position, reused every step."""
        n = sum(t.numel() for t in tensors)
        t0 = tensors[0]
        flat = self._flats.get(slot)
        if flat is None or flat.numel() < n or flat.dtype != t0.dtype or flat.device != t0.device:
            flat = self._flats[slot] = torch.empty(n, dtype=t0.dtype, device=t0.device)
        flat = flat[:n]
        torch.cat([t.reshape(-1) for t in tensors], out=flat)
        return flat

    def allreduce_start(self, tensors: list[torch.Tensor], divisor: int, slot: int = 0
                        ) -> "PendingAllreduce":
        """Issue the SUM of ``tensors`` (same dtype) across the group in one flat bucket without
        waiting; ``wait`` on the result divides by ``divisor`` (floating dtypes) and writes back into ``tensors``,
        which must not change meanwhile. Buckets in flight at once need distinct ``slot``s; the
        backend runs them in the order they were issued.
        """
        if not tensors or self.world == 1:
            return PendingAllreduce(None, None, tensors, divisor, 0.0, "")
        if self.pg is None:
            raise CollectiveError("no process group for this quorum")
        what = f"all-reduce in group {self.key}"
        flat = self._bucket(tensors, slot)
        try:
            work = self.pg.allreduce([flat])
        except Exception as e:  # noqa: BLE001 - a broken group refuses at issue time
            self._flats.clear()
            raise CollectiveError(f"{what} failed: {e}") from e
        self._works = [w for w in self._works if not w.is_completed()] + [work]
        return PendingAllreduce(work, flat, tensors, divisor, self.timeout, what)

    def allreduce_mean(self, tensors: list[torch.Tensor], divisor: int,
                       abort: threading.Event) -> None:
        """SUM ``tensors`` (same dtype) across the group in one flat bucket, divide by ``divisor``."""
        pending = self.allreduce_start(tensors, divisor)
        try:
            pending.wait(abort)
        except CollectiveError:
            self.drop_buffers()
            raise

    def drop_buffers(self) -> None:
        """Forget every bucket buffer: an abandoned operation may still write into its buffer
        later, so after a failure none is ever reused."""
        self._flats.clear()

    def abort_current(self) -> None:
        """Abort and drop the current group, and the bucket buffers an aborted operation might
        still write, without blocking the caller.

        The abort matters for correctness: a member that hung and resumes later must see its
        operation on the old group fail, not complete against what its peers left queued. The
        dropped group is kept referenced until its operations ended (they fail at the group's
        own timeout): destroying a gloo group joins its worker threads, which would block this
        thread, with the GIL held, until then.
        """
        pg, self.pg = self.pg, None
        works, self._works = self._works, []
        self.drop_buffers()
        self._graveyard = [(g, w) for g, w in self._graveyard
                           if not all(x.is_completed() for x in w)]
        if pg is None:
            return
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - a broken group may refuse; it is dropped anyway
            pass
        if any(not w.is_completed() for w in works):
            self._graveyard.append((pg, works))


def store_on(host: str) -> dist.TCPStore:
    """The rendezvous store of this group's cross-group process groups, listening on ``host`` only.

    Given a port, torch's TCPStore listens on every interface; handing it a socket already bound
    to ``host`` keeps it off the others. The store has no authentication: keep ``ft.host`` on a
    private network (see README, Security).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, 0), family=family, backlog=512)
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         master_listen_fd=listener.detach())
