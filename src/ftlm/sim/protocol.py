"""Deterministic simulation of a fault-tolerant job: the real protocol code, a seeded scheduler,
a simulated clock, and faults at any moment.

What runs for real: the coordinator's state machine (``ftlm.ft.membership.Membership``, with the
quorum rules of ``ftlm.ft.quorum``), each group's step protocol (``ftlm.ft.group.GroupProtocol``)
and the catch-up check (``ftlm.ft.group.check_replay``): the same objects the aiohttp server and
the manager drive in production. What is simulated: the network (latency, loss, reordering), the
processes (start-up, crashes, hangs of a whole group or of its training thread only, graceful
leaves on SIGTERM, the checkpoint writer saving its step first, and the launcher that starts a
group again), the all-reduce (which can complete for some members and fail for others), the
state transfer (slow, failing, source dying mid-way), durable checkpoints and the job's model
file, the coordinator process (crashed and restarted, or stopped and resumed with the messages
sent to it meanwhile waiting at its door), the local supervisor, and a group's model, reduced to
what the invariants need: its step, history chain, data cursor and the sample ranges of its
history (the job's shape and the processes' state are ``ftlm.sim.job``). A group's loop
follows the trainer's order of operations (``ftlm.train.trainer``): it asks for the next quorum
right after its commit vote and applies its update while the request waits, owes that quorum's
step even when asked to stop meanwhile, and, recovering, loads an arrived snapshot and replays
its backlog of buffered updates while its zero contribution to the all-reduce waits (over
several steps when it is long), reporting the head after the vote of the step it reached it in.

After every event the simulator checks the invariants listed in docs/ft-protocol.md,
'The simulator'; a violation stops
the run with the seed and the trace of events that led to it, so ``run(seed)`` replays it
exactly. Not responsible for: timing or cost at scale (that is the goodput model), nor tensors.
"""

from __future__ import annotations

import heapq
import random
from typing import Any, Callable

