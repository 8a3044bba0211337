"""Chaos injection by the local launcher: breaking one process of the job when the schedule says.

Responsible for: the processes chaos may hit right now (never the last up-to-date group: a
healthy participant of the last quorum with no other such group alive), and sending the drawn
failure: SIGKILL, SIGSTOP (a hang, left to the watchdog) or SIGTERM (a preemption the group must
leave on) to a group's rank, or SIGKILL to the coordinator; the ``failure_injected`` event.

Not responsible for: the draws (``ftlm.launch.chaos``: when, which target, which signal), when
chaos stops (the launcher's loop: once a group reached the last step), nor restarting what it
broke.
"""

from __future__ import annotations

import os
import signal
import time

from ftlm.launch.chaos import ALL_RANKS, COORDINATOR, Chaos
from ftlm.launch.coordinator_process import CoordinatorProcess
from ftlm.launch.group_process import GroupProcess
from ftlm.observe.events import EventLog


class ChaosInjection:
    """The chaos of ``LocalLauncher`` (a part of it: it reads the launcher's groups, schedule and
    coordinator process)."""

    groups: list[GroupProcess]
    ranks: int
    chaos: Chaos
    coordinator: CoordinatorProcess
    _healthy: set[str]
    _down_since: float | None

    def _inject(self, events: EventLog, status: dict | None) -> None:
        """Break one process. A group may be hit unless it is the last up-to-date one (a healthy
        participant of the last quorum with no other such group alive): starting and recovering
        groups are fair game, before the first quorum too."""
        last = (status or {}).get("last_quorum") or {}
        if last.get("participants"):
            self._healthy = set(last["participants"])
        # A coordinator that just restarted knows no quorum yet: judge by the last one seen, or
        # the last up-to-date group could be killed while nobody can tell it is the last.
        healthy = self._healthy
        live = [g for g in self.groups if g.running() and not g.stopped and not g.finished
                and g.restart_at is None]
        candidates = [g.name for g in live if g.replica_id not in healthy
                      or any(x.replica_id in healthy for x in live if x is not g)]
        if self.chaos.participants_only:
            candidates = [name for name in candidates
                          if next(g for g in live if g.name == name).replica_id in healthy]
        fault = self.chaos.choose(candidates, self.ranks, self.coordinator.running())
        if fault is None:
            return
        if fault.target == COORDINATOR:
            self._down_since = time.time()
            events.emit("failure_injected", step=-1, target=COORDINATOR, target_rank=0,
                        signal=fault.signal, pid=self.coordinator.pid)
            self.coordinator.kill()  # _watch_coordinator restarts it on the next tick
            return
        g = next(x for x in self.groups if x.name == fault.target)
        events.emit("failure_injected", step=-1, target=g.name, target_rank=fault.rank,
                    signal=fault.signal, incarnation=g.incarnation, registered=g.registered)
        if fault.signal == "SIGTERM":  # a preemption, not a failure: the group must leave on its own
            g.terminated = True
            for p in (g.procs if fault.rank == ALL_RANKS else [g.procs[fault.rank]]):
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            return
        g.cause = "chaos"
        if fault.signal == "SIGSTOP":
            g.stopped = True
            os.kill(g.procs[fault.rank].pid, signal.SIGSTOP)
        else:
            g.procs[fault.rank].kill()

