"""A cross-replica process group that is rebuilt for every new quorum and can be abandoned.

torch.distributed process groups are fixed-membership and a collective with a dead peer blocks
until its timeout. ``ReconfigurablePG`` builds a fresh gloo (CPU) or NCCL (CUDA) group for each
quorum id under its own store prefix, runs every blocking operation on a daemon thread, and waits
for it with a deadline *and* an abort event: when the coordinator reports a member dead the
waiter returns at once and the old group is aborted and dropped, never reused. Errors surface as
``CollectiveError`` for the manager to turn into a failed step; nothing here decides policy.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable

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


class ReconfigurablePG:
    """The cross-replica group of one shard rank; ``configure`` once per quorum id."""

    def __init__(self, backend: str, timeout: float):
        self.backend = backend
        self.timeout = timeout
        self.pg: Any = None
        self.rank = 0
        self.world = 1
        self.key = ""

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
            prefixed = dist.PrefixStore(f"ftlm/{key}", store)
            if self.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = td
                return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
            return dist.ProcessGroupGloo(prefixed, rank, world, td)

        self.pg = _run_bounded(build, self.timeout, abort, f"joining group {key}")

    def allreduce_mean(self, tensors: list[torch.Tensor], divisor: int,
                       abort: threading.Event) -> None:
        """SUM ``tensors`` (same dtype) across the group in one flat bucket, divide by ``divisor``."""
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if self.world > 1:
            if self.pg is None:
                raise CollectiveError("no process group for this quorum")
            work_pg = self.pg
            _run_bounded(lambda: work_pg.allreduce([flat]).wait(), self.timeout, abort,
                         f"all-reduce in group {self.key}")
        if divisor != 1:
            flat.div_(divisor)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n

    def abort_current(self) -> None:
        """Drop the current group; a collective still running on it fails at its own timeout."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - a broken group may refuse; it is dropped anyway
                pass
