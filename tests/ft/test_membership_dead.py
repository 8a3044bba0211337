"""The coordinator's state machine on deaths and departures: which dead members a heartbeat answer
names, a member told it was declared dead, and a finished job never rolled back (``Membership``,
driven by hand with a simulated clock)."""

from __future__ import annotations

from ftlm.ft.history import GENESIS
from ftlm.ft.membership import Event, Issued, Membership
from ftlm.ft.quorum import Heartbeat, MemberRequest, QuorumOptions


def test_heartbeat_answers_list_the_dead_of_the_quorum_in_flight_until_they_return() -> None:
    """The dead list of heartbeat answers is kept between heartbeats; it must still
    follow each death, a member that comes back, and the next quorum."""
    m = Membership(QuorumOptions(1, 1.0, 1.0, 3, rebuild_grace=0.0), epoch="e")
    beat = lambda g, t: m.heartbeat(t, Heartbeat(f"{g}:a", g, t, 0))[0]["dead"]  # noqa: E731
    for g in ("g0", "g1", "g2"):
        beat(g, 0.0)
    issued = [o for g in ("g0", "g1", "g2")
              for o in m.request(0.1, MemberRequest(f"{g}:a", g, 0, -1, False, {}, 0.1, GENESIS))
              if isinstance(o, Issued)]
    assert [len(o.quorum.members) for o in issued] == [3]
    assert beat("g0", 0.9) == [] and beat("g1", 0.9) == []
    assert beat("g0", 1.2) == ["g2:a"]  # g2 was silent for a heartbeat timeout
    assert beat("g1", 1.3) == ["g2:a"]
    assert beat("g2", 1.4) == []  # a hang that ended: alive again, nobody aborts for it
    m.tick(2.5)  # g0 and g1 silent since 1.2/1.3: both dead now, g2 alive
    assert beat("g2", 2.5) == ["g0:a", "g1:a"]


def test_a_member_declared_dead_that_speaks_again_is_told_so() -> None:
    """A group paused past the heartbeat timeout (SIGSTOP, swap, GC) came back and committed the
    step its peers had failed without it: the answer now says it was declared dead."""
    m = Membership(QuorumOptions(1, 1.0, 1.0, 3, rebuild_grace=0.0), epoch="e")
    answer = lambda g, t: m.heartbeat(t, Heartbeat(f"{g}:a", g, t, 0))[0]  # noqa: E731
    assert "declared_dead" not in answer("g0", 0.0) and "declared_dead" not in answer("g1", 0.0)
    answer("g0", 0.9)
    answer("g0", 1.5)  # g1 silent past the timeout: declared dead
    assert answer("g1", 1.6).get("declared_dead") is True  # it speaks again: told once
    assert "declared_dead" not in answer("g1", 1.7)


def test_a_job_finished_through_leave_is_never_rolled_back_for_a_late_group() -> None:
    """Soak finding: every group finished and left (``POST /v1/leave`` reason "finished") while
    one was dead; its restart at step 0 rolled the job back and trained it again alone. The rule
    existed in ``quorum.remove_member`` but the coordinator's leave never passed it on."""
    m = Membership(QuorumOptions(1, 1.0, 1.0, 2, rebuild_grace=0.0, rollback_grace=0.5), epoch="e")
    claims = {g: (0, GENESIS, -1) for g in ("g0", "g1")}
    now = 0.0
    for _ in range(3):  # both groups train three steps
        for g in claims:
            m.heartbeat(now, Heartbeat(f"{g}:a", g, now, claims[g][0], claims[g][2], claims[g][1]))
        issued = [o.quorum for g in claims for o in m.request(now, MemberRequest(
            f"{g}:a", g, claims[g][0], claims[g][2], False, {}, now, claims[g][1])) if isinstance(o, Issued)]
        q = issued[-1]
        claims = {g: (q.step + 1, q.next_chain(), q.quorum_id) for g in claims}
        now += 0.1
    for g in claims:
        m.heartbeat(now, Heartbeat(f"{g}:a", g, now, claims[g][0], claims[g][2], claims[g][1]))
    m.tick(now)
    assert m.state.head == (3, claims["g0"][1])
    m.leave(now, "g0:a", "g0", "finished")
    # Listed as left (in the coordinator's /status), for supervisors to wait for its exit.
    assert [d[1:] for d in m.recent_departed(now)] == [("g0:a", "g0", "finished")]
    m.report_dead(now, "g1:a", "g1", "SIGKILL")  # g1 died before it could leave
    outputs = []
    for t in (1.0, 2.0, 4.0):  # g1's new incarnation starts from scratch, past the rollback grace
        outputs += m.heartbeat(t, Heartbeat("g1:b", "g1", t, 0))[1]
        outputs += m.request(t, MemberRequest("g1:b", "g1", 0, -1, False, {}, t, GENESIS))
        outputs += m.tick(t + 0.5)
    assert not [o for o in outputs if isinstance(o, Issued) or getattr(o, "kind", "") == "restore"], outputs
    assert not [o for o in outputs if isinstance(o, Event) and o.kind == "restore"]
    assert m.state.head[0] == 3 and "the job finished at step 3" in m.reason


