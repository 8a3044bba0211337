"""No live group holds the head: members behind it look for a newer durable checkpoint before the
coordinator rolls the job back (session 8), driven through the coordinator's state machine with
a hand-driven clock."""

from __future__ import annotations

import pytest

from ftlm.ft.client import CoordinatorClient
from ftlm.ft.coordinator_requests import parse_quorum_request
from ftlm.ft.group import GroupProtocol
from ftlm.ft.history import GENESIS
from ftlm.ft.membership import Answer, Event, Issued, Membership
from ftlm.ft.quorum import Heartbeat, MemberRequest, Quorum, QuorumOptions

HB_TIMEOUT = 1.0  # rollback grace: 2.0 s; told after 0.5 s (a quarter of it); waited for 2.0 s


def ask(m: Membership, group: str, now: float, step: int, chain: str, disk_checked: int = -1,
        inc: str = "a") -> list:
    return m.request(now, MemberRequest(f"{group}:{inc}", group, step, -1, False, {}, now, chain, (), disk_checked))


def beat(m: Membership, group: str, now: float, step: int, chain: str) -> dict:
    return m.heartbeat(now, Heartbeat(f"{group}:a", group, now, step, 0, chain))[0]


def tick(m: Membership, now: float, step: int = 0, group: str = "g1") -> list:
    """``group`` (alive, at ``step``) heartbeats, which re-evaluates: the outputs."""
    return m.heartbeat(now, Heartbeat(f"{group}:a", group, now, step, 0, GENESIS))[1]


def issued(out: list) -> list[Quorum]:
    return [o.quorum for o in out if isinstance(o, Issued)]


def restores(out: list) -> list[tuple[int, int]]:
    return [(o.fields["from_step"], o.fields["to_step"]) for o in out if isinstance(o, Event) and o.kind == "restore"]


def reloads(out: list) -> dict[str, int]:
    return {o.replica_id: o.body["reload"] for o in out
            if isinstance(o, Answer) and o.status == 504 and o.body and "reload" in o.body}


def job(extra: tuple[str, ...] = ()) -> tuple[Membership, str]:
    """g0 and g1 train step 0; only g0 commits it (g1's step failed), then g0 dies at 1.0.
    Returns the coordinator and the chain of step 1 (the head, held by nobody alive)."""
    m = Membership(QuorumOptions(1, 0.5, HB_TIMEOUT, 2 + len(extra), rebuild_grace=0.0), epoch="e")
    for g in ("g0", "g1", *extra):
        beat(m, g, 0.0, 0, GENESIS)
    [q] = issued(ask(m, "g0", 0.1, 0, GENESIS) + ask(m, "g1", 0.1, 0, GENESIS)
                 + [o for g in extra for o in ask(m, g, 0.1, 0, GENESIS)])
    head = q.next_chain()
    ask(m, "g0", 0.2, 1, head)  # committed: the head is step 1
    [q1] = issued(ask(m, "g1", 0.9, 0, GENESIS))  # failed it: behind, recovers from g0
    assert m.state.head == (1, head) and q1.recovering == ["g1:a"]
    m.report_dead(1.0, "g0:a", "g0", "SIGKILL")
    ask(m, "g1", 1.05, 0, GENESIS)  # its pull from g0 failed: it asks again
    return m, head


def test_a_member_behind_is_told_and_loading_the_head_avoids_the_rollback() -> None:
    m, head = job()
    assert reloads(tick(m, 1.3)) == {}  # not at once: a holder's late heartbeat can look like this
    out = tick(m, 1.6)
    assert reloads(out) == {"g1:a": 1} and "g1:a" not in m.state.pending  # answered at once
    # g1 loads the durable checkpoint of step 1 (the head itself) and asks with it.
    out = ask(m, "g1", 1.9, 1, head, disk_checked=1)
    [q] = issued(out)
    assert q.step == 1 and q.participants == ["g1:a"] and restores(out) == []
    assert reloads(ask(m, "g1", 2.0, 2, q.next_chain())) == {}  # held again: nobody is told


