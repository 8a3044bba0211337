"""The simulated world of one seeded job: the clock, the event queue, the network and the
coordinator process, and the run loop that drives the parts of the model after every event.

``Simulation`` owns what every part shares: the seeded random source (one, so that a seed replays
exactly), the simulated clock and its queue of events (``at``), the trace of events, the
network (latency, lost messages), the coordinator (the real ``ftlm.ft.membership.Membership``):
the door its messages go through (``to_door``: handled at once, or queued while the process is
stopped), its crash and restart, its pause and resumption, and the delivery of what it outputs
(answers to long-polls, issued quorums, events). It composes the rest, each holding a reference
back to it: the launcher and supervisor (``ftlm.sim.processes``), each group's step loop
(``ftlm.sim.group``), the all-reduce (``ftlm.sim.collective``), live recovery and reloads from
disk (``ftlm.sim.recovery``), durable checkpoints and the model file (``ftlm.sim.durable``), the
fault schedule (``ftlm.sim.faults``) and the invariant checks (``ftlm.sim.invariants``).

Not responsible for what a group does (the group model) nor for judging what happened (the
invariants); not for timing or cost at scale (the goodput model), nor tensors.
"""

from __future__ import annotations

import heapq
import random
from typing import Any, Callable

from ftlm.ft.coordinator_record import apply_entry, entry_of
from ftlm.ft.membership import Answer, Event, Issued, Membership
from ftlm.ft.quorum import MemberRequest, QuorumOptions, StaleIncarnation
from ftlm.sim.collective import AllReduce, quorum_key
from ftlm.sim.durable import Storage
from ftlm.sim.faults import Faults
from ftlm.sim.group import GroupModel
from ftlm.sim.invariants import Invariants
from ftlm.sim.job import Incarnation, SimConfig, SimResult, State, Violation
from ftlm.sim.processes import Launcher
from ftlm.sim.recovery import Recovery

TICK = 0.05
"""Seconds between the coordinator's re-evaluations (``CoordinatorConfig.tick_interval``)."""


