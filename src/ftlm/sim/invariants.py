"""Every invariant the protocol simulation checks (docs/ft-protocol.md, 'The simulator').

``Invariants`` judges what the world and the group model report as it happens, and the whole
run at its end; a violation raises ``Violation`` naming the seed (``Simulation.fail``), which
stops the run with its trace. Safety: every participant of a quorum holds the quorum's state, a
committed step carries every participant's slice from that state, a quorum id names one set of
members, states with one history agree (every sample once), a replay reaches the head it was
checked against, the coordinator's head never goes back or forks without a restore, quorum ids
never go back, the job's model file never goes back and is written only by a group known to hold
the job's state, a group retired for its link had a bad one (``check_conviction``), a member
declared dead for its silence was silent at the coordinator's door (``check_silence``), and at
the end every group finished alike, the model file holds the final state and the job's record
proves every sample trained once. Liveness: some group commits every ``progress_seconds`` (plus
what the faults striking during a bad-link search may cost it), the
job finishes within ``liveness_seconds`` of its last fault, every injected hang is detected,
and a graceful leave in quiet times never makes the others wait for a timeout
(``watch_leave``, ``check_leaves``).

Not responsible for making anything happen: it only reads the simulation's state, and keeps
what it needs to judge later (the states seen, the head, the leaves under judgement, the job's
record of commits and restores).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ftlm.ft.group import Role
from ftlm.ft.quorum import Quorum
from ftlm.ft.quorum.spares import promoted
from ftlm.observe.summary import data_accounting
from ftlm.sim.collective import quorum_key
from ftlm.sim.job import Collective, Incarnation, LeaveWatch, State, copy_state

if TYPE_CHECKING:
    from ftlm.sim.world import Simulation


class Invariants:
    """The checks of one ``Simulation`` and what they remember between events."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.c = sim.c
        self.max_issued_id: dict[str, int] = {}  # per coordinator epoch
        self.head: tuple[int, str] | None = None
        self.seen_states: dict[str, State] = {}  # chain -> state (same chain, same history)
        self.last_commit = 0.0
        self.storm_allowance = 0.0  # seconds the progress bound grows by for faults during a search
        self.leave_watches: list[LeaveWatch] = []
        self.leaves_judged = 0
        self.convictions = self.wrong_convictions = 0  # see SimResult
        # Incarnations found corrupt (``state_mismatch``), and the corruptions a majority outvoted.
        self.found_corrupt: set[str] = set()
        self.outvoted: set[int] = set()
        self.promotions = 0  # see SimResult
        self.spare_quorums = 0
        self.last_issued: Quorum | None = None  # the last quorum issued with a new id (any epoch)
        self.alone_since: dict[str, float] = {}  # replica id -> since when it is the last at the end
        self.first_finish: float | None = None  # when the first group finished
        # The job's record as events.jsonl would hold it (the trainer's commits, the coordinator's
        # restores): at the end the summary's accounting of it must prove what happened.
        self.record: list[dict] = []

    def fail(self, text: str) -> None:
        self.sim.fail(text)

    # -- after every event ---------------------------------------------------------------------------
    def check(self, what: str) -> None:
        sim = self.sim
        if self.leave_watches:
            self.check_leaves()
        bound = self.c.progress_seconds * self.c.bad_links + self.storm_allowance  # (each bad link may take a search)
        # A coordinator outage stops every group for its length: the bound counts the rest.
        idle = sim.now - self.last_commit
        if not sim.faults.endgame and idle > bound and idle - sim.down_seconds(self.last_commit) > bound:
            self.fail(f"no step committed for {bound:g} simulated s (a livelock?)")
        if self.c.fault_mtbf and sim.now - sim.faults.last_fault > self.c.liveness_seconds:
            best = max((g.state.step for g in sim.groups.values() if g is not None), default=0)
            self.fail(f"no liveness: {self.c.liveness_seconds:g} s after the last fault the job is at "
                      f"step {best} of {self.c.steps}")
        if sim.finished:
            self.check_last_at_end()

    def check_last_at_end(self) -> None:
        """A running group at the final state, when every other group finished with that state,
        finishes within ``end_bound`` (its quorum counts the others as finished there,
        ``Quorum.groups_left``): nobody can join it, so waiting for joiners is waiting for nobody."""
        sim = self.sim
        if self.first_finish is None:
            self.first_finish = sim.now
        if not self.c.coordinator_record and any(up > self.first_finish for _, up in sim.outages):
            return  # a coordinator restarted without its record forgot who finished: quorum_timeout
        for group, inc in sim.groups.items():
            if (inc is None or not inc.alive or not inc.running or inc.finished or inc.left
                    or set(sim.finished) != set(sim.groups) - {group}
                    or {(s.step, s.chain) for s in sim.finished.values()} != {(inc.state.step, inc.state.chain)}):
                if inc is not None:
                    self.alone_since.pop(inc.replica_id, None)
                continue
            since = self.alone_since.setdefault(inc.replica_id, sim.now)
            if sim.now - since - sim.down_seconds(since) > self.c.end_bound:
                self.fail(f"{inc.replica_id} holds the final state, every other group finished with it, "
                          f"and it is still in the job {sim.now - since:.1f} s later (waiting for joiners "
                          f"that cannot come?)")

    def check_hangs_detected(self) -> None:
        """Every injected hang is detected and its process killed within 30 simulated s of the
        coordinator answering (nobody detects anything while it is down)."""
        sim = self.sim
        pending = sim.faults.pending_hung
        for rid, (since, kind) in list(pending.items()):
            inc = sim.incarnation(rid)
            if inc is None or not inc.alive:
                del pending[rid]
            elif sim.now - since - sim.down_seconds(since) > 30.0:
                self.fail(f"fault {kind} of {rid} was never detected")

    # -- the coordinator -----------------------------------------------------------------------------
    def check_quorum_id(self, q: Quorum) -> None:
        """Quorum ids never go back within a coordinator epoch."""
        last = self.max_issued_id.get(q.epoch, -1)
        if q.quorum_id < last:
            self.fail(f"quorum id went back: {q.quorum_id} after {last}")
        self.max_issued_id[q.epoch] = q.quorum_id

    def check_head(self) -> None:
        """The coordinator's head moves forward one step at a time, or back only by a restore."""
        coordinator = self.sim.coordinator
        if coordinator is None or coordinator.state.head is None:
            return
        head = coordinator.state.head
        if self.head is not None and head != self.head:
            step, chain = self.head
            if head[0] < step:
                self.fail(f"the head went back from step {step} to {head[0]} without a restore")
            if head[0] == step:
                self.fail(f"the head changed history at step {step} without a restore")
        self.head = head

    def check_gave_up(self, inc: Incarnation) -> None:
        """A group gives up on its quorum only after ``quorum_seconds`` in which the coordinator
        answered: never during an outage, and not before that long after the last one ended."""
        sim = self.sim
        since = sim.answering_since(inc.asking_since)
        if since is None:
            self.fail(f"{inc.replica_id} gave up on its quorum while the coordinator was down "
                      f"(for {sim.now - sim.down_since:.2f} s)")
        elif sim.now - since < self.c.quorum_seconds - 1e-9:
            self.fail(f"{inc.replica_id} gave up on its quorum {sim.now - since:.2f} s after the "
                      f"coordinator came back, within quorum_seconds={self.c.quorum_seconds:g}: "
                      "it counted the outage")

    def check_silence(self, replica_id: str, reason: str) -> None:
        """A member declared dead for its silence (heartbeat timeout, quiet after a peer's report)
        was silent that long at the coordinator's door: what reached it while it did not run
        (stopped, swapped out) counts. (A member declared hung for no progress is judged by its
        own word, the progress age its heartbeats report, which the coordinator reads in order.)"""
        seen = self.sim.door_seen.get(replica_id)
        if seen is None:
            return
        silent = self.sim.now - seen
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
        sim = self.sim
        assert sim.coordinator is not None
        at, rid, probe = sim.coordinator.convictions[-1]
        if (at, rid) != (sim.now, replica_id):
            return
        self.convictions += 1
        inc = sim.incarnation(rid)
        bad = inc is not None and inc.bad_link
        self.wrong_convictions += not bad
        sim.log(f"convicted {rid} ({'bad link' if bad else 'no bad link'}) of failing step {probe.step}")
        if not bad and max(sim.faults.disturbed_at, sim.last_loss) < probe.since:
            self.fail(f"{rid} was retired for failing step {probe.step} but its link is good, and no "
                      f"other fault struck since its attempts began failing ({probe.since:.3f})")

    # -- a group's steps -----------------------------------------------------------------------------
    def state_mismatch(self, fields: dict) -> None:
        """The coordinator found ``replica_id``'s state digest outvoted (or no majority): it must
        never take part in a step again, and a majority's verdict must be right: an outvoted
        group holds a corrupt state (unless a corruption spread to the majority by a snapshot
        or a checkpoint first: then the majority's state wins, corrupt or not). A member retired
        because it copied a corrupt member's state (``copied_from``, rule I2) reports no digest:
        its state now counts."""
        rid = fields["replica_id"]
        self.found_corrupt.add(rid)
        inc = self.sim.groups.get(fields["group"])
        copied = f" (copied from {fields['copied_from']})" if fields.get("copied_from") else ""
        self.sim.log(f"state mismatch: {rid} at step {fields['step']}{copied} (majority {fields['majority'][:8] or '-'})")
        if not fields["majority"]:
            # No majority (two groups): the corrupt one's state must not survive either (the
            # job rolls back to before the disagreement).
            reported = self._corruption_of(fields)
            if reported:
                self.outvoted.add(reported)
            return
        if inc is None or inc.replica_id != rid:
            return
        # The corruption the outvoted digest shows (the member may have replaced that state
        # since, by a copy: the verdict was right about the state it reported).
        reported = self._corruption_of(fields)
        if reported:
            self.outvoted.add(reported)
        elif inc.state.corruption:
            self.outvoted.add(inc.state.corruption)
        elif not any(g is not None and g.state.corruption for g in self.sim.groups.values()):
            self.fail(f"{rid} was found corrupt at step {fields['step']} but no group holds a corrupt state")

    def _corruption_of(self, fields: dict) -> int:
        """Which silent corruption the reported ``digest`` of state (step, chain) holds (0: none
        or no digest); ``State.digest`` hashes the corruption's number with the history."""
        digest = fields.get("digest")
        if not digest:
            return 0
        for c in range(1, self.sim.faults.corruptions + 1):
            if State(fields["step"], fields["chain"], 0, (), c).digest() == digest:
                return c
        return 0

    def check_no_corrupt_participant(self, q: Quorum) -> None:
        """A group found corrupt never takes part in a step again (it is retired)."""
        stayed = self.found_corrupt.intersection(q.participants)
        if stayed:
            self.fail(f"{sorted(stayed)} found corrupt but a participant of quorum {q.quorum_id} at step {q.step}")

    def check_participant(self, inc: Incarnation, q: Quorum, role: Role) -> None:
        """Every participant (and every spare) of a quorum holds the quorum's ``(step, chain)``:
        a spare that is not current is never promoted, nor kept as a spare."""
        what = "a participant" if role.participant_index is not None else "a spare" if role.spare else ""
        if what and (inc.state.step, inc.state.chain) != (q.step, q.chain):
            self.fail(f"{inc.replica_id} is {what} of quorum {q.quorum_id} at step {q.step} but holds step "
                      f"{inc.state.step} with another history")

    def check_roles(self, q: Quorum) -> None:
        """**spares**: at most ``max_participants`` train; a spare stands by only while every
        training place is taken (a free place goes to a current spare at once)."""
        most = self.sim.options.max_participants
        if q.spares:
            self.spare_quorums += 1
        self.promotions += len(promoted(q, self.last_issued))
        self.last_issued = q
        if not most:
            if q.spares:
                self.fail(f"quorum {q.quorum_id} has spares {q.spares} in a job without spares")
            return
        if len(q.participants) > most:
            self.fail(f"quorum {q.quorum_id} has {len(q.participants)} participants, more than the "
                      f"{most} training places")
        if q.spares and len(q.participants) < most:
            self.fail(f"quorum {q.quorum_id} leaves spares {q.spares} standing by with "
                      f"{len(q.participants)} of {most} training places taken")

    def check_collective(self, coll: Collective, q: Quorum) -> None:
        """One quorum id (within an epoch and step) names one set of members."""
        if coll.quorum.replica_ids() != q.replica_ids():
            self.fail(f"two different quorums share id {q.quorum_id} at step {q.step}")

    def check_commit(self, inc: Incarnation, q: Quorum, coll: Collective) -> None:
        """A committed step carries every participant's slice, each from the quorum's state."""
        slices = sorted(i for i, _, _ in coll.entered.values() if i is not None)
        if slices != list(range(len(q.participants))):
            self.fail(f"{inc.replica_id} committed step {q.step} of quorum {q.quorum_id} without every "
                      f"participant's slice (got {slices})")
        for rid, (i, step, chain) in coll.entered.items():
            if i is not None and (step, chain) != (q.step, q.chain):
                self.fail(f"{rid} contributed a slice to step {q.step} from another state")

    def committed(self, inc: Incarnation, q: Quorum, before: State) -> None:
        """``inc`` committed step ``q.step`` as a participant, from ``before`` to its state now: the
        commit is recorded, its protocol and state agree, and its history is consistent."""
        self.record_commit(inc, q, before, inc.state)
        if (inc.proto.step, inc.proto.chain) != (inc.state.step, inc.state.chain):
            self.fail(f"{inc.replica_id}: protocol and state disagree after a commit")
        self.remember(inc.state)
        self.last_commit = self.sim.now
        self.storm_allowance = 0.0

    def fault_during_search(self, kind: str) -> None:
        """A fault struck while a bad link is in the job: the progress bound grows by what the
        fault may cost the search for it (docs/ft-protocol.md, 'A bad link'). A coordinator crash
        loses the search (its evidence is the coordinator's soft state): a whole search again,
        ``probe_after`` + log2(groups) + 1 failed attempts of up to ``allreduce_timeout``; any other
        fault (a member killed, hung, restarted behind, a pause) may fail or void one attempt."""
        c = self.c
        if kind == "coordinator_crash":
            self.storm_allowance += (c.probe_after + math.ceil(math.log2(c.groups)) + 1) * c.allreduce_timeout
        else:
            self.storm_allowance += c.allreduce_timeout

    def record_commit(self, inc: Incarnation, q: Quorum, before: State, after: State) -> None:
        """The ``commit`` event the trainer writes (a participant's, or a recovering group's at the
        head it caught up to): the step's global sample range, its chain and its parent."""
        self.record.append({"ts": self.sim.now, "kind": "commit", "group": inc.group, "step": q.step,
                            "quorum_id": q.quorum_id, "participants": len(q.participants),
                            "samples": [before.cursor, after.cursor], "tokens": after.cursor - before.cursor,
                            "chain": after.chain, "parent": before.chain})

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

    def check_replayed(self, inc: Incarnation, st: State, q: Quorum) -> None:
        """A catch-up that applied every update ``check_replay`` allowed reaches the head of ``q``."""
        if (st.step, st.chain) != (q.step, q.chain):
            self.fail(f"{inc.replica_id}: replayed state differs from the checked head")

    # -- the end of the job --------------------------------------------------------------------------
    def check_finished_alike(self, inc: Incarnation) -> None:
        """Every group finishes with the state the first one finished with."""
        first = next(iter(self.sim.finished.values()))
        if (inc.state.step, inc.state.chain) != (first.step, first.chain):
            self.fail(f"{inc.replica_id} finished at step {inc.state.step} with another state than the "
                      f"first group to finish (step {first.step})")

    def check_model_write(self, inc: Incarnation) -> None:
        """What the rule let ``inc`` write into the model file: never a state behind the one it
        holds (nothing in the simulation moves it aside), and, from a group that never took part
        in a quorum in this process, only the final step."""
        model, st = self.sim.storage.model, inc.state
        if model is not None and st.step < model.step:
            self.fail(f"{inc.replica_id} replaced the job's model file (step {model.step}) with its "
                      f"state at step {st.step}, behind it")
        if inc.quorum is None and st.step < self.c.steps:
            self.fail(f"{inc.replica_id} never took part in a quorum and wrote the job's model file with "
                      f"its state at step {st.step} (the job's last step is {self.c.steps})")

    def check_end(self) -> None:
        sim = self.sim
        if sim.lost_groups:
            self.fail(f"{', '.join(sorted(sim.lost_groups))} lost: died after every other group had finished, "
                      f"with no final state on disk to resume from (the launch fails)")
        states = {g: (s.step, s.chain) for g, s in sim.finished.items()}
        if len(set(states.values())) != 1:
            self.fail(f"groups finished with different states: {states}")
        (step, chain), = set(states.values())
        survived = {g: s.corruption for g, s in sim.finished.items() if s.corruption in self.outvoted}
        if survived:
            self.fail(f"a corrupt state the majority outvoted survived to the end in {sorted(survived)}")
        bits = {g: s.corruption for g, s in sim.finished.items()}
        # Identical bits at the end, unless a corruption struck too late for a state digest to
        # be compared after it (two ``integrity_every`` before the end).
        late = self.c.steps - 2 * self.c.integrity_every
        if len(set(bits.values())) > 1 and any(sim.faults.corrupted_at.get(b, late) < late for b in bits.values() if b):
            self.fail(f"groups finished with the same history but different bits (silent corruption "
                      f"never found): {bits}")
        if step != self.c.steps:
            self.fail(f"groups finished at step {step}, not {self.c.steps}")
        # The run's summary proves exactly-once from the record alone (ftlm.observe.summary): it
        # must find what the states say, the final state's samples once each and nothing else.
        final = next(iter(sim.finished.values()))
        model = sim.storage.model
        if model is None or (model.step, model.chain) != (final.step, final.chain):
            held = f"step {model.step}" if model is not None else "nothing"
            self.fail(f"the job's model file holds {held}, not the final step {final.step}")
        data = data_accounting(self.record)
        found = (data["samples_committed"], data["duplicates"], data["gaps"], data["inconsistent_steps"])
        if found != (final.cursor, 0, 0, []):
            self.fail(f"the record's accounting (samples, duplicates, gaps, inconsistent steps) is {found}; "
                      f"the final state trained samples [0, {final.cursor}) once each")

    # -- graceful leaves -----------------------------------------------------------------------------
    def watch_leave(self, leaver: Incarnation) -> None:
        """Judge a leave that reached the coordinator in quiet times: every other group healthy
        (no fault was injected into its process: one resumed after a SIGSTOP may still wait out
        an old all-reduce) and a live member holding the head (else the others may rightly wait:
        for a hung peer's detection, a lagging peer or one loading a checkpoint, a lost request's
        poll timeout, a rollback). Their next quorum must come within ``leave_bound``
        (``check_leaves``)."""
        sim = self.sim
        c = sim.coordinator
        if c is None or c.state.head is None or sim.now - sim.resumed_at < self.c.poll_timeout:
            return  # (after a pause, the others' requests may have been withdrawn meanwhile, their polls ended)
        others = [g for g in sim.groups.values() if g is not None and g is not leaver and g.alive and not g.left]
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
            if q is not None and any((*quorum_key(q), r) in sim.lost_answers for r in q.replica_ids()):
                return
        if not any((hb.step, hb.chain) == c.state.head for hb in c.state.heartbeats.values()):
            return
        if c.state.prev_quorum is None and len({g.group for g in others}) < c.options_now().expected_groups:
            return  # a coordinator's first quorum waits for the groups it expects (some left before it started)
        # One that trains in a quorum without the leaver (issued before the leave arrived) waits
        # for nobody: its next quorum comes after its step, however long (a DiLoCo phase).
        waiting = {g.replica_id for g in others if g.replica_id in healthy and not (
            g.phase in ("training", "collective") and g.quorum is not None
            and not g.quorum.present(leaver.replica_id))}
        if not waiting:
            return
        self.leave_watches.append(LeaveWatch(leaver.replica_id, sim.now, sim.now + self.c.leave_bound, waiting))
        self.leaves_judged += 1

    def answered(self, inc: Incarnation, q: Quorum) -> None:
        """``inc`` received quorum ``q``: a leave it waited on is settled if ``q`` is without the leaver."""
        for w in self.leave_watches:
            if inc.replica_id in w.waiting and not q.present(w.leaver):
                w.waiting.discard(inc.replica_id)

    def check_leaves(self) -> None:
        """A graceful leave never makes the others wait for a timeout (all-reduce, join, heartbeat)."""
        sim = self.sim
        c = sim.coordinator
        current = c.state.prev_quorum if c is not None else None
        # An answer of the quorum in flight that crossed the end of its member's long-poll before
        # the leave arrived: that quorum waits for the member that lost it (seed 854).
        lost = current is not None and any((*quorum_key(current), r) in sim.lost_answers
                                           for r in current.replica_ids())
        kept = []
        for w in self.leave_watches:
            if sim.last_loss >= w.at or sim.loss != self.c.loss or lost:
                continue  # a lost message may delay anyone: not the leave's doing
            w.waiting = {r for r in w.waiting if (g := sim.incarnation(r)) is not None
                         and g.alive and not g.left and not g.stopping}
            if not w.waiting:
                continue
            if sim.now > w.deadline:
                self.fail(f"{w.leaver} left at {w.at:.3f} and {', '.join(sorted(w.waiting))} got no quorum "
                          f"without it within {self.c.leave_bound:g} s (waiting for a timeout?)")
            kept.append(w)
        self.leave_watches = kept
