"""The coordinator as a sans-I/O state machine: inputs are messages and clock readings, outputs are
answers to waiting members and events to log.

Responsible for: feeding heartbeats, quorum requests, leaves, reported deaths and ticks into the
pure rules of ``ftlm.ft.quorum`` in the right order (expire, advance the head, decide, record), and
saying what must happen as a result: which waiting members get which answer, which events are
logged. The aiohttp server (``ftlm.ft.coordinator``) and the protocol simulator (``ftlm.sim``) both
drive this same class, so the simulator tests the code that runs in production.

Not responsible for: sockets, futures, threads, timers, metrics or the dashboard (the shell does
those from the outputs), nor for validating the wire format (the shell parses requests first).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ftlm.ft.history import extend_chain
from ftlm.ft.quorum import (
    Convicted,
    CoordinatorState,
    Heartbeat,
    MemberRequest,
    Probe,
    Quorum,
    QuorumOptions,
    Restore,
    StaleIncarnation,
    advance_head,
    commit_quorum,
    compute_quorum,
    convict,
    expire,
    promotion_fields,
    record_heartbeat,
    record_request,
    reload_due,
    reload_hint,
    reload_round,
    remove_member,
    withdraw_request,
)
from ftlm.ft.quorum.integrity import (
    WHY_CORRUPT,
    DigestReport,
    IntegrityBook,
    Verdict,
    copied,
    expect,
    is_quarantined,
    pending,
    suspect_bounds,
    suspect_since,
    suspect_snapshot,
    suspect_states,
    tainted,
    vouch_copies,
)
from ftlm.ft.quorum.integrity import record as record_digest
from ftlm.ft.quorum.types import SuspectStates

DEAD_MEMORY_SECONDS = 60.0
"""How long a dead replica is remembered (status page, abort pushes to its quorum peers)."""
MAX_DEAD_LISTED = 256
"""Most dead replicas one heartbeat answer names (answers stay small at any job size)."""
REASON_REPLACED = "replaced by new incarnation"
STALL_TICKS = 4
"""A gap between two inputs longer than this many tick intervals (and at most half a heartbeat
timeout) is the coordinator's own stall (``Membership.stall_after``)."""


@dataclass
class Answer:
    """Wake the long-polls of ``replica_id`` with this HTTP status and JSON body.

    A quorum answer carries the issued ``quorum`` instead of a body: each member is sent only its
    own part of it (``ftlm.ft.quorum_answer``), built by whoever sends it.
    """

    replica_id: str
    status: int
    body: dict[str, Any] | None
    quorum: Quorum | None = None


@dataclass
class Event:
    """Log an event of ``kind`` (the events.jsonl vocabulary, ``ftlm.observe.events``)."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class Issued:
    """A quorum was issued, ``latency`` seconds after the round's first request."""

    quorum: Quorum
    latency: float
    new_id: bool


Output = Answer | Event | Issued