from ftlm.ft.client import reload_word
from ftlm.ft.end_of_run import may_write_model
from ftlm.ft.group import GroupProtocol, TooManyFailures, check_replay
from ftlm.ft.history import extend_chain
from ftlm.ft.membership import Answer, Event, Issued, Membership
from ftlm.ft.quorum import Heartbeat, MemberRequest, Quorum, QuorumOptions, StaleIncarnation
from ftlm.ft.quorum_answer import AnswerEncoder, MemberQuorum
from ftlm.observe.summary import data_accounting
from ftlm.sim.job import (FAULTS, Collective, Incarnation, LeaveWatch, SimConfig, SimResult, State, Violation,
                          copy_state)

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
        self._seq = 0
        self.options = QuorumOptions(1, self.c.join_timeout, self.c.heartbeat_timeout, self.c.groups,
                                     progress_timeout=self.c.progress_timeout,
                                     suspect_window=self.c.suspect_window, probe_after=self.c.probe_after)
        self.reports_deaths = {"all": True, "none": False}.get(self.c.supervisor_reports, seed % 2 == 1)
        every = self.c.checkpoint_every
        self.checkpoint_every = every if every is not None else 0 if seed % 3 == 2 else 10
        self.encoder = AnswerEncoder()
        self.coordinator: Membership | None = Membership(self.options, self._epoch(), TICK)
        self.inbox: list[Callable[[], None]] | None = None  # messages waiting on a stopped coordinator
        self.resumed_at = float("-inf")  # when the coordinator last resumed after a pause
        # When each replica's last message reached the coordinator's door (handled, or waiting
        # on a stopped coordinator) since it (re)started.
        self.door_seen: dict[str, float] = {}
        # replica id -> its request whose long-poll the coordinator holds (the last it handled, until
        # answered or withdrawn): a stopped coordinator may answer one whose member asked anew meanwhile
        self.polls: dict[str, tuple[MemberRequest, int]] = {}
        self.model: State | None = None  # what the job's model file holds (each group writes it as it exits)
        self.model_at = 0.0  # when it was written
        self.coordinator_epoch = 0
        self.groups: dict[str, Incarnation | None] = {f"g{i}": None for i in range(self.c.groups)}
        self.disk: dict[int, State] = {}
        self.collectives: dict[tuple[int, int], Collective] = {}
        self.trace: list[str] = []
        self._trace_len = trace_len
        self.faults: dict[str, int] = {}
        self.restores = 0
        self.restores_past_checkpoint = self.steps_past_checkpoint = 0
        self.past_checkpoint: int | None = None  # the newest step on disk when a rollback went below it
        # The job's record as events.jsonl would hold it (the trainer's commits, the coordinator's
        # restores): at the end the summary's accounting of it must prove what happened.
        self.record: list[dict] = []
        self.last_fault = 0.0
        self.max_issued_id: dict[str, int] = {}  # per coordinator epoch
        self.head: tuple[int, str] | None = None
        self.seen_states: dict[str, State] = {}  # chain -> state (same chain, same history)
        self.pending_hung: dict[str, tuple[float, str]] = {}  # replica id -> (since, kind)
        self.finished: dict[str, State] = {}
        self.lost_groups: set[str] = set()  # died after every other group had finished: not restarted
        self.endgame = False  # a group came within 3 steps of the end
        self.slow_restart: set[str] = set()  # groups whose next restart outlasts the drain
        self.exited: dict[str, float] = {}  # finished group -> when the supervisor sees its process end
        self._inc_seq = 0
        self.loss = self.c.loss
        self.last_commit = 0.0
        self.slow_next = False
        self.kill_source_next = False
        self.departed: set[str] = set()  # left and not started again by the launcher
        self.last_loss = float("-inf")  # when a message was last lost
        self.leave_watches: list[LeaveWatch] = []
        self.leaves_judged = 0
        self.lost_answers: set[tuple[str, int, int, str]] = set()  # (epoch, quorum id, step, replica id)
        self.sticky_links: set[str] = set()  # groups whose next process starts with a bad link
        self.hang_next_start: set[str] = set()  # groups whose next process hangs before it registers
        self.disturbed_at = float("-inf")  # the last fault other than a bad link that struck
        self.convictions = self.wrong_convictions = 0  # see SimResult

    def _epoch(self) -> str:
        return f"e{self.rng.getrandbits(32):08x}"

    # -- the scheduler ---------------------------------------------------------------------------
    def at(self, delay: float, fn: Callable[[], None], what: str) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (self.now + max(0.0, delay), self._seq, fn, what))

    def log(self, text: str) -> None:
        self.trace.append(f"{self.now:9.3f} {text}")
        if len(self.trace) > self._trace_len:
            del self.trace[0]

    def fail(self, text: str) -> None:
        raise Violation(f"seed {self.seed}: {text}")

    def latency(self) -> float:
        lo, hi = self.c.latency
        return self.rng.uniform(lo, hi)

    def lost(self) -> bool:
        if self.rng.random() < self.loss:
            self.last_loss = self.now
            return True
        return False

    def settled(self) -> int:
        """Groups done: finished, or gone for good (lost, departed)."""
        return len(self.finished) + len(self.lost_groups) + len(self.departed - set(self.finished))

    def run(self) -> SimResult:
        try:
            for g in self.groups:
                self.spawn(g, delay=self.rng.uniform(0.0, 0.3))
            self.at(TICK, self.tick, "tick")
            if self.c.fault_mtbf > 0:
                self.at(self.rng.expovariate(1 / self.c.fault_mtbf), self.inject, "fault")
            while self._queue and self.settled() < self.c.groups:
                self.now, _, fn, what = heapq.heappop(self._queue)
                if self.now > self.c.max_seconds:
                    self.fail("the run did not finish within max_seconds")
                fn()
                self.check(what)
            if self.settled() < self.c.groups:
                self.fail(f"the run stalled: {sorted(self.finished)} finished of {self.c.groups}")
            self.check_end()
            return SimResult(self.seed, True, self.c.steps, self.faults, self.restores, self.now,
                             leaves_judged=self.leaves_judged,
                             restores_past_checkpoint=self.restores_past_checkpoint,
                             steps_past_checkpoint=self.steps_past_checkpoint,
                             convictions=self.convictions, wrong_convictions=self.wrong_convictions)
        except Violation as e:
            return SimResult(self.seed, False, self.c.steps, self.faults, self.restores, self.now, str(e),
                             list(self.trace), self.leaves_judged, self.restores_past_checkpoint,
                             self.steps_past_checkpoint)

    # -- processes (the supervisor's view) -------------------------------------------------------
    def spawn(self, group: str, delay: float) -> None:
        def start() -> None:
            others = [g for g in self.groups if g != group]
            if self.finished and self.c.steps not in self.disk and all(
                    g in self.lost_groups or g in self.departed
                    or self.exited.get(g, self.now + 1) <= self.now for g in others):
                # As the local supervisor does: every other group finished and its process
                # exited, and the final step is not on disk, so a new incarnation would have
                # nobody to recover from. (With it, the new incarnation resumes at the end.)
                self.lost_groups.add(group)
                self.log(f"lost {group}: died after every other group had finished")
                return
            self._inc_seq += 1
            inc = Incarnation(group, f"i{self._inc_seq}", GroupProtocol(
                f"{group}:i{self._inc_seq}", self.c.max_consecutive_failures, self.c.steps), State(),
                started_at=self.now)
            self.groups[group] = inc
            if group in self.sticky_links:
                self.sticky_links.discard(group)
                inc.bad_link = inc.injected = True
                self.last_fault = self.now  # (a fault again: liveness counts from here)
                self.log(f"spawn {inc.replica_id} (its link is still bad)")
            self.log(f"spawn {inc.replica_id}")
            if group in self.hang_next_start:  # wedged before it registers: only the start-up timeout finds it
                self.hang_next_start.discard(group)
                inc.injected = inc.hung = True
                self.pending_hung[inc.replica_id] = (self.now, "hang_restarting")
                self.log(f"{inc.replica_id} hangs while starting")
            lo, hi = self.c.startup_seconds
            self.at(self.rng.uniform(lo, hi), lambda: self.boot(inc), f"boot {inc.replica_id}")
            self.at(self.c.startup_timeout, lambda: self.startup_watchdog(inc), "watchdog")
        self.at(delay, start, f"start {group}")

    def boot(self, inc: Incarnation) -> None:
        if not inc.running:
            return
        # Resume from the newest durable checkpoint, as `ftlm train` does with checkpoint.resume.
        steps = sorted(self.disk)
        if steps:
            pick = steps[-1]
            if inc.lag_once and len(steps) > 1:  # restored from an older checkpoint on purpose
                pick = steps[self.rng.randrange(len(steps) - 1)]
            inc.state = copy_state(self.disk[pick])
            inc.writer = False
        inc.proto.sync(inc.state.step, inc.state.chain)
        inc.phase = "idle"
        self.log(f"boot {inc.replica_id} at step {inc.state.step}")
        self.heartbeat(inc)
        self.next_step(inc)  # (a stop requested during start-up: it joined, and leaves at once)

    def die(self, inc: Incarnation, why: str, restart: bool = True) -> None:
        if not inc.alive:
            return
        inc.alive = False
        self.log(f"exit {inc.replica_id}: {why}")
        if inc.bad_link and self.rng.random() < self.c.sticky_link:
            self.sticky_links.add(inc.group)
        # Its connections reset: peers inside an all-reduce with it fail at once (transport error).
        for other in self.groups.values():
            if (other is not None and other is not inc and other.phase == "collective" and other.quorum is not None
                    and other.quorum.present(inc.replica_id)):
                self.at(self.latency(), lambda o=other, q=other.quorum: self.peer_reset(o, q), "connection reset")
        if self.groups.get(inc.group) is inc and restart:
            if self.coordinator is not None and self.reports_deaths:
                def report() -> None:
                    if self.coordinator is not None:
                        self.deliver_outputs(self.coordinator.report_dead(self.now, inc.replica_id, inc.group, why))
                self.to_door(report)
            delay = self.c.restart_delay
            if inc.group in self.slow_restart:  # its node takes long to come back
                self.slow_restart.discard(inc.group)
                delay += self.rng.uniform(0.5, 1.5) * self.c.drain_seconds
                self.at(delay, lambda: setattr(self, "last_fault", self.now), "slow restart")  # liveness from here
            self.spawn(inc.group, delay)

    def startup_watchdog(self, inc: Incarnation) -> None:
        if inc.alive and not inc.registered and not inc.left:  # (stopped while starting: it left at boot)
            if not inc.injected:
                self.fail(f"{inc.replica_id} did not register within the start-up timeout without a fault")
            self.die(inc, "start-up timeout")

    def supervise(self) -> None:
        """Kill hung processes the coordinator declared dead (as the local supervisor does)."""
        if self.coordinator is None:
            return
        dead = {rid for t, rid, _, _ in self.coordinator.recent_dead(self.now) if self.now - t >= 0.5}
        members = self.coordinator.state.heartbeats
        for inc in list(self.groups.values()):
            if inc is None or not inc.alive or inc.phase == "starting" or inc.left:
                continue
            if inc.replica_id in dead and (inc.hung or inc.hung_training):
                self.die(inc, "killed: declared dead while hung")
            # Not a live member for a start-up timeout (hung before registering, or silent since
            # the coordinator restarted): hung.
            inc.absent_since = None if inc.replica_id in members else (inc.absent_since or self.now)
            if inc.absent_since is not None and self.now - inc.absent_since > self.c.startup_timeout:
                if not inc.injected:
                    self.fail(f"{inc.replica_id} was not a live member for {self.c.startup_timeout} s "
                              "without a fault")
                self.die(inc, "killed: not a live member")
        for rid, (since, kind) in list(self.pending_hung.items()):
            inc = self.groups.get(rid.split(":")[0])
            if inc is None or inc.replica_id != rid or not inc.alive:
                del self.pending_hung[rid]
            elif self.now - since > 30.0:
                self.fail(f"fault {kind} of {rid} was never detected")

    # -- the coordinator -------------------------------------------------------------------------
    def tick(self) -> None:
        if self.coordinator is not None and self.inbox is None:  # (a stopped coordinator does not tick)
            self.deliver_outputs(self.coordinator.tick(self.now))
        self.supervise()
        self.at(TICK, self.tick, "tick")

    def to_door(self, handle: Callable[[], None]) -> None:
        """A message reaches the coordinator: handled now, or when it resumes if it is stopped
        (the kernel keeps its connections' bytes meanwhile)."""
        if self.inbox is not None:
            self.inbox.append(handle)
        else:
            handle()

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
        self.log(f"coordinator stopped for {seconds:.2f} s")

        def resume() -> None:
            if self.coordinator_epoch != epoch or self.inbox is None or self.coordinator is None:
                return
            queued, self.inbox = self.inbox, None
            self.resumed_at = self.now
            self.log(f"coordinator resumes: {len(queued)} message(s) waited")
            tick_first = self.rng.random() < 0.5
            if tick_first:
                self.deliver_outputs(self.coordinator.tick(self.now))
            for handle in queued:
                handle()
            if not tick_first and self.coordinator is not None:
                self.deliver_outputs(self.coordinator.tick(self.now))
        self.at(seconds, resume, "SIGCONT coordinator")

    def deliver_outputs(self, outputs: list) -> None:
        for o in outputs:
            if isinstance(o, Answer):
                self.send_answer(o)
            elif isinstance(o, Issued):
                q = o.quorum
                if o.new_id:
                    self.log(f"quorum {q.quorum_id} step {q.step} P={q.participants} R={q.recovering}")
                    if self.past_checkpoint is not None:  # the first quorum after a rollback past the disk
                        newest, self.past_checkpoint = self.past_checkpoint, None
                        if q.step < newest:
                            self.restores_past_checkpoint += 1
                            self.steps_past_checkpoint += newest - q.step
                last = self.max_issued_id.get(q.epoch, -1)
                if q.quorum_id < last:
                    self.fail(f"quorum id went back: {q.quorum_id} after {last}")
                self.max_issued_id[q.epoch] = q.quorum_id
            elif isinstance(o, Event):
                if o.kind == "member_dead":
                    self.check_silence(o.fields["replica_id"], o.fields["reason"])
                if o.kind == "member_dead" and self.coordinator is not None and self.coordinator.convictions:
                    self.check_conviction(o.fields["replica_id"])
                if o.kind == "restore":
                    if self.finished:
                        self.fail(f"the job finished at step {next(iter(self.finished.values())).step} "
                                  f"and was rolled back: {o.fields['reason']}")
                    self.restores += 1
                    self.record.append({"ts": self.now, "kind": "restore", "group": "coordinator",
                                        "step": o.fields["to_step"], **o.fields})
                    newest = max(self.disk, default=-1)
                    # Counted when the next quorum acts on it (a later restore may undo it first).
                    self.past_checkpoint = newest if o.fields["to_step"] < newest <= o.fields["from_step"] else None
                    self.leave_watches = []  # the others wait for a rollback, rightly
                    self.log(f"restore {o.fields['from_step']} -> {o.fields['to_step']}")
                    self.head = None  # an explicit rollback: the next head is judged afresh
        self.check_head()

    def check_silence(self, replica_id: str, reason: str) -> None:
        """A member declared dead for its silence (heartbeat timeout, quiet after a peer's report)
        was silent that long at the coordinator's door: what reached it while it did not run
        (stopped, swapped out) counts. (A member declared hung for no progress is judged by its
        own word, the progress age its heartbeats report, which the coordinator reads in order.)"""
        seen = self.door_seen.get(replica_id)
        if seen is None:
            return
        silent = self.now - seen
        if reason == "heartbeat timeout":
            bound = self.c.heartbeat_timeout
        elif reason.startswith("silent for"):
            bound = self.c.suspect_window
        else:
            return
        if silent < bound - 1e-9:
            self.fail(f"{replica_id} was declared dead ({reason}) {silent:.3f} s after its last word reached "
                      f"the coordinator (it counts {bound:g} s): its silence was the coordinator's")

    def check_conviction(self, replica_id: str) -> None:
        """A member retired for failing the steps it took part in must be one with a bad link,
        unless another fault or a lost message may have failed those attempts too."""
        assert self.coordinator is not None
        at, rid, probe = self.coordinator.convictions[-1]
        if (at, rid) != (self.now, replica_id):
            return
        self.convictions += 1
        inc = self.groups.get(rid.split(":")[0])
        bad = inc is not None and inc.replica_id == rid and inc.bad_link
        self.wrong_convictions += not bad
        self.log(f"convicted {rid} ({'bad link' if bad else 'no bad link'}) of failing step {probe.step}")
        if not bad and max(self.disturbed_at, self.last_loss) < probe.since:
            self.fail(f"{rid} was retired for failing step {probe.step} but its link is good, and no "
                      f"other fault struck since its attempts began failing ({probe.since:.3f})")

    def check_head(self) -> None:
        """The coordinator's head moves forward one step at a time, or back only by a restore."""
        if self.coordinator is None or self.coordinator.state.head is None:
            return
        head = self.coordinator.state.head
        if self.head is not None and head != self.head:
            step, chain = self.head
            if head[0] < step:
                self.fail(f"the head went back from step {step} to {head[0]} without a restore")
            if head[0] == step:
                self.fail(f"the head changed history at step {step} without a restore")
        self.head = head

    def send_answer(self, answer: Answer) -> None:
        inc = self.groups.get(answer.replica_id.split(":")[0])
        if inc is None or inc.replica_id != answer.replica_id:
            return
        # The long-poll the coordinator holds gets it (a member that asked anew meanwhile does not
        # take an answer to its earlier request).
        held = self.polls.pop(answer.replica_id, None)
        seq = held[1] if held is not None else inc.request_seq
        if self.lost():
            inc.request_lost = inc.request_lost or seq == inc.request_seq
            if answer.quorum is not None:
                self.lost_answers.add((*_key(answer.quorum), answer.replica_id))
            return
        self.at(self.latency(), lambda: self.on_answer(inc, seq, answer), f"answer {answer.replica_id}")

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
        self.head = None

        def restart() -> None:
            if self.coordinator_epoch == epoch:
                self.coordinator = Membership(self.options, self._epoch(), TICK)
                self.log("coordinator restart")
        self.at(self.rng.uniform(0.2, 1.5), restart, "coordinator restart")

    # -- a group's loop --------------------------------------------------------------------------
    def heartbeat(self, inc: Incarnation) -> None:
        if not inc.alive or inc.left:  # (``Manager.leave`` stops the heartbeat thread first)
            return
        since = self.now - inc.asked_at
        if since < self.c.heartbeat_interval - 1e-9 and not inc.hung:  # (float rounding: no zero waits)
            # As the real Heartbeater: a quorum request went out within the interval, so it was
            # the heartbeat; the next one is due an interval after it.
            self.at(self.c.heartbeat_interval - since, lambda: self.heartbeat(inc), "hb")
            return
        if not inc.hung:
            p = inc.proto
            beat = Heartbeat(inc.replica_id, inc.group, 0.0, p.step, max(p.quorum_id, 0), p.chain,
                             known_head=p.known_head)

            age = 0.0  # seconds since its last progress, as the heartbeat says (``progress_age``)

            def arrive() -> None:
                nonlocal age
                if self.coordinator is None or not inc.alive or inc.left:
                    return
                age = self.now - inc.progress_at
                self.door_seen[inc.replica_id] = self.now
                self.to_door(handle)

            def handle() -> None:
                if self.coordinator is None or not inc.alive:  # (died while it waited: its connection reset)
                    return
                beat.last_seen = self.now
                beat.progress_at = self.now - age  # (as the coordinator reads it: the age counts from now)
                result = self.to_coordinator(inc, lambda c: c.heartbeat(self.now, beat))
                if result is None:
                    return
                answer, outputs = result
                self.deliver_outputs(outputs)
                if not self.lost():
                    self.at(self.latency(), lambda: self.on_heartbeat_answer(inc, answer), "hb answer")
            if not self.lost():
                self.at(self.latency(), arrive, f"heartbeat {inc.replica_id}")
        self.at(self.c.heartbeat_interval, lambda: self.heartbeat(inc), "hb")

    def alive(self, replica_id: str) -> bool:
        inc = self.groups.get(replica_id.split(":")[0])
        return (inc is not None and inc.replica_id == replica_id and inc.alive) or replica_id.split(":")[0] in self.finished

    def to_coordinator(self, inc: Incarnation, call: Callable[[Membership], Any]) -> Any:
        """A message of ``inc`` reaches the coordinator; None when its incarnation was refused
        (the process then exits, as the real one does on a 409)."""
        try:
            result = call(self.coordinator)
        except StaleIncarnation:
            if not inc.left:  # (a message that overtook its own leave: the process exits anyway)
                self.at(self.latency(), lambda: self.die(inc, "stale incarnation"), "stale")
            return None
        inc.registered = True
        return result

    def on_heartbeat_answer(self, inc: Incarnation, answer: dict) -> None:
        if not inc.running:
            return
        inc.reload_hint = reload_word(answer)
        if answer.get("rebuilding") or inc.quorum is None:
            return
        # As the manager: the answer names the quorums in flight that lost a member.
        if answer.get("epoch") == inc.quorum.epoch and inc.quorum.quorum_id in answer.get("dead_quorums", []):
            # As the manager's abort event: it fails this step's collective whenever it comes
            # (until the next quorum clears it), not only while the collective runs.
            inc.abort_pending = True
            if inc.phase == "collective":
                self.abort(inc, "a quorum member was reported dead")

    def next_step(self, inc: Incarnation) -> None:
        """The trainer's loop, between two steps: leave when asked to stop (unless the next
        quorum was asked for already: that step is owed), else take the next quorum."""
        if not inc.running or inc.hung_training or inc.left or inc.phase in ("done", "starting"):
            return
        asked, inc.asked_next = inc.asked_next, False
        if inc.stopping and not asked:
            self.leave(inc, "stopped")
            return
        if not asked:
            self.ask(inc)
            return
        # ``Manager._answer``: the answer of the request sent right after the vote.
        inc.phase = "asking"
        if inc.reload_head is not None:
            head, inc.reload_head = inc.reload_head, None
            self.reload(inc, head)
        elif inc.held is not None:
            answer, inc.held = inc.held, None
            self.start_step(inc, answer)
        elif inc.poll_stopped:  # its long-poll ended on the stop request: StopRequested
            self.leave(inc, "stopped")
        elif not inc.polling:
            self.ask(inc)  # (its answer was refused or lost: ask anew)

    def ask(self, inc: Incarnation, early: bool = False) -> None:
        """Send this step's quorum request: one outstanding request per process, as the real
        (synchronous) client has; a newer ask supersedes an older one that was not sent yet.
        ``early``: right after the commit vote, while the update is applied (``Manager.ask``)."""
        if not inc.running or inc.hung_training or inc.left:
            return
        if inc.stopping and not early and not inc.polling:
            self.leave(inc, "stopped")  # ``_request_quorum`` raises StopRequested before asking
            return
        if not inc.polling:
            inc.asking_since = self.now
        if not early:
            inc.phase = "asking"
        inc.polling = True
        inc.poll_stopped = False
        inc.progress_at = self.now
        inc.request_seq += 1
        seq = inc.request_seq
        if inc.request is not None and self.coordinator is not None:
            self.withdraw(inc.request)  # the earlier long-poll ended (answered or not)
        inc.request = None
        if inc.lag_once and inc.proto.step > 0 and not inc.lagged:
            inc.lagged = True  # a slow group: its request goes out well after the others'
            self.at(self.c.join_timeout * self.rng.uniform(1.0, 3.0), lambda: self.send_request(inc, seq),
                    "lagging ask")
            return
        self.send_request(inc, seq)

    def send_request(self, inc: Incarnation, seq: int) -> None:
        if not inc.running or inc.hung_training or inc.request_seq != seq or not inc.polling or inc.left:
            return
        inc.proto.sync(inc.state.step, inc.state.chain)  # as Manager.start_step (or Manager.ask) does
        head, again = inc.reload_hint
        if self.c.reload_checkpoints and head is not None and inc.proto.reload_due(head, again):
            self.told_to_reload(inc, head)  # as Manager._request_quorum
            return
        fields = inc.proto.request()
        req = MemberRequest(inc.replica_id, inc.group, fields["step"], fields["last_quorum_id"], fields["failed"],
                            {"recover_request": fields["recover_request"]}, 0.0, fields["chain"],
                            tuple(fields["watch"]), fields["disk_checked"], fields["disk_round"])
        inc.request = req
        inc.asked_at = self.now  # a quorum request is a heartbeat: the next beat waits an interval

        def arrive() -> None:
            if self.coordinator is None or not inc.alive or inc.request is not req:
                inc.request_lost = inc.request_lost or inc.request is req  # (the coordinator was down)
                return
            self.door_seen[inc.replica_id] = self.now
            self.to_door(handle)

        def handle() -> None:
            if self.coordinator is None or not inc.alive:  # (died while it waited: its connection reset)
                return
            req.asked_at = self.now
            self.polls[inc.replica_id] = (req, seq)
            outputs = self.to_coordinator(inc, lambda c: c.request(self.now, req))
            if outputs is not None:
                self.deliver_outputs(outputs)
        inc.request_lost = self.lost()
        if not inc.request_lost:
            self.at(self.latency(), arrive, f"request {inc.replica_id} step {fields['step']}")
        self.log(f"{inc.replica_id} asks at step {fields['step']}{' (failed)' if fields['failed'] else ''}"
                 f"{' (early)' if inc.phase == 'updating' else ''}")

        def poll_timeout() -> None:
            if not inc.polling or inc.request_seq != seq or inc.left:
                return
            if inc.running and not inc.hung_training:
                self.poll_ended(inc)
            elif inc.request is not None and self.coordinator is not None:
                # The coordinator answers 504 at the long-poll's deadline and forgets the request
                # whatever the member's threads do: a wedged training thread asks no more, so it
                # is no longer "waiting for a quorum" and progress_timeout can declare it hung
                # (before, its request stayed pending forever here, and so did it: seed 10291).
                self.withdraw(inc.request)
        self.at(self.c.poll_timeout, poll_timeout, "poll timeout")

    def poll_ended(self, inc: Incarnation) -> None:
        """A long-poll ended without a quorum: ``Manager._request_quorum`` polls again, or raises
        StopRequested when a stop was requested meanwhile, or gives up after ft.quorum_timeout."""
        if inc.stopping:
            inc.polling = False
            if inc.request is not None and self.coordinator is not None:
                self.withdraw(inc.request)
            inc.request = None
            if inc.phase == "updating":
                inc.poll_stopped = True  # the trainer sees it when it takes the answer
            else:
                self.leave(inc, "stopped")
        elif self.now - inc.asking_since > self.c.quorum_seconds:
            self.die(inc, "no quorum within ft.quorum_timeout")  # as Manager._request_quorum
        else:
            self.ask(inc, early=inc.phase == "updating")

    def on_answer(self, inc: Incarnation, seq: int, answer: Answer) -> None:
        if (not inc.running or inc.hung_training or not inc.polling or inc.request_seq != seq
                or inc.request is None or inc.left):
            if answer.quorum is not None and inc.running and not inc.left:
                # It crossed the end of its long-poll: its quorum waits for this member (lost to it).
                self.lost_answers.add((*_key(answer.quorum), answer.replica_id))
                self.last_loss = self.now
            return
        inc.request = None
        if answer.status == 409:
            self.die(inc, "stale incarnation")
            return
        head, again = reload_word(answer.body or {})
        if answer.status == 504 and self.c.reload_checkpoints and inc.proto.reload_due(head, again):
            self.told_to_reload(inc, head)
            return
        if answer.status != 200:
            self.at(0.01, lambda: self.poll_ended(inc) if inc.polling and inc.request_seq == seq else None,
                    "re-ask")
            return
        inc.polling = False
        if answer.quorum is not None:
            self.answered(inc, answer.quorum)
        if inc.phase == "updating":
            inc.held = answer  # the asker thread holds it until the trainer's next start_step
            return
        self.start_step(inc, answer)

    def start_step(self, inc: Incarnation, answer: Answer) -> None:
        """``Manager.start_step`` with the quorum answer, then the trainer's start of a step."""
        q = answer.quorum  # the whole quorum, for the simulator's own bookkeeping and checks
        # The group sees only its own answer, through the same encoding the coordinator sends.
        view = MemberQuorum.from_json(self.encoder.encode(q, inc.replica_id))
        try:
            role = inc.proto.on_quorum(view)
        except TooManyFailures as e:
            if not inc.injected:
                self.fail(f"healthy group {inc.replica_id} gave up: {e}")
            self.die(inc, f"too many failures: {e}")
            return
        inc.quorum = q
        inc.abort_pending = False
        inc.progress_at = self.now
        inc.reload_hint = (None, 0)  # as the manager: a quorum is newer word than any heartbeat's "reload"
        me = inc.replica_id
        if role.participant_index is not None and (inc.state.step, inc.state.chain) != (q.step, q.chain):
            self.fail(f"{me} is a participant of quorum {q.quorum_id} at step {q.step} but holds step "
                      f"{inc.state.step} with another history")
        if role.publish:
            inc.published[q.step] = copy_state(inc.state)
        # As the manager does: snapshots no joiner pulls any more are dropped.
        inc.published = {s: v for s, v in inc.published.items() if s in role.retain}
        if role.fetch_from is not None:
            self.start_fetch(inc, q, role.fetch_from)
        if role.drain:
            self.drain(inc, q, role)
            return
        inc.phase = "training"
        lo, hi = self.c.step_seconds
        self.at(self.rng.uniform(lo, hi), lambda: self.enter_collective(inc, q), f"train {me}")

    def drain(self, inc: Incarnation, q: Quorum, role: Any) -> None:
        if role.recovering:
            inc.phase = "idle"
            self.load_snapshot(inc)
            if inc.catching and self.replay_backlog(inc, q, until_head=True):
                self.finish_catch_up(inc, q, committed=False)  # at the final step: nothing to apply
                self.at(0.0, lambda: self.next_step(inc), "next step")
            else:
                self.at(0.1, lambda: self.next_step(inc), "drain ask")
            return
        groups = {m.group for m in q.members}
        if not q.recovering and len(groups) >= self.c.groups:
            self.finish(inc)
            return
        if inc.draining_since is None or q.recovering:
            inc.draining_since = self.now
        if self.now - inc.draining_since > self.c.drain_seconds or inc.stopping:
            self.finish(inc)  # (a stop request ends the serving; the group still leaves finished)
            return
        inc.phase = "idle"
        self.at(0.25, lambda: self.next_step(inc), "drain ask")

    def finish(self, inc: Incarnation) -> None:
        inc.finished = True
        inc.phase = "done"
        self.save_final(inc, finishing=True)
        if (not self.finished and self.late_kinds() and self.c.late_faults > 0
                and self.rng.random() < self.c.late_faults):
            seconds = self.c.drain_seconds + self.c.quorum_seconds + self.c.startup_timeout
            self.at(self.rng.uniform(0.0, seconds), self.late_fault, "late fault")
        self.finished[inc.group] = copy_state(inc.state)
        self.log(f"finished {inc.replica_id} at step {inc.state.step}")
        # It left the job; its process writes its results and exits a moment later.
        self.exited[inc.group] = self.now + self.rng.uniform(0.2, 3.0)
        if self.coordinator is not None:
            def arrive() -> None:
                if self.coordinator is not None:
                    self.deliver_outputs(self.coordinator.leave(self.now, inc.replica_id, inc.group, "finished"))
                    self.watch_leave(inc)
            self.to_door(arrive)
        inc.alive = False
        first = next(iter(self.finished.values()))
        if (inc.state.step, inc.state.chain) != (first.step, first.chain):
            self.fail(f"{inc.replica_id} finished at step {inc.state.step} with another state than the "
                      f"first group to finish (step {first.step})")
        self.write_model(inc)

    def leave(self, inc: Incarnation, reason: str, saved: bool = False) -> None:
        """A graceful leave (SIGTERM, a finished ``train.max_seconds``): the trainer's loop ended,
        the manager stops its heartbeats and tells the coordinator (``Manager.leave``); the
        process exits 0 a moment later (it writes its model and summary first), and the
        launcher may start the group again later (a spot node coming back). With
        ``checkpoint_on_stop`` the trainer's ``_leave_stopped`` saves the step first (``saved``:
        done already); heartbeats go on meanwhile."""
        if inc.left or not inc.alive or (inc.phase == "saving" and not saved):
            return
        if not saved and reason == "stopped" and self.saves_on_stop(inc):
            inc.phase = "saving"
            state = copy_state(inc.state)
            inc.progress_at = self.now

            def saved_then_leave() -> None:
                # (a process stopped or wedged meanwhile never finishes it: the hang is detected)
                if inc.running and not inc.hung_training and not inc.left:
                    self.disk[state.step] = state
                    self.log(f"{inc.replica_id} saved step {state.step} before leaving")
                    self.leave(inc, reason, saved=True)
            self.at(self.rng.uniform(*self.c.stop_save_seconds), saved_then_leave, f"save {inc.replica_id}")
            return
        inc.left = True
        inc.polling = False
        inc.phase = "left"
        self.log(f"{inc.replica_id} leaves: {reason}")
        inc.request = None
        if not self.lost():
            epoch = self.coordinator_epoch

            def arrive() -> None:
                if self.coordinator is not None and self.coordinator_epoch == epoch:
                    self.to_door(handle)

            def handle() -> None:
                if self.coordinator is not None and self.coordinator_epoch == epoch:
                    self.deliver_outputs(self.coordinator.leave(self.now, inc.replica_id, inc.group, reason))
                    self.watch_leave(inc)
            self.at(self.latency(), arrive, f"leave {inc.replica_id}")
        lo, hi = self.c.exit_seconds
        self.at(self.rng.uniform(lo, hi), lambda: self.exit_after_leave(inc), f"exit {inc.replica_id}")

    def exit_after_leave(self, inc: Incarnation) -> None:
        if not inc.alive:
            return
        self.write_model(inc)
        self.die(inc, "exit 0 after leaving", restart=False)
        if self.groups.get(inc.group) is not inc:
            return
        others = [g for g in self.groups if g != inc.group and g not in self.departed]
        if self.rng.random() < self.c.leave_restart or len(others) < 2 or inc.group in self.slow_restart:
            self.slow_restart.discard(inc.group)
            delay = self.rng.uniform(0.5, 8.0)
            self.spawn(inc.group, delay)  # the launcher brings it back
            self.at(delay, lambda: setattr(self, "last_fault", self.now), "relaunch")  # liveness from here
        else:
            self.departed.add(inc.group)  # gone for good (its node did not come back): once a job at most
            self.log(f"departed {inc.group}")

    # -- durable state: checkpoints and the job's model file ---------------------------------------
    def checkpoint_due(self, step: int) -> bool:
        """``Checkpointer.due``: a periodic checkpoint of ``step``."""
        return self.checkpoint_every > 0 and step > 0 and step % self.checkpoint_every == 0

    def saves_on_stop(self, inc: Incarnation) -> bool:
        """The trainer's ``_saves_on_stop``: a group stopped by SIGTERM that wrote its last step's
        checkpoints saves that step on its way out unless it is on disk (periodic or not)."""
        return self.c.checkpoint_on_stop and inc.writer and not self.checkpoint_due(inc.state.step)

    def save_final(self, inc: Incarnation, finishing: bool) -> None:
        """The trainer's ``_save_final``: the job's last step is made durable whatever
        ``checkpoint.every`` says, once (by its writer at the commit, or by whichever group
        finishes first, ``finishing``): a group started after the others left resumes there."""
        if inc.state.step >= self.c.steps and inc.state.step not in self.disk:
            self.disk[inc.state.step] = copy_state(inc.state)

    def may_write_model(self, inc: Incarnation) -> tuple[bool, str]:
        """The trainer's rule for replacing the job's model file with ``inc``'s state as its
        process exits (``ftlm.ft.end_of_run.may_write_model``)."""
        head = inc.quorum.step if inc.quorum is not None else None
        held = self.model.step if self.model is not None else None
        return may_write_model(held, inc.state.step, head is not None, self.c.steps, head or 0)

    def write_model(self, inc: Incarnation) -> None:
        """``inc``'s process exits after it finished or left: it writes the job's model file if the
        rule lets it. The file never goes back to a state behind the one it holds (nothing in
        the simulation moves it aside), and a group that never took part in a quorum in this
        process writes no model unless it holds the final step."""
        ok, why = self.may_write_model(inc)
        st = inc.state
        if not ok:
            self.log(f"{inc.replica_id} does not write the model at step {st.step}: {why}")
            return
        if self.model is not None and st.step < self.model.step:
            self.fail(f"{inc.replica_id} replaced the job's model file (step {self.model.step}) with its "
                      f"state at step {st.step}, behind it")
        if inc.quorum is None and st.step < self.c.steps:
            self.fail(f"{inc.replica_id} never took part in a quorum and wrote the job's model file with "
                      f"its state at step {st.step} (the job's last step is {self.c.steps})")
        self.model, self.model_at = copy_state(st), self.now
        self.log(f"{inc.replica_id} writes the model at step {st.step}")

    # -- the all-reduce and the vote -------------------------------------------------------------
    def enter_collective(self, inc: Incarnation, q: Quorum) -> None:
        if not inc.running or inc.hung_training or inc.phase != "training" or inc.quorum is not q:
            return
        inc.phase = "collective"
        inc.progress_at = self.now
        if inc.proto.role is not None and inc.proto.role.recovering:
            # As the trainer: its zero buckets are on their way; it catches up while they wait.
            self.load_snapshot(inc)
            if inc.catching:
                self.replay_backlog(inc, q, until_head=False)
        if inc.abort_pending:
            self.abort(inc, "a quorum member was reported dead")
            return
        if any(not self.alive(r) for r in q.replica_ids()):  # a dead peer refuses the connection
            self.at(self.latency(), lambda: self.peer_reset(inc, q), "connection refused")
        key = (q.epoch, q.quorum_id, q.step)
        coll = self.collectives.setdefault(key, Collective(q))
        if coll.quorum.replica_ids() != q.replica_ids():
            self.fail(f"two different quorums share id {q.quorum_id} at step {q.step}")
        index = q.participant_index(inc.replica_id)
        coll.entered[inc.replica_id] = (index, inc.state.step, inc.state.chain)
        if q.size > 1 and any(self.bad_link(r) for r in q.replica_ids()):
            # A bad link: the transport fails, at once (a reset) or when the operation times out.
            delay = self.latency() if self.rng.random() < 0.5 else self.c.allreduce_timeout
            self.at(delay, lambda: self.link_failed(inc, q), "bad link")
            return
        if coll.done:
            self.at(self.latency(), lambda: self.outcome(inc, q, False), "late to collective")
            return
        if set(coll.entered) == set(q.replica_ids()):
            coll.done = True
            # Worst moment: the result reaches some members while others fail.
            partial = self.rng.random() < 0.05 and len(coll.entered) > 1
            for rid in coll.entered:
                member = self.groups.get(rid.split(":")[0])
                if member is None or member.replica_id != rid:
                    continue
                ok = not (partial and self.rng.random() < 0.5)
                self.at(self.latency(), lambda m=member, ok=ok: self.outcome(m, m.quorum, ok), f"allreduce {rid}")
            return
        self.at(self.c.allreduce_timeout, lambda: self.collective_timeout(inc, q, coll), "allreduce timeout")

    def links_bad(self) -> int:
        """Groups whose process has a bad link, or whose next one will."""
        live = {g.group for g in self.groups.values() if g is not None and g.alive and g.bad_link}
        return len(live | self.sticky_links)

    def bad_link(self, replica_id: str) -> bool:
        inc = self.groups.get(replica_id.split(":")[0])
        if inc is None or inc.replica_id != replica_id or not inc.alive or not inc.bad_link:
            return False
        # (a process hung in its start-up keeps its group out until the start-up timeout)
        wedged = {g.group for g in self.groups.values() if g is not None and g.alive and g.hung and not g.registered}
        left = len(self.groups) - len(self.departed | self.lost_groups | set(self.finished) | wedged)
        if left < 3 or left - self.links_bad() < 2:
            # The model's premise is gone: no two good groups are left to commit (FAULTS).
            inc.bad_link = False
            self.sticky_links.discard(inc.group)
            self.log(f"the bad link of {replica_id} heals: fewer than two good groups are left")
            return False
        return True

    def link_failed(self, inc: Incarnation, q: Quorum) -> None:
        if inc.running and inc.phase == "collective" and inc.quorum is q:
            self.abort(inc, "connection reset (a bad link)")

    def peer_reset(self, inc: Incarnation, q: Quorum) -> None:
        if inc.running and inc.phase == "collective" and inc.quorum is q:
            self.abort(inc, "connection reset by a quorum member")

    def collective_timeout(self, inc: Incarnation, q: Quorum, coll: Collective) -> None:
        if inc.running and inc.phase == "collective" and inc.quorum is q:
            self.abort(inc, "all-reduce timeout")

    def abort(self, inc: Incarnation, why: str) -> None:
        q = inc.quorum
        coll = self.collectives.get((q.epoch, q.quorum_id, q.step)) if q is not None else None
        if coll is not None:
            coll.done = True  # an aborted collective completes for nobody
        self.outcome(inc, q, False, why)

    def outcome(self, inc: Incarnation, q: Quorum | None, ok: bool, why: str = "") -> None:
        if (not inc.running or inc.hung_training or inc.phase != "collective" or q is None
                or inc.quorum is None or inc.left
                or (inc.quorum.epoch, inc.quorum.quorum_id, inc.quorum.step) != (q.epoch, q.quorum_id, q.step)):
            return
        if not ok:
            inc.proto.fail(why or "collective failed")
            self.log(f"{inc.replica_id} failed step {q.step} (quorum {q.quorum_id}): {why or 'collective failed'}")
        coll = self.collectives.get((q.epoch, q.quorum_id, q.step))
        committed = inc.proto.on_outcome(ok)
        inc.progress_at = self.now
        samples = len(q.participants) * self.c.batch
        role = inc.proto.role
        if committed and not role.recovering:
            slices = sorted(i for i, _, _ in coll.entered.values() if i is not None)
            if slices != list(range(len(q.participants))):
                self.fail(f"{inc.replica_id} committed step {q.step} of quorum {q.quorum_id} without every "
                          f"participant's slice (got {slices})")
            for rid, (i, step, chain) in coll.entered.items():
                if i is not None and (step, chain) != (q.step, q.chain):
                    self.fail(f"{rid} contributed a slice to step {q.step} from another state")
            st = inc.state
            inc.state = State(st.step + 1, q.next_chain(), st.cursor + samples,
                              st.ranges + ((st.cursor, st.cursor + samples),))
            self.record_commit(inc, q, st, inc.state)
            if (inc.proto.step, inc.proto.chain) != (inc.state.step, inc.state.chain):
                self.fail(f"{inc.replica_id}: protocol and state disagree after a commit")
            self.remember(inc.state)
            inc.writer = role.participant_index == 0
            self.last_commit = self.now
            self.log(f"{inc.replica_id} committed step {q.step} (quorum {q.quorum_id})")
            if role.participant_index == 0 and inc.state.step == self.c.steps:
                self.save_final(inc, finishing=False)  # at once by its writer (and by any group that finishes)
            elif role.participant_index == 0 and self.checkpoint_due(inc.state.step):
                self.disk[inc.state.step] = copy_state(inc.state)
            if inc.state.step >= self.c.steps - 3 and not self.endgame:
                self.endgame = True  # from 3 steps before the end: the fault lands before, during or after the finish
                if self.rng.random() < self.c.endgame_faults:
                    self.at(self.rng.uniform(0.0, 1.0), self.endgame_fault, "endgame fault")
            self.ask_early_and_update(inc)
            return
        if role.recovering:
            inc.writer = False  # no checkpoint writer until it commits as a participant
            # As the trainer: at this step's head, apply its average if it committed here; else
            # keep the average for the replay. Then ask for the next quorum with the state this
            # step leaves, as the participants do (the bookkeeping overlaps with the request).
            if inc.catching and inc.state.step == q.step:
                self.finish_catch_up(inc, q, committed)
            elif committed:
                inc.buffer[q.step] = (q.quorum_id, list(q.participants), samples)
            self.ask_early_and_update(inc)
            return
        inc.phase = "idle"
        self.at(0.0, lambda: self.next_step(inc), "next step")

    def ask_early_and_update(self, inc: Incarnation) -> None:
        """As the trainer after a vote: the next quorum is asked for right away, and the update
        (or a recovering group's bookkeeping) is applied while that request waits for the other
        groups; once asked, the next step is owed to the quorum it gets, even if a stop is
        requested meanwhile."""
        inc.phase = "updating"
        inc.asked_next = self.c.early_ask and not inc.stopping
        if inc.asked_next:
            self.ask(inc, early=True)
        lo, hi = self.c.update_seconds
        self.at(self.rng.uniform(lo, hi), lambda: self.update_done(inc), f"update {inc.replica_id}")

    def update_done(self, inc: Incarnation) -> None:
        """The optimizer update is applied: the trainer's loop goes on (to the asked quorum)."""
        if inc.phase != "updating" or not inc.alive or inc.left:
            return
        if not inc.running:
            inc.update_pending = True  # stopped mid-update (SIGSTOP): it goes on after SIGCONT
            return
        self.next_step(inc)

    def told_to_reload(self, inc: Incarnation, head: int) -> None:
        """``Manager._request_quorum`` raises ReloadCheckpoint, which the trainer's step handles
        (after the update, for a request sent early)."""
        inc.polling = False
        if inc.phase == "updating":
            inc.reload_head = head
        else:
            self.reload(inc, head)

    def reload(self, inc: Incarnation, head: int) -> None:
        """The trainer's ``_reload_checkpoint``: no live group holds the head, so load the newest
        durable checkpoint if it is newer than this group's state, dropping a pull in flight or a
        snapshot being replayed; then ask again (saying it looked: ``disk_checked``)."""
        newer = [s for s in self.disk if s > inc.state.step]
        inc.phase = "reloading"
        if not newer:
            self.log(f"{inc.replica_id} finds no checkpoint newer than step {inc.state.step} (head {head})")
            self.reload_done(inc)
            return
        pick = max(newer)
        lo, hi = self.c.reload_seconds

        def loaded() -> None:
            if not inc.alive or inc.left or inc.phase != "reloading" or inc.hung_training:
                return
            before = inc.state.step
            inc.state = copy_state(self.disk[pick])
            inc.writer = False
            inc.catching, inc.buffer = False, {}
            if inc.fetch is not None or inc.proto.fetching:
                inc.fetch = None
                inc.proto.fetch_finished()
            self.log(f"{inc.replica_id} loaded the checkpoint of step {pick} (was at {before}, head {head})")
            if not inc.running:
                inc.update_pending = True  # SIGSTOPped while loading: it asks after SIGCONT
                return
            self.reload_done(inc)
        self.at(self.rng.uniform(lo, hi), loaded, f"reload {inc.replica_id}")

    def reload_done(self, inc: Incarnation) -> None:
        inc.phase = "idle"
        self.next_step(inc)

    # -- live recovery ---------------------------------------------------------------------------
    def start_fetch(self, inc: Incarnation, q: Quorum, source: str) -> None:
        if inc.catching:  # its pull arrived and is being replayed: a second one is wasted work
            self.fail(f"{inc.replica_id} started a second pull while replaying the snapshot it loaded")
        fetch = {"source": source, "step": q.step, "done": False, "result": None}
        inc.fetch = fetch
        seconds = self.rng.uniform(0.05, 0.5) * (20 if self.slow_next else 1)
        self.slow_next = False
        src = self.groups.get(source.split(":")[0])
        if self.kill_source_next and src is not None and src.replica_id == source:
            self.kill_source_next = False
            src.injected = True
            self.at(seconds / 2, lambda: self.die(src, "killed mid-transfer"), "source crash")

        def arrive() -> None:
            s = self.groups.get(source.split(":")[0])
            if s is not None and s.replica_id == source and s.running and not s.left and q.step in s.published:
                fetch["result"] = copy_state(s.published[q.step])
            fetch["done"] = True
        self.at(seconds, arrive, f"transfer to {inc.replica_id}")

    def load_snapshot(self, inc: Incarnation) -> None:
        """The trainer loads the pulled snapshot once it arrived (``poll_recovery``); its backlog
        of buffered updates is then replayed over one or more steps (``replay_backlog``)."""
        fetch = inc.fetch
        if inc.catching or fetch is None or not fetch["done"]:
            return
        inc.fetch = None
        if fetch["result"] is None:
            inc.proto.fetch_finished()
            return  # the pull failed: the next quorum assigns a source again
        inc.state = fetch["result"]
        inc.catching = True
        self.log(f"{inc.replica_id} loaded the snapshot of step {inc.state.step}")

    def replay_backlog(self, inc: Incarnation, q: Quorum, until_head: bool) -> bool:
        """The trainer's ``_replay_backlog``: the buffered updates from the state's step on
        (``CatchUpBuffer.run_from``) must lead to the head of ``q`` (``check_replay``); then at
        least two are applied, more while the all-reduce waits (a random number here), all of
        them with ``until_head``. False (and the pull starts over) when they do not lead there."""
        st = inc.state
        inc.buffer = {s: r for s, r in inc.buffer.items() if s >= st.step}
        later = sorted(inc.buffer)
        records = ([(s, *inc.buffer[s]) for s in later]
                   if later == list(range(st.step, st.step + len(later))) else None)
        check = (check_replay(st.step, st.chain, [(s, qi, p) for s, qi, p, _ in records], q, False)
                 if records is not None else None)
        if check is None or not check.ok:
            inc.catching = False  # the snapshot stays loaded; the group reports its step and recovers again
            inc.proto.fetch_finished()  # the manager's restart_recovery
            inc.buffer = {}
            self.log(f"{inc.replica_id} replay rejected: {check.reason if check else 'a buffered update is missing'}")
            return False
        n = check.apply if until_head else min(check.apply, max(2, self.rng.randint(0, check.apply)))
        for s, qid, parts, samples in records[:n]:
            st = State(st.step + 1, extend_chain(st.chain, s, qid, parts), st.cursor + samples,
                       st.ranges + ((st.cursor, st.cursor + samples),))
            del inc.buffer[s]
        if n == check.apply and (st.step, st.chain) != (q.step, q.chain):
            self.fail(f"{inc.replica_id}: replayed state differs from the checked head")
        inc.state = st
        self.remember(st)
        self.log(f"{inc.replica_id} replayed to step {st.step} (head {q.step})")
        return True

    def finish_catch_up(self, inc: Incarnation, q: Quorum, committed: bool) -> None:
        """The trainer's ``_finish_catch_up``: after the vote of the step the group caught up to,
        apply that step's average if it committed here, and report the state from now on."""
        inc.catching = False
        inc.buffer = {}
        st = inc.state
        if committed:
            samples = len(q.participants) * self.c.batch
            before, st = st, State(st.step + 1, q.next_chain(), st.cursor + samples,
                                   st.ranges + ((st.cursor, st.cursor + samples),))
            self.record_commit(inc, q, before, st)
            inc.state = st
            self.remember(st)
        inc.proto.caught_up(st.step, st.chain)
        self.log(f"{inc.replica_id} caught up to step {st.step}")

    # -- faults ----------------------------------------------------------------------------------
    def inject(self) -> None:
        best = max((g.state.step for g in self.groups.values() if g is not None), default=0)
        if best >= self.c.faults_until_step * self.c.steps or self.finished:
            return
        self.strike(self.rng.choice(self.c.faults))
        self.at(self.rng.expovariate(1 / self.c.fault_mtbf), self.inject, "fault")

    def endgame_fault(self) -> None:
        """One fault at the end of the job, when groups drain, serve late joiners and leave."""
        kinds: list[str] = [k for k in ("crash", "hang", "hang_resume", "coordinator_crash", "old_checkpoint", "leave")
                            if k in self.c.faults]
        if "crash" in kinds:
            kinds.append("crash_slow_restart")  # back only after the others may have left
        # (after the kinds above: the seeds found with them keep their schedules)
        kinds += [k for k in ("coordinator_pause", "hang_restarting") if k in self.c.faults]
        if kinds:
            self.strike(self.rng.choice(kinds))

    def late_kinds(self) -> list[str]:
        return [k for k in ("leave", "crash") if k in self.c.faults]

    def late_fault(self) -> None:
        """One fault after the first group finished, at a group still in the job: perhaps one
        restarted after the others left, waiting for a quorum that never comes (a spot reclaim,
        the launcher stopping the job, a crash)."""
        if any(g is not None and g.alive and not g.hung and not g.left for g in self.groups.values()):
            self.strike(self.rng.choice(self.late_kinds()))

    def strike(self, kind: str) -> None:
        if kind == "bad_link" and (self.c.groups < 3 or self.links_bad() >= min(
                self.c.bad_links, self.c.groups - 2)):
            return  # at most ``bad_links``, and two good groups must remain (see FAULTS)
        self.faults[kind] = self.faults.get(kind, 0) + 1
        self.last_fault = self.now
        if kind != "bad_link":
            self.disturbed_at = self.now
        self.leave_watches = []  # another fault may delay anyone: a leave is judged in quiet times
        live = [g for g in self.groups.values() if g is not None and g.alive and not g.hung and not g.left]
        target = self.rng.choice(live) if live else None
        self.log(f"fault {kind} -> {target.replica_id if target else '-'}")
        if kind == "coordinator_crash":
            self.coordinator_crash()
        elif kind == "coordinator_pause":
            self.pause_coordinator()
        elif target is None:
            pass
        elif kind == "crash_slow_restart":
            target.injected = True
            self.slow_restart.add(target.group)
            self.die(target, "SIGKILL (slow restart)")
        elif kind in ("crash", "crash_starting"):
            if kind == "crash" or not target.registered:
                target.injected = True
                self.die(target, "SIGKILL")
        elif kind == "hang_restarting":
            target.injected = True
            self.hang_next_start.add(target.group)
            self.die(target, "SIGKILL (its next process hangs while starting)")
        elif kind in ("hang", "hang_starting"):
            if kind == "hang" or not target.registered:
                target.injected = True
                target.hung = True
                self.pending_hung[target.replica_id] = (self.now, kind)
        elif kind == "hang_resume":
            # SIGSTOP, then SIGCONT a moment later: back with whatever state it held, perhaps
            # after the others declared it dead and moved on (or rolled back without it).
            target.injected = True
            target.hung = True

            def resume(t: Incarnation = target) -> None:
                if t.alive and t.hung:
                    t.hung = False
                    self.pending_hung.pop(t.replica_id, None)  # it came back on its own
                    self.log(f"resume {t.replica_id}")
                    if t.polling:  # its long-poll ended while it was stopped: ask anew
                        self.ask(t, early=t.phase == "updating")
                    if t.phase == "updating" and t.update_pending:
                        t.update_pending = False
                        self.update_done(t)
                    elif t.phase == "reloading" and t.update_pending:
                        t.update_pending = False
                        self.reload_done(t)
                    elif t.phase == "asking" and not t.polling:
                        self.ask(t)
                    elif t.phase == "collective" and t.quorum is not None:
                        self.at(self.c.allreduce_timeout, lambda: self.collective_timeout(t, t.quorum, None),
                                "allreduce timeout")
                    elif t.phase == "training" and t.quorum is not None:
                        self.enter_collective(t, t.quorum)
                    elif t.phase == "idle":
                        self.next_step(t)
            self.at(self.rng.uniform(0.2, 3.0), resume, "SIGCONT")
        elif kind == "hang_training":
            target.injected = True
            target.hung_training = True
            target.phase = "hung-training"
            self.pending_hung[target.replica_id] = (self.now, kind)
        elif kind == "lag":
            target.lag_once = True
        elif kind == "old_checkpoint":
            target.injected = True
            self.die(target, "SIGKILL (restarts from an older checkpoint)")
            self.at(self.c.restart_delay + 0.01, lambda: _mark_lag(self.groups.get(target.group)), "old ckpt")
        elif kind == "slow_transfer":
            self.slow_next = True
        elif kind == "source_crash_mid_transfer":
            self.kill_source_next = True
        elif kind == "bogus_claim" and self.coordinator is not None:
            beat = Heartbeat(f"{target.group}:bogus{self._seq}", target.group, self.now,
                             self.rng.choice([10**15, 2**53]), 2**53, "f" * 64)

            def bogus() -> None:
                if self.coordinator is None:
                    return
                beat.last_seen = beat.progress_at = self.now
                try:
                    _, outputs = self.coordinator.heartbeat(self.now, beat)
                    self.deliver_outputs(outputs)
                except StaleIncarnation:
                    pass
            self.to_door(bogus)
            # The bogus claim replaced the group's real incarnation: that process exits and restarts.
            target.injected = True
        elif kind == "leave":
            self.stop(target)
        elif kind == "bad_link":
            target.injected = target.bad_link = True
        elif kind == "partition_drop":
            target.injected = True
            self.loss = 0.5
            self.at(self.rng.uniform(0.2, 1.0), lambda: setattr(self, "loss", self.c.loss), "heal partition")

    def stop(self, inc: Incarnation) -> None:
        """SIGTERM (spot reclaim, preemption, a drained node) at whatever moment ``inc`` is in:
        the trainer finishes its step (or the step it owes an early request) and leaves; now
        and then the step is interrupted where it is (SIGINT: KeyboardInterrupt) and it leaves
        at once; before its handler is installed the signal kills a starting process."""
        if inc.hung_training:
            return  # its training thread cannot run the handler: the launcher's SIGKILL follows (a crash)
        if inc.phase == "starting" and self.rng.random() < 0.3:
            inc.injected = True
            self.die(inc, "SIGTERM before its handler was installed")
        elif inc.phase != "starting" and self.rng.random() < 0.25:
            self.leave(inc, "stopped (interrupted)")
        else:
            inc.stopping = True
            self.log(f"SIGTERM {inc.replica_id} in phase {inc.phase}")

    def watch_leave(self, leaver: Incarnation) -> None:
        """Judge a leave that reached the coordinator in quiet times: every other group healthy
        (no fault was injected into its process: one resumed after a SIGSTOP may still wait out
        an old all-reduce, seed 9124)
        and a live member holding the head (else the others may rightly wait: for a hung peer's
        detection, a lagging peer or one loading a checkpoint, a lost request's poll timeout, a
        rollback). Their next quorum must come within
        ``leave_bound`` (``check``)."""
        c = self.coordinator
        if c is None or c.state.head is None or self.now - self.resumed_at < self.c.poll_timeout:
            return  # (after a pause, the others' requests may have been withdrawn meanwhile, their polls ended)
        others = [g for g in self.groups.values() if g is not None and g is not leaver and g.alive and not g.left]
        healthy = {g.replica_id for g in others
                   if g.running and not g.hung_training and g.registered and g.phase not in ("starting", "reloading")
                   and not g.injected
                   and not g.stopping and not (g.lag_once and not g.lagged) and not g.request_lost
                   and not (g.polling and g.request is None)  # (a lagging request not sent yet)
                   and g.replica_id in c.state.heartbeats}
        if not healthy or len(healthy) < len(others) or set(c.state.heartbeats) != healthy:
            return
        for g in others:  # a quorum one of whose members lost its answer waits for that member
            q = g.held.quorum if g.held is not None else g.quorum if g.phase in ("training", "collective") else None
            if q is not None and any((*_key(q), r) in self.lost_answers for r in q.replica_ids()):
                return
        if not any((hb.step, hb.chain) == c.state.head for hb in c.state.heartbeats.values()):
            return
        if c.state.prev_quorum is None and len({g.group for g in others}) < c.options_now().expected_groups:
            return  # a coordinator's first quorum waits for the groups it expects (some left before it started)
        self.leave_watches.append(LeaveWatch(leaver.replica_id, self.now, self.now + self.c.leave_bound, healthy))
        self.leaves_judged += 1

    def answered(self, inc: Incarnation, q: Quorum) -> None:
        """``inc`` received quorum ``q``: a leave it waited on is settled if ``q`` is without the leaver."""
        for w in self.leave_watches:
            if inc.replica_id in w.waiting and not q.present(w.leaver):
                w.waiting.discard(inc.replica_id)

    def check_leaves(self) -> None:
        """A graceful leave never makes the others wait for a timeout (all-reduce, join, heartbeat)."""
        kept = []
        for w in self.leave_watches:
            if self.last_loss >= w.at or self.loss != self.c.loss:
                continue  # a lost message may delay anyone: not the leave's doing
            w.waiting = {r for r in w.waiting if (g := self.groups.get(r.split(":")[0])) is not None
                         and g.replica_id == r and g.alive and not g.left and not g.stopping}
            if not w.waiting:
                continue
            if self.now > w.deadline:
                self.fail(f"{w.leaver} left at {w.at:.3f} and {', '.join(sorted(w.waiting))} got no quorum "
                          f"without it within {self.c.leave_bound:g} s (waiting for a timeout?)")
            kept.append(w)
        self.leave_watches = kept

    # -- invariants ------------------------------------------------------------------------------
    def remember(self, st: State) -> None:
        """Same chain, same history: two states with one chain must have one cursor and one data."""
        seen = self.seen_states.get(st.chain)
        if seen is None:
            self.seen_states[st.chain] = copy_state(st)
        elif (seen.step, seen.cursor, seen.ranges) != (st.step, st.cursor, st.ranges):
            self.fail(f"two states share history {st.chain[:12]} but differ (step {seen.step}/{st.step}, "
                      f"cursor {seen.cursor}/{st.cursor})")
        if st.ranges and (st.ranges[0][0] != 0 or any(a[1] != b[0] for a, b in zip(st.ranges, st.ranges[1:]))
                          or st.ranges[-1][1] != st.cursor):
            self.fail(f"state at step {st.step} trained samples not exactly once: {st.ranges[:4]}...")

    def check(self, what: str) -> None:
        if self.leave_watches:
            self.check_leaves()
        bound = self.c.progress_seconds * self.c.bad_links  # (each bad link may take a search)
        if not self.endgame and self.now - self.last_commit > bound:  # draining is no livelock
            self.fail(f"no step committed for {bound:g} simulated s (a livelock?)")
        if self.c.fault_mtbf and self.now - self.last_fault > self.c.liveness_seconds:
            best = max((g.state.step for g in self.groups.values() if g is not None), default=0)
            self.fail(f"no liveness: {self.c.liveness_seconds:g} s after the last fault the job is at "
                      f"step {best} of {self.c.steps}")

    def record_commit(self, inc: Incarnation, q: Quorum, before: State, after: State) -> None:
        """The ``commit`` event the trainer writes (a participant's, or a recovering group's at the
        head it caught up to): the step's global sample range, its chain and its parent."""
        self.record.append({"ts": self.now, "kind": "commit", "group": inc.group, "step": q.step,
                            "quorum_id": q.quorum_id, "participants": len(q.participants),
                            "samples": [before.cursor, after.cursor], "tokens": after.cursor - before.cursor,
                            "chain": after.chain, "parent": before.chain})

    def check_end(self) -> None:
        if self.lost_groups:
            self.fail(f"{', '.join(sorted(self.lost_groups))} lost: died after every other group had finished, "
                      f"with no final state on disk to resume from (the launch fails)")
        states = {g: (s.step, s.chain) for g, s in self.finished.items()}
        if len(set(states.values())) != 1:
            self.fail(f"groups finished with different states: {states}")
        (step, chain), = set(states.values())
        if step != self.c.steps:
            self.fail(f"groups finished at step {step}, not {self.c.steps}")
        # The run's summary proves exactly-once from the record alone (ftlm.observe.summary): it
        # must find what the states say, the final state's samples once each and nothing else.
        final = next(iter(self.finished.values()))
        if self.model is None or (self.model.step, self.model.chain) != (final.step, final.chain):
            held = f"step {self.model.step}" if self.model is not None else "nothing"
            self.fail(f"the job's model file holds {held}, not the final step {final.step}")
        data = data_accounting(self.record)
        found = (data["samples_committed"], data["duplicates"], data["gaps"], data["inconsistent_steps"])
        if found != (final.cursor, 0, 0, []):
            self.fail(f"the record's accounting (samples, duplicates, gaps, inconsistent steps) is {found}; "
                      f"the final state trained samples [0, {final.cursor}) once each")


def _key(q: Quorum) -> tuple[str, int, int]:
    return q.epoch, q.quorum_id, q.step


def _mark_lag(inc: Incarnation | None) -> None:
    if inc is not None:
        inc.lag_once = True


def run(seed: int, config: SimConfig | None = None) -> SimResult:
    """Simulate one job with ``seed``; the same seed replays the same run exactly."""
    return Simulation(seed, config).run()


# (the job's shape and processes live in ftlm.sim.job)
__all__ = ["FAULTS", "SimConfig", "SimResult", "Simulation", "Violation", "run"]