def test_a_late_group_at_the_last_step_is_told_who_left_finished() -> None:
    """Bench finding: a group killed near the end restarted from the final checkpoint after the
    others had left finished; its finish loop waited ``quorum_timeout`` (30 s) for groups that
    were never coming back. Its quorum now counts the groups that left on purpose, so that
    ``group_count + groups_left`` reaches the job's groups at once."""
    from ftlm.ft.quorum_answer import MemberQuorum, member_json

    m = Membership(QuorumOptions(1, 1.0, 1.0, 3, rebuild_grace=0.0), epoch="e")
    groups = ("g0", "g1", "g2")
    for g in groups:
        m.heartbeat(0.0, Heartbeat(f"{g}:a", g, 0.0, 0))
    first = [o.quorum for g in groups for o in m.request(
        0.1, MemberRequest(f"{g}:a", g, 0, -1, False, {}, 0.1, GENESIS)) if isinstance(o, Issued)]
    assert first[-1].groups_left == 0
    q = first[-1]
    for g in ("g0", "g1"):  # both committed step 0 and finished there (the job's last step)
        m.heartbeat(0.15, Heartbeat(f"{g}:a", g, 0.15, 1, q.quorum_id, q.next_chain()))
    m.leave(0.2, "g0:a", "g0", "finished")
    m.leave(0.2, "g1:a", "g1", "finished")
    m.heartbeat(0.3, Heartbeat("g2:a", "g2", 0.3, 1, q.quorum_id, q.next_chain()))
    late = [o.quorum for o in m.request(0.3, MemberRequest("g2:a", "g2", 1, q.quorum_id, False, {},
                                                             0.3, q.next_chain())) if isinstance(o, Issued)]
    assert late and late[-1].group_count == 1 and late[-1].groups_left == 2
    answer = MemberQuorum.from_json(member_json(late[-1], "g2:a"))
    assert answer.group_count + answer.groups_left == 3
    # A group that comes back is no longer counted as gone.
    m.heartbeat(0.4, Heartbeat("g0:b", "g0", 0.4, 0))
    again = [o.quorum for o in m.request(0.4, MemberRequest("g2:a", "g2", 1, late[-1].quorum_id, False,
                                                              {}, 0.4, q.next_chain())) if isinstance(o, Issued)]
    assert not again or again[-1].groups_left == 1


def test_a_group_that_finished_another_history_is_still_waited_for() -> None:
    """Simulator finding (spares seed 192): a group left finished at the last step of a history
    the job then rolled back from; counted as done, the others ended at once and its model file,
    written later, replaced theirs. Only groups that finished at the quorum's own state count."""
    m = Membership(QuorumOptions(1, 1.0, 1.0, 2, rebuild_grace=0.0), epoch="e")
    for g in ("g0", "g1"):
        m.heartbeat(0.0, Heartbeat(f"{g}:a", g, 0.0, 0))
    first = [o.quorum for g in ("g0", "g1") for o in m.request(
        0.1, MemberRequest(f"{g}:a", g, 0, -1, False, {}, 0.1, GENESIS)) if isinstance(o, Issued)]
    m.heartbeat(0.15, Heartbeat("g0:a", "g0", 0.15, 1, first[-1].quorum_id, "f" * 64))  # another history
    m.leave(0.2, "g0:a", "g0", "finished")
    q = first[-1]
    m.heartbeat(0.3, Heartbeat("g1:a", "g1", 0.3, 1, q.quorum_id, q.next_chain()))
    late = [o.quorum for o in m.request(0.3, MemberRequest("g1:a", "g1", 1, q.quorum_id, False, {},
                                                             0.3, q.next_chain())) if isinstance(o, Issued)]
    assert late and late[-1].groups_left == 0
