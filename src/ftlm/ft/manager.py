"""The per-step fault-tolerance protocol of one replica group (DESIGN.md sections 3 and 4).

Each step the ``Manager`` asks the coordinator for a quorum, (re)builds the cross-replica process
group when the quorum id changed, averages gradients across the participating groups, and votes
on whether the update may be applied. The decisions are ``ftlm.ft.group.GroupProtocol``'s (the
same code the protocol simulator runs); the manager carries them out with sockets and threads. It serves CPU snapshots of its state to recovering groups
it is the source for, and, when its own group is recovering, pulls a peer's snapshot in the
background. Errors on the data path are recorded and turned into a failed commit, never raised;
only a run of ``max_consecutive_failures`` failed steps ends the process.

It knows the training state only as tensors plus a JSON dict (``SnapshotFn``); the trainer
decides what to do with a recovered state (load it and replay its buffered updates).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ftlm.ft.client import CoordinatorClient, CoordinatorError, CoordinatorUnavailable, Heartbeater, QuorumTimeout
from ftlm.ft.config import FTConfig
from ftlm.ft.faults import FaultPlan
from ftlm.ft.group import GroupProtocol, Role, TooManyFailures
from ftlm.ft.process_group import CollectiveError, ReconfigurablePG
from ftlm.ft.protocol import Recovered, SnapshotFn, StepPlan
from ftlm.ft.quorum import Quorum
from ftlm.observe.logs import CONTEXT as LOG_CONTEXT
from ftlm.observe.metrics import NullMetrics
from ftlm.ft.framing import ExpectedLayout, expected_layout
from ftlm.ft.tls import client_context, server_context
from ftlm.ft.transport import SnapshotServer, TransferError, fetch_snapshot, snapshot_state

log = logging.getLogger("ftlm.ft.manager")


class _NoEvents:
    def emit(self, kind: str, step: int, **fields: Any) -> dict:
        return {}


@dataclass
class _Fetch:
    """A background pull of a peer's snapshot."""

    source: str
    url: str
    step: int
    started: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[dict, dict] | None = None
    error: str = ""
    nbytes: int = 0


