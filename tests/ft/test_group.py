"""A group's side of the step protocol (``GroupProtocol``) and the catch-up check, hand-driven."""

from __future__ import annotations

import pytest

from ftlm.ft.group import GroupProtocol, TooManyFailures, check_replay
from ftlm.ft.history import GENESIS, extend_chain
from ftlm.ft.quorum import Member, Quorum


def quorum(qid: int, step: int, chain: str, participants: list[str], recovering: list[str] = (),
           sources: dict[str, str] | None = None, meta: dict[str, dict] | None = None) -> Quorum:
    meta = meta or {}
    ids = sorted(list(participants) + list(recovering))
    members = [Member(r, r.split(":")[0], step, meta.get(r, {})) for r in ids]
    return Quorum(qid, step, members, list(participants), list(recovering),
                  sources if sources is not None else {r: participants[0] for r in recovering}, 0.0,
                  chain=chain, epoch="e1")


def test_a_source_serves_every_new_recovery_of_the_same_incarnation() -> None:
    """A second recovery of one incarnation is served at once: the request number moves after
    every pull, so the source never skips a (joiner, request) pair as one it served already."""
    source = GroupProtocol("A:a", 5)
    joiner = GroupProtocol("B:b", 5)
    q1 = quorum(1, 3, "3" * 64, ["A:a"], ["B:b"], meta={"B:b": joiner.request()})
    assert source.on_quorum(q1).publish
    assert joiner.on_quorum(q1).fetch_from == "A:a"
    joiner.caught_up(4, "4" * 64)  # the first pull arrived; the joiner caught up ...
    # ... and later fell behind again (it failed a step the others committed): a new request.
    q2 = quorum(2, 9, "9" * 64, ["A:a"], ["B:b"], meta={"B:b": joiner.request()})
    assert source.on_quorum(q2).publish
    assert joiner.on_quorum(q2).fetch_from == "A:a"
    # While that pull runs, later quorums neither re-publish nor start a second pull.
    q3 = quorum(2, 10, "a" * 64, ["A:a"], ["B:b"], meta={"B:b": joiner.request()})
    assert not source.on_quorum(q3).publish
    assert joiner.on_quorum(q3).fetch_from is None


def test_a_pull_that_arrived_stays_open_while_its_backlog_is_replayed_over_several_steps() -> None:
    """A backlog replayed over several steps kept the joiner recovering after its pull arrived;
    the next quorum then started a second whole-state pull (and a new snapshot copy on the
    source) while the first was still being replayed: seen as two `recovery_start` events and a
    12 s pull of the 82M model in `bench.ft_vs_torchft`'s rejoin case, healthy steps slowed
    throughout. Only a rejected replay or a failed pull asks for a source again."""
    source = GroupProtocol("A:a", 50)
    joiner = GroupProtocol("B:b", 50)

    def step(qid: int, s: int) -> tuple[bool, str | None]:
        q = quorum(qid, s, f"{s:064x}", ["A:a"], ["B:b"], meta={"B:b": joiner.request()})
        return source.on_quorum(q).publish, joiner.on_quorum(q).fetch_from

    assert step(1, 3) == (True, "A:a")  # the pull starts
    # It arrives (the manager's poll_recovery keeps it open); the replay takes three more steps.
    for s in (4, 5, 6):
        assert step(1, s) == (False, None)
    # The replay was rejected (e.g. a buffered update is missing): a new request, a new source.
    joiner.fetch_finished()
    assert step(1, 7) == (True, "A:a")
    assert step(1, 8) == (False, None)
    joiner.caught_up(9, "9" * 64)  # it reached the head: the pull is over
    assert not joiner.fetching
    # Fallen behind again later: another new request.
    assert step(2, 12) == (True, "A:a")


def test_replay_that_does_not_reach_the_head_is_rejected() -> None:
    """A replay must reach exactly the head the quorum names: finishing in a step the participants
    failed would leave the joiner ahead with another history, and a missing last step must be
    noticed."""
    c5 = "5" * 64
    head6 = extend_chain(c5, 5, 7, ["A:a"])
    q = quorum(8, 6, head6, ["A:a"], ["B:b"])
    # Snapshot of step 5 + the update of step 5 in quorum 7 reaches the head: apply both it and
    # this step's own update (committed here).
    ok = check_replay(5, c5, [(5, 7, ["A:a"]), (6, 8, ["A:a"])], q, committed_now=True)
    assert ok.ok and ok.apply == 2 and ok.chain == q.next_chain()
    # The same, but this step failed here: stop at the head.
    ok = check_replay(5, c5, [(5, 7, ["A:a"]), (6, 8, ["A:a"])], q, committed_now=False)
    assert ok.ok and ok.apply == 1 and ok.chain == head6
    # The buffered update of step 5 came from a quorum whose step the participants redid.
    bad = check_replay(5, c5, [(5, 6, ["A:a", "C:c"])], q, committed_now=False)
    assert not bad.ok and "another history" in bad.reason
    # The update of step 5 is missing (this group failed that step while the others committed).
    bad = check_replay(5, c5, [], q, committed_now=False)
    assert not bad.ok
    bad = check_replay(5, c5, [(6, 8, ["A:a"])], q, committed_now=True)
    assert not bad.ok and "jump" in bad.reason


