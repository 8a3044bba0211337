"""The per-step fault-tolerance protocol of one replica group (docs/design.md, 'One training step'
and 'Joining and catching up').

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

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ftlm.ft.client import (FINISHED_LEAVE_RETRY_SECONDS, CoordinatorClient, CoordinatorError,
                            CoordinatorUnavailable, CoordinatorUnreachable, Convicted, Heartbeater,
                            QuorumTimeout, StaleIncarnation, reload_word, suspect_word)
from ftlm.ft.coordinator_address import ADDRESS_FILE_ENV
from ftlm.ft.config import FTConfig
from ftlm.ft.faults import FaultSchedule
from ftlm.ft.group import GroupProtocol, Role, TooManyFailures
from ftlm.ft.integrity import StateDigester, combine, flip_bit
from ftlm.ft.process_group import CollectiveError, ReconfigurablePG, store_on
from ftlm.ft.group_control import broadcast_json, control_group, gather_strings, group_all
from ftlm.ft.protocol import Recovered, ReloadCheckpoint, SnapshotFn, StepPlan, StopRequested
from ftlm.ft.quorum_answer import MemberQuorum
from ftlm.ft.quorum_wait import QuorumWait
from ftlm.observe.logs import CONTEXT as LOG_CONTEXT
from ftlm.observe.metrics import NullMetrics
from ftlm.ft.framing import ExpectedLayout, expected_layout, layout
from ftlm.ft.serve_process import make_snapshot_server
from ftlm.ft.snapshot_reserve import SnapshotReserve
from ftlm.ft.tls import client_context
from ftlm.ft.transport import TransferError, fetch_snapshot, on_this_host, snapshot_pinned, snapshot_state

log = logging.getLogger("ftlm.ft.manager")

STOP_POLL_SECONDS = 2.0
"""Longest quorum long-poll: a stop request (SIGTERM) is noticed within this while waiting."""
OUTAGE_RETRY_SECONDS = 0.5
"""Pause between quorum requests while the coordinator does not answer: a restarted one is
found within this (plus its start-up), and a refused connection does not become a busy loop."""


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


FINISH_POLL_SECONDS = (0.25, 2.0)
"""A finished group waiting for the others asks for a quorum again after the first of these, the
pause doubling up to the second while the members stay the same (``Manager.finish``): a group
coming back then waits at most that long for its quorum with it."""


class Manager:
    """Fault tolerance for one rank of a replica group.

    Rank 0 (the group leader) talks to the coordinator and shares each quorum with its ranks over
    the group's own process group; rank r of every group forms the cross-replica group of shard
    r, serves its shard to recovering groups and pulls shard r when its group recovers. The
    commit vote spans the group's ranks: an update is applied everywhere in the group or nowhere.
    """

    def __init__(self, config: FTConfig, group: str, incarnation: str, coordinator: str,
                 token: str = "", events: Any = None, device: torch.device | None = None,
                 fault: FaultSchedule | None = None, total_steps: int | None = None,
                 expected_groups: int = 0, metrics: Any = None):
        self.config = config
        self.token = token
        self.fault = fault
        self.expected_groups = expected_groups
        self.metrics: Any = metrics if metrics is not None else NullMetrics()  # the rank's, shared with the trainer
        grouped = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if grouped else 0
        # The leader records the group's events; any rank records a failure injected into it.
        self._fault_events = events or _NoEvents()
        self.events = self._fault_events if self.rank == 0 else _NoEvents()
        self.ranks = dist.get_world_size() if grouped else 1
        # Control traffic inside the group (quorum broadcast, commit vote, recovery agreement) is
        # small CPU tensors: always on gloo, never on the group's NCCL data group.
        self.control = control_group() if grouped else None
        # One incarnation id for the whole group: rank 0's (each rank drawing its own would make
        # every other rank a stranger to the quorum).
        if self.ranks > 1:
            incarnation = broadcast_json(incarnation or uuid.uuid4().hex if self.rank == 0 else None,
                                          self.ranks, self.control)
        self.incarnation = incarnation or uuid.uuid4().hex
        self.group = group
        self.replica_id = f"{group}:{self.incarnation}"
        self.proto = GroupProtocol(self.replica_id, config.max_consecutive_failures, total_steps)
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        self.pg = ReconfigurablePG(backend, config.allreduce_timeout)
        # Other groups reach this one at ``host``: loopback locally, the pod/node IP on a cluster.
        self.host = os.environ.get("FTLM_HOST") or config.host
        # TLS for the live state transfer when [ft] tls_cert/tls_key (and tls_ca to verify) are set.
        self._client_tls = client_context(config.tls_ca) if config.tls_ca else None
        # The serve fault points need a hook per chunk; without one, serving costs this process
        # nothing per chunk (a server process never calls back).
        serve_fault = fault is not None and bool(fault.points & {"during_serve", "slow_serve"})
        self.server = make_snapshot_server(config, host=self.host, token=token,
                                           on_chunk=self._on_serve_chunk if serve_fault else None)
        self.server.start()
        # The next snapshot's memory, allocated ahead on a background thread (opt-in:
        # ``ft.snapshot_reserve``).
        self.reserve = SnapshotReserve() if config.snapshot_reserve else None
        self.transfer_urls = gather_strings(self.server.url, self.ranks, self.control)
        self.abort = threading.Event()
        self.quorum: MemberQuorum | None = None
        self._progress_at = time.monotonic()
        self._asking = False  # the leader is in ``_request_quorum``
        self._fetch: _Fetch | None = None
        self._expected: ExpectedLayout | None = None  # what a pulled snapshot must look like
        self._left = False
        self._snapshotting: tuple[threading.Event, dict] | None = None  # copy in flight
        self._pending: list | None = None  # all-reduce buckets started this step
        self._answered = threading.Condition()  # a heartbeat answer arrived (leader)
        self._answered_at = time.monotonic()
        self._declared_dead = False  # the coordinator declared this incarnation dead this step
        # A heartbeat answer's ``reload`` and ``reload_round`` (no live holder of the head).
        self._reload_hint: tuple[int | None, int] = (None, 0)
        self._allreduce_started = 0.0
        # Set from a signal handler: a plain flag (an Event's lock could deadlock there).
        self._stop_requested = False
        self._closed = False
        # The request for the next step's quorum sent right after a commit (``ask``): the state
        # it asks for and the answer to come.
        self._asked: tuple[int, str, Future] | None = None
        self._asker: ThreadPoolExecutor | None = None
        # The state digest every ft.integrity_every steps (silent data corruption): the one in
        # flight this step, and the group's digest the next quorum request carries (leader).
        self.integrity = StateDigester(config.integrity_every)
        self._digesting = False
        self._integrity_report: tuple[int, str, str] | None = None
        self.client: CoordinatorClient | None = None
        self.heartbeater: Heartbeater | None = None
        self.store: dist.TCPStore | None = None
        if self.rank == 0:
            self.client = CoordinatorClient(coordinator, group, self.incarnation, token,
                                            timeout=max(1.0, config.heartbeat_timeout),
                                            tls_ca=config.tls_ca,
                                            address_file=os.environ.get(ADDRESS_FILE_ENV, ""))
            self.store = store_on(self.host)
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
                # keep trying, as after any coordinator failure (ftlm.ft.quorum_wait).
                log.warning("coordinator not reachable at start-up, will keep trying: %s", e)
            self.heartbeater.start()

    # -- failure detection ---------------------------------------------------------------------------
    def _report(self) -> tuple[int, int, str, float, int]:
        """What each heartbeat says: committed state, last quorum id, seconds since progress,
        and the highest step this group saw the job reach."""
        p = self.proto
        # Asking for a quorum is progress for as long as it lasts: one request may block for
        # its whole timeout while the coordinator is stopped, and the coordinator, resumed, must
        # not read the heartbeats queued meanwhile as a hung group.
        age = 0.0 if self._asking else time.monotonic() - self._progress_at
        return p.step, max(p.quorum_id, 0), p.chain, age, p.known_head

    def _progress(self) -> None:
        self._progress_at = time.monotonic()

    def _on_answer(self, answer: dict[str, Any]) -> None:
        """Abort the collective in flight when a member of our quorum is reported dead."""
        q = self.quorum
        try:
            self._reload_hint = reload_word(answer)
            if q is None or answer.get("rebuilding"):
                return
            dead, aborted = answer.get("dead"), answer.get("dead_quorums")
            if answer.get("declared_dead") is True or (isinstance(dead, list) and self.replica_id in dead):
                self._declared_dead = True  # until the next quorum
            # The answer names the quorums in flight with a dead member (ours names no peers).
            gone = answer.get("epoch") == q.epoch and isinstance(aborted, list) and q.quorum_id in aborted
            if gone and not self.abort.is_set():
                log.warning("a member of quorum %d was reported dead: aborting", q.quorum_id)
                self.abort.set()
        finally:
            with self._answered:
                self._answered_at = time.monotonic()
                self._answered.notify_all()

    def _fresh_word(self) -> bool:
        """Leader, before its vote: after a pause long enough to be declared dead (a stopped or
        swapped process, a long GC), hear from the coordinator first, and never commit a step
        of a quorum that declared this group dead meanwhile: its peers failed that step, and
        an all-reduce may complete here against operations they left behind. Returns False
        when the step must fail."""
        if self.heartbeater is None:
            return True
        timeout = self.config.heartbeat_timeout
        paused_since = time.monotonic()
        with self._answered:
            if paused_since - self._answered_at <= timeout:
                return not self._declared_dead
            log.warning("no word from the coordinator for %.1f s: asking before the vote",
                        paused_since - self._answered_at)
            self._answered.wait_for(lambda: self._answered_at > paused_since, timeout=timeout)
            heard = self._answered_at > paused_since
        return heard and not self._declared_dead

    def _on_kill(self) -> None:
        """The coordinator relayed a kill request (the dashboard's chaos button): die like a crash."""
        self._fault_events.emit("failure_injected", step=self.proto.step, point="dashboard",
                                signal="SIGKILL")
        os.kill(os.getpid(), signal.SIGKILL)

    def _fire(self, point: str) -> None:
        if self.fault is not None:
            self.fault.maybe_fire(point, self.proto.step, self._fault_events.emit,
                                  committed=lambda: self.proto.step)

    def _on_serve_chunk(self, step: int, index: int) -> None:
        self._fire("slow_serve")  # (first: "slow_serve,during_serve" dies after the slow stretch)
        self._fire("during_serve")

    def fire(self, point: str) -> None:
        """Reach a named fault point that lives outside the manager (e.g. during replay)."""
        self._fire(point)

    def nonfinite_fault(self, step: int, start: int, stop: int) -> bool:
        """Whether an injected condition makes this attempt of ``step``, training sample
        positions ``[start, stop)``, non-finite here (``ftlm.ft.faults``)."""
        return self.fault is not None and self.fault.nonfinite(step, start, stop, self._fault_events.emit)

    def _fail(self, reason: str) -> None:
        if not self.proto.failed:
            log.warning("step %d failed in quorum %d: %s", self.proto.step, self.proto.quorum_id, reason)
        self.proto.fail(reason)
        self.pg.abort_current()

    # -- the step protocol ---------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return {"store": f"{self.host}:{self.store.port}", "transfer": self.transfer_urls,
                "recover_request": self.proto.recover_request}

    def request_stop(self) -> None:
        """Stop waiting for a quorum (SIGTERM): ``start_step`` raises ``StopRequested`` within
        ``STOP_POLL_SECONDS`` instead of waiting up to ``ft.quorum_timeout``. Signal-safe."""
        self._stop_requested = True

    def _request_quorum(self, keepalive: Callable[[], None] = lambda: None) -> MemberQuorum:
        """Ask until a quorum comes, calling ``keepalive`` between requests. Gives up
        (``TooManyFailures``) after ``ft.quorum_timeout`` of answers without one, or an outage
        beyond ``ft.coordinator_outage_timeout`` (0: never); while the coordinator does not
        answer at all, the group keeps its state and waits, saying so every ``PROGRESS_EVERY`` s
        (``ftlm.ft.quorum_wait``)."""
        self._asking = True
        try:
            return self._ask_until_answered(keepalive)
        finally:
            self._asking = False
            self._progress()

    def _ask_until_answered(self, keepalive: Callable[[], None]) -> MemberQuorum:
        wait = QuorumWait(self.config.quorum_timeout, self.config.coordinator_outage_timeout,
                          time.monotonic())
        reason = "no answer yet"
        while True:
            if self._stop_requested:
                raise StopRequested(f"asked to stop while waiting for a quorum (last reason: {reason})")
            now = time.monotonic()
            why = wait.give_up(now)
            if why is not None:
                raise TooManyFailures(
                    f"{why} (last reason: {reason}); is the coordinator running and are enough "
                    "groups up (ft.min_replicas)?")
            if wait.report_due(now):
                self._say_unreachable(wait.outage_seconds(now), reason, started=False)
            keepalive()
            self._progress()  # asking is progress: a group waiting for others is not hung
            head, again = self._reload_hint
            if head is not None and self.proto.reload_due(head, again):
                # Heard in a heartbeat answer: no live group holds the job's newest state.
                raise ReloadCheckpoint(head, f"no live group holds step {head}")
            ask = self.proto.request()
            try:
                q = self.client.quorum(ask["step"], ask["last_quorum_id"], ask["failed"], self._meta(),
                                       timeout=min(wait.remaining(now), STOP_POLL_SECONDS),
                                       chain=ask["chain"], watch=ask["watch"],
                                       disk_checked=ask["disk_checked"], disk_round=ask["disk_round"],
                                       integrity=self._integrity_report)
                self._integrity_report = None  # delivered
                self._coordinator_answered(wait)
                return q
            except QuorumTimeout as e:
                self._coordinator_answered(wait)
                reason = e.reason
                if self.proto.reload_due(e.reload, e.reload_round):
                    raise ReloadCheckpoint(e.reload, e.reason) from None
            except CoordinatorUnreachable as e:
                reason = str(e)
                if wait.unreachable(e.sent_at, time.monotonic()):
                    self._say_unreachable(wait.outage_seconds(time.monotonic()), reason, started=True)
                # Refused at once, or timed out: either way ask again soon, not in a tight loop
                # (not on ``abort``: a collective's abort may be set, and would not pause).
                time.sleep(OUTAGE_RETRY_SECONDS)
            except CoordinatorUnavailable as e:  # it answered 502/503: busy or stopping
                self._coordinator_answered(wait)
                reason = f"coordinator unavailable ({e})"
                self.abort.wait(min(0.2, max(0.0, wait.remaining(time.monotonic()))))

    def _say_unreachable(self, seconds: float, reason: str, started: bool) -> None:
        """A line saying why this group is not stepping; at the outage's start, an event too."""
        url, step = self.client.url, self.proto.step
        log.warning("coordinator at %s unreachable for %.0f s; waiting, state kept at step %d (%s)",
                    url, seconds, step, reason)
        if started:
            self.events.emit("coordinator_unreachable", step=step, address=url,
                             seconds=round(seconds, 3), reason=reason[:200])

    def _coordinator_answered(self, wait: QuorumWait) -> None:
        seconds = wait.answered(time.monotonic())
        if seconds is not None:
            log.warning("coordinator at %s answers again after %.1f s unreachable; state kept at step %d",
                        self.client.url, seconds, self.proto.step)
            self.events.emit("coordinator_back", step=self.proto.step, address=self.client.url,
                             seconds=round(seconds, 3))

    def _next_quorum(self) -> MemberQuorum:
        """The leader asks; every rank of the group gets the same answer. While the leader waits
        (an outage may last minutes), it tells the other ranks so every ``_rank_keepalive_every``
        seconds: their broadcast would otherwise end at the group's collective timeout
        (``ft.quorum_timeout + ft.allreduce_timeout``, ``ftlm.train.group``)."""
        if self.rank == 0:
            told = [time.monotonic()]

            def keepalive() -> None:
                if self.ranks > 1 and time.monotonic() - told[0] >= self._rank_keepalive_every():
                    broadcast_json({"waiting": True}, self.ranks, self.control)
                    told[0] = time.monotonic()
            try:
                q = self._request_quorum(keepalive)
            except (StopRequested, TooManyFailures, ReloadCheckpoint, StaleIncarnation) as e:
                # The other ranks wait for this answer: tell them, or they would hang in the broadcast.
                end = {"end": type(e).__name__, "why": str(e)}
                if isinstance(e, ReloadCheckpoint):
                    end["head"] = e.head
                if isinstance(e, Convicted) and e.suspect_state is not None:
                    end["suspect_state"] = list(e.suspect_state)
                broadcast_json(end, self.ranks, self.control)
                raise
            with self._answered:  # a quorum answer is word from the coordinator, as a heartbeat's
                self._answered_at = time.monotonic()
            # Newer than the last heartbeat's "reload" (a group asking every step sends no
            # heartbeats, so a stale one would make it look on disk at every step after a rollback).
            self._reload_hint = (None, 0)
            broadcast_json(q.to_json(), self.ranks, self.control)
            return q
        got = broadcast_json(None, self.ranks, self.control)
        while isinstance(got, dict) and got.get("waiting") is True:
            got = broadcast_json(None, self.ranks, self.control)
        if isinstance(got, dict) and "end" in got:
            if got["end"] == "ReloadCheckpoint":
                raise ReloadCheckpoint(got["head"], got["why"])
            # Every rank ends as its leader does: a retired group's ranks all exit with its status.
            if got["end"] == "Convicted":
                raise Convicted(got["why"], suspect_word(got))
            ends = {"StopRequested": StopRequested, "StaleIncarnation": StaleIncarnation}
            raise ends.get(got["end"], TooManyFailures)(got["why"])
        return MemberQuorum.from_json(got)

    def _rank_keepalive_every(self) -> float:
        """Seconds between the leader's words to its ranks while it waits: well inside the
        group's collective timeout, whatever one request in between takes (a few seconds)."""
        return max(0.5, min(10.0, self.config.quorum_timeout / 4))

    def _publish_in_background(self, snapshot: SnapshotFn, step: int) -> None:
        """Copy the state into a snapshot on a helper thread while this step's forward and
        backward run (they read the parameters and optimizer state but never write them), and
        publish it; ``commit`` waits for the copy before the update may change the state."""
        self._wait_snapshot()
        tensors, meta = snapshot()  # references to the live tensors: no copy yet
        done = threading.Event()
        box: dict[str, BaseException] = {}

        def copy() -> None:
            # At the training thread's own priority: the update waits for the copy (commit),
            # so a starved copy would delay the step it should overlap with.
            try:
                t0 = time.monotonic()
                snap = snapshot_state(tensors, meta, step, shared=self.server.shared_memory,
                                      reserve=self.reserve)
                self.server.publish(snap)
                self.metrics.on_snapshot(time.monotonic() - t0, snap.total_bytes)
            except BaseException as e:  # noqa: BLE001 - reported on the training thread
                box["error"] = e
            finally:
                done.set()

        self._snapshotting = (done, box)
        threading.Thread(target=copy, name="ftlm-snapshot", daemon=True).start()

    def _digest_in_background(self, snapshot: SnapshotFn, q: MemberQuorum) -> None:
        """Digest the state this participant holds on a helper thread while the step's forward
        and backward run, every ``ft.integrity_every`` steps (``ftlm.ft.integrity``); ``commit``
        waits for it. An injected ``bitflip`` corrupts the state first."""
        which = self.fault.bitflip(q.step, self._fault_events.emit) if self.fault is not None else None
        if which is not None:
            log.warning("FTLM_FAULT: flipped a bit of %s", flip_bit(snapshot()[0], which))
        if self.integrity.due(q.step):
            self._digesting = self.integrity.start(snapshot()[0], q.step, q.chain) or self._digesting

    def _finish_digest(self) -> None:
        """Before the update may change the state: wait for the digest of this step's state; the
        group's digest combines its ranks' in rank order, and the leader's next quorum request
        carries it."""
        if not self._digesting:
            return
        self._digesting = False
        result = self.integrity.wait()
        shards = gather_strings(result[2] if result is not None else "", self.ranks, self.control)
        if result is not None and all(shards):
            self._integrity_report = (result[0], result[1], combine(shards))

    def _wait_snapshot(self) -> None:
        """Block until the snapshot copy in flight (if any) no longer reads the live state."""
        pending, self._snapshotting = self._snapshotting, None
        if pending is None:
            return
        done, box = pending
        done.wait()
        if "error" in box:
            # No snapshot to serve: the joiner's pull fails and it asks again, nothing is lost.
            log.warning("could not publish a snapshot for a recovering peer: %s", box["error"])

    def ask(self, step: int, chain: str) -> bool:
        """Request the quorum of ``(step, chain)``, the state this group just committed, now, from a
        helper thread: ``start_step`` of that state waits for this answer instead of asking then.
        Called right after a commit vote, the round trip and the wait for the other groups overlap
        with the optimizer update (docs/design.md, 'One training step'). A no-op where the control
        collectives share the group's default process group with training (several ranks on gloo):
        the answer's broadcast must not interleave with the training thread's collectives. Returns
        whether the request went out: then the next step is owed to the quorum it gets."""
        # A stop request is this rank's own (each rank gets the signal at its own moment): in a
        # group of several ranks the trainer asks only while none of them wants to stop, and a
        # request that went out is ended on every rank by the leader's ``StopRequested``.
        stopping = self._stop_requested if self.ranks == 1 else self._closed
        if self._asked is not None or stopping or (self.ranks > 1 and self.control is None):
            return False
        self.proto.sync(step, chain)
        self._declared_dead = False
        if self._asker is None:  # one long-lived thread, not one per step
            self._asker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftlm-quorum")
        self._asked = (step, chain, self._asker.submit(self._next_quorum))
        return True

    def _answer(self, step: int, chain: str) -> tuple[MemberQuorum, float]:
        """The quorum of ``(step, chain)`` (the one ``ask`` requested, else a request now) and
        the seconds this thread waited for it."""
        asked, self._asked = self._asked, None
        t0 = time.monotonic()
        if asked is not None:
            a_step, a_chain, answer = asked
            if (a_step, a_chain) == (step, chain):
                q = answer.result()  # re-raises StopRequested, TooManyFailures, ReloadCheckpoint
                return q, time.monotonic() - t0
            try:  # asked for another state (not the trainer's order): drop that answer
                answer.result()
            except ReloadCheckpoint:
                raise  # it says the group looked on disk (``disk_checked``): it must look now
            except Exception as e:  # noqa: BLE001 - a new request follows
                log.warning("dropped the answer to an earlier quorum request: %s", e)
        self.proto.sync(step, chain)
        self._declared_dead = False
        q = self._next_quorum()
        return q, time.monotonic() - t0

    def start_step(self, step: int, chain: str, snapshot: SnapshotFn) -> StepPlan:
        self._pending = None
        q, waited = self._answer(step, chain)
        self._progress()
        role = self.proto.on_quorum(q)
        self.quorum = q
        LOG_CONTEXT.update(quorum_id=q.quorum_id, step=step)
        self.metrics.on_quorum(q.quorum_id, q.participant_count, q.recovering_count, waited)
        self.abort.clear()
        if role.reconfigure:
            try:
                self.pg.configure(q.store, f"q{q.quorum_id}.{q.epoch}/r{self.rank}", q.rank(self.replica_id),
                                  q.size, self.abort)
                self.proto.process_group_ready()
            except CollectiveError as e:
                self._fail(str(e))
        if role.participant_index is not None:
            self._digest_in_background(snapshot, q)
        if role.publish:
            self._publish_in_background(snapshot, q.step)
        # Snapshots no recovering peer pulls any more are freed, not kept for the next one.
        self.server.retain(role.retain)
        self._keep_reserve(role, snapshot)
        if role.fetch_from is not None:
            if self._expected is None:
                # A peer's snapshot must have exactly this rank's own tensor layout: nothing it
                # claims beyond that is ever allocated.
                self._expected = expected_layout(snapshot()[0])
            self._start_fetch(q, role.fetch_from)
        return self._plan(role, waited)

    def _keep_reserve(self, role: Role, snapshot: SnapshotFn) -> None:
        """Prepare the next snapshot's memory while nobody pulls one: a participant past its
        first step (the optimizer state exists then), with no snapshot published, before the job's
        end (a finished group serving late joiners takes no more snapshots after theirs). So at
        most one snapshot and one reserve are held at a time."""
        reserve = self.reserve
        if (reserve is None or not reserve.idle or role.participant_index is None or role.drain
                or role.publish or role.quorum.step == 0 or self.server.steps()):
            return
        tensors = snapshot()[0]
        shared = self.server.shared_memory
        reserve.prepare(layout(tensors)[1], shared=shared,
                        pinned=snapshot_pinned(tensors, shared=shared))

    def _plan(self, role: Role, waited: float = 0.0) -> StepPlan:
        q = role.quorum
        return StepPlan(quorum_id=q.quorum_id, step=q.step, participant_index=role.participant_index,
                        participants=role.participants, recovering=role.recovering,
                        drain=role.drain, quorum=q, waited=waited, spare=role.spare)

    def allreduce_start(self, tensors: list[torch.Tensor]) -> None:
        """Issue the average of one bucket of ``tensors`` now (e.g. from a backward hook); the
        step's ``allreduce`` waits for it. Every group must start the same buckets in the same
        order (the bucket plan is a function of the model alone)."""
        if self._pending is None:  # the first bucket of this step
            self._fire("before_allreduce")
            self._pending, self._allreduce_started = [], time.monotonic()
        if self.proto.failed:
            return
        if (self.fault is not None and self.quorum is not None and self.quorum.size > 1
                and self.fault.allreduce_fails(self.proto.step, self._fault_events.emit)):  # (alone: no link used)
            self._fail("FTLM_FAULT: the all-reduce failed (a bad link)")
            return
        if len(self._pending) == 1:
            self._fire("inside_allreduce")
        participants = self.quorum.participant_count if self.quorum else 1
        try:
            self._pending.append(self.pg.allreduce_start(tensors, participants,
                                                         slot=len(self._pending)))
        except CollectiveError as e:
            self._fail(str(e))

    def allreduce(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` (in buckets) and wait for them and every bucket started before."""
        for bucket in self._buckets(tensors):
            self.allreduce_start(bucket)
        if self._pending is None:  # nothing at all to average this step
            self._fire("before_allreduce")
            self._pending, self._allreduce_started = [], time.monotonic()
        pending, self._pending = self._pending, None
        for p in pending:
            if self.proto.failed:
                break
            try:
                p.wait(self.abort)
            except CollectiveError as e:
                self._fail(str(e))
        self._progress()
        sent = sum(t.numel() * t.element_size() for p in pending for t in p.tensors)
        self.metrics.on_allreduce(time.monotonic() - self._allreduce_started, nbytes=sent)
        self._fire("after_allreduce")

    def allreduce_in_flight(self) -> bool:
        """Whether a bucket this step started is still on its way: the peers are still computing
        (a recovering group replays its backlog meanwhile)."""
        return any(p.work is not None and not p.work.is_completed() for p in self._pending or ())

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

    def step_alive(self) -> bool:
        """Progress, so the group is not declared hung (between the inner steps of a DiLoCo
        phase: minutes without another protocol point); False once the step cannot commit: it
        failed, a member of its quorum was reported dead, or a bucket already on its way failed
        (a peer's process ended). Cheap and non-blocking: the session asks it as backward
        starts each bucket, and before each block of the forward pass."""
        self._progress()
        if not self.proto.failed and not self.abort.is_set():
            for p in self._pending or ():
                if (why := p.failed()) is not None:
                    self._fail(why)
                    break
        return not self.proto.failed and not self.abort.is_set()

    def commit(self) -> bool:
        self._wait_snapshot()  # the update may change the state only once the copy is done
        self._finish_digest()  # (and once its digest is done)
        if not self.proto.failed and not self._fresh_word():
            self._fail("this group was silent past ft.heartbeat_timeout and the coordinator "
                       "declared it dead (or did not answer): its peers failed this step")
        self._fire("before_commit")
        ok = group_all(not self.proto.failed, self.ranks, self.control)
        self._progress()
        return self.proto.on_outcome(ok)

    # -- live recovery -------------------------------------------------------------------------------
    def _start_fetch(self, q: MemberQuorum, source: str) -> None:
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
                parallel = (self.config.transfer_parallel_local if on_this_host(fetch.url)
                            else self.config.transfer_parallel)
                fetch.result = fetch_snapshot(
                    fetch.url, fetch.step, token=self.token, parallel=parallel,
                    timeout=self.config.allreduce_timeout,
                    wait_available=self.config.quorum_timeout, progress=progress,
                    expected=self._expected, ssl_context=self._client_tls,
                    thread_nice=self.config.transfer_nice)
            except TransferError as e:
                fetch.error = str(e)
            except Exception as e:  # noqa: BLE001 - a failed pull is retried, never fatal
                fetch.error = f"{type(e).__name__}: {e}"
            finally:
                fetch.done.set()

        threading.Thread(target=run, name="ftlm-fetch", daemon=True).start()

    def head_step(self) -> int | None:
        """The step of the last quorum this group was in (None before any: it knows no head, and
        its state is not known to be the job's): a group whose state is behind it (recovering,
        or restarted from an older checkpoint) does not hold the job's newest state."""
        return self.quorum.step if self.quorum is not None else None

    def holds_head(self, step: int, chain: str) -> bool:
        """Whether the last quorum this group was in stood at ``step`` with history ``chain``:
        the coordinator confirmed that state as the job's."""
        q = self.quorum
        return q is not None and q.step == step and q.chain == chain

    def poll_recovery(self) -> Recovered | None:
        fetch = self._fetch
        # Every rank of the group loads its shard in the same step, or none does.
        if not group_all(fetch is not None and fetch.done.is_set(), self.ranks, self.control):
            return None
        self._fetch = None
        if not group_all(not fetch.error and fetch.result is not None, self.ranks, self.control):
            self.proto.fetch_finished()
            self.events.emit("recovery_end", step=self.proto.step, ok=False, source=fetch.source,
                             error=fetch.error)
            return None
        # Arrived: the pull stays open (no new source) until the trainer's replay reaches the
        # head (``caught_up``) or is rejected (``restart_recovery``).
        tensors, meta = fetch.result
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return Recovered(step=fetch.step, tensors=tensors, meta=meta, source=fetch.source,
                         seconds=time.monotonic() - fetch.started, nbytes=nbytes)

    def restart_recovery(self, reason: str) -> None:
        """Drop the pull in flight, or the arrived snapshot being replayed (none: a no-op)."""
        if self._fetch is not None or self.proto.fetching:  # in flight, or arrived and replaying
            log.warning("restarting recovery: %s", reason)
            self.events.emit("recovery_end", step=self.proto.step, ok=False, error=reason)
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
        for them, until a quorum shows all ``expected_groups`` groups up to date (less those that
        left finished at that same state: ``groups_left``), or no such quorum came within
        ``quorum_timeout``.
        """
        deadline = time.monotonic() + self.config.quorum_timeout
        pause, seen = FINISH_POLL_SECONDS[0], None
        while True:
            try:
                plan = self.start_step(step, chain, snapshot)
            except (TooManyFailures, StopRequested) as e:
                log.warning("stopped waiting for the other groups to finish: %s", e)
                break
            q = plan.quorum
            if not q.recovering_count and q.group_count + q.groups_left >= max(1, self.expected_groups):
                break
            if q.recovering_count:  # someone is pulling from us: stay for as long as that takes
                deadline = time.monotonic() + self.config.quorum_timeout
            # Each ask is a quorum round for the coordinator: ask at once again while the
            # members change, less and less often while nothing does.
            now_seen = (q.group_count, q.recovering_count)
            pause = FINISH_POLL_SECONDS[0] if now_seen != seen else min(2 * pause, FINISH_POLL_SECONDS[1])
            seen = now_seen
            self.abort.wait(pause)
            # The leader's clock decides for every rank (each start_step is a collective).
            if not broadcast_json(time.monotonic() < deadline if self.rank == 0 else None,
                                   self.ranks, self.control):
                break
        self.leave("finished", (step, chain))

    def leave(self, reason: str, at: tuple[int, str] | None = None) -> None:
        """Tell the coordinator this group leaves on purpose (leader; once), with the state it
        leaves with when ``at`` says it (finished: its last heartbeat may predate the last step)."""
        if self._left or self.client is None:
            return
        self._left = True
        if self.heartbeater is not None:
            self.heartbeater.stop()
        give_up = time.monotonic() + (FINISHED_LEAVE_RETRY_SECONDS if reason == "finished" else 0.0)
        pause = 0.2
        while True:
            try:
                self.client.leave(reason, at)
                return
            except CoordinatorUnavailable as e:
                if time.monotonic() + pause > give_up:
                    log.warning("could not tell the coordinator that %s leaves (%s): %s", self.replica_id,
                                reason, e)
                    return
                log.info("the coordinator is unreachable (%s); telling it again in %.1f s that %s leaves "
                         "(%s)", e, pause, self.replica_id, reason)
                time.sleep(pause)
                pause = min(2 * pause, 2.0)
            except (CoordinatorError, OSError) as e:
                log.warning("could not tell the coordinator that %s leaves: %s", self.replica_id, e)
                return

    def close(self) -> None:
        self._closed = True
        self._wait_snapshot()
        self.integrity.wait()
        if self._asker is not None:  # a request in flight ends within STOP_POLL_SECONDS
            self._stop_requested = True
            self._asker.shutdown(wait=False, cancel_futures=True)
        if self.heartbeater is not None:
            self.heartbeater.stop()
        self.pg.abort_current()
        self.server.stop()
        if self.reserve is not None:
            self.reserve.close()
        if self.client is not None:
            self.client.close()
