"""A replica group's side of the per-step protocol, as a sans-I/O state machine.

Responsible for: what the group reports (its committed ``(step, chain)``, the last quorum id it
knows, whether its last step failed, its recovery request number), what an issued quorum means for
it (train a data slice, stand by as a spare, recover, drain at the end of the job; rebuild the cross-group process
group; publish a snapshot for a recovering peer; start pulling one), whether an update may be
applied, when repeated failures of its own end it, and whether a replayed catch-up reached the
head (``check_replay``).

Not responsible for: tensors, sockets, threads or clocks (``ftlm.ft.manager`` drives this class in
production, ``ftlm.sim`` in the protocol simulation, so both run the same decisions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ftlm.errors import FaultError
from ftlm.ft.history import GENESIS, extend_chain
from ftlm.ft.quorum import MAX_WATCH, Quorum
from ftlm.ft.quorum_answer import MemberQuorum

AnyQuorum = Quorum | MemberQuorum
"""The coordinator's whole quorum, or one member's answer: both answer what a group asks."""


class TooManyFailures(FaultError):
    """The group failed too many steps in a row or could not get a quorum in time."""


ABSENT_QUORUMS = 16
"""Quorums a joiner may miss (it asked too late while pulling) before its snapshot is freed."""


@dataclass
class Role:
    """What one issued quorum asks of this group."""

    quorum: AnyQuorum
    participant_index: int | None
    """Data slice among the participants; None while recovering."""
    recovering: bool
    drain: bool
    """The job reached its last step: nothing is trained; finished groups serve late joiners."""
    reconfigure: bool
    """The quorum id changed: the cross-group process group must be rebuilt."""
    publish: bool
    """A recovering peer newly asked this group for its state: publish a snapshot of this step."""
    fetch_from: str | None
    """Start pulling the state from this replica id (a recovering group with no pull in flight)."""
    retain: frozenset[int] = frozenset()
    """Steps of the published snapshots a recovering peer may still be pulling; every other
    snapshot can be dropped (its memory freed)."""

    @property
    def participants(self) -> int:
        return self.quorum.participant_count

    @property
    def spare(self) -> bool:
        """This group holds the head but trains no data: it follows the step with zeros and
        commits its average as a participant does (``ftlm.ft.quorum.spares``)."""
        return self.participant_index is None and not self.recovering and not self.drain


@dataclass
class ReplayCheck:
    """Outcome of ``check_replay``: how many records to apply and the chain they lead to."""

    ok: bool
    apply: int
    chain: str
    reason: str = ""


@dataclass
class GroupProtocol:
    """The step protocol of one replica group (one incarnation)."""

    replica_id: str
    max_consecutive_failures: int
    total_steps: int | None = None
    step: int = 0
    """Committed steps (the step being worked on); reported with ``chain``."""
    chain: str = GENESIS
    quorum_id: int = -1
    """The last quorum id this group knows."""
    recover_request: int = 0
    """Bumped after every pull (ok or not) so that a source serves the next request anew."""
    failed: bool = False
    """The step in progress failed (reported with the next request)."""
    failure: str = ""
    consecutive: int = 0
    quorum: AnyQuorum | None = None
    role: Role | None = None
    fetching: bool = False
    """A pull is in flight, or the snapshot it brought is loaded and still being replayed (over
    one or more steps): no source is asked for again until it ends (``fetch_finished`` when it
    failed or its replay was rejected, ``caught_up`` when it reached the head)."""
    known_head: int = 0
    """The highest step this group saw the job reach (reported in heartbeats)."""
    disk_checked: int = -1
    """The head step (held by no live group) for which this group looked for a newer durable
    checkpoint since its last quorum (``reload_due``); reported in its requests."""
    disk_round: int = 0
    """The ``reload_round`` it looked in (the coordinator voids a look made before a newer state's
    holder left: that holder may have saved it on its way out)."""
    _pg_quorum: tuple[str, int] | None = None
    _suspect: str | None = None  # membership digest of a failed step's quorum, judged at the next quorum
    _served: set[tuple[str, int]] = field(default_factory=set)
    _published_step: int | None = None
    _serving: dict[str, int] = field(default_factory=dict)  # joiner -> step of its snapshot
    _absent: dict[str, int] = field(default_factory=dict)  # joiner -> quorums it was missing from

    # -- asking ----------------------------------------------------------------------------------
    def sync(self, step: int, chain: str) -> None:
        """Adopt the trainer's committed state (after a catch-up or a checkpoint restore)."""
        self.step, self.chain = step, chain
        self.known_head = max(self.known_head, step)

    def request(self) -> dict:
        """The fields of this group's next quorum request; ``watch``: the joiners it serves, whose
        membership the answer reports (the answer does not list the members)."""
        return {"step": self.step, "chain": self.chain, "last_quorum_id": self.quorum_id,
                "failed": self.failed, "recover_request": self.recover_request,
                "watch": sorted(self._serving)[:MAX_WATCH], "disk_checked": self.disk_checked,
                "disk_round": self.disk_round}

    def reload_due(self, head: int | None, again: int = 0) -> bool:
        """Whether a "no quorum yet" answer naming ``head`` (no live group holds it), in its round
        ``again`` (``reload_round``), asks this group to look for a durable checkpoint newer than
        its state; if so, it will have looked by its next request (which says so)."""
        if head is None or head <= self.step or (head, again) == (self.disk_checked, self.disk_round):
            return False
        self.disk_checked, self.disk_round = head, again
        return True

    # -- an issued quorum ------------------------------------------------------------------------
    def on_quorum(self, q: AnyQuorum) -> Role:
        """What ``q`` asks of this group. Raises TooManyFailures after too many own failures."""
        if self._suspect is not None:
            # A failed step counts against this group only if the same members came back: when a
            # peer died or a joiner came and went, the failure was theirs, not this group's.
            if q.digest == self._suspect:
                self.consecutive += 1
            self._suspect = None
            if self.consecutive >= self.max_consecutive_failures:
                raise TooManyFailures(
                    f"{self.consecutive} consecutive steps failed with the same members "
                    f"(ft.max_consecutive_failures={self.max_consecutive_failures}); last error: "
                    f"{self.failure}")
        self.quorum = q
        self.quorum_id = q.quorum_id
        self.known_head = max(self.known_head, q.step, self.step)
        self.disk_checked, self.disk_round = -1, 0
        self.failed, self.failure = False, ""
        me = self.replica_id
        recovering = q.is_recovering(me)
        drain = self.total_steps is not None and q.step >= self.total_steps
        reconfigure = not drain and (q.epoch, q.quorum_id) != self._pg_quorum
        publish = False
        # A joiner that is done (or pulls from someone else now) needs its snapshot no more; a
        # snapshot no joiner needs is dropped (Role.retain), so it must be published anew when
        # a later request asks for the same step.
        joiners = q.joiners_of(me)
        mine = {m.replica_id for m in joiners}
        serving: dict[str, int] = {}
        for j, step in self._serving.items():
            if j in mine:
                serving[j], self._absent[j] = step, 0
            elif not q.present(j) and self._absent.get(j, 0) < ABSENT_QUORUMS:
                # Not in this quorum: a joiner busy pulling may ask too late for it (join
                # timeout), so its snapshot stays for a while; a dead one's goes after that.
                serving[j], self._absent[j] = step, self._absent.get(j, 0) + 1
        self._absent = {j: n for j, n in self._absent.items() if j in serving}
        self._serving = serving
        if self._published_step not in self._serving.values():
            self._published_step = None
        for member in joiners:
            request = (member.replica_id, int(member.meta.get("recover_request", 0)))
            if request in self._served:
                continue
            self._served.add(request)
            self._serving[member.replica_id] = q.step
            if self._published_step != q.step:
                publish = True
                self._published_step = q.step
        fetch_from = None
        if recovering and not self.fetching:
            fetch_from = q.source_of(me)
            self.fetching = fetch_from is not None
        self.role = Role(q, q.participant_index(me), recovering, drain, reconfigure, publish,
                         fetch_from, frozenset(self._serving.values()))
        return self.role

    def process_group_ready(self) -> None:
        """The cross-group process group of the current quorum is built."""
        q = self.quorum
        self._pg_quorum = (q.epoch, q.quorum_id) if q is not None else None

    # -- the outcome of a step -------------------------------------------------------------------
    def fail(self, reason: str) -> None:
        """Record that this step failed here (collective error, abort, a local fault)."""
        if not self.failed:
            self.failure = reason
        self.failed = True
        self._pg_quorum = None  # the process group is aborted: rebuild it next time

    def on_outcome(self, ok: bool) -> bool:
        """The group-wide vote ``ok``; returns whether the update is applied (and advances).

        A participant that commits moves to ``(step + 1, next chain)`` at once, so that its
        heartbeats report the new committed state before it asks again. A recovering group's
        update is buffered; its state moves when the replay is checked (``caught_up``).
        """
        role = self.role
        assert role is not None, "on_outcome before on_quorum"
        if not ok:
            self.failed = True
            self._suspect = role.quorum.digest
            return False
        self.consecutive = 0
        if not role.recovering and not role.drain:
            self.step, self.chain = role.quorum.step + 1, role.quorum.next_chain()
            self.known_head = max(self.known_head, self.step)
        return True

    # -- recovery --------------------------------------------------------------------------------
    def fetch_finished(self) -> None:
        """A pull ended without a usable state (it failed, was abandoned, or its replay did not
        lead to the head): the next quorum's source serves a new request."""
        self.fetching = False
        self.recover_request += 1

    def caught_up(self, step: int, chain: str) -> None:
        """The replayed state was checked against the head: report it from now on. The pull is
        over; a later recovery is a new request.

        Until then a pull that arrived stays open: a backlog replayed over several steps used to
        start a second whole-state pull at the next quorum (and a new snapshot copy on the
        source), which slowed every group while the first one was still being replayed."""
        self.step, self.chain = step, chain
        self.fetching = False
        self.recover_request += 1