def test_the_rollback_waits_for_a_member_that_is_loading_at_most_reload_seconds() -> None:
    m, _ = job()
    assert reloads(tick(m, 1.6)) == {"g1:a": 1}
    for t in (2.0, 2.5, 3.0, 3.5, 3.59):  # it heartbeats but has not asked again (a long load)
        assert restores(tick(m, t)) == []
    assert "to look for a newer durable checkpoint" in m.reason
    assert restores(tick(m, 3.61)) == [(1, 0)]  # 2.0 s after it was told: the job goes on without it


def test_a_member_that_looked_and_found_nothing_newer_lets_the_rollback_go_ahead() -> None:
    m, _ = job()
    tick(m, 1.6)
    out = ask(m, "g1", 1.7, 0, GENESIS, disk_checked=1)  # it looked: nothing newer than step 0
    assert reloads(out) == {} and restores(out) == []  # not told again for this head
    assert restores(tick(m, 2.5)) == []  # the grace (2.0 s from 1.0) is not over
    out = tick(m, 3.05)
    assert restores(out) == [(1, 0)]
    [q] = issued(out)
    assert q.step == 0 and q.participants == ["g1:a"]


def test_a_member_that_has_not_asked_hears_it_in_its_heartbeat_answer() -> None:
    m, head = job(extra=("g2",))
    m.leave(1.0, "g1:a", "g1", "stopped")
    # g2 (in the first quorum, never asked again: still starting its step) heartbeats at step 0.
    assert "reload" not in beat(m, "g2", 1.2, 0, GENESIS)
    assert beat(m, "g2", 1.6, 0, GENESIS)["reload"] == 1
    assert restores(tick(m, 2.5, group="g2")) == []
    assert restores(tick(m, 3.05, group="g2")) == []  # the grace is over, but g2 has not said it looked
    out = ask(m, "g2", 3.1, 0, GENESIS, disk_checked=1)
    assert restores(out) == [(1, 0)]
    assert "reload" not in beat(m, "g2", 3.2, 0, GENESIS)


def test_a_restarted_coordinator_lets_members_behind_the_known_head_look_first() -> None:
    m = Membership(QuorumOptions(1, 0.5, HB_TIMEOUT, 1, rebuild_grace=0.0), epoch="e2")
    # The only live group reports step 3 and says the job had reached step 9 (known_head).
    m.heartbeat(0.0, Heartbeat("g1:b", "g1", 0.0, 3, 0, "3" * 64, known_head=9))
    out = ask(m, "g1", 0.1, 3, "3" * 64, inc="b")
    assert reloads(out) == {"g1:b": 9} and m.state.head is None and restores(out) == []
    out = ask(m, "g1", 0.5, 8, "8" * 64, disk_checked=9, inc="b")  # loaded the checkpoint of step 8
    assert restores(out) == [(9, 8)] and m.state.head == (8, "8" * 64)


def test_group_protocol_looks_once_per_head_until_its_next_quorum() -> None:
    p = GroupProtocol("g1:a", 3)
    p.sync(4, "4" * 64)
    assert not p.reload_due(None) and not p.reload_due(4)  # nothing, or not behind
    assert p.reload_due(7) and p.request()["disk_checked"] == 7
    assert not p.reload_due(7)  # it looked for this head already
    assert p.reload_due(8)


def test_disk_checked_is_validated_at_the_door() -> None:
    body = {"group": "g1", "incarnation": "a", "step": 0, "last_quorum_id": -1, "failed": False,
            "meta": {}, "timeout": 1.0}
    assert parse_quorum_request(body).disk_checked == -1
    assert parse_quorum_request({**body, "disk_checked": 5}).disk_checked == 5
    for bad in (-2, "5", True, 2**60):
        with pytest.raises(ValueError, match="disk_checked"):
            parse_quorum_request({**body, "disk_checked": bad})


def _rebuilt_with_two_behind() -> Membership:
    """A restarted coordinator hears g1 at step 3 and g2 at step 5, both saying the job had reached
    step 9: each is told to look on disk (``reload`` 9)."""
    m = Membership(QuorumOptions(1, 0.5, HB_TIMEOUT, 2, rebuild_grace=0.0), epoch="e2")
    m.heartbeat(0.0, Heartbeat("g1:b", "g1", 0.0, 3, 0, "3" * 64, known_head=9))
    m.heartbeat(0.0, Heartbeat("g2:b", "g2", 0.0, 5, 0, "5" * 64, known_head=9))
    assert reloads(ask(m, "g1", 0.1, 3, "3" * 64, inc="b")) == {"g1:b": 9}
    assert reloads(ask(m, "g2", 0.1, 5, "5" * 64, inc="b")) == {"g2:b": 9}
    return m