class Membership:
    """One job's membership and quorum state; every method takes ``now`` and returns outputs."""

    def __init__(self, options: QuorumOptions, epoch: str | None = None, tick_interval: float | None = None) -> None:
        """``tick_interval``: as ``ticks_every``; None: the caller does not tick on a timer (a
        test's hand-driven clock), and a long gap between inputs says nothing."""
        self.options = options
        # Longer than this between two inputs, this coordinator was not running (``_resumed``).
        self.stall_after = float("inf")
        self._last_input: float | None = None  # when it last processed an input (a message or a tick)
        if tick_interval is not None:
            self.ticks_every(tick_interval)
        self.state = CoordinatorState(epoch=epoch if epoch is not None else uuid.uuid4().hex[:12])
        self.reason = "no member has asked for a quorum"
        self.dead: deque[tuple[float, str, str, str]] = deque()  # (time, replica id, group, reason)
        # (time, replica id, ids of the quorums in flight it left without finishing their step)
        self.left: deque[tuple[float, str, frozenset[int]]] = deque()
        self.promotions = 0  # spares that took a participant's place (``quorum.spares``)
        # (time, replica id, group, reason) of every leave: a supervisor gives a group that left
        # the time to exit (save, summarize, stop its servers) instead of taking it for hung.
        self.departed: deque[tuple[float, str, str, str]] = deque()
        self._gone_groups: set[str] = set()  # left on purpose, not back since
        # Groups that left finished, not back since: the state they finished at (step, chain).
        self._finished_at: dict[str, tuple[int, str]] = {}
        self._options_less_gone: tuple[QuorumOptions, QuorumOptions] | None = None  # (options, less gone)
        self.kill_requests: set[str] = set()
        # (time, replica id, the probe that found it) of members retired for failing every step
        # they took part in (``quorum.Probe``), the newest MAX_DEAD_LISTED
        self.convictions: deque[tuple[float, str, Probe]] = deque(maxlen=MAX_DEAD_LISTED)
        self._last_emitted_id: int | None = None
        self._dead_peers_key: tuple[Any, ...] | None = None
        self._dead_peers: list[str] = []
        self._dead_quorums: list[int] = []
        # The digests of the replicated state that members report (``quorum.integrity``).
        self.integrity = IntegrityBook()

    def ticks_every(self, interval: float) -> None:
        """The caller ticks every ``interval`` seconds from now on (``CoordinatorConfig.tick_interval``):
        a gap between two inputs longer than ``STALL_TICKS`` of them (at most half a heartbeat
        timeout) is this coordinator's own stall (``_resumed``)."""
        self.stall_after = min(STALL_TICKS * interval, self.options.heartbeat_timeout / 2)
        self._last_input = None

    # -- inputs ----------------------------------------------------------------------------------
    def heartbeat(self, now: float, hb: Heartbeat, tick: bool = True) -> tuple[dict[str, Any], list[Output]]:
        """Record a heartbeat; returns the answer body and the outputs. Raises StaleIncarnation.

        ``tick=False``: the caller re-evaluates (``tick``) soon itself, once for a burst of
        messages (the coordinator: once per pass of its event loop); the answer then reflects the
        last evaluation."""
        out = self._resumed(now)
        # A member declared dead that speaks again (a pause that ended) is told so: its peers
        # failed the step it was in, so it must not commit that step (see Manager.commit).
        revived = hb.replica_id not in self.state.heartbeats and any(
            rid == hb.replica_id for _, rid, _, _ in self.dead)
        for old in record_heartbeat(self.state, hb):
            self._mark_dead(now, old, hb.group, REASON_REPLACED, out)
        self._gone_groups.discard(hb.group)
        self._finished_at.pop(hb.group, None)
        if tick or self.state.head is None:  # (while rebuilding: the answer says whether it still is)
            out += self.tick(now)
        dead, aborted = self._dead_in_flight(now)
        answer: dict[str, Any] = {"quorum_id": self.state.quorum_id, "dead": dead, "dead_quorums": aborted,
                                  "epoch": self.state.epoch, "rebuilding": self.state.head is None}
        if revived:
            answer["declared_dead"] = True
        if (reload := reload_hint(now, self.state, self.options, hb.replica_id)) is not None:
            answer["reload"] = reload  # no live group holds it: look for a newer checkpoint first
            if again := reload_round(self.state, hb.replica_id):
                answer["reload_round"] = again  # it looked, and must look again
        if self.kill_requests:
            self.kill_requests = {r for r in self.kill_requests if r in self.state.heartbeats}  # forget gone ones
            if hb.replica_id in self.kill_requests:
                answer["kill"] = True
        return answer, out

    def request(self, now: float, req: MemberRequest, tick: bool = True) -> list[Output]:
        """Record a quorum request; the asker is answered through an ``Answer`` output (maybe later,
        and with ``tick=False`` only from the caller's next ``tick``)."""
        out = self._resumed(now)
        host = _host(req)
        if is_quarantined(self.integrity, req.group, host):
            raise Convicted(f"replica {req.replica_id} was refused: group {req.group} was found corrupt "
                            f"{self.integrity.corrupt_count.get(req.group, 0)} times on host {host} "
                            "(quarantined there); this process must exit (start it on another host)")
        for old in record_request(self.state, req):
            self._mark_dead(now, old, req.group, REASON_REPLACED, out)
        self._gone_groups.discard(req.group)
        self._finished_at.pop(req.group, None)
        if req.integrity is not None:
            step, chain, digest = req.integrity
            report = DigestReport(req.replica_id, req.group, host, step, chain, digest)
            for verdict in record_digest(self.integrity, report, set(self.state.heartbeats)):
                self._judged(now, verdict, out)
        return out + self.tick(now) if tick else out

    def restore_finished(self, group: str, step: int, chain: str) -> None:
        """``group`` left finished at ``(step, chain)`` before this coordinator started (its
        record, ``ftlm.ft.coordinator_record``): counted in ``groups_left`` at that state until
        it is heard from again. Not taken as gone: an entry of an earlier launch in the same run
        directory must not let a new launch's first quorum start without one of its groups
        (the rebuild and the first quorum wait ``join_timeout`` for it at most)."""
        if not any(hb.group == group for hb in self.state.heartbeats.values()):
            self._finished_at[group] = (step, chain)

    def restore_retired(self, replica_id: str, why: str, set_aside: tuple[int, str] | None) -> None:
        """``replica_id`` was retired for its state (found corrupt, or holding a suspect one)
        before this coordinator started (its record): its messages are refused as a convicted
        one's, naming the checkpoint to set aside, as if the retirement were this coordinator's.
        Its answer may have been lost with the coordinator that retired it; without this it
        would take part again, and its checkpoint stay."""
        if set_aside is not None:
            self.state.set_aside[replica_id] = set_aside
        remove_member(self.state, replica_id, 0.0, why=f"was retired: {why}")

    def withdraw(self, req: MemberRequest) -> None:
        """The asker stopped waiting (timeout, disconnect): never issue it a quorum nobody receives."""
        withdraw_request(self.state, req)

    def leave(self, now: float, replica_id: str, group: str, reason: str,
              at: tuple[int, str] | None = None) -> list[Output]:
        """A group leaves on purpose (finished, preempted, stopped): not a failure. ``at``: the
        state (step, chain) it says it leaves with, newer than its last heartbeat's maybe.

        The quorums in flight that counted it and whose step it has not reported done cannot
        complete (it was interrupted mid-step, or its answer crossed its stop request): heartbeat
        answers name them in ``dead_quorums``, as for a dead member, so that their other members
        abort now instead of waiting for ``ft.allreduce_timeout``.
        """
        out = self._resumed(now)
        stranded = self._unfinished_quorums(replica_id)
        last = self.state.heartbeats.get(replica_id)
        if last is not None and at is not None and at[0] >= last.step:
            last = self.state.heartbeats[replica_id] = dataclasses.replace(last, step=at[0], chain=at[1])
        fields: dict[str, Any] = {"group": group, "replica_id": replica_id, "reason": reason}
        # Where it finished: what it says, else its last heartbeat. Said by one just declared dead
        # (silent while it waited for its last quorum) it still counts: it finished there.
        final = at if at is not None else (last.step, last.chain) if last is not None else None
        if reason == "finished" and final is not None:
            self._finished_at[group] = final
            fields.update(step=final[0], chain=final[1])  # (kept in the coordinator's record)
        # A group that leaves having finished holds the job's final state: it is never rolled back.
        if remove_member(self.state, replica_id, now, finished=reason == "finished"):
            out.append(Event("member_left", fields))
            self.departed.append((now, replica_id, group, reason))
        elif "chain" in fields:
            out.append(Event("member_left", fields))
        if not any(hb.group == group for hb in self.state.heartbeats.values()):
            self._gone_groups.add(group)
        if stranded:
            self.left.append((now, replica_id, stranded))
        out.append(Answer(replica_id, 409, {"error": f"{replica_id} left the job ({reason})"}))
        return out + self.tick(now)

    def report_dead(self, now: float, replica_id: str, group: str, reason: str) -> list[Output]:
        """A supervisor saw the replica's process end: drop it now instead of waiting for its heartbeat."""
        out = self._resumed(now)
        if remove_member(self.state, replica_id, now):
            self._mark_dead(now, replica_id, group, reason, out)
        return out + self.tick(now)

    def kill(self, group: str) -> list[str]:
        """Mark the live replica of ``group`` so its next heartbeat answer says ``kill`` (chaos drill)."""
        targets = sorted(r for r, hb in self.state.heartbeats.items() if hb.group == group)
        self.kill_requests.update(targets)
        return targets

    def tick(self, now: float) -> list[Output]:
        """Re-evaluate: expire the silent and the hung, move the head, issue a quorum if due."""
        out = self._resumed(now)
        options = self.options_now()
        for rid, why in expire(now, self.state, options):
            self._mark_dead(now, rid, rid.split(":", 1)[0], why, out)
        if self.integrity.reports:  # a reporter expected may have died or left meanwhile
            for verdict in pending(self.integrity, set(self.state.heartbeats)):
                self._judged(now, verdict, out)
        restores, waiting = advance_head(now, self.state, options)
        for r in restores:
            out.append(Event("restore", self._restore_fields(r)))
        stranded, self.state.stranded = self.state.stranded, {}
        for rid, (step, chain) in stranded.items():
            hb = self.state.heartbeats.get(rid)
            if hb is not None:
                why = (f"its state (step {step}) may hold the bits of a member found corrupt, and no group "
                       "vouched for holds a state: it sets that state's checkpoint aside and starts again "
                       "from an older one")
                out.append(Event("member_dead", {"group": hb.group, "replica_id": rid, "reason": why,
                                                 **_retired(why, (step, chain))}))
                self._retire_corrupt(now, rid, hb.group, why, out, (step, chain))
        if (guilty := convict(self.state)) is not None:
            self._retire_guilty(now, guilty[0], guilty[1], guilty[2], out)
        head, due = reload_due(now, self.state, options)
        for req in due:
            # Answered now, not at the end of its long-poll: the rollback grace is short.
            withdraw_request(self.state, req)
            body = {"error": "quorum timeout", "reload": head,
                    "reason": (f"no live group holds step {head}: load a durable checkpoint newer than "
                               f"step {req.step} if there is one, then ask again")}
            if again := reload_round(self.state, req.replica_id):
                body["reload_round"] = again
            out.append(Answer(req.replica_id, 504, body))
        quorum, reason = compute_quorum(now, self.state, options)
        self.reason = waiting if quorum is None and waiting else reason
        if quorum is None:
            return out
        started = self.state.round_started
        prev = self.state.prev_quorum
        # (Only those that finished at this very state: one that finished another history, or
        # left otherwise, may still write its model or come back: the finishers wait for it.)
        quorum.groups_left = sum(1 for at in self._finished_at.values() if at == (quorum.step, quorum.chain))
        commit_quorum(self.state, quorum)
        expect(self.integrity, quorum.step, quorum.chain, frozenset(quorum.participants))
        new_id = quorum.quorum_id != self._last_emitted_id
        if new_id:
            if quorum.sources:
                copied(self.integrity, quorum.step, quorum.sources)
                if vouch_copies(self.state, quorum.step, quorum.sources):
                    # (Kept in the coordinator's record: a restarted one knows who is vouched for.)
                    out.append(Event("suspect_vouched", {"step": quorum.step, "sources": dict(quorum.sources),
                                                         "suspect": suspect_snapshot(self.state)}))
            self._last_emitted_id = quorum.quorum_id
            out.append(Event("quorum", {"quorum_id": quorum.quorum_id, "step": quorum.step,
                                        "participants": list(quorum.participants),
                                        "recovering": list(quorum.recovering), "reason": quorum.reason,
                                        **({"spares": list(quorum.spares)} if quorum.spares else {})}))
            if prev is not None and prev.spares:
                gone = [(t, rid) for t, rid, _, _ in self.dead] + [(t, rid) for t, rid, _ in self.left]
                promotion = promotion_fields(now, quorum, prev, gone)
                if promotion is not None:
                    self.promotions += 1
                    out.append(Event("spare_promoted", promotion))
        out.append(Issued(quorum, now - started if started is not None else 0.0, new_id))
        out += [Answer(rid, 200, None, quorum) for rid in quorum.replica_ids()]
        return out

    # -- queries ---------------------------------------------------------------------------------
    def recent_dead(self, now: float) -> list[tuple[float, str, str, str]]:
        while self.dead and now - self.dead[0][0] > DEAD_MEMORY_SECONDS:
            self.dead.popleft()
        return list(self.dead)

    def recent_departed(self, now: float) -> list[tuple[float, str, str, str]]:
        """The leaves of the last ``DEAD_MEMORY_SECONDS``: (time, replica id, group, reason)."""
        while self.departed and (now - self.departed[0][0] > DEAD_MEMORY_SECONDS
                                 or len(self.departed) > MAX_DEAD_LISTED):
            self.departed.popleft()
        return list(self.departed)

    def dead_peers(self, now: float) -> list[str]:
        """Recently dead members of the quorums in flight: what a member must abort for (bounded).

        Called for every heartbeat: its work grows with the recent deaths, not with the job's size.
        """
        return self._dead_in_flight(now)[0]

    def _dead_in_flight(self, now: float) -> tuple[list[str], list[int]]:
        """``dead_peers`` and the ids of the quorums in flight that have one of them as a member
        (a member aborts its all-reduce when its quorum is listed: its answer does not name its
        peers)."""
        while self.dead and now - self.dead[0][0] > DEAD_MEMORY_SECONDS:
            self.dead.popleft()
        while self.left and now - self.left[0][0] > DEAD_MEMORY_SECONDS:
            self.left.popleft()
        if not self.dead and not self.left:
            return [], []
        state = self.state
        index = state.index
        index.track_prev(state.prev_quorum)
        # The answer changes only with the deaths and leaves, who heartbeats, and the quorums in flight.
        key = (len(self.dead), self.dead[0][:2] if self.dead else None, self.dead[-1][:2] if self.dead else None,
               len(self.left), self.left[-1][:2] if self.left else None, index.hb_version, id(index.prev),
               state.head, tuple(qid for qid, _ in state.head_quorums))
        if key == self._dead_peers_key:
            return list(self._dead_peers), list(self._dead_quorums)
        in_head = [ids for _, ids in index.head_quorum_info(state)] if state.head is not None else []
        if state.head is None and state.head_quorums:  # not kept by the index without a head
            in_head = [frozenset(parts) for _, parts in state.head_quorums]
        # A member declared dead that heartbeats again (a hang that ended) is alive: aborting for
        # it would fail every step it takes part in.
        dead = [rid for _, rid, _, _ in self.dead
                if (rid in index.prev_ids or any(rid in ids for ids in in_head)) and rid not in state.heartbeats]
        gone = set(dead)
        in_flight = [(qid, ids) for (qid, _), ids in zip(state.head_quorums, in_head)]
        if index.prev is not None:
            in_flight.append((index.prev.quorum_id, index.prev_ids))
        stranded = {qid for _, _, qids in self.left for qid in qids}
        aborted = sorted({qid for qid, ids in in_flight if not gone.isdisjoint(ids) or qid in stranded})
        self._dead_peers_key, self._dead_peers = key, dead[-MAX_DEAD_LISTED:]
        self._dead_quorums = aborted[-MAX_DEAD_LISTED:]
        return list(self._dead_peers), list(self._dead_quorums)

    # -- internals -------------------------------------------------------------------------------
    def _resumed(self, now: float) -> list[Output]:
        """Note an input at ``now``; after a gap longer than ``stall_after`` since the previous
        one, this coordinator was not running (SIGSTOP, a swapped-out or starved process, a long
        pause of its own): it heard nothing because it did not listen, and the messages sent to
        it meanwhile are still on their way in. So every deadline that counts a member's silence
        is moved to at least one heartbeat timeout from now: each member's heartbeat, its
        progress, the rollback grace, a wait for a look on disk and a rebuild's gathering of
        claims. An open suspicion (peers reported a failed step) is dropped: its suspects' silence
        cannot be told from this coordinator's; they get a heartbeat timeout as everyone does,
        and a report made after the resumption opens a new one.

        Not the mechanism of a restarted coordinator (it knows no member, so it has no deadline
        to move, and it gathers claims before choosing the head): this one keeps its head, its
        members and their quorums."""
        last = self._last_input
        self._last_input = now if last is None else max(last, now)
        if last is None or now - last <= self.stall_after:
            return []
        options, state = self.options, self.state
        timeout = options.heartbeat_timeout
        for hb in state.heartbeats.values():
            # Moved forward only: the index's deadline heaps hold lower bounds, refreshed when due.
            if options.progress_timeout > 0:
                progress = hb.progress_at if hb.progress_at is not None else hb.last_seen
                hb.progress_at = max(progress, now + timeout - options.progress_timeout)
            hb.last_seen = max(hb.last_seen, now)
        state.suspicion = None
        if state.head_seen_at is not None:
            state.head_seen_at = max(state.head_seen_at, now + timeout - options.rollback_seconds)
        if state.head is None and state.started_at is not None:
            state.started_at = max(state.started_at, now + timeout - options.rebuild_seconds)
        for rid, told in list(state.reloads.items()):
            if told is not None:
                state.reloads[rid] = max(told, now + timeout - options.reload_seconds)
        return [Event("coordinator_stalled", {"seconds": round(now - last, 3), "members": len(state.heartbeats),
                                              "reason": "this coordinator processed nothing meanwhile: every "
                                                        "member has a heartbeat timeout from now to speak"})]

    def options_now(self) -> QuorumOptions:
        """The quorum options, expecting no group that left on purpose (and has not come back):
        the job's first quorum and a restarted coordinator's rebuild wait for the groups the job
        was launched with, but never for one that left (a preempted group would cost the others
        ``join_timeout``)."""
        expected = self.options.expected_groups
        if not self._gone_groups or not expected:
            return self.options
        less = max(1, expected - len(self._gone_groups))
        cached = self._options_less_gone
        if cached is None or cached[0] is not self.options or cached[1].expected_groups != less:
            cached = self._options_less_gone = (self.options, dataclasses.replace(self.options, expected_groups=less))
        return cached[1]

    def _unfinished_quorums(self, replica_id: str) -> frozenset[int]:
        """Ids of the quorums in flight with ``replica_id`` as a member whose commit it has not
        reported (its last report is not the state that quorum's commit reaches: a member
        still at the quorum's step, recovering, or holding a stale claim ahead of it)."""
        state = self.state
        hb = state.heartbeats.get(replica_id)
        done = (hb.step, hb.chain) if hb is not None else None
        ids = set()
        prev = state.prev_quorum
        if prev is not None and prev.present(replica_id) and done != (prev.step + 1, prev.next_chain()):
            ids.add(prev.quorum_id)
        if state.head is not None:
            step, chain = state.head
            ids.update(qid for qid, parts in state.head_quorums
                       if replica_id in parts and done != (step + 1, extend_chain(chain, step, qid, parts)))
        return frozenset(ids)

    def _mark_dead(self, now: float, replica_id: str, group: str, reason: str, out: list[Output]) -> None:
        self.dead.append((now, replica_id, group, reason))
        out.append(Event("member_dead", {"group": group, "replica_id": replica_id, "reason": reason}))
        if reason == REASON_REPLACED:
            out.append(Answer(replica_id, 409, {"error": f"{replica_id} was {reason}; this process must exit"}))
        else:
            out.append(Answer(replica_id, 504, {"error": "quorum timeout", "reason": f"{replica_id}: {reason}"}))

    def _retire_guilty(self, now: float, replica_id: str, why: str, probe: Probe, out: list[Output]) -> None:
        """Attempts with ``replica_id`` failed, one without it committed, and the next step's with
        it failed again (``quorum.convict``): retire it, so that its process exits (and is
        restarted) instead of failing the next steps too."""
        hb = self.state.heartbeats.get(replica_id)
        group = hb.group if hb is not None else replica_id.split(":", 1)[0]
        req = self.state.pending.get(replica_id)
        store = str(req.meta.get("store", "")) if req is not None else ""
        if not remove_member(self.state, replica_id, now, why=f"was retired: {why}"):
            return  # it died or left meanwhile
        self.dead.append((now, replica_id, group, why))
        self.convictions.append((now, replica_id, probe))
        fields: dict[str, Any] = {"group": group, "replica_id": replica_id, "reason": why, "step": probe.step}
        if store.rpartition(":")[0]:  # the host its leader serves the group's store on: where the bad link is
            fields["host"] = store.rpartition(":")[0]
        out.append(Event("member_dead", fields))
        out.append(Answer(replica_id, 409, {"error": f"{replica_id} was retired: {why}; this process "
                                                      "must exit (its supervisor starts it again)",
                                             "convicted": True}))  # ``quorum.Convicted``

    def _judged(self, now: float, verdict: Verdict, out: list[Output]) -> None:
        """The digests of one state were compared (``quorum.integrity``): retire every member
        whose state differs from the majority's (it recovers from a majority member when its
        supervisor starts it again); without a majority, retire them all: the job rolls back to
        the newest durable checkpoint from before the disagreement. Every state of the job since
        the reporters' last agreement before this state is suspect then, vouched for by nobody
        (rule I2), and whoever copied a reporter's state since is retired with them: each sets
        aside the checkpoint of the state it held, and a group that starts from another suspect
        checkpoint is retired and sets that one aside too, until the groups hold a state from
        before the disagreement (or step 0). Digests of two or more groups that all agree are a
        ``state_agreed`` event (the record keeps it: where a later suspect window starts)."""
        trusted = bool(verdict.majority)
        agreeing = self.integrity.reporters.get((verdict.step, verdict.chain), frozenset())
        if verdict.agreed and len(agreeing) > 1:
            out.append(Event("state_agreed", {"step": verdict.step, "chain": verdict.chain,
                                              "digest": verdict.majority, "groups": sorted(verdict.digests),
                                              "replica_ids": sorted(agreeing)}))
            return
        if not trusted:
            # Whoever copied a reporter's state since its last agreement may hold the bad bits.
            split_copies = {rid: src for r in verdict.corrupt
                            for rid, src in tainted(self.integrity, r.replica_id, verdict.step).items()}
            # The states since the reporters' last agreement before this state (a later one, judged
            # first, may be an agreement of a corrupt member with its own copy).
            lo = min(suspect_since(self.integrity, r.replica_id, verdict.step) for r in verdict.corrupt)
            entry = suspect_states(self.state, self.integrity, verdict, lo)
            out.append(Event("suspect_states", {
                "replica_id": "", "group": "", "step": verdict.step,
                **_bounds(entry, verdict.step), "copied": dict(split_copies),
                "vouched": [], "suspect": suspect_snapshot(self.state)}))
        for r in verdict.corrupt:
            why = (f"{WHY_CORRUPT} at step {verdict.step}" if trusted else
                   f"its replicated state at step {verdict.step} differs from its peers' and no majority "
                   "holds one state (silent data corruption): the job rolls back to its newest durable "
                   f"checkpoint from before step {lo}")
            held = None if trusted else (verdict.step, verdict.chain)
            fields: dict[str, Any] = {
                "group": r.group, "replica_id": r.replica_id, "host": r.host, "step": verdict.step,
                "chain": verdict.chain, "digest": r.digest, "digests": dict(verdict.digests),
                "majority": verdict.majority, "times": self.integrity.corrupt_count.get(r.group, 0),
                "quarantined": is_quarantined(self.integrity, r.group, r.host), **_retired(why, held)}
            out.append(Event("state_mismatch", fields))
            self._retire_corrupt(now, r.replica_id, r.group, why, out, suspect=held)
            if trusted:
                # Whoever copied the corrupt state before it was found holds the same bits, and
                # the checkpoints it (or they) wrote since may hold them too (rule I2).
                entry = suspect_states(self.state, self.integrity, verdict,
                                       suspect_since(self.integrity, r.replica_id, verdict.step))
                copies = tainted(self.integrity, r.replica_id, verdict.step)
                out.append(Event("suspect_states", {
                    "replica_id": r.replica_id, "group": r.group, "step": verdict.step,
                    **_bounds(entry, verdict.step), "copied": dict(copies),
                    "vouched": sorted(entry.vouched), "suspect": suspect_snapshot(self.state)}))
            else:
                copies = {rid: src for rid, src in split_copies.items() if src == r.replica_id}
            whose = "the majority's" if trusted else "its peers'"
            for rid, source in copies.items():
                hb = self.state.heartbeats.get(rid)
                if hb is None:
                    continue  # gone already
                req = self.state.pending.get(rid)
                held = None if trusted else (hb.step, hb.chain)
                why = (f"it copied its state from {source}, whose state differs from {whose} at step "
                       f"{verdict.step} (silent data corruption)")
                out.append(Event("state_mismatch", {
                    "group": hb.group, "replica_id": rid, "host": _host(req) if req is not None else "",
                    "step": verdict.step, "chain": verdict.chain,
                    "digest": "", "digests": dict(verdict.digests), "majority": verdict.majority,
                    "copied_from": source, "times": self.integrity.corrupt_count.get(hb.group, 0),
                    "quarantined": False, **_retired(why, held)}))
                self._retire_corrupt(now, rid, hb.group, why, out, suspect=held)
        if not trusted:
            out.append(Event("integrity_rollback", {
                "step": verdict.step, "digests": dict(verdict.digests), "last_agreed": lo - 1,
                "reason": (f"the {len(verdict.digests)} groups at step {verdict.step} hold different states "
                           "and no majority holds one: every one is retired and the job continues from "
                           f"its newest durable checkpoint at or before step {max(lo - 1, 0)}, "
                           "the last step whose digests agreed before")}))

    def _retire_corrupt(self, now: float, replica_id: str, group: str, why: str, out: list[Output],
                        suspect: tuple[int, str] | None = None) -> None:
        """Retire a member whose state is corrupt or suspect; ``suspect``: the state whose
        checkpoint it sets aside before it exits (``quorum.Convicted``), told again to a later
        message of it. The event that names the retirement carries ``_retired``'s fields: the
        coordinator's record keeps them (``restore_retired``)."""
        if suspect is not None:
            self.state.set_aside[replica_id] = suspect
        if remove_member(self.state, replica_id, now, why=f"was retired: {why}"):
            self.dead.append((now, replica_id, group, why))
            body: dict[str, Any] = {"error": f"{replica_id} was retired: {why}; this process must exit (its "
                                             "supervisor starts it again)", "convicted": True}  # ``quorum.Convicted``
            if suspect is not None:
                body["suspect_state"] = list(suspect)
            out.append(Answer(replica_id, 409, body))

    def _restore_fields(self, r: Restore) -> dict[str, Any]:
        return {"step": r.to_step, "from_step": r.from_step, "to_step": r.to_step, "chain": r.chain,
                "holders": list(r.holders), "reason": r.reason,
                "source": "live" if r.to_step >= r.from_step - 1 else "checkpoint"}


def _retired(why: str, set_aside: tuple[int, str] | None) -> dict[str, Any]:
    """The fields of an event naming a member retired for its state: why (what its refused
    messages are told), and the state whose checkpoint it sets aside (None: none)."""
    return {"retired": why, "set_aside": list(set_aside) if set_aside is not None else None}


def _bounds(entry: SuspectStates, step: int) -> dict[str, int]:
    """A ``suspect_states`` event's ``from_step`` and ``to_step``."""
    first, last = suspect_bounds(entry, step)
    return {"from_step": first, "to_step": last}


def _host(req: MemberRequest) -> str:
    """The host a member's leader runs on: where its rendezvous store listens (``meta.store``)."""
    store = req.meta.get("store")
    return store.rpartition(":")[0] if isinstance(store, str) else ""


__all__ = ["Answer", "Event", "Issued", "Membership", "Output", "StaleIncarnation"]
