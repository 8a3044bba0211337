"""A graceful leave (SIGTERM of a spot reclaim, a stop, a finished group) through the coordinator's
state machine with a hand-driven clock: the quorums in flight that counted the leaver are named in
the others' heartbeat answers, so they abort at once instead of at ``ft.allreduce_timeout``
(found by the protocol simulator, tests/sim)."""

from __future__ import annotations

from ftlm.ft.history import GENESIS
from ftlm.ft.membership import Event, Issued, Membership
from ftlm.ft.quorum import Heartbeat, MemberRequest, Quorum, QuorumOptions

GROUPS = ("g0", "g1", "g2")


def ask(m: Membership, group: str, now: float, step: int = 0, last_quorum_id: int = -1,
        failed: bool = False, chain: str = GENESIS) -> list[Quorum]:
    """``group`` asks for a quorum; returns the quorums issued as a result."""
    req = MemberRequest(f"{group}:a", group, step, last_quorum_id, failed, {}, now, chain)
    return [o.quorum for o in m.request(now, req) if isinstance(o, Issued)]


def job() -> tuple[Membership, Quorum]:
    """Three groups heartbeating at 0.0 and in one quorum of step 0 issued at 0.1."""
    m = Membership(QuorumOptions(1, 2.0, 1.0, len(GROUPS), rebuild_grace=0.0), epoch="e")
    for g in GROUPS:
        m.heartbeat(0.0, Heartbeat(f"{g}:a", g, 0.0, 0))
    issued = [q for g in GROUPS for q in ask(m, g, 0.1)]
    assert len(issued) == 1
    return m, issued[0]


def aborted(m: Membership, group: str, now: float, step: int = 0, chain: str = GENESIS) -> list[int]:
    answer, _ = m.heartbeat(now, Heartbeat(f"{group}:a", group, now, step, 1, chain))
    assert answer["epoch"] == "e"
    return answer["dead_quorums"]


def test_a_group_that_leaves_mid_step_aborts_the_quorum_that_counted_it() -> None:
    """g2 was counted in the quorum and interrupted before it finished the step (or its answer
    crossed its stop request): g0 and g1 are told to abort now, and their next quorum forms
    without g2 as soon as they ask."""
    m, q = job()
    out = m.leave(0.2, "g2:a", "g2", "stopped")
    assert [o.kind for o in out if isinstance(o, Event)] == ["member_left"]  # not a death
    assert aborted(m, "g0", 0.25) == [q.quorum_id] and aborted(m, "g1", 0.26) == [q.quorum_id]
    assert m.recent_dead(0.3) == []  # the status page lists no death
    issued = [n for g in ("g0", "g1") for n in ask(m, g, 0.3, 0, q.quorum_id, failed=True)]
    assert len(issued) == 1 and issued[0].replica_ids() == ["g0:a", "g1:a"]
    assert issued[0].quorum_id not in aborted(m, "g0", 0.35)  # the new quorum is not aborted


def test_a_group_that_leaves_after_reporting_its_commit_aborts_nothing() -> None:
    """g2 committed the step and asked for the next one before its stop: the quorum it took part
    in completed, so its leave must not fail the others' step."""
    m, q = job()
    ask(m, "g2", 0.2, 1, q.quorum_id, chain=q.next_chain())
    m.leave(0.25, "g2:a", "g2", "stopped")
    assert aborted(m, "g0", 0.3) == [] and aborted(m, "g1", 0.3) == []


def test_a_group_that_leaves_before_being_counted_aborts_nothing() -> None:
    m, _ = job()
    m.heartbeat(0.2, Heartbeat("g3:a", "g3", 0.2, 0))  # a joiner, not in the quorum in flight
    m.leave(0.3, "g3:a", "g3", "stopped")
    assert aborted(m, "g0", 0.35) == []


def test_the_first_quorum_does_not_wait_for_a_group_that_left() -> None:
    """The job's first quorum (also a restarted coordinator's) waits ``join_timeout`` for the
    groups the job was launched with; a group that left is not waited for, until it comes back."""
    m = Membership(QuorumOptions(1, 2.0, 1.0, len(GROUPS), rebuild_grace=0.0), epoch="e")
    for g in GROUPS:
        m.heartbeat(0.0, Heartbeat(f"{g}:a", g, 0.0, 0))
    m.leave(0.05, "g2:a", "g2", "stopped")
    issued = [q for g in ("g0", "g1") for q in ask(m, g, 0.1)]
    assert len(issued) == 1 and issued[0].replica_ids() == ["g0:a", "g1:a"]  # not 2 s later

    m = Membership(QuorumOptions(1, 2.0, 1.0, len(GROUPS), rebuild_grace=0.0), epoch="e")
    m.heartbeat(0.0, Heartbeat("g2:a", "g2", 0.0, 0))
    m.leave(0.05, "g2:a", "g2", "stopped")
    m.heartbeat(0.06, Heartbeat("g2:b", "g2", 0.06, 0))  # back: expected again
    m.heartbeat(0.06, Heartbeat("g0:a", "g0", 0.06, 0))
    assert ask(m, "g0", 0.1) == [] and "first quorum" in m.reason


def test_a_group_with_a_stale_claim_ahead_that_leaves_mid_step_aborts_its_quorum() -> None:
    """Sim seed 2031: a recovering group reported a step far ahead of the head (a checkpoint of
    an abandoned branch) and left mid-step; its report is no commit of the quorum it was in."""
    m, q = job()
    m.heartbeat(0.15, Heartbeat("g2:a", "g2", 0.15, 120, q.quorum_id, "f" * 64))
    m.leave(0.2, "g2:a", "g2", "stopped")
    assert aborted(m, "g0", 0.25) == [q.quorum_id]
