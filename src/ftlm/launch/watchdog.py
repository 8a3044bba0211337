"""The local launcher's watchdog: which of its groups are hung, and killing them so that they
restart.

Responsible for: the hang checks of every running group on each tick of the launcher's loop (a
start-up that stalled or timed out, a group dropped from the coordinator's members, a group that
left the job or printed its result but does not exit), with their clocks stopped while the
coordinator was down; the ``member_killed`` event and the kill.

Not responsible for: what the exit of a killed group means or its restart (``ftlm.launch.local``
reaps it), nor the coordinator's own failure detection (heartbeats, progress), which it reads
from the coordinator's status.
"""

from __future__ import annotations

from pathlib import Path

from ftlm import startup_beacon
from ftlm.config import RunConfig
from ftlm.launch.group_process import GroupProcess
from ftlm.observe.events import EventLog

TEARDOWN_SECONDS = 10.0
"""How long a group that left the job, every rank of which printed its final result, may take to
exit before it is killed (its result stands): it has nothing left to do, and the other groups
stay at the end of the job only ``ft.quorum_timeout`` for it to come back if it was preempted."""


class Watchdog:
    """The hang checks of ``LocalLauncher`` (a part of it: it reads the launcher's config,
    groups, run directory and the coordinator's outages)."""

    config: RunConfig
    groups: list[GroupProcess]
    run_dir: Path
    ranks: int
    _outages: list[tuple[float, float]]
    _down_since: float | None

    def _watchdog(self, status: dict, events: EventLog, now: float) -> None:
        """Kill hung groups so that they restart. A group is hung when:

        * before it made progress, one of its ranks showed no sign of life (its start-up beacon,
          ``ftlm.startup_beacon``) for ``ft.startup_stall_timeout``: the process was stopped or
          frozen while it started, a leader before it registered or any other rank;
        * it has not registered within ``ft.startup_timeout`` of its start (not counting the time
          the coordinator was down: it cannot register meanwhile): alive, but stuck in a phase;
        * it registered, but has been missing from the coordinator's members for ``grace`` seconds:
          the coordinator dropped it (its heartbeat stopped, or it made no progress for
          ``ft.progress_timeout`` while its heartbeat lived: a hung non-leader rank or a wedged
          training thread), or it never came back to a restarted coordinator;
        * it left the job (finished or preempted: no heartbeat is expected any more) but has not
          exited within ``cluster.grace_seconds``: saving the model, summarizing and stopping its
          servers take longer than a heartbeat timeout for a large model or on a busy machine;
          once every rank printed its final result, though, nothing is left but the exit, which
          gets ``TEARDOWN_SECONDS`` (soak seed 46 with preemptions: a preempted group SIGSTOPped
          on its way out was waited for twice the grace, the others finished meanwhile, and the
          job gave up with a replica short of the last step);
        * any of these, but it printed its final result (it is exiting), and it still has not
          exited ``cluster.grace_seconds`` later (a teardown that hangs): it is killed, and its
          result stands (``_reap``).

        The quorum drops a dead group at once (the healthy groups do not wait); the grace of a few
        heartbeat timeouts lets a process that was only starved of CPU come back and rejoin.
        """
        ft = self.config.ft
        grace = 3 * ft.heartbeat_timeout
        dead = {d["replica_id"]: d for d in status.get("dead", [])}
        for g in self.groups:
            if not g.running() or g.finished or g.restart_at is not None or g.killed:
                continue  # (killed: still exiting; the loop reaps and restarts it)
            reason = "" if g.progressed else self._stalled_start(g, now)
            if reason:
                pass  # stopped while starting: none of the checks below applies
            elif not g.registered:
                if self._up_seconds(g.started, now) > ft.startup_timeout:
                    reason = "start-up timeout"
            elif g.left_at is not None:
                # Every rank printed its result: only the exit is left.
                if g.final_result(self.run_dir, self.ranks) is not None:
                    g.exiting_since = g.exiting_since or now
                    if now - g.exiting_since > TEARDOWN_SECONDS:
                        reason, g.stuck_exit = (f"left the job and printed its result but did not exit "
                                                f"within {TEARDOWN_SECONDS:g} s"), True
                elif now - g.left_at > self.config.cluster.grace_seconds:
                    reason = (f"did not exit within cluster.grace_seconds="
                              f"{self.config.cluster.grace_seconds} s of leaving the job")
            elif g.absent_since is not None and self._up_seconds(g.absent_since, now) > grace:
                entry = dead.get(g.replica_id)
                reason = f"declared dead: {entry['reason']}" if entry else "heartbeat lost"
            if reason and not g.stuck_exit and g.printed_error(self.run_dir):
                # Every rank stopped on an error of its own and is exiting (the heartbeat ended
                # first): let it, so that its exit status says what it was (2: a restart repeats
                # it), within TEARDOWN_SECONDS (on a loaded machine the teardown outlasted the
                # grace).
                g.erring_since = g.erring_since or now
                if now - g.erring_since <= TEARDOWN_SECONDS:
                    continue
            # Exiting: bounded too (a teardown can hang).
            if reason and not g.stuck_exit and g.printed_result(self.run_dir):
                g.exiting_since = g.exiting_since or now
                if now - g.exiting_since <= self.config.cluster.grace_seconds:
                    continue
                reason, g.stuck_exit = (f"printed its result but did not exit within "
                                        f"cluster.grace_seconds={self.config.cluster.grace_seconds} s"), True
            if reason:
                events.emit("member_killed", step=-1, target=g.name, incarnation=g.incarnation,
                            reason=reason, stopped=g.stopped)
                g.cause = g.cause if g.cause == "chaos" else "hung"
                g.kill()

    def _stalled_start(self, g: GroupProcess, now: float) -> str:
        """Why a group that has not made progress yet is hung in its start-up: a rank whose
        start-up beacon stopped for ``ft.startup_stall_timeout`` (or never appeared: counted
        from the start); "" when every rank shows signs of life."""
        limit = self.config.ft.startup_stall_timeout
        if not limit:
            return ""
        for rank in range(len(g.procs)):
            seen = startup_beacon.read(g.beacon(self.run_dir, rank), now)
            silent, phase = seen if seen is not None else (now - g.started, "starting the interpreter")
            if silent > limit:
                return (f"start-up stalled: rank {rank} showed no sign of life for {silent:.0f} s "
                        f"(while {phase}; ft.startup_stall_timeout={limit:g})")
        return ""

    def _up_seconds(self, since: float, now: float) -> float:
        """Seconds of ``[since, now]`` during which the coordinator was up: a group can neither
        register nor heartbeat while it is down, so the watchdog's clocks stop meanwhile."""
        outages = self._outages + ([(self._down_since, now)] if self._down_since is not None else [])
        down = sum(max(0.0, min(b, now) - max(a, since)) for a, b in outages)
        return now - since - down

