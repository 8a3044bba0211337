"""The quorum decision and membership bookkeeping, as pure functions with a hand-driven clock."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest

from ftlm.ft.quorum import (
    CoordinatorState,
    Heartbeat,
    Member,
    MemberRequest,
    Quorum,
    QuorumOptions,
    StaleIncarnation,
    commit_quorum,
    compute_quorum,
    expire,
    record_heartbeat,
    record_request,
    withdraw_request,
)

HB_TIMEOUT = 0.5
JOIN = 1.0


def opts(min_replicas: int = 1) -> QuorumOptions:
    return QuorumOptions(min_replicas=min_replicas, join_timeout=JOIN, heartbeat_timeout=HB_TIMEOUT)


def rid(group: str) -> str:
    return f"{group}:a"


def ask(group: str, step: int = 0, at: float = 0.0, last: int = 0, failed: bool = False) -> MemberRequest:
    return MemberRequest(rid(group), group, step, last, failed, {"url": f"http://{group}"}, at)


def prev_quorum(groups: list[str], quorum_id: int, step: int = 0) -> Quorum:
    ids = [rid(g) for g in groups]
    return Quorum(quorum_id, step, [Member(rid(g), g, step, {}) for g in groups], ids, [], {}, 0.0)


@dataclass
class Case:
    name: str
    asks: list[MemberRequest]
    now: float
    min_replicas: int = 1
    beats: dict[str, float] = field(default_factory=dict)  # heartbeats after the asks: group -> last_seen
    prev: list[str] | None = None  # groups of the previous quorum (id 5)
    quorum_id: int = 0  # the state's id (5 when prev is given)
    expect: list[str] | None = None  # groups of the issued quorum; None: nothing issued
    expect_id: int | None = None
    reason: str = ""


CASES = [
    Case("nobody_asked", [], 0.0, beats={"g0": 0.0}, reason="no member has asked for a quorum"),
    Case(
        "below_min_replicas",
        [ask("g0")],
        0.0,
        min_replicas=2,
        reason="only 1 healthy group asked, need min_replicas=2",
    ),
    Case(
        "first_quorum_everyone_asked_issues_at_once",
        [ask("g0"), ask("g1")],
        0.0,
        min_replicas=2,
        expect=["g0", "g1"],
        expect_id=1,
        reason="all 2 heartbeating groups asked",
    ),
    Case(
        "first_quorum_waits_join_timeout_for_stragglers",
        [ask("g0"), ask("g1", at=0.2)],
        0.4,
        beats={"g2": 0.3},
        reason="waiting for g2 (asked 2 of 3); join timeout in 0.6 s",
    ),
    Case(
        "first_quorum_issues_majority_after_join_timeout",
        [ask("g0", at=0.0), ask("g1", at=0.2)],
        1.0,
        beats={"g0": 0.9, "g1": 0.9, "g2": 0.9},
        expect=["g0", "g1"],
        expect_id=1,
        reason="join timeout passed",
    ),
    Case(
        "split_brain_refused_minority_never_issues",
        [ask("g0", at=1.9)],
        2.0,
        beats={"g1": 1.9, "g2": 1.9},
        reason="1 of 3 heartbeating groups asked: not a majority",
    ),
    Case(
        "exactly_half_is_not_a_majority",
        [ask("g0", at=1.9), ask("g1", at=1.9)],
        2.0,
        beats={"g2": 1.9, "g3": 1.9},
        reason="2 of 4 heartbeating groups asked: not a majority",
    ),
    Case(
        "stale_request_is_not_a_candidate",
        [ask("g0", at=0.0), ask("g1", at=0.9)],
        1.0,
        min_replicas=2,
        reason="only 1 healthy group asked, need min_replicas=2",
    ),
    Case(
        "fast_path_identical_membership_keeps_id",
        [ask("g0", at=0.1), ask("g1", at=0.1), ask("g2", at=0.1)],
        0.1,
        prev=["g0", "g1", "g2"],
        expect=["g0", "g1", "g2"],
        expect_id=5,
        reason="fast path: all 3 healthy members of quorum 5 asked",
    ),
    Case(
        "fast_path_waits_for_live_previous_member",
        [ask("g0", at=0.1), ask("g1", at=0.1)],
        0.2,
        beats={"g2": 0.1},
        prev=["g0", "g1", "g2"],
        reason="waiting for g2 (asked 2 of 3)",
    ),
    Case(
        "heartbeat_expiry_makes_fast_path_fire",
        [ask("g0", at=0.6), ask("g1", at=0.6)],
        0.6,
        beats={"g2": 0.1},
        prev=["g0", "g1", "g2"],
        expect=["g0", "g1"],
        expect_id=6,
        reason="fast path: all 2 healthy members of quorum 5 asked",
    ),
    Case(
        "fast_path_includes_joiners_and_bumps_id",
        [ask("g0"), ask("g1"), ask("g3")],
        0.0,
        prev=["g0", "g1"],
        expect=["g0", "g1", "g3"],
        expect_id=6,
        reason="(+1 joiner)",
    ),
    Case(
        "failed_commit_bumps_id",
        [ask("g0"), ask("g1", failed=True)],
        0.0,
        prev=["g0", "g1"],
        expect=["g0", "g1"],
        expect_id=6,
    ),
    Case(
        "restarted_coordinator_continues_above_reported_ids",
        [ask("g0", last=7), ask("g1", last=6)],
        0.0,
        expect=["g0", "g1"],
        expect_id=8,
    ),
    Case(
        "id_raised_by_heartbeat_report_after_restart",
        [ask("g0")],
        0.0,
        quorum_id=11,
        expect=["g0"],
        expect_id=12,
    ),
    Case(
        "previous_quorum_all_dead_new_groups_form_one",
        [ask("g3", at=2.0), ask("g4", at=2.0)],
        2.0,
        prev=["g0", "g1"],
        expect=["g3", "g4"],
        expect_id=6,
        reason="all 2 heartbeating groups asked",
    ),
]


def build(case: Case) -> CoordinatorState:
    state = CoordinatorState(quorum_id=case.quorum_id)
    if case.prev is not None:
        state.prev_quorum = prev_quorum(case.prev, 5)
        state.quorum_id = max(state.quorum_id, 5)
    for req in case.asks:
        record_request(state, req)
    for group, seen in case.beats.items():  # heartbeats after the asks keep the askers fresh
        record_heartbeat(state, Heartbeat(rid(group), group, seen, 0))
    return state


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_compute_quorum_rules(case: Case) -> None:
    state = build(case)
    before = copy.deepcopy(state)
    quorum, reason = compute_quorum(case.now, state, opts(case.min_replicas))
    assert state == before, "compute_quorum must not mutate the state"
    assert case.reason in reason
    if case.expect is None:
        assert quorum is None, reason
        return
    assert quorum is not None, reason
    assert [m.group for m in quorum.members] == case.expect
    assert quorum.quorum_id == case.expect_id
    assert quorum.reason == reason and quorum.issued_at == case.now


def test_participants_at_max_step_and_round_robin_sources() -> None:
    state = CoordinatorState()
    for group, step in [("g4", 9), ("g1", 10), ("g0", 5), ("g3", 10), ("g2", 7)]:
        record_request(state, ask(group, step=step))
    quorum, _ = compute_quorum(0.0, state, opts())
    assert quorum is not None
    assert quorum.step == 10
    assert quorum.participants == ["g1:a", "g3:a"]
    assert quorum.recovering == ["g0:a", "g2:a", "g4:a"]
    assert quorum.sources == {"g0:a": "g1:a", "g2:a": "g3:a", "g4:a": "g1:a"}
    assert [quorum.participant_index(r) for r in ["g1:a", "g3:a", "g0:a"]] == [0, 1, None]
    assert quorum.member("g2:a").meta == {"url": "http://g2"}


def test_newer_incarnation_replaces_older_and_old_one_is_refused() -> None:
    state = CoordinatorState()
    record_request(state, MemberRequest("g1:old", "g1", 3, 2, False, {}, 0.0))
    record_heartbeat(state, Heartbeat("g0:a", "g0", 0.0, 3))
    assert record_heartbeat(state, Heartbeat("g1:new", "g1", 0.1, 0)) == ["g1:old"]
    assert set(state.heartbeats) == {"g0:a", "g1:new"}
    assert "g1:old" not in state.pending
    with pytest.raises(StaleIncarnation, match="g1:old"):
        record_heartbeat(state, Heartbeat("g1:old", "g1", 0.2, 3))
    with pytest.raises(StaleIncarnation):
        record_request(state, MemberRequest("g1:old", "g1", 3, 2, False, {}, 0.2))
    assert set(state.heartbeats) == {"g0:a", "g1:new"}
    # A request from the newer one replaces nothing further and counts as its heartbeat.
    assert record_request(state, MemberRequest("g1:new", "g1", 0, 2, False, {}, 0.3)) == []
    assert state.heartbeats["g1:new"].last_seen == 0.3


def test_replacement_of_a_quorum_member_lets_survivors_continue() -> None:
    state = CoordinatorState(prev_quorum=prev_quorum(["g0", "g1"], 5), quorum_id=5)
    record_request(state, ask("g0", step=4, at=0.1, last=5))
    record_heartbeat(state, Heartbeat("g1:new", "g1", 0.1, 0))  # g1 restarted, has not asked yet
    quorum, reason = compute_quorum(0.1, state, opts())
    assert quorum is not None and quorum.replica_ids() == ["g0:a"] and quorum.quorum_id == 6, reason


def test_expire_drops_stale_heartbeats_and_their_requests() -> None:
    state = CoordinatorState()
    record_request(state, ask("g0", at=0.0))
    record_request(state, ask("g1", at=0.4))
    record_heartbeat(state, Heartbeat("g2:a", "g2", 0.2, 0))
    assert state.round_started == 0.0
    assert sorted(expire(0.75, state, opts())) == ["g0:a", "g2:a"]
    assert list(state.heartbeats) == ["g1:a"] and list(state.pending) == ["g1:a"]
    assert expire(0.75, state, opts()) == []
    assert expire(1.0, state, opts()) == ["g1:a"]
    assert state.pending == {} and state.round_started is None


def test_commit_starts_a_new_round_and_withdraw_drops_only_the_current_request() -> None:
    state = CoordinatorState()
    first = ask("g0", at=0.0)
    record_request(state, first)
    quorum, _ = compute_quorum(0.0, state, opts())
    commit_quorum(state, quorum)
    assert state.prev_quorum is quorum and state.quorum_id == 1
    assert state.pending == {} and state.round_started is None
    assert not withdraw_request(state, first)
    newer = ask("g0", step=1, at=0.2)
    record_request(state, newer)
    assert state.round_started == 0.2
    assert not withdraw_request(state, ask("g0", step=1, at=0.2))  # an equal but different request
    assert withdraw_request(state, newer)
    assert state.pending == {} and state.round_started is None


def test_ids_never_go_backwards_over_a_sequence_of_steps() -> None:
    """Drive three groups through failures, a restart of the coordinator and a rejoin."""
    o = opts(min_replicas=1)
    state = CoordinatorState()
    seen: list[int] = []

    def round_(now: float, asks: list[MemberRequest]) -> Quorum:
        for r in asks:
            record_request(state, r)
        expire(now, state, o)
        quorum, reason = compute_quorum(now, state, o)
        assert quorum is not None, reason
        commit_quorum(state, quorum)
        seen.append(quorum.quorum_id)
        return quorum

    round_(0.0, [ask(g, 0, 0.0) for g in ("g0", "g1", "g2")])
    round_(0.1, [ask(g, 1, 0.1, last=seen[-1]) for g in ("g0", "g1", "g2")])
    round_(0.2, [ask(g, 2, 0.2, last=seen[-1], failed=(g == "g1")) for g in ("g0", "g1", "g2")])
    # g2 dies (no more traffic); after its heartbeat expires the others go on without waiting.
    round_(0.8, [ask(g, 3, 0.8, last=seen[-1]) for g in ("g0", "g1")])
    state = CoordinatorState()  # the coordinator restarts and forgets everything
    round_(0.9, [ask(g, 4, 0.9, last=seen[-1]) for g in ("g0", "g1")])
    q = round_(1.0, [ask(g, s, 1.0, last=seen[-1]) for g, s in (("g0", 5), ("g1", 5), ("g2", 0))])
    assert seen == [1, 1, 2, 3, 4, 5]
    assert q.participants == ["g0:a", "g1:a"] and q.sources == {"g2:a": "g0:a"}


def test_quorum_json_round_trip_and_bad_shape() -> None:
    state = CoordinatorState()
    record_request(state, ask("g0", step=2))
    record_request(state, ask("g1", step=1))
    quorum, _ = compute_quorum(0.0, state, opts())
    assert Quorum.from_json(quorum.to_json()) == quorum
    import json

    assert Quorum.from_json(json.dumps(quorum.to_json())) == quorum
    with pytest.raises(ValueError, match="not a quorum"):
        Quorum.from_json({"quorum_id": 1})


def test_progress_never_silently_goes_back_when_every_holder_of_the_newest_state_died() -> None:
    state = CoordinatorState()
    record_heartbeat(state, Heartbeat(rid("g0"), "g0", 0.0, 40))  # g0 trained to step 40, then died
    expire(10.0, state, opts())
    record_request(state, ask("g1", step=0, at=10.0))  # a restarted group, from scratch
    quorum, reason = compute_quorum(10.0, state, opts())
    assert quorum is None and "step 40" in reason and "durable checkpoint" in reason
    # One step behind is the ordinary aftermath of a step that only the dead group committed.
    record_request(state, ask("g1", step=39, at=10.1))
    quorum, _ = compute_quorum(10.1, state, opts())
    assert quorum is not None and quorum.step == 39
