"""The group model: one process of a replica group, reduced to its order of operations.

``GroupModel`` drives each ``Incarnation``'s real ``ftlm.ft.group.GroupProtocol`` in the order
the trainer and the manager do: heartbeats (a quorum request counts as one), the quorum request
and its long-poll (asked again at its deadline; given up after ``ft.quorum_timeout`` of answers
without a quorum, never for a coordinator that does not answer: ``ftlm.ft.quorum_wait``), the
answer (seen through the coordinator's own encoding, ``MemberQuorum``), the start of a step
(``GroupProtocol.on_quorum`` decides the role: train a slice, recover, drain at the end), the
commit vote after the all-reduce (``GroupProtocol.on_outcome``), the next quorum asked for right
after the vote while the update is applied (the step it gets is owed even if a stop comes
meanwhile), draining and finishing at the end of the job, and graceful leaves on SIGTERM (the
committed step saved first with ``checkpoint.on_stop``).

Not responsible for: the all-reduce itself (``ftlm.sim.collective``), pulling and replaying a
peer's state or reloading from disk (``ftlm.sim.recovery``), what is on disk
(``ftlm.sim.durable``), nor judging any of it (``ftlm.sim.invariants``). It does not import the
trainer (``ftlm.sim`` sits beside ``ftlm.train``): where the trainer's rule is not a function of
``ftlm.ft`` it is written here, and docs/ft-protocol.md ('The simulator') lists those places.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ftlm.ft.client import FINISHED_LEAVE_RETRY_SECONDS, reload_word
from ftlm.ft.group import TooManyFailures
from ftlm.ft.membership import Answer
from ftlm.ft.quorum import Heartbeat, MemberRequest, Quorum
from ftlm.ft.quorum_answer import AnswerEncoder, MemberQuorum
from ftlm.ft.quorum_wait import QuorumWait
from ftlm.sim.collective import quorum_key
from ftlm.sim.job import Incarnation, copy_state

if TYPE_CHECKING:
    from ftlm.sim.world import Simulation


ABANDON_SECONDS = 0.005
"""From the news that a step is doomed to the next block or bucket boundary, where the session
abandons the step (a fixed delay: no draw from the seed's random source)."""

class GroupModel:
    """Each group's step loop in one ``Simulation``."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.c = sim.c
        self.encoder = AnswerEncoder()

    # -- heartbeats --------------------------------------------------------------------------------
    def heartbeat(self, inc: Incarnation) -> None:
        sim = self.sim
        if not inc.alive or inc.left:  # (``Manager.leave`` stops the heartbeat thread first)
            return
        since = sim.now - inc.asked_at
        if since < self.c.heartbeat_interval - 1e-9 and not inc.hung:  # (float rounding: no zero waits)
            # As the real Heartbeater: a quorum request went out within the interval, so it was
            # the heartbeat; the next one is due an interval after it.
            sim.at(self.c.heartbeat_interval - since, lambda: self.heartbeat(inc), "hb")
            return
        if not inc.hung:
            p = inc.proto
            beat = Heartbeat(inc.replica_id, inc.group, 0.0, p.step, max(p.quorum_id, 0), p.chain,
                             known_head=p.known_head)

            age = 0.0  # seconds since its last progress, as the heartbeat says (``progress_age``)

            def arrive() -> None:
                nonlocal age
                if sim.coordinator is None or not inc.alive or inc.left:
                    return
                age = sim.now - inc.progress_at
                sim.door_seen[inc.replica_id] = sim.now
                sim.to_door(handle)

            def handle() -> None:
                if sim.coordinator is None or not inc.alive:  # (died while it waited: its connection reset)
                    return
                beat.last_seen = sim.now
                beat.progress_at = sim.now - age  # (as the coordinator reads it: the age counts from now)
                result = sim.to_coordinator(inc, lambda c: c.heartbeat(sim.now, beat))
                if result is None:
                    return
                answer, outputs = result
                sim.deliver_outputs(outputs)
                if not sim.lost():
                    sim.at(sim.latency(), lambda: self.on_heartbeat_answer(inc, answer), "hb answer")
            if not sim.lost():
                sim.at(sim.latency(), arrive, f"heartbeat {inc.replica_id}")
        sim.at(self.c.heartbeat_interval, lambda: self.heartbeat(inc), "hb")

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
                self.sim.allreduce.abort(inc, "a quorum member was reported dead")
            elif inc.phase == "training" and self.c.abandon_doomed_steps:
                # As the session (``abandon_doomed_steps``): the rest of the forward or backward
                # pass is skipped at the next block or bucket, and the step fails at once.
                q = inc.quorum
                self.sim.at(ABANDON_SECONDS, lambda: self.sim.allreduce.enter(inc, q), "abandon doomed step")

    # -- asking for a quorum -----------------------------------------------------------------------
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
            self.sim.recovery.reload(inc, head)
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
        sim = self.sim
        if not inc.running or inc.hung_training or inc.left:
            return
        if inc.stopping and not early and not inc.polling:
            self.leave(inc, "stopped")  # ``_request_quorum`` raises StopRequested before asking
            return
        if not inc.polling:
            inc.asking_since = sim.now
            inc.wait = QuorumWait(self.c.quorum_seconds, 0.0, sim.now)
        if not early:
            inc.phase = "asking"
        inc.polling = True
        inc.poll_stopped = False
        inc.progress_at = sim.now
        inc.request_seq += 1
        seq = inc.request_seq
        if inc.request is not None and sim.coordinator is not None:
            sim.withdraw(inc.request)  # the earlier long-poll ended (answered or not)
        inc.request = None
        if inc.lag_once and inc.proto.step > 0 and not inc.lagged:
            inc.lagged = True  # a slow group: its request goes out well after the others'
            sim.at(self.c.join_timeout * sim.rng.uniform(1.0, 3.0), lambda: self.send_request(inc, seq),
                   "lagging ask")
            return
        self.send_request(inc, seq)

    def send_request(self, inc: Incarnation, seq: int) -> None:
        sim = self.sim
        if not inc.running or inc.hung_training or inc.request_seq != seq or not inc.polling or inc.left:
            return
        inc.proto.sync(inc.state.step, inc.state.chain)  # as Manager.start_step (or Manager.ask) does
        head, again = inc.reload_hint
        if self.c.reload_checkpoints and head is not None and inc.proto.reload_due(head, again):
            sim.recovery.told_to_reload(inc, head)  # as Manager._request_quorum
            return
        fields = inc.proto.request()
        req = MemberRequest(inc.replica_id, inc.group, fields["step"], fields["last_quorum_id"], fields["failed"],
                            {"recover_request": fields["recover_request"]}, 0.0, fields["chain"],
                            tuple(fields["watch"]), fields["disk_checked"], fields["disk_round"], inc.integrity)
        inc.request = req
        inc.asked_at = sim.now  # a quorum request is a heartbeat: the next beat waits an interval

        def arrive() -> None:
            if sim.coordinator is None or not inc.alive or inc.request is not req:
                inc.request_lost = inc.request_lost or inc.request is req  # (the coordinator was down)
                return
            sim.door_seen[inc.replica_id] = sim.now
            sim.to_door(handle)

        def handle() -> None:
            if sim.coordinator is None or not inc.alive:  # (died while it waited: its connection reset)
                return
            req.asked_at = sim.now
            sim.polls[inc.replica_id] = (req, seq)
            outputs = sim.to_coordinator(inc, lambda c: c.request(sim.now, req))
            if outputs is not None:
                sim.deliver_outputs(outputs)
        inc.request_lost = sim.lost()
        if not inc.request_lost:
            sim.at(sim.latency(), arrive, f"request {inc.replica_id} step {fields['step']}")
        sim.log(f"{inc.replica_id} asks at step {fields['step']}{' (failed)' if fields['failed'] else ''}"
                f"{' (early)' if inc.phase == 'updating' else ''}")

        def poll_timeout() -> None:
            if not inc.polling or inc.request_seq != seq or inc.left:
                return
            if inc.running and not inc.hung_training:
                self.poll_ended(inc)
            elif inc.request is not None and sim.coordinator is not None:
                # The coordinator answers 504 at the long-poll's deadline and forgets the request
                # whatever the member's threads do: a wedged training thread asks no more, so it
                # is no longer "waiting for a quorum" and progress_timeout can declare it hung.
                sim.withdraw(inc.request)
        sim.at(self.c.poll_timeout, poll_timeout, "poll timeout")

    def poll_ended(self, inc: Incarnation) -> None:
        """A long-poll ended without a quorum: ``Manager._request_quorum`` polls again, or raises
        StopRequested when a stop was requested meanwhile, or gives up after ft.quorum_timeout."""
        sim = self.sim
        if inc.stopping:
            inc.polling = False
            if inc.request is not None and sim.coordinator is not None:
                sim.withdraw(inc.request)
            inc.request = None
            if inc.phase == "updating":
                inc.poll_stopped = True  # the trainer sees it when it takes the answer
            else:
                self.leave(inc, "stopped")
        elif self.gives_up(inc):
            sim.invariants.check_gave_up(inc)
            sim.launcher.die(inc, "no quorum within ft.quorum_timeout")  # as Manager._request_quorum
        else:
            self.ask(inc, early=inc.phase == "updating")

    def gives_up(self, inc: Incarnation) -> bool:
        """At a long-poll's deadline: whether the coordinator answered it (504) or not at all
        (down, stopped, the request or answer lost), fed to the group's ``QuorumWait`` as
        ``Manager._request_quorum`` feeds it; then whether the group gives up."""
        sim, wait = self.sim, inc.wait
        if wait is None:
            return False
        held = sim.polls.get(inc.replica_id)
        answered = (not inc.request_lost and sim.coordinator is not None and sim.inbox is None
                    and held is not None and held[0] is inc.request)
        if answered:
            wait.answered(sim.now)
        else:
            wait.unreachable(inc.asked_at, sim.now)
        return wait.give_up(sim.now) is not None

    def on_answer(self, inc: Incarnation, seq: int, answer: Answer) -> None:
        sim = self.sim
        if (not inc.running or inc.hung_training or not inc.polling or inc.request_seq != seq
                or inc.request is None or inc.left):
            if answer.quorum is not None and inc.running and not inc.left:
                # It crossed the end of its long-poll: its quorum waits for this member (lost to it).
                sim.lost_answers.add((*quorum_key(answer.quorum), answer.replica_id))
                sim.last_loss = sim.now
            return
        inc.request = None
        if answer.status == 409:
            sim.storage.set_aside(inc, (answer.body or {}).get("suspect_state"))
            sim.launcher.die(inc, "stale incarnation")
            return
        head, again = reload_word(answer.body or {})
        if answer.status == 504 and self.c.reload_checkpoints and inc.proto.reload_due(head, again):
            sim.recovery.told_to_reload(inc, head)
            return
        if answer.status != 200:
            sim.at(0.01, lambda: self.poll_ended(inc) if inc.polling and inc.request_seq == seq else None,
                   "re-ask")
            return
        inc.polling = False
        inc.integrity = None  # delivered (``Manager._request_quorum``)
        if answer.quorum is not None:
            sim.invariants.answered(inc, answer.quorum)
        if inc.phase == "updating":
            inc.held = answer  # the asker thread holds it until the trainer's next start_step
            return
        self.start_step(inc, answer)

    # -- a step ------------------------------------------------------------------------------------
    def start_step(self, inc: Incarnation, answer: Answer) -> None:
        """``Manager.start_step`` with the quorum answer, then the trainer's start of a step."""
        sim = self.sim
        q = answer.quorum  # the whole quorum, for the simulator's own bookkeeping and checks
        # The group sees only its own answer, through the same encoding the coordinator sends.
        view = MemberQuorum.from_json(self.encoder.encode(q, inc.replica_id))
        try:
            role = inc.proto.on_quorum(view)
        except TooManyFailures as e:
            if not inc.injected:
                sim.fail(f"healthy group {inc.replica_id} gave up: {e}")
            sim.launcher.die(inc, f"too many failures: {e}")
            return
        inc.quorum = q
        inc.abort_pending = False
        inc.progress_at = sim.now
        inc.reload_hint = (None, 0)  # as the manager: a quorum is newer word than any heartbeat's "reload"
        sim.invariants.check_participant(inc, q, role)
        every = self.c.integrity_every
        if role.participant_index is not None and every > 0 and q.step > 0 and q.step % every == 0:
            inc.integrity = (q.step, q.chain, inc.state.digest())  # ``Manager._digest_in_background``
        if role.publish:
            inc.published[q.step] = copy_state(inc.state)
        # As the manager does: snapshots no joiner pulls any more are dropped.
        inc.published = {s: v for s, v in inc.published.items() if s in role.retain}
        if role.fetch_from is not None:
            sim.recovery.start_fetch(inc, q, role.fetch_from)
        if role.drain:
            self.drain(inc, q, role)
            return
        inc.phase = "training"
        lo, hi = self.c.step_seconds
        sim.at(sim.rng.uniform(lo, hi), lambda: sim.allreduce.enter(inc, q), f"train {inc.replica_id}")

    def outcome(self, inc: Incarnation, q: Quorum | None, ok: bool, why: str = "") -> None:
        """The all-reduce ended for ``inc`` (``ok``: it completed here): the commit vote
        (``GroupProtocol.on_outcome``), then what the trainer does with its verdict."""
        sim = self.sim
        if (not inc.running or inc.hung_training or inc.phase != "collective" or q is None
                or inc.quorum is None or inc.left or quorum_key(inc.quorum) != quorum_key(q)):
            return
        if not ok:
            inc.proto.fail(why or "collective failed")
            sim.log(f"{inc.replica_id} failed step {q.step} (quorum {q.quorum_id}): {why or 'collective failed'}")
        coll = sim.allreduce.collectives.get(quorum_key(q))
        committed = inc.proto.on_outcome(ok)
        inc.progress_at = sim.now
        samples = len(q.participants) * self.c.batch
        role = inc.proto.role
        if committed and not role.recovering:
            sim.invariants.check_commit(inc, q, coll)
            before = inc.state
            inc.state = before.after(q.next_chain(), samples)
            sim.invariants.committed(inc, q, before)
            inc.writer = role.participant_index == 0
            sim.log(f"{inc.replica_id} committed step {q.step} (quorum {q.quorum_id})")
            sim.storage.committed(inc, role)
            sim.faults.committed(inc.state.step)
            self.ask_early_and_update(inc)
            return
        if role.recovering:
            inc.writer = False  # no checkpoint writer until it commits as a participant
            # As the trainer: at this step's head, apply its average if it committed here; else
            # keep the average for the replay. Then ask for the next quorum with the state this
            # step leaves, as the participants do (the bookkeeping overlaps with the request).
            if inc.catching and inc.state.step == q.step:
                sim.recovery.finish_catch_up(inc, q, committed)
            elif committed:
                inc.buffer[q.step] = (q.quorum_id, list(q.participants), samples)
            self.ask_early_and_update(inc)
            return
        inc.phase = "idle"
        sim.at(0.0, lambda: self.next_step(inc), "next step")

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
        self.sim.at(self.sim.rng.uniform(lo, hi), lambda: self.update_done(inc), f"update {inc.replica_id}")

    def update_done(self, inc: Incarnation) -> None:
        """The optimizer update is applied: the trainer's loop goes on (to the asked quorum)."""
        if inc.phase != "updating" or not inc.alive or inc.left:
            return
        if not inc.running:
            inc.update_pending = True  # stopped mid-update (SIGSTOP): it goes on after SIGCONT
            return
        self.next_step(inc)

    # -- the end of the job and leaving ------------------------------------------------------------
    def drain(self, inc: Incarnation, q: Quorum, role: Any) -> None:
        """A quorum at the job's last step: a recovering group catches up; a finished one serves
        late joiners until a quorum shows every group up to date (``Manager.finish``) or
        ``drain_seconds`` pass without a joiner."""
        sim = self.sim
        if role.recovering:
            inc.phase = "idle"
            sim.recovery.load_snapshot(inc)
            if inc.catching and sim.recovery.replay_backlog(inc, q, until_head=True):
                sim.recovery.finish_catch_up(inc, q, committed=False)  # at the final step: nothing to apply
                sim.at(0.0, lambda: self.next_step(inc), "next step")
            else:
                sim.at(0.1, lambda: self.next_step(inc), "drain ask")
            return
        if not q.recovering_count and q.group_count + q.groups_left >= self.c.groups:
            self.finish(inc)
            return
        if inc.draining_since is None or q.recovering_count:
            inc.draining_since = sim.now
        if sim.now - inc.draining_since > self.c.drain_seconds or inc.stopping:
            self.finish(inc)  # (a stop request ends the serving; the group still leaves finished)
            return
        inc.phase = "idle"
        sim.at(0.25, lambda: self.next_step(inc), "drain ask")

    def finish(self, inc: Incarnation) -> None:
        sim = self.sim
        inc.finished = True
        inc.phase = "done"
        sim.storage.save_final(inc, finishing=True)
        sim.faults.finishing()
        sim.finished[inc.group] = copy_state(inc.state)
        sim.log(f"finished {inc.replica_id} at step {inc.state.step}")
        # It left the job; its process writes its results and exits a moment later.
        sim.exited[inc.group] = sim.now + sim.rng.uniform(0.2, 3.0)
        # ``Manager.leave``: told again while the coordinator is down, for a while.
        give_up = sim.now + FINISHED_LEAVE_RETRY_SECONDS

        def arrive() -> None:
            if sim.coordinator is not None:
                sim.deliver_outputs(sim.coordinator.leave(sim.now, inc.replica_id, inc.group, "finished",
                                                               (inc.state.step, inc.state.chain)))
                sim.invariants.watch_leave(inc)
            elif sim.now < give_up:
                sim.at(sim.rng.uniform(0.2, 2.0), lambda: sim.to_door(arrive), f"leave again {inc.replica_id}")
        sim.to_door(arrive)
        inc.alive = False
        sim.invariants.check_finished_alike(inc)
        sim.storage.write_model(inc)

    def leave(self, inc: Incarnation, reason: str, saved: bool = False) -> None:
        """A graceful leave (SIGTERM, a finished ``train.max_seconds``): the trainer's loop ended,
        the manager stops its heartbeats and tells the coordinator (``Manager.leave``); the
        process exits 0 a moment later (it writes its model and summary first), and the
        launcher may start the group again later (a spot node coming back). With
        ``checkpoint_on_stop`` the session's ``_leave_stopped`` saves the step first (``saved``:
        done already); heartbeats go on meanwhile."""
        sim = self.sim
        if inc.left or not inc.alive or (inc.phase == "saving" and not saved):
            return
        if not saved and reason == "stopped" and sim.storage.saves_on_stop(inc):
            inc.phase = "saving"
            state = copy_state(inc.state)
            inc.progress_at = sim.now

            def saved_then_leave() -> None:
                # (a process stopped or wedged meanwhile never finishes it: the hang is detected)
                if inc.running and not inc.hung_training and not inc.left:
                    sim.storage.disk[state.step] = state
                    sim.log(f"{inc.replica_id} saved step {state.step} before leaving")
                    self.leave(inc, reason, saved=True)
            sim.at(sim.rng.uniform(*self.c.stop_save_seconds), saved_then_leave, f"save {inc.replica_id}")
            return
        inc.left = True
        inc.polling = False
        inc.phase = "left"
        sim.log(f"{inc.replica_id} leaves: {reason}")
        inc.request = None
        if not sim.lost():
            epoch = sim.coordinator_epoch

            def arrive() -> None:
                if sim.coordinator is not None and sim.coordinator_epoch == epoch:
                    sim.to_door(handle)

            def handle() -> None:
                if sim.coordinator is not None and sim.coordinator_epoch == epoch:
                    sim.deliver_outputs(sim.coordinator.leave(sim.now, inc.replica_id, inc.group, reason))
                    sim.invariants.watch_leave(inc)
            sim.at(sim.latency(), arrive, f"leave {inc.replica_id}")
        lo, hi = self.c.exit_seconds
        sim.at(sim.rng.uniform(lo, hi), lambda: sim.launcher.exit_after_leave(inc), f"exit {inc.replica_id}")