class Manager:
    """Fault tolerance for one rank of a replica group.

    Rank 0 (the group leader) talks to the coordinator and shares each quorum with its ranks over
    the group's own process group; rank r of every group forms the cross-replica group of shard
    r, serves its shard to recovering groups and pulls shard r when its group recovers. The
    commit vote spans the group's ranks: an update is applied everywhere in the group or nowhere.
    """

    def __init__(self, config: FTConfig, group: str, incarnation: str, coordinator: str,
                 token: str = "", events: Any = None, device: torch.device | None = None,
                 fault: FaultPlan | None = None, total_steps: int | None = None,
                 expected_groups: int = 0):
        self.config = config
        self.token = token
        self.fault = fault
        self.expected_groups = expected_groups
        self.metrics: Any = NullMetrics()  # the trainer hands over its metrics
        grouped = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if grouped else 0
        # The leader records the group's events; any rank records a failure injected into it.
        self._fault_events = events or _NoEvents()
        self.events = self._fault_events if self.rank == 0 else _NoEvents()
        self.ranks = dist.get_world_size() if grouped else 1
        self.group = group
        self.replica_id = f"{group}:{incarnation}"
        self.proto = GroupProtocol(self.replica_id, config.max_consecutive_failures, total_steps)
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        self.pg = ReconfigurablePG(backend, config.allreduce_timeout)
        # Other groups reach this one at ``host``: loopback locally, the pod/node IP on a cluster.
        self.host = os.environ.get("FTLM_HOST") or config.host
        # TLS for the live state transfer when [ft] tls_cert/tls_key (and tls_ca to verify) are set.
        self._server_tls = server_context(config.tls_cert, config.tls_key) if config.tls_cert else None
        self._client_tls = client_context(config.tls_ca) if config.tls_ca else None
        self.server = SnapshotServer(host=self.host, token=token,
                                     chunk_bytes=config.transfer_chunk_bytes, keep=4,
                                     on_chunk=self._on_serve_chunk, ssl_context=self._server_tls)
        self.server.start()
        self.transfer_urls = _gather_strings(self.server.url, self.ranks)
        self.abort = threading.Event()
        self.quorum: Quorum | None = None
        self._progress_at = time.monotonic()
        self._fetch: _Fetch | None = None
        self._expected: ExpectedLayout | None = None  # what a pulled snapshot must look like
        self._left = False
        self.client: CoordinatorClient | None = None
        self.heartbeater: Heartbeater | None = None
        self.store: dist.TCPStore | None = None
        if self.rank == 0:
            self.client = CoordinatorClient(coordinator, group, incarnation, token,
                                            timeout=max(1.0, config.heartbeat_timeout),
                                            tls_ca=config.tls_ca)
            self.store = _store_on(self.host)
            self.heartbeater = Heartbeater(self.client, config.heartbeat_interval, self._report,
                                           self._on_answer, on_kill=self._on_kill)

    def join(self, step: int, chain: str) -> None:
        """Become known to the coordinator with the committed state ``(step, chain)`` (leader)."""
        self.proto.sync(step, chain)
        if self.heartbeater is not None:
            try:
                self.heartbeater.beat()  # be known as alive before the first quorum request
            except CoordinatorUnavailable as e:
                # The coordinator may be restarting: the heartbeat thread and the quorum request
                # keep trying (bounded by ft.quorum_timeout), as after any coordinator failure.
                log.warning("coordinator not reachable at start-up, will keep trying: %s", e)
            self.heartbeater.start()

    # -- failure detection ---------------------------------------------------------------------------
    def _report(self) -> tuple[int, int, str, float, int]:
        """What each heartbeat says: committed state, last quorum id, seconds since progress,
        and the highest step this group saw the job reach."""
        p = self.proto
        return p.step, max(p.quorum_id, 0), p.chain, time.monotonic() - self._progress_at, p.known_head

    def _progress(self) -> None:
        self._progress_at = time.monotonic()

    def _on_answer(self, answer: dict[str, Any]) -> None:
        """Abort the collective in flight when a member of our quorum is reported dead."""
        q = self.quorum
        if q is None or answer.get("rebuilding"):
            return
        dead = answer.get("dead")
        gone = [r for r in q.replica_ids() if isinstance(dead, list) and r in dead]
        if gone and not self.abort.is_set():
            log.warning("quorum %d member(s) %s reported dead: aborting", q.quorum_id, gone)
            self.abort.set()

    def _on_kill(self) -> None:
        """The coordinator relayed a kill request (the dashboard's chaos button): die like a crash."""
        self._fault_events.emit("failure_injected", step=self.proto.step, point="dashboard",
                                signal="SIGKILL")
        os.kill(os.getpid(), signal.SIGKILL)

    def _fire(self, point: str) -> None:
        if self.fault is not None:
            self.fault.maybe_fire(point, self.proto.step, self._fault_events.emit)

    def _on_serve_chunk(self, step: int, index: int) -> None:
        self._fire("during_serve")
        self._fire("slow_serve")

    def fire(self, point: str) -> None:
        """Reach a named fault point that lives outside the manager (e.g. during replay)."""
        self._fire(point)

    def _fail(self, reason: str) -> None:
        if not self.proto.failed:
            log.warning("step %d failed in quorum %d: %s", self.proto.step, self.proto.quorum_id, reason)
        self.proto.fail(reason)
        self.pg.abort_current()

    # -- the step protocol ---------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return {"store": f"{self.host}:{self.store.port}", "transfer": self.transfer_urls,
                "recover_request": self.proto.recover_request}

    def _request_quorum(self) -> Quorum:
        deadline = time.monotonic() + self.config.quorum_timeout
        reason = "no answer yet"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TooManyFailures(
                    f"no quorum within ft.quorum_timeout={self.config.quorum_timeout} s "
                    f"(last reason: {reason}); is the coordinator running and are enough "
                    "groups up (ft.min_replicas)?")
            self._progress()  # asking is progress: a group waiting for others is not hung
            ask = self.proto.request()
            try:
                return self.client.quorum(ask["step"], ask["last_quorum_id"], ask["failed"], self._meta(),
                                          timeout=min(remaining, 5.0), chain=ask["chain"])
            except QuorumTimeout as e:
                reason = e.reason
            except CoordinatorUnavailable as e:
                reason = f"coordinator unavailable ({e})"
                self.abort.wait(min(0.2, max(0.0, remaining)))

    def _next_quorum(self) -> Quorum:
        """The leader asks; every rank of the group gets the same answer."""
        if self.rank == 0:
            q = self._request_quorum()
            _broadcast_json(q.to_json(), self.ranks)
            return q
        return Quorum.from_json(_broadcast_json(None, self.ranks))

    def start_step(self, step: int, chain: str, snapshot: SnapshotFn) -> StepPlan:
        self.proto.sync(step, chain)
        asked = time.monotonic()
        q = self._next_quorum()
        self._progress()
        role = self.proto.on_quorum(q)
        self.quorum = q
        LOG_CONTEXT.update(quorum_id=q.quorum_id, step=step)
        self.metrics.on_quorum(q.quorum_id, len(q.participants), len(q.recovering),
                               time.monotonic() - asked)
        self.abort.clear()
        if role.reconfigure:
            members = q.replica_ids()
            store = q.members[0].meta.get("store", "")
            try:
                self.pg.configure(store, f"q{q.quorum_id}.{q.epoch}/r{self.rank}", members.index(self.replica_id),
                                  len(members), self.abort)
                self.proto.process_group_ready()
            except CollectiveError as e:
                self._fail(str(e))
        if role.publish:
            tensors, meta = snapshot()
            self.server.publish(snapshot_state(tensors, meta, q.step))
        if role.fetch_from is not None:
            if self._expected is None:
                # A peer's snapshot must have exactly this rank's own tensor layout: nothing it
                # claims beyond that is ever allocated.
                self._expected = expected_layout(snapshot()[0])
            self._start_fetch(q, role.fetch_from)
        return self._plan(role)

    def _plan(self, role: Role) -> StepPlan:
        q = role.quorum
        return StepPlan(quorum_id=q.quorum_id, step=q.step, participant_index=role.participant_index,
                        participants=role.participants, recovering=role.recovering,
                        members=q.replica_ids(), drain=role.drain, quorum=q)

    def allreduce(self, tensors: list[torch.Tensor]) -> None:
        self._fire("before_allreduce")
        if self.proto.failed:
            return
        participants = len(self.quorum.participants) if self.quorum else 1
        started = time.monotonic()
        try:
            for i, bucket in enumerate(self._buckets(tensors)):
                if i == 1:
                    self._fire("inside_allreduce")
                self.pg.allreduce_mean(bucket, participants, self.abort)
        except CollectiveError as e:
            self._fail(str(e))
        self._progress()
        self.metrics.on_allreduce(time.monotonic() - started)
        self._fire("after_allreduce")

    def _buckets(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Consecutive runs of same-dtype, same-device tensors of at most ``bucket_bytes`` each."""
        buckets: list[list[torch.Tensor]] = []
        size = 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            last = buckets[-1][-1] if buckets else None
            if (last is None or last.dtype != t.dtype or last.device != t.device
                    or size + nbytes > self.config.bucket_bytes):
                buckets.append([])
                size = 0
            buckets[-1].append(t)
            size += nbytes
        return buckets

    def fail_step(self, reason: str) -> None:
        """This group cannot take part in this step's update (e.g. a non-finite gradient)."""
        self._fail(reason)

    def commit(self) -> bool:
        self._fire("before_commit")
        ok = _group_all(not self.proto.failed, self.ranks)
        self._progress()
        return self.proto.on_outcome(ok)

    # -- live recovery -------------------------------------------------------------------------------
    def _start_fetch(self, q: Quorum, source: str) -> None:
        member = q.member(source)
        urls = member.meta.get("transfer") if member is not None else None
        if not isinstance(urls, list) or len(urls) != self.ranks or not isinstance(urls[self.rank], str):
            # The source has another number of ranks: nobody to pull this shard from.
            self.proto.fetch_finished()
            return
        fetch = _Fetch(source=member.group, url=urls[self.rank], step=q.step)
        self._fetch = fetch
        self.events.emit("recovery_start", step=self.proto.step, source=member.group,
                         snapshot_step=q.step, quorum_id=q.quorum_id)

        def progress(done: int, total: int) -> None:
            fetch.nbytes = done
            self._fire("during_receive")

        def run() -> None:
            try:
                fetch.result = fetch_snapshot(
                    fetch.url, fetch.step, token=self.token,
                    parallel=self.config.transfer_parallel,
                    timeout=self.config.allreduce_timeout,
                    wait_available=self.config.quorum_timeout, progress=progress,
                    expected=self._expected, ssl_context=self._client_tls)
            except TransferError as e:
                fetch.error = str(e)
            except Exception as e:  # noqa: BLE001 - a failed pull is retried, never fatal
                fetch.error = f"{type(e).__name__}: {e}"
            finally:
                fetch.done.set()

        threading.Thread(target=run, name="ftlm-fetch", daemon=True).start()

    def poll_recovery(self) -> Recovered | None:
        fetch = self._fetch
        # Every rank of the group loads its shard in the same step, or none does.
        if not _group_all(fetch is not None and fetch.done.is_set(), self.ranks):
            return None
        self._fetch = None
        self.proto.fetch_finished()
        if not _group_all(not fetch.error and fetch.result is not None, self.ranks):
            self.events.emit("recovery_end", step=self.proto.step, ok=False, source=fetch.source,
                             error=fetch.error)
            return None
        tensors, meta = fetch.result
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return Recovered(step=fetch.step, tensors=tensors, meta=meta, source=fetch.source,
                         seconds=time.monotonic() - fetch.started, nbytes=nbytes)

    def restart_recovery(self, reason: str) -> None:
        log.warning("restarting recovery: %s", reason)
        self.events.emit("recovery_end", step=self.proto.step, ok=False, error=reason)
        if self._fetch is not None:  # (a pull that arrived was already counted by poll_recovery)
            self._fetch = None  # an in-flight pull finishes on its own and is ignored
            self.proto.fetch_finished()

    def caught_up(self, step: int, chain: str) -> None:
        """The trainer replayed its way to the head: report that state from now on."""
        self.proto.caught_up(step, chain)
        self._progress()

    # -- the end of the job --------------------------------------------------------------------------
    def finish(self, step: int, chain: str, snapshot: SnapshotFn) -> None:
        """Keep serving until every group of the job holds the final state, then leave the job.

        A group that reached the last step is the only source left for a group still recovering
        (or restarted near the end): it answers quorums at the final step, publishing its state
        for them, until a quorum shows all ``expected_groups`` groups up to date, or no such
        quorum came within ``quorum_timeout``.
        """
        deadline = time.monotonic() + self.config.quorum_timeout
        while time.monotonic() < deadline:
            try:
                plan = self.start_step(step, chain, snapshot)
            except TooManyFailures as e:
                log.warning("stopped waiting for the other groups to finish: %s", e)
                break
            q = plan.quorum
            if not q.recovering and len({m.group for m in q.members}) >= max(1, self.expected_groups):
                break
            if q.recovering:  # someone is pulling from us: stay for as long as that takes
                deadline = time.monotonic() + self.config.quorum_timeout
            self.abort.wait(0.25)
        self.leave("finished")

    def leave(self, reason: str) -> None:
        """Tell the coordinator this group leaves on purpose (leader; once)."""
        if self._left or self.client is None:
            return
        self._left = True
        if self.heartbeater is not None:
            self.heartbeater.stop()
        try:
            self.client.leave(reason)
        except (CoordinatorError, OSError) as e:
            log.warning("could not tell the coordinator that %s leaves: %s", self.replica_id, e)

    def close(self) -> None:
        if self.heartbeater is not None:
            self.heartbeater.stop()
        self.pg.abort_current()
        self.server.stop()
        if self.client is not None:
            self.client.close()


def _store_on(host: str) -> dist.TCPStore:
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


# -- collectives inside the replica group (its own default process group) ------------------------
def _broadcast_json(value: Any, ranks: int) -> Any:
    """Rank 0's JSON value on every rank of the group (bytes in tensors: no pickle)."""
    if ranks == 1:
        return value
    data = json.dumps(value).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=0)
    buf = torch.zeros(int(size), dtype=torch.uint8)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    return json.loads(bytes(buf.tolist()).decode())


def _gather_strings(value: str, ranks: int) -> list[str]:
    """Every rank's ``value``, in rank order."""
    if ranks == 1:
        return [value]
    width = 512
    raw = value.encode()[:width]
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    out = [torch.zeros(width, dtype=torch.uint8) for _ in range(ranks)]
    dist.all_gather(out, mine)
    return [bytes(t.tolist()).rstrip(b"\0").decode() for t in out]


def _group_all(flag: bool, ranks: int) -> bool:
    """True on every rank iff ``flag`` is true on every rank of the group."""
    if ranks == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())
