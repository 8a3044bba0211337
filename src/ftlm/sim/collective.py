"""The simulated all-reduce of a quorum: who entered it with what, and how it ends for each.

``AllReduce`` keeps one ``Collective`` per issued quorum (epoch, quorum id, step). A member that
enters it after its step's computation contributes its data slice (a participant) or zeros (a
recovering group, which meanwhile loads an arrived snapshot and replays part of its backlog, as
the trainer does); the collective completes once every member entered, and then it completes
for each member a moment later, or, now and then, for some members and fails for the others.
It fails for a member at once when a peer's process is gone (connection refused or reset) or a
member's link is bad (at once or at the timeout), when the coordinator reported a member dead
(the manager's abort), or at ``allreduce_timeout`` when a member never comes. The member's
vote then goes to the group model (``GroupModel.outcome``).

Not responsible for the vote and what follows it (``ftlm.sim.group``), nor for deciding which
links are bad (``ftlm.sim.faults``); no tensors are reduced: only who contributed which slice
from which state, which the invariants check at every commit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftlm.ft.quorum import Quorum
from ftlm.sim.job import Collective, Incarnation

if TYPE_CHECKING:
    from ftlm.sim.world import Simulation


def quorum_key(q: Quorum) -> tuple[str, int, int]:
    """What names one issued quorum (and its all-reduce): epoch, quorum id, step."""
    return q.epoch, q.quorum_id, q.step


class AllReduce:
    """The all-reduces of one ``Simulation``."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.c = sim.c
        self.collectives: dict[tuple[str, int, int], Collective] = {}

    def enter(self, inc: Incarnation, q: Quorum) -> None:
        """``inc`` computed its step of ``q`` and enters the all-reduce."""
        sim = self.sim
        if not inc.running or inc.hung_training or inc.phase != "training" or inc.quorum is not q:
            return
        inc.phase = "collective"
        inc.progress_at = sim.now
        if inc.proto.role is not None and inc.proto.role.recovering:
            # As the trainer: its zero buckets are on their way; it catches up while they wait.
            sim.recovery.load_snapshot(inc)
            if inc.catching:
                sim.recovery.replay_backlog(inc, q, until_head=False)
        if inc.abort_pending:
            self.abort(inc, "a quorum member was reported dead")
            return
        if any(not sim.alive(r) for r in q.replica_ids()):  # a dead peer refuses the connection
            sim.at(sim.latency(), lambda: self.peer_reset(inc, q), "connection refused")
        coll = self.collectives.setdefault(quorum_key(q), Collective(q))
        sim.invariants.check_collective(coll, q)
        index = q.participant_index(inc.replica_id)
        coll.entered[inc.replica_id] = (index, inc.state.step, inc.state.chain)
        if q.size > 1 and any(sim.faults.bad_link(r) for r in q.replica_ids()):
            # A bad link: the transport fails, at once (a reset) or when the operation times out.
            delay = sim.latency() if sim.rng.random() < 0.5 else self.c.allreduce_timeout
            sim.at(delay, lambda: self.link_failed(inc, q), "bad link")
            return
        if coll.done:
            sim.at(sim.latency(), lambda: sim.group_model.outcome(inc, q, False), "late to collective")
            return
        if set(coll.entered) == set(q.replica_ids()):
            coll.done = True
            # Worst moment: the result reaches some members while others fail.
            partial = sim.rng.random() < 0.05 and len(coll.entered) > 1
            for rid in coll.entered:
                member = sim.incarnation(rid)
                if member is None:
                    continue
                ok = not (partial and sim.rng.random() < 0.5)
                sim.at(sim.latency(), lambda m=member, ok=ok: sim.group_model.outcome(m, m.quorum, ok),
                       f"allreduce {rid}")
            return
        sim.at(self.c.allreduce_timeout, lambda: self.timed_out(inc, q), "allreduce timeout")

    def still_in(self, inc: Incarnation, q: Quorum) -> bool:
        """``inc`` still runs and waits in the all-reduce of ``q``."""
        return inc.running and inc.phase == "collective" and inc.quorum is q

    def link_failed(self, inc: Incarnation, q: Quorum) -> None:
        if self.still_in(inc, q):
            self.abort(inc, "connection reset (a bad link)")

    def peer_reset(self, inc: Incarnation, q: Quorum) -> None:
        if self.still_in(inc, q):
            self.abort(inc, "connection reset by a quorum member")

    def timed_out(self, inc: Incarnation, q: Quorum) -> None:
        if self.still_in(inc, q):
            self.abort(inc, "all-reduce timeout")

    def abort(self, inc: Incarnation, why: str) -> None:
        q = inc.quorum
        coll = self.collectives.get(quorum_key(q)) if q is not None else None
        if coll is not None:
            coll.done = True  # an aborted collective completes for nobody
        self.sim.group_model.outcome(inc, q, False, why)