def rounds(out: list) -> dict[str, int]:
    return {o.replica_id: o.body.get("reload_round", 0) for o in out
            if isinstance(o, Answer) and o.status == 504 and o.body and "reload" in o.body}


def test_a_look_made_before_a_newer_holder_left_is_done_again() -> None:
    # (ftlm sim check --groups 5, seed 30206: the groups behind looked, then the only holder of a
    # newer state saved it on its way out; the rollback went past it to the older state.)
    m = _rebuilt_with_two_behind()
    out = ask(m, "g1", 0.2, 3, "3" * 64, disk_checked=9, inc="b")  # g1 looked: nothing newer than 3
    assert restores(out) == [] and reloads(out) == {}  # g2 (at 5, newer) is still loading
    out = m.leave(0.3, "g2:b", "g2", "stopped")  # g2 saved step 5 on its way out (checkpoint.on_stop)
    assert restores(out) == [] and rounds(out) == {"g1:b": 1}  # g1 looks again, in round 1
    # Its request sent before it heard (round 0) does not count as that look.
    out = ask(m, "g1", 0.31, 3, "3" * 64, disk_checked=9, inc="b")
    assert restores(out) == [] and rounds(out) == {"g1:b": 1}
    answer = m.heartbeat(0.32, Heartbeat("g1:b", "g1", 0.32, 3, 0, "3" * 64))[0]  # (if it heartbeats)
    assert (answer["reload"], answer["reload_round"]) == (9, 1)
    # It loaded the checkpoint of step 5 and says it looked in round 1: the job goes on from 5.
    out = m.request(0.4, MemberRequest("g1:b", "g1", 5, -1, False, {}, 0.4, "5" * 64, (), 9, 1))
    assert restores(out) == [(9, 5)] and m.state.head == (5, "5" * 64)


def test_a_departure_that_leaves_an_as_new_holder_voids_no_look() -> None:
    m = _rebuilt_with_two_behind()
    m.heartbeat(0.0, Heartbeat("g3:b", "g3", 0.0, 5, 0, "5" * 64, known_head=9))
    assert reloads(ask(m, "g3", 0.1, 5, "5" * 64, inc="b")) == {"g3:b": 9}
    ask(m, "g1", 0.2, 3, "3" * 64, disk_checked=9, inc="b")
    ask(m, "g3", 0.2, 5, "5" * 64, disk_checked=9, inc="b")
    out = m.leave(0.3, "g2:b", "g2", "stopped")  # g3 still holds step 5: nothing newer left
    assert rounds(out) == {} and restores(out) == [(9, 5)]


def test_group_protocol_looks_again_in_a_new_round() -> None:
    p = GroupProtocol("g1:a", 3)
    p.sync(4, "4" * 64)
    assert p.reload_due(7) and (p.request()["disk_checked"], p.request()["disk_round"]) == (7, 0)
    assert not p.reload_due(7, 0)
    assert p.reload_due(7, 1) and p.request()["disk_round"] == 1
    assert not p.reload_due(7, 1)


def test_disk_round_is_validated_at_the_door_and_sent_only_when_above_zero() -> None:
    body = {"group": "g1", "incarnation": "a", "step": 0, "last_quorum_id": -1, "failed": False,
            "meta": {}, "timeout": 1.0, "disk_checked": 5}
    assert parse_quorum_request(body).disk_round == 0
    assert parse_quorum_request({**body, "disk_round": 2}).disk_round == 2
    for bad in (-1, "2", False, 2**60):
        with pytest.raises(ValueError, match="disk_round"):
            parse_quorum_request({**body, "disk_round": bad})
    client = CoordinatorClient("http://127.0.0.1:1", "g1", "a")
    assert "disk_round" not in client.quorum_body(0, -1, False, {}, 1.0, disk_checked=5)
    assert client.quorum_body(0, -1, False, {}, 1.0, disk_checked=5, disk_round=2)["disk_round"] == 2
