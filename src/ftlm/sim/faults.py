"""What is injected into a simulated job, where and when (the kinds are ``ftlm.sim.job.FAULTS``).

``Faults`` draws faults from the seed: one every ``fault_mtbf`` simulated seconds on average
(exponential gaps) until the job reached ``faults_until_step`` of its steps, one more around the
end of the job (within a second of a group committing the third-last step: ``endgame_fault``),
and one more after the first group finished, at a group still in the job (``late_fault``). Each
strikes a live process chosen at random (``strike``): SIGKILL (with a slow restart, or a
restart from an older checkpoint, or a next process that hangs while starting), SIGSTOP with or
without SIGCONT, a wedged training thread, SIGTERM at any moment (``stop``), a lagging group,
a slow or failing state transfer, a bogus claim, a lossy partition, a bad link, or the
coordinator crashed or paused. It also keeps what a fault leaves behind for later: which links
are bad (``bad_link``: healed once fewer than two good groups remain), which groups' next
process starts with a bad link or hung, and when the last fault struck (liveness counts from
there).

Not responsible for what the struck process or the coordinator then does (``ftlm.sim.group``,
``ftlm.sim.processes``, ``ftlm.sim.world``), nor for judging it (``ftlm.sim.invariants``).
"""

from __future__ import annotations

import dataclasses
import random
from typing import TYPE_CHECKING

from ftlm.ft.quorum import Heartbeat, StaleIncarnation
from ftlm.sim.job import Incarnation

if TYPE_CHECKING:
    from ftlm.sim.world import Simulation