REPLAY_AT_LEAST = 2
"""Buffered updates a recovering group replays per step at least while it catches up (more while
the all-reduce waits; all of them once it is the last step before the head): the catch-up never
falls further behind, and never holds the participants' step up."""


def check_replay(snapshot_step: int, snapshot_chain: str, records: list[tuple[int, int, list[str]]],
                 quorum: AnyQuorum, committed_now: bool) -> ReplayCheck:
    """Whether a snapshot plus buffered updates reproduces the head, and how far to apply.

    ``records`` are ``(step, quorum_id, participants)`` of the buffered updates from
    ``snapshot_step`` on, in order and without gaps. Folding them over the snapshot's chain must
    reach ``quorum.chain`` exactly at ``quorum.step`` (the head the participants hold); the record
    of ``quorum.step`` itself is applied only when this step committed here (``committed_now``).
    Anything else (a missing step, an update of a quorum whose step was redone elsewhere, a
    snapshot newer than the head) means the pull must start over.
    """
    chain, step, applied = snapshot_chain, snapshot_step, 0
    for rec_step, qid, participants in records:
        if rec_step != step:
            return ReplayCheck(False, 0, chain, f"buffered updates jump from step {step} to {rec_step}")
        if step == quorum.step:
            break
        chain = extend_chain(chain, step, qid, participants)
        step += 1
        applied += 1
    if step != quorum.step or chain != quorum.chain:
        return ReplayCheck(False, 0, chain,
                           f"snapshot of step {snapshot_step} plus {applied} buffered update(s) reaches "
                           f"step {step} with another history than the head (step {quorum.step})")
    if committed_now and records and records[-1][0] == quorum.step:
        return ReplayCheck(True, applied + 1, quorum.next_chain())
    return ReplayCheck(True, applied, chain)
