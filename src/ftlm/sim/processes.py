"""The processes of a simulated job, as the launcher and the local supervisor see them.

``Launcher`` starts a group's process (a new ``Incarnation``, or none when every other group
finished and the final step is not on disk: the group is lost), boots it from the newest durable
checkpoint, ends it (a crash, a kill, an exit after leaving: its connections reset, the
coordinator is told when the supervisor reports deaths) and starts it again, kills a process
that did not register within the start-up timeout or that the coordinator declared dead while it
hung, and decides whether a group that left is started again (a spot node coming back) or is
gone for good.

Not responsible for what a running process does (``ftlm.sim.group``) nor for choosing which
process a fault strikes (``ftlm.sim.faults``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftlm.ft.group import GroupProtocol
from ftlm.sim.job import Incarnation, State, copy_state

if TYPE_CHECKING:
    from ftlm.sim.world import Simulation


class Launcher:
    """Starts, restarts and kills the groups' processes of one ``Simulation``."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.c = sim.c
        self._inc_seq = 0

    def spawn(self, group: str, delay: float) -> None:
        sim = self.sim

        def start() -> None:
            others = [g for g in sim.groups if g != group]
            if sim.finished and self.c.steps not in sim.storage.disk and all(
                    g in sim.lost_groups or g in sim.departed
                    or sim.exited.get(g, sim.now + 1) <= sim.now for g in others):
                # As the local supervisor does: every other group finished and its process
                # exited, and the final step is not on disk, so a new incarnation would have
                # nobody to recover from. (With it, the new incarnation resumes at the end.)
                sim.lost_groups.add(group)
                sim.log(f"lost {group}: died after every other group had finished")
                return
            self._inc_seq += 1
            inc = Incarnation(group, f"i{self._inc_seq}", GroupProtocol(
                f"{group}:i{self._inc_seq}", self.c.max_consecutive_failures, self.c.steps), State(),
                started_at=sim.now)
            sim.groups[group] = inc
            sim.faults.link_at_start(inc)
            sim.log(f"spawn {inc.replica_id}")
            sim.faults.hang_at_start(inc)
            lo, hi = self.c.startup_seconds
            sim.at(sim.rng.uniform(lo, hi), lambda: self.boot(inc), f"boot {inc.replica_id}")
            sim.at(self.c.startup_timeout, lambda: self.startup_watchdog(inc), "watchdog")
        sim.at(delay, start, f"start {group}")

    def boot(self, inc: Incarnation) -> None:
        sim = self.sim
        if not inc.running:
            return
        # Resume from the newest durable checkpoint, as `ftlm train` does with checkpoint.resume.
        disk = sim.storage.disk
        steps = sorted(disk)
        if steps:
            pick = steps[-1]
            if inc.lag_once and len(steps) > 1:  # restored from an older checkpoint on purpose
                pick = steps[sim.rng.randrange(len(steps) - 1)]
            inc.state = copy_state(disk[pick])
            inc.writer = False
        inc.proto.sync(inc.state.step, inc.state.chain)
        inc.phase = "idle"
        sim.log(f"boot {inc.replica_id} at step {inc.state.step}")
        sim.group_model.heartbeat(inc)
        sim.group_model.next_step(inc)  # (a stop requested during start-up: it joined, and leaves at once)

    def die(self, inc: Incarnation, why: str, restart: bool = True) -> None:
        sim = self.sim
        if not inc.alive:
            return
        inc.alive = False
        sim.log(f"exit {inc.replica_id}: {why}")
        sim.faults.exited(inc)
        # Its connections reset: peers inside an all-reduce with it fail at once (transport error).
        for other in sim.groups.values():
            if (other is not None and other is not inc and other.phase == "collective" and other.quorum is not None
                    and other.quorum.present(inc.replica_id)):
                sim.at(sim.latency(), lambda o=other, q=other.quorum: sim.allreduce.peer_reset(o, q),
                       "connection reset")
        if sim.groups.get(inc.group) is inc and restart:
            if sim.coordinator is not None and sim.reports_deaths:
                def report() -> None:
                    if sim.coordinator is not None:
                        sim.deliver_outputs(sim.coordinator.report_dead(sim.now, inc.replica_id, inc.group, why))
                sim.to_door(report)
            delay = self.c.restart_delay
            if inc.group in sim.faults.slow_restart:  # its node takes long to come back
                sim.faults.slow_restart.discard(inc.group)
                delay += sim.rng.uniform(0.5, 1.5) * self.c.drain_seconds
                sim.at(delay, sim.faults.liveness_from_now, "slow restart")  # liveness from here
            self.spawn(inc.group, delay)

    def startup_watchdog(self, inc: Incarnation) -> None:
        """A start-up timeout counts the coordinator's up time only (the local launcher's
        ``_up_seconds``): nobody registers while it is down."""
        left = self.c.startup_timeout - (self.sim.now - inc.started_at - self.sim.down_seconds(inc.started_at))
        if left > 1e-9 and inc.alive and not inc.registered and not inc.left:
            self.sim.at(left, lambda: self.startup_watchdog(inc), "watchdog")
            return
        if inc.alive and not inc.registered and not inc.left:  # (stopped while starting: it left at boot)
            if not inc.injected:
                self.sim.fail(f"{inc.replica_id} did not register within the start-up timeout without a fault")
            self.die(inc, "start-up timeout")

    def supervise(self) -> None:
        """Kill hung processes the coordinator declared dead (as the local supervisor does)."""
        sim = self.sim
        if sim.coordinator is None:
            return
        dead = {rid for t, rid, _, _ in sim.coordinator.recent_dead(sim.now) if sim.now - t >= 0.5}
        members = sim.coordinator.state.heartbeats
        for inc in list(sim.groups.values()):
            if inc is None or not inc.alive or inc.phase == "starting" or inc.left:
                continue
            if inc.replica_id in dead and (inc.hung or inc.hung_training):
                self.die(inc, "killed: declared dead while hung")
            # Not a live member for a start-up timeout (hung before registering, or silent since
            # the coordinator restarted): hung.
            inc.absent_since = None if inc.replica_id in members else (inc.absent_since or sim.now)
            if (inc.absent_since is not None and sim.now - inc.absent_since
                    - sim.down_seconds(inc.absent_since) > self.c.startup_timeout):
                if not inc.injected:
                    sim.fail(f"{inc.replica_id} was not a live member for {self.c.startup_timeout} s "
                             "without a fault")
                self.die(inc, "killed: not a live member")
        sim.invariants.check_hangs_detected()

    def exit_after_leave(self, inc: Incarnation) -> None:
        """The process of a group that left exits 0 (writing the model file first); the launcher
        starts the group again 0.5-8 s later, or it is gone for good (once a job at most, and
        only while two other groups remain)."""
        sim = self.sim
        if not inc.alive:
            return
        sim.storage.write_model(inc)
        self.die(inc, "exit 0 after leaving", restart=False)
        if sim.groups.get(inc.group) is not inc:
            return
        others = [g for g in sim.groups if g != inc.group and g not in sim.departed]
        if sim.rng.random() < self.c.leave_restart or len(others) < 2 or inc.group in sim.faults.slow_restart:
            sim.faults.slow_restart.discard(inc.group)
            delay = sim.rng.uniform(0.5, 8.0)
            self.spawn(inc.group, delay)  # the launcher brings it back
            sim.at(delay, sim.faults.liveness_from_now, "relaunch")  # liveness from here
        else:
            sim.departed.add(inc.group)  # gone for good (its node did not come back): once a job at most
            sim.log(f"departed {inc.group}")