class Faults:
    """The fault schedule of one ``Simulation`` and the state faults leave behind."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.c = sim.c
        self.counts: dict[str, int] = {}  # faults struck, by kind (``SimResult.faults``)
        self.last_fault = 0.0
        self.disturbed_at = float("-inf")  # the last fault other than a bad link that struck
        self.endgame = False  # a group came within 3 steps of the end
        self.pending_hung: dict[str, tuple[float, str]] = {}  # replica id -> (since, kind): not detected yet
        self.slow_restart: set[str] = set()  # groups whose next restart outlasts the drain
        self.sticky_links: set[str] = set()  # groups whose next process starts with a bad link
        self.hang_next_start: set[str] = set()  # groups whose next process hangs before it registers
        self.slow_next = False  # the next state transfer is slow
        self.kill_source_next = False  # the next state transfer's source dies mid-way
        # Silent data corruption has a random source of its own: a seed's other faults stay.
        self.sdc_rng = random.Random(f"sdc-{sim.seed}")
        self.corruptions = 0  # states corrupted so far (each one's ``State.corruption``)
        self.corrupted_at: dict[int, int] = {}  # corruption -> the step of the state it struck

    def schedule_corruption(self) -> None:
        """With probability ``SimConfig.sdc``, one group's state is corrupted once, at a random
        moment of the first half of the job's expected length (``corrupt``)."""
        rng = self.sdc_rng
        if self.c.integrity_every > 0 and rng.random() < self.c.sdc:
            expected = self.c.steps * sum(self.c.step_seconds) / 2
            self.sim.at(rng.uniform(0.5, max(1.0, expected / 2)), self.corrupt, "silent data corruption")

    def corrupt(self) -> None:
        """Flip a bit of one live group's state (``FTLM_FAULT=bitflip``): its history is unchanged,
        its bits and its digest differ; nothing fails."""
        sim = self.sim
        live = sorted((g for g in sim.groups.values() if g is not None and g.alive and not g.left
                       and g.state.step > 0), key=lambda g: g.group)
        # A group at the newest state (a group behind replaces its state by a pull anyway).
        live = [g for g in live if g.state.step == max(x.state.step for x in live)]
        if sim.finished:
            return
        if not live:  # nobody has trained a step yet
            sim.at(0.5, self.corrupt, "silent data corruption")
            return
        target = self.sdc_rng.choice(live)
        self.corruptions += 1
        target.state = dataclasses.replace(target.state, corruption=self.corruptions)
        self.corrupted_at[self.corruptions] = target.state.step
        target.injected = True
        self.counts["state_mismatch"] = self.counts.get("state_mismatch", 0) + 1
        sim.log(f"fault state_mismatch -> {target.replica_id} at step {target.state.step}")

    # -- when ----------------------------------------------------------------------------------------
    def inject(self) -> None:
        sim = self.sim
        best = max((g.state.step for g in sim.groups.values() if g is not None), default=0)
        if best >= self.c.faults_until_step * self.c.steps or sim.finished:
            return
        # A long coordinator outage stands for the faults of its time: each one striking during
        # it would wait for the coordinator to be detected, and stacked they outlast the
        # progress bound, which is for faults that heal within it (short outages keep theirs).
        if not sim.long_outage:
            self.strike(sim.rng.choice(self.c.faults))
        sim.at(sim.rng.expovariate(1 / self.c.fault_mtbf), self.inject, "fault")

    def committed(self, step: int) -> None:
        """A group committed ``step``: from 3 steps before the end, one fault is scheduled to land
        before, during or after the finish."""
        sim = self.sim
        if step >= self.c.steps - 3 and not self.endgame:
            self.endgame = True
            if sim.rng.random() < self.c.endgame_faults:
                sim.at(sim.rng.uniform(0.0, 1.0), self.endgame_fault, "endgame fault")

    def endgame_fault(self) -> None:
        """One fault at the end of the job, when groups drain, serve late joiners and leave."""
        kinds: list[str] = [k for k in ("crash", "hang", "hang_resume", "coordinator_crash", "old_checkpoint", "leave")
                            if k in self.c.faults]
        if "crash" in kinds:
            kinds.append("crash_slow_restart")  # back only after the others may have left
        # (after the kinds above: the seeds found with them keep their schedules)
        kinds += [k for k in ("coordinator_pause", "hang_restarting") if k in self.c.faults]
        if kinds:
            self.strike(self.sim.rng.choice(kinds))

    def finishing(self) -> None:
        """A group finishes: when it is the first, one more fault is scheduled within
        ``drain_seconds + quorum_seconds + startup_timeout`` (``late_fault``)."""
        sim = self.sim
        if (not sim.finished and self.late_kinds() and self.c.late_faults > 0
                and sim.rng.random() < self.c.late_faults):
            seconds = self.c.drain_seconds + self.c.quorum_seconds + self.c.startup_timeout
            sim.at(sim.rng.uniform(0.0, seconds), self.late_fault, "late fault")

    def late_kinds(self) -> list[str]:
        return [k for k in ("leave", "crash") if k in self.c.faults]

    def late_fault(self) -> None:
        """One fault after the first group finished, at a group still in the job: perhaps one
        restarted after the others left, waiting for a quorum that never comes (a spot reclaim,
        the launcher stopping the job, a crash)."""
        if any(g is not None and g.alive and not g.hung and not g.left for g in self.sim.groups.values()):
            self.strike(self.sim.rng.choice(self.late_kinds()))

    def liveness_from_now(self) -> None:
        """A group is started again long after its fault (a slow node, a relaunch): the job's
        liveness bound counts from now."""
        self.last_fault = self.sim.now

    # -- what ----------------------------------------------------------------------------------------
    def strike(self, kind: str) -> None:
        sim = self.sim
        if kind == "bad_link" and (self.c.groups < 3 or self.links_bad() >= min(
                self.c.bad_links, self.c.groups - 2)):
            return  # at most ``bad_links``, and two good groups must remain (see FAULTS)
        if self.links_bad():
            sim.invariants.fault_during_search(kind)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.last_fault = sim.now
        if kind != "bad_link":
            self.disturbed_at = sim.now
        sim.invariants.leave_watches = []  # another fault may delay anyone: a leave is judged in quiet times
        live = [g for g in sim.groups.values() if g is not None and g.alive and not g.hung and not g.left]
        target = sim.rng.choice(live) if live else None
        if self.c.spares:
            # A spare's own failures (dying, hanging, falling behind) must never reach training:
            # half the faults strike a current spare when there is one.
            spares = [g for g in live if g.proto.role is not None and g.proto.role.spare]
            if spares and sim.rng.random() < 0.5:
                target = sim.rng.choice(spares)
        sim.log(f"fault {kind} -> {target.replica_id if target else '-'}")
        die = sim.launcher.die
        if kind == "coordinator_crash":
            sim.coordinator_crash()
        elif kind == "coordinator_pause":
            sim.pause_coordinator()
        elif target is None:
            pass
        elif kind == "crash_slow_restart":
            target.injected = True
            self.slow_restart.add(target.group)
            die(target, "SIGKILL (slow restart)")
        elif kind in ("crash", "crash_starting"):
            if kind == "crash" or not target.registered:
                target.injected = True
                die(target, "SIGKILL")
        elif kind == "hang_restarting":
            target.injected = True
            self.hang_next_start.add(target.group)
            die(target, "SIGKILL (its next process hangs while starting)")
        elif kind in ("hang", "hang_starting"):
            if kind == "hang" or not target.registered:
                target.injected = True
                target.hung = True
                self.pending_hung[target.replica_id] = (sim.now, kind)
        elif kind == "hang_resume":
            # SIGSTOP, then SIGCONT a moment later: back with whatever state it held, perhaps
            # after the others declared it dead and moved on (or rolled back without it).
            target.injected = True
            target.hung = True
            sim.at(sim.rng.uniform(0.2, 3.0), lambda t=target: self.resume(t), "SIGCONT")
        elif kind == "hang_training":
            target.injected = True
            target.hung_training = True
            target.phase = "hung-training"
            self.pending_hung[target.replica_id] = (sim.now, kind)
        elif kind == "lag":
            target.lag_once = True
        elif kind == "old_checkpoint":
            target.injected = True
            die(target, "SIGKILL (restarts from an older checkpoint)")
            sim.at(self.c.restart_delay + 0.01, lambda: _mark_lag(sim.groups.get(target.group)), "old ckpt")
        elif kind == "slow_transfer":
            self.slow_next = True
        elif kind == "source_crash_mid_transfer":
            self.kill_source_next = True
        elif kind == "bogus_claim" and sim.coordinator is not None:
            self.bogus_claim(target)
        elif kind == "leave":
            self.stop(target)
        elif kind == "bad_link":
            target.injected = target.bad_link = True
        elif kind == "partition_drop":
            target.injected = True
            sim.loss = 0.5
            sim.at(sim.rng.uniform(0.2, 1.0), lambda: setattr(sim, "loss", self.c.loss), "heal partition")

    def resume(self, t: Incarnation) -> None:
        """SIGCONT of a process stopped by ``hang_resume``: it goes on where it was."""
        sim, gm = self.sim, self.sim.group_model
        if t.alive and t.hung:
            t.hung = False
            self.pending_hung.pop(t.replica_id, None)  # it came back on its own
            sim.log(f"resume {t.replica_id}")
            if t.polling:  # its long-poll ended while it was stopped: its outcome counts, as
                gm.poll_ended(t)  # the client's wait for the HTTP call takes it, then it asks anew
            if t.phase == "updating" and t.update_pending:
                t.update_pending = False
                gm.update_done(t)
            elif t.phase == "reloading" and t.update_pending:
                t.update_pending = False
                sim.recovery.reload_done(t)
            elif t.phase == "asking" and not t.polling:
                gm.ask(t)
            elif t.phase == "collective" and t.quorum is not None:
                sim.at(self.c.allreduce_timeout, lambda: sim.allreduce.timed_out(t, t.quorum), "allreduce timeout")
            elif t.phase == "training" and t.quorum is not None:
                sim.allreduce.enter(t, t.quorum)
            elif t.phase == "idle":
                gm.next_step(t)

    def bogus_claim(self, target: Incarnation) -> None:
        """A heartbeat in ``target``'s group's name claiming a step and quorum id far ahead: it
        replaces the group's real incarnation, whose process exits and restarts."""
        sim = self.sim
        beat = Heartbeat(f"{target.group}:bogus{sim.seq}", target.group, sim.now,
                         sim.rng.choice([10**15, 2**53]), 2**53, "f" * 64)

        def bogus() -> None:
            if sim.coordinator is None:
                return
            beat.last_seen = beat.progress_at = sim.now
            try:
                _, outputs = sim.coordinator.heartbeat(sim.now, beat)
                sim.deliver_outputs(outputs)
            except StaleIncarnation:
                pass
        sim.to_door(bogus)
        target.injected = True

    def stop(self, inc: Incarnation) -> None:
        """SIGTERM (spot reclaim, preemption, a drained node) at whatever moment ``inc`` is in:
        the trainer finishes its step (or the step it owes an early request) and leaves; now
        and then the step is interrupted where it is (SIGINT: KeyboardInterrupt) and it leaves
        at once; before its handler is installed the signal kills a starting process."""
        sim = self.sim
        if inc.hung_training:
            return  # its training thread cannot run the handler: the launcher's SIGKILL follows (a crash)
        if inc.phase == "starting" and sim.rng.random() < 0.3:
            inc.injected = True
            sim.launcher.die(inc, "SIGTERM before its handler was installed")
        elif inc.phase != "starting" and sim.rng.random() < 0.25:
            sim.group_model.leave(inc, "stopped (interrupted)")
        else:
            inc.stopping = True
            sim.log(f"SIGTERM {inc.replica_id} in phase {inc.phase}")

    # -- what a fault leaves behind --------------------------------------------------------------------
    def link_at_start(self, inc: Incarnation) -> None:
        """A new process of a group whose last one had a bad link may have one too (its node's)."""
        if inc.group in self.sticky_links:
            self.sticky_links.discard(inc.group)
            inc.bad_link = inc.injected = True
            self.last_fault = self.sim.now  # (a fault again: liveness counts from here)
            self.sim.log(f"spawn {inc.replica_id} (its link is still bad)")

    def hang_at_start(self, inc: Incarnation) -> None:
        """A process wedged before it registers: only the start-up timeout finds it."""
        if inc.group in self.hang_next_start:
            self.hang_next_start.discard(inc.group)
            inc.injected = inc.hung = True
            self.pending_hung[inc.replica_id] = (self.sim.now, "hang_restarting")
            self.sim.log(f"{inc.replica_id} hangs while starting")

    def exited(self, inc: Incarnation) -> None:
        """A process with a bad link ended: its group's next process has one too, now and then."""
        if inc.bad_link and self.sim.rng.random() < self.c.sticky_link:
            self.sticky_links.add(inc.group)

    def links_bad(self) -> int:
        """Groups whose process has a bad link, or whose next one will."""
        live = {g.group for g in self.sim.groups.values() if g is not None and g.alive and g.bad_link}
        return len(live | self.sticky_links)

    def bad_link(self, replica_id: str) -> bool:
        """Whether ``replica_id``'s link is bad now (it heals once fewer than two good groups are
        left: the model's premise, ``FAULTS``)."""
        sim = self.sim
        inc = sim.incarnation(replica_id)
        if inc is None or not inc.alive or not inc.bad_link:
            return False
        # (a process hung in its start-up keeps its group out until the start-up timeout)
        wedged = {g.group for g in sim.groups.values() if g is not None and g.alive and g.hung and not g.registered}
        left = len(sim.groups) - len(sim.departed | sim.lost_groups | set(sim.finished) | wedged)
        if left < 3 or left - self.links_bad() < 2:
            # The model's premise is gone: no two good groups are left to commit (FAULTS).
            inc.bad_link = False
            self.sticky_links.discard(inc.group)
            sim.log(f"the bad link of {replica_id} heals: fewer than two good groups are left")
            return False
        return True

    def transfer_seconds(self, seconds: float) -> float:
        """How long a state transfer takes: ``seconds``, or 20 times that after ``slow_transfer``."""
        seconds *= 20 if self.slow_next else 1
        self.slow_next = False
        return seconds

    def transfer_started(self, source: Incarnation, seconds: float) -> None:
        """A transfer from ``source`` of ``seconds`` began: after ``source_crash_mid_transfer`` the
        source is killed half-way."""
        if self.kill_source_next:
            self.kill_source_next = False
            source.injected = True
            self.sim.at(seconds / 2, lambda: self.sim.launcher.die(source, "killed mid-transfer"), "source crash")


def _mark_lag(inc: Incarnation | None) -> None:
    if inc is not None:
        inc.lag_once = True