def test_commit_moves_the_reported_state_at_once_and_recovering_groups_wait_for_the_check() -> None:
    g = GroupProtocol("A:a", 5)
    q = quorum(1, 0, GENESIS, ["A:a", "B:b"])
    role = g.on_quorum(q)
    assert role.participant_index == 0 and role.reconfigure and not role.recovering
    g.process_group_ready()
    assert g.on_outcome(True)
    assert (g.step, g.chain) == (1, q.next_chain())  # heartbeats report the commit right away
    assert g.request()["step"] == 1 and not g.request()["failed"]
    q2 = quorum(1, 1, q.next_chain(), ["A:a", "B:b"])
    assert not g.on_quorum(q2).reconfigure  # same epoch and id: the process group is kept
    j = GroupProtocol("C:c", 5)
    role = j.on_quorum(quorum(2, 1, q.next_chain(), ["A:a"], ["C:c"]))
    assert role.recovering and role.fetch_from == "A:a"
    assert j.on_outcome(True) and (j.step, j.chain) == (0, GENESIS)


def test_only_failures_with_the_same_members_count_and_the_limit_names_the_error() -> None:
    g = GroupProtocol("A:a", 2)
    q = quorum(1, 0, GENESIS, ["A:a", "B:b"])
    g.on_quorum(q)
    g.fail("collective timed out")
    assert not g.on_outcome(False)
    assert g.request()["failed"]
    g.on_quorum(quorum(2, 0, GENESIS, ["A:a"]))  # B died: not this group's failure
    assert g.consecutive == 0
    g.fail("again")
    g.on_outcome(False)
    g.on_quorum(quorum(3, 0, GENESIS, ["A:a"]))
    g.fail("and again")
    g.on_outcome(False)
    with pytest.raises(TooManyFailures, match="2 consecutive steps failed with the same members.*and again"):
        g.on_quorum(quorum(4, 0, GENESIS, ["A:a"]))


def test_the_last_step_drains_without_training() -> None:
    g = GroupProtocol("A:a", 5, total_steps=10)
    role = g.on_quorum(quorum(9, 10, "f" * 64, ["A:a"], ["B:b"], meta={"B:b": {"recover_request": 0}}))
    assert role.drain and not role.reconfigure and role.publish


def test_a_source_keeps_a_snapshot_only_while_a_peer_may_pull_it() -> None:
    """A snapshot is freed once no joiner may pull it any more."""
    source = GroupProtocol("A:a", 5)
    b, c = GroupProtocol("B:b", 5), GroupProtocol("C:c", 5)
    q1 = quorum(1, 3, "3" * 64, ["A:a"], ["B:b"], meta={"B:b": b.request()})
    assert source.on_quorum(q1).retain == {3}
    q2 = quorum(2, 5, "5" * 64, ["A:a"], ["B:b", "C:c"],
                meta={"B:b": b.request(), "C:c": c.request()})
    assert source.on_quorum(q2).retain == {3, 5}  # B still pulls step 3, C starts on step 5
    q3 = quorum(3, 6, "6" * 64, ["A:a", "B:b"], ["C:c"], meta={"C:c": c.request()})
    assert source.on_quorum(q3).retain == {5}  # B caught up: its snapshot is freed
    q4 = quorum(4, 7, "7" * 64, ["A:a", "B:b", "C:c"])
    assert source.on_quorum(q4).retain == frozenset()
    # A joiner that now pulls from another source releases this one's snapshot too.
    q5 = quorum(5, 8, "8" * 64, ["A:a", "B:b"], ["C:c"], sources={"C:c": "B:b"},
                meta={"C:c": {"recover_request": 1}})
    assert source.on_quorum(q5).retain == frozenset()


def test_a_snapshot_dropped_between_two_joiners_is_published_again() -> None:
    """A source that had dropped its snapshot of step 100 (no joiner pulled it any more) answered
    the next joiner of the same step with nothing: 404 until the job gave up."""
    source = GroupProtocol("A:a", 5, total_steps=100)
    b, c = GroupProtocol("B:b", 5), GroupProtocol("C:c", 5)
    q1 = quorum(1, 100, "1" * 64, ["A:a"], ["B:b"], meta={"B:b": b.request()})
    r1 = source.on_quorum(q1)
    assert r1.publish and r1.retain == {100}
    r2 = source.on_quorum(quorum(2, 100, "1" * 64, ["A:a", "B:b"]))
    assert r2.retain == frozenset()  # B is done: the snapshot is freed
    q3 = quorum(3, 100, "1" * 64, ["A:a", "B:b"], ["C:c"], meta={"C:c": c.request()})
    r3 = source.on_quorum(q3)
    assert r3.publish and r3.retain == {100}


def test_a_joiner_missing_from_a_quorum_keeps_its_snapshot_for_a_while() -> None:
    """A joiner busy pulling 1 GB asked too late for one quorum (join timeout): freeing its
    snapshot then cut its transfer with a 404."""
    from ftlm.ft.group import ABSENT_QUORUMS
    source = GroupProtocol("A:a", 5)
    b = GroupProtocol("B:b", 5)
    q1 = quorum(1, 8, "8" * 64, ["A:a", "C:c"], ["B:b"], meta={"B:b": b.request()})
    assert source.on_quorum(q1).retain == {8}
    for i in range(ABSENT_QUORUMS):  # B is absent from these quorums: still pulling
        assert source.on_quorum(quorum(2 + i, 9 + i, "9" * 64, ["A:a", "C:c"])).retain == {8}
    # Absent for longer than that: presumed gone, the snapshot is freed.
    assert source.on_quorum(quorum(40, 40, "4" * 64, ["A:a", "C:c"])).retain == frozenset()