class Simulation:
    """One seeded run; ``run()`` returns a ``SimResult`` (``ok`` False on a violation)."""

    def __init__(self, seed: int, config: SimConfig | None = None, trace_len: int = 60) -> None:
        self.seed = seed
        self.c = config or SimConfig()
        self.rng = random.Random(seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None], str]] = []
        self.seq = 0  # events scheduled so far (also names a bogus claim's incarnation)
        self.options = QuorumOptions(1, self.c.join_timeout, self.c.heartbeat_timeout, self.c.groups,
                                     progress_timeout=self.c.progress_timeout,
                                     suspect_window=self.c.suspect_window, probe_after=self.c.probe_after,
                                     max_participants=self.c.groups - self.c.spares if self.c.spares else 0)
        self.reports_deaths = {"all": True, "none": False}.get(self.c.supervisor_reports, seed % 2 == 1)
        self.coordinator: Membership | None = Membership(self.options, self._epoch(), TICK)
        self.inbox: list[Callable[[], None]] | None = None  # messages waiting on a stopped coordinator
        self.resumed_at = float("-inf")  # when the coordinator last resumed after a pause
        # When the coordinator did not answer at all (stopped or crashed): closed outages, and
        # the start of the one in progress. A source of its own draws which outages are long.
        self.outages: list[tuple[float, float]] = []
        self.down_since: float | None = None
        self.long_outage = False  # the outage in progress is one of the long ones
        self.outage_rng = random.Random(seed * 7919 + 17)
        # When each replica's last message reached the coordinator's door (handled, or waiting
        # on a stopped coordinator) since it (re)started.
        self.door_seen: dict[str, float] = {}
        # replica id -> its request whose long-poll the coordinator holds (the last it handled, until
        # answered or withdrawn): a stopped coordinator may answer one whose member asked anew meanwhile
        self.polls: dict[str, tuple[MemberRequest, int]] = {}
        self.coordinator_epoch = 0
        self.groups: dict[str, Incarnation | None] = {f"g{i}": None for i in range(self.c.groups)}
        self.trace: list[str] = []
        self._trace_len = trace_len
        self.restores = 0
        self.restores_past_checkpoint = self.steps_past_checkpoint = 0
        self.past_checkpoint: int | None = None  # the newest step on disk when a rollback went below it
        self.finished: dict[str, State] = {}
        self.lost_groups: set[str] = set()  # died after every other group had finished: not restarted
        self.exited: dict[str, float] = {}  # finished group -> when the supervisor sees its process end
        self.departed: set[str] = set()  # left and not started again by the launcher
        self.record_kept: list[dict] = []  # the coordinator's record (``SimConfig.coordinator_record``)
        self.loss = self.c.loss
        self.last_loss = float("-inf")  # when a message was last lost
        self.lost_answers: set[tuple[str, int, int, str]] = set()  # (epoch, quorum id, step, replica id)
        self.launcher = Launcher(self)
        self.group_model = GroupModel(self)
        self.allreduce = AllReduce(self)
        self.recovery = Recovery(self)
        self.storage = Storage(self)
        self.faults = Faults(self)
        self.invariants = Invariants(self)

    def _epoch(self) -> str:
        return f"e{self.rng.getrandbits(32):08x}"

    # -- the scheduler ---------------------------------------------------------------------------
    def at(self, delay: float, fn: Callable[[], None], what: str) -> None:
        self.seq += 1
        heapq.heappush(self._queue, (self.now + max(0.0, delay), self.seq, fn, what))

    def log(self, text: str) -> None:
        self.trace.append(f"{self.now:9.3f} {text}")
        if len(self.trace) > self._trace_len:
            del self.trace[0]

    def fail(self, text: str) -> None:
        raise Violation(f"seed {self.seed}: {text}")

    # -- the network -----------------------------------------------------------------------------
    def latency(self) -> float:
        lo, hi = self.c.latency
        return self.rng.uniform(lo, hi)

    def lost(self) -> bool:
        if self.rng.random() < self.loss:
            self.last_loss = self.now
            return True
        return False

    def incarnation(self, replica_id: str) -> Incarnation | None:
        """The live incarnation ``replica_id`` names (None: its group runs another one, or none)."""
        inc = self.groups.get(replica_id.split(":")[0])
        return inc if inc is not None and inc.replica_id == replica_id else None

    def alive(self, replica_id: str) -> bool:
        """``replica_id``'s process is alive, or its group finished the job."""
        inc = self.incarnation(replica_id)
        return (inc is not None and inc.alive) or replica_id.split(":")[0] in self.finished

    def settled(self) -> int:
        """Groups done: finished, or gone for good (lost, departed)."""
        return len(self.finished) + len(self.lost_groups) + len(self.departed - set(self.finished))

    def run(self) -> SimResult:
        inv = self.invariants
        try:
            for g in self.groups:
                self.launcher.spawn(g, delay=self.rng.uniform(0.0, 0.3))
            self.at(TICK, self.tick, "tick")
            if self.c.fault_mtbf > 0:
                self.at(self.rng.expovariate(1 / self.c.fault_mtbf), self.faults.inject, "fault")
            self.faults.schedule_corruption()
            while self._queue and self.settled() < self.c.groups:
                self.now, _, fn, what = heapq.heappop(self._queue)
                if self.now > self.c.max_seconds:
                    self.fail("the run did not finish within max_seconds")
                fn()
                inv.check(what)
            if self.settled() < self.c.groups:
                self.fail(f"the run stalled: {sorted(self.finished)} finished of {self.c.groups}")
            inv.check_end()
            return SimResult(self.seed, True, self.c.steps, self.faults.counts, self.restores, self.now,
                             leaves_judged=inv.leaves_judged,
                             restores_past_checkpoint=self.restores_past_checkpoint,
                             steps_past_checkpoint=self.steps_past_checkpoint,
                             convictions=inv.convictions, wrong_convictions=inv.wrong_convictions,
                             promotions=inv.promotions, spare_quorums=inv.spare_quorums)
        except Violation as e:
            return SimResult(self.seed, False, self.c.steps, self.faults.counts, self.restores, self.now, str(e),
                             list(self.trace), inv.leaves_judged, self.restores_past_checkpoint,
                             self.steps_past_checkpoint)

    # -- the coordinator -------------------------------------------------------------------------
    def tick(self) -> None:
        if self.coordinator is not None and self.inbox is None:  # (a stopped coordinator does not tick)
            self.deliver_outputs(self.coordinator.tick(self.now))
        self.launcher.supervise()
        self.at(TICK, self.tick, "tick")

    def to_door(self, handle: Callable[[], None]) -> None:
        """A message reaches the coordinator: handled now, or when it resumes if it is stopped
        (the kernel keeps its connections' bytes meanwhile)."""
        if self.inbox is not None:
            self.inbox.append(handle)
        else:
            handle()

    def to_coordinator(self, inc: Incarnation, call: Callable[[Membership], Any]) -> Any:
        """A message of ``inc`` reaches the coordinator; None when its incarnation was refused
        (the process then exits, as the real one does on a 409)."""
        try:
            result = call(self.coordinator)
        except StaleIncarnation as e:
            self.storage.set_aside(inc, getattr(e, "suspect_state", None))
            if not inc.left:  # (a message that overtook its own leave: the process exits anyway)
                self.at(self.latency(), lambda: self.launcher.die(inc, "stale incarnation"), "stale")
            return None
        inc.registered = True
        return result

    def withdraw(self, req: MemberRequest) -> None:
        """A long-poll ended (answered, timed out, dropped): the coordinator forgets its request."""
        def handle() -> None:
            if self.coordinator is not None:
                self.coordinator.withdraw(req)
            held = self.polls.get(req.replica_id)
            if held is not None and held[0] is req:
                del self.polls[req.replica_id]
        self.to_door(handle)

    def pause_coordinator(self) -> None:
        """SIGSTOP the coordinator for 2-6 heartbeat timeouts, then SIGCONT: what was sent to it
        meanwhile is handled on resumption, in the order it came, before or after its first tick."""
        if self.coordinator is None or self.inbox is not None:
            return
        self.inbox = []
        epoch = self.coordinator_epoch
        seconds = self.rng.uniform(2.0, 6.0) * self.c.heartbeat_timeout
        seconds = self._maybe_long(seconds)
        self.log(f"coordinator stopped for {seconds:.2f} s")
        self.down_since = self.now

        def resume() -> None:
            if self.coordinator_epoch != epoch or self.inbox is None or self.coordinator is None:
                return
            queued, self.inbox = self.inbox, None
            self.resumed_at = self.now
            self._outage_over()
            self.log(f"coordinator resumes: {len(queued)} message(s) waited")
            tick_first = self.rng.random() < 0.5
            if tick_first:
                self.deliver_outputs(self.coordinator.tick(self.now))
            for handle in queued:
                handle()
            if not tick_first and self.coordinator is not None:
                self.deliver_outputs(self.coordinator.tick(self.now))
        self.at(seconds, resume, "SIGCONT coordinator")

    def coordinator_crash(self) -> None:
        self.log("coordinator crash")
        self.coordinator = None
        self.inbox = None  # (what waited on a stopped coordinator is lost with it)
        self.door_seen = {}
        for inc in self.groups.values():  # their long-polls wait on a coordinator that forgot them
            if inc is not None and inc.polling:
                inc.request_lost = True
        self.coordinator_epoch += 1
        epoch = self.coordinator_epoch
        self.invariants.head = None
        if self.down_since is None:  # (crashed while stopped: the outage began at the stop)
            self.down_since = self.now

        def restart() -> None:
            if self.coordinator_epoch == epoch:
                self.coordinator = Membership(self.options, self._epoch(), TICK)
                for entry in self.record_kept:  # (the run directory's coordinator_record.jsonl)
                    apply_entry(self.coordinator, entry)
                self._outage_over()
                self.log("coordinator restart")
        self.at(self._maybe_long(self.rng.uniform(0.2, 1.5)), restart, "coordinator restart")

    def _maybe_long(self, seconds: float) -> float:
        """``seconds``, or for a share ``long_outages`` of outages 1.2-2.5 ``quorum_seconds``."""
        if self.outage_rng.random() < self.c.long_outages:
            self.long_outage = True
            return self.outage_rng.uniform(1.2, 2.5) * self.c.quorum_seconds
        return seconds

    def _outage_over(self) -> None:
        if self.down_since is not None:
            self.outages.append((self.down_since, self.now))
            self.log(f"coordinator back after {self.now - self.down_since:.2f} s")
            self.down_since = None
            self.long_outage = False

    def down_seconds(self, since: float) -> float:
        """Seconds of ``[since, now]`` during which the coordinator did not answer."""
        spans = self.outages + ([(self.down_since, self.now)] if self.down_since is not None else [])
        return sum(max(0.0, b - max(a, since)) for a, b in spans if b > since)

    def answering_since(self, since: float) -> float | None:
        """The start of the coordinator's current stretch of answering within ``[since, now]``
        (``since`` when no outage ended after it); None during an outage."""
        if self.down_since is not None:
            return None
        return max([since] + [b for _, b in self.outages])

    def deliver_outputs(self, outputs: list) -> None:
        """What the coordinator output: answers go to their long-polls; issued quorums and events
        are checked (``Invariants``) and counted."""
        inv = self.invariants
        for o in outputs:
            if isinstance(o, Answer):
                self.send_answer(o)
            elif isinstance(o, Issued):
                q = o.quorum
                if o.new_id:
                    spares = f" S={q.spares}" if q.spares else ""
                    self.log(f"quorum {q.quorum_id} step {q.step} P={q.participants} R={q.recovering}{spares}")
                    if self.past_checkpoint is not None:  # the first quorum after a rollback past the disk
                        newest, self.past_checkpoint = self.past_checkpoint, None
                        if q.step < newest:
                            self.restores_past_checkpoint += 1
                            self.steps_past_checkpoint += newest - q.step
                inv.check_quorum_id(q)
                inv.check_no_corrupt_participant(q)
                inv.check_roles(q)
            elif isinstance(o, Event):
                if self.c.coordinator_record and (entry := entry_of(o.kind, o.fields)) is not None:
                    self.record_kept.append(entry)
                if o.kind == "member_dead":
                    inv.check_silence(o.fields["replica_id"], o.fields["reason"])
                if o.kind == "member_dead" and self.coordinator is not None and self.coordinator.convictions:
                    inv.check_conviction(o.fields["replica_id"])
                if o.kind == "restore":
                    self.restored(o)
                if o.kind == "state_mismatch":
                    inv.state_mismatch(o.fields)
        inv.check_head()

    def restored(self, event: Event) -> None:
        """The coordinator rolled the job back (a ``restore`` event)."""
        fields = event.fields
        inv = self.invariants
        if self.finished:
            self.fail(f"the job finished at step {next(iter(self.finished.values())).step} "
                      f"and was rolled back: {fields['reason']}")
        self.restores += 1
        inv.record.append({"ts": self.now, "kind": "restore", "group": "coordinator",
                           "step": fields["to_step"], **fields})
        newest = max(self.storage.disk, default=-1)
        # Counted when the next quorum acts on it (a later restore may undo it first).
        self.past_checkpoint = newest if fields["to_step"] < newest <= fields["from_step"] else None
        inv.leave_watches = []  # the others wait for a rollback, rightly
        self.log(f"restore {fields['from_step']} -> {fields['to_step']}")
        inv.head = None  # an explicit rollback: the next head is judged afresh

    def send_answer(self, answer: Answer) -> None:
        inc = self.incarnation(answer.replica_id)
        if inc is None:
            return
        # The long-poll the coordinator holds gets it (a member that asked anew meanwhile does not
        # take an answer to its earlier request).
        held = self.polls.pop(answer.replica_id, None)
        seq = held[1] if held is not None else inc.request_seq
        if self.lost():
            inc.request_lost = inc.request_lost or seq == inc.request_seq
            if answer.quorum is not None:
                self.lost_answers.add((*quorum_key(answer.quorum), answer.replica_id))
            return
        self.at(self.latency(), lambda: self.group_model.on_answer(inc, seq, answer), f"answer {answer.replica_id}")
