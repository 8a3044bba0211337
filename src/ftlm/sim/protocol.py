"""Deterministic simulation of a fault-tolerant job: the real protocol code, a seeded scheduler,
a simulated clock, and faults at any moment. ``run(seed)`` is the entry point.

What runs for real: the coordinator's state machine (``ftlm.ft.membership.Membership``, with the
quorum rules of ``ftlm.ft.quorum``), each group's step protocol (``ftlm.ft.group.GroupProtocol``),
the catch-up check (``ftlm.ft.group.check_replay``) and the model file's rule
(``ftlm.ft.end_of_run.may_write_model``): the same objects the aiohttp server, the manager and
the trainer use in production. What is simulated, one concept per module:

* ``ftlm.sim.world``: the clock, the event queue and the run loop (``Simulation``), the network
  (latency, loss, reordering) and the coordinator process (crashed and restarted, or stopped and
  resumed with the messages sent to it meanwhile waiting at its door);
* ``ftlm.sim.processes``: the launcher and the local supervisor (start-up, boot from the newest
  checkpoint, exits, restarts, kills of hung processes);
* ``ftlm.sim.group``: a group's order of operations, as the trainer and manager run it
  (heartbeats, the quorum long-poll, the step, the vote, asking early for the next quorum while
  the update is applied, draining at the end, graceful leaves);
* ``ftlm.sim.collective``: the all-reduce (which can complete for some members and fail for
  others);
* ``ftlm.sim.recovery``: state transfers (slow, failing, source dying mid-way), the replay of
  the backlog, reloads of a newer durable checkpoint;
* ``ftlm.sim.durable``: durable checkpoints and the job's model file;
* ``ftlm.sim.faults``: which fault strikes where and when;
* ``ftlm.sim.invariants``: the checks run after every event and at the end;
* ``ftlm.sim.job``: the job's shape (``SimConfig``), a group's model reduced to what the
  invariants need (its step, history chain, data cursor and the sample ranges of its history)
  and what a run found (``SimResult``).

After every event the simulator checks the invariants listed in docs/ft-protocol.md,
'The simulator'; a violation stops the run with the seed and the trace of events that led to
it, so ``run(seed)`` replays it exactly. Not responsible for: timing or cost at scale (that is
the goodput model), nor tensors.
"""

from __future__ import annotations

from ftlm.sim.job import FAULTS, Incarnation, SimConfig, SimResult, Violation
from ftlm.sim.world import Simulation


def run(seed: int, config: SimConfig | None = None) -> SimResult:
    """Simulate one job with ``seed``; the same seed replays the same run exactly."""
    return Simulation(seed, config).run()


__all__ = ["FAULTS", "Incarnation", "SimConfig", "SimResult", "Simulation", "Violation", "run"]
