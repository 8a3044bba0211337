"""The quorum decision and membership bookkeeping, as pure functions with a hand-driven clock (the
index they read: test_quorum_index.py)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest

from ftlm.ft.history import GENESIS
from ftlm.ft.quorum import (
    CoordinatorState,
    Heartbeat,
    Member,
    MemberRequest,
    Quorum,
    QuorumOptions,
    Restore,
    StaleIncarnation,
    advance_head,
    commit_quorum,
    compute_quorum,
    expire,
    record_heartbeat,
    record_request,
    remove_member,
    withdraw_request,
)

HB_TIMEOUT = 0.5
JOIN = 1.0


def opts(min_replicas: int = 1) -> QuorumOptions:
    # These rules are about a coordinator that knows the job: no wait to rebuild after a start
    # (tested on its own in test_restarted_coordinator_gathers_claims_before_deciding).
    return QuorumOptions(min_replicas=min_replicas, join_timeout=JOIN, heartbeat_timeout=HB_TIMEOUT,
                         rebuild_grace=0.0)


def rid(group: str) -> str:
    return f"{group}:a"


def ask(group: str, step: int = 0, at: float = 0.0, last: int = 0, failed: bool = False,
        chain: str | None = None, disk_checked: int = -1) -> MemberRequest:
    return MemberRequest(rid(group), group, step, last, failed, {"url": f"http://{group}"}, at,
                         chain if chain is not None else CHAINS.get(step, GENESIS), (), disk_checked)


def prev_quorum(groups: list[str], quorum_id: int, step: int = 0) -> Quorum:
    ids = [rid(g) for g in groups]
    return Quorum(quorum_id, step, [Member(rid(g), g, step, {}) for g in groups], ids, [], {}, 0.0)


PREV = ["g0", "g1", "g2"]
CHAINS = {0: GENESIS, 1: prev_quorum(PREV, 5).next_chain()}
"""Chains of the table's states: step 1 is what committing quorum 5 (g0, g1, g2) at step 0 gives."""


def decide(now: float, state: CoordinatorState, options: QuorumOptions) -> tuple[Quorum | None, str]:
    """What the coordinator does on a tick: move the head, then decide."""
    expire(now, state, options)
    restores, waiting = advance_head(now, state, options)
    assert not restores
    quorum, reason = compute_quorum(now, state, options)
    return quorum, waiting or reason


@dataclass
class Case:
    name: str
    asks: list[MemberRequest]
    now: float
    min_replicas: int = 1
    beats: dict[str, float] = field(default_factory=dict)  # heartbeats after the asks: group -> last_seen
    prev: list[str] | None = None  # groups of the previous quorum (id 5, step 0, all committed)
    quorum_id: int = 0  # the state's id (5 when prev is given)
    fresh: bool = False  # a coordinator that just (re)started: it learns the head from the members
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
        [ask("g0", 1, at=0.1), ask("g1", 1, at=0.1), ask("g2", 1, at=0.1)],
        0.1,
        prev=["g0", "g1", "g2"],
        expect=["g0", "g1", "g2"],
        expect_id=5,
        reason="fast path: all 3 healthy members of quorum 5 asked",
    ),
    Case(
        "fast_path_waits_for_live_previous_member",
        [ask("g0", 1, at=0.1), ask("g1", 1, at=0.1)],
        0.2,
        beats={"g2": 0.1},
        prev=["g0", "g1", "g2"],
        reason="waiting for g2 (asked 2 of 3)",
    ),
    Case(
        "heartbeat_expiry_makes_fast_path_fire",
        [ask("g0", 1, at=0.6), ask("g1", 1, at=0.6)],
        0.6,
        beats={"g2": 0.1},
        prev=["g0", "g1", "g2"],
        expect=["g0", "g1"],
        expect_id=6,
        reason="fast path: all 2 healthy members of quorum 5 asked",
    ),
    Case(
        "fast_path_includes_joiners_and_bumps_id",
        [ask("g0", 1), ask("g1", 1), ask("g2", 1), ask("g3")],
        0.0,
        prev=["g0", "g1", "g2"],
        expect=["g0", "g1", "g2", "g3"],
        expect_id=6,
        reason="(+1 joiner)",
    ),
    Case(
        "failed_commit_bumps_id",
        [ask("g0", 1), ask("g1", 1), ask("g2", 1, failed=True)],
        0.0,
        prev=["g0", "g1", "g2"],
        expect=["g0", "g1", "g2"],
        expect_id=6,
    ),
    Case(
        "restarted_coordinator_continues_above_reported_ids",
        [ask("g0", last=7, at=0.55), ask("g1", last=6, at=0.55)],
        0.6,
        fresh=True,
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
        "previous_quorum_all_dead_new_groups_form_one_after_the_rollback",
        # (both looked for a checkpoint newer than their state and found none: disk_checked)
        [ask("g3", at=2.0, disk_checked=1), ask("g4", at=2.0, disk_checked=1)],
        2.0,
        prev=["g0", "g1", "g2"],
        expect=["g3", "g4"],
        expect_id=6,
        reason="all 2 heartbeating groups asked",
    ),
    Case(
        "previous_quorum_all_dead_the_rollback_waits_for_groups_behind_to_look_for_a_checkpoint",
        [ask("g3", at=2.0, disk_checked=1), ask("g4", at=2.0)],
        2.0,
        prev=["g0", "g1", "g2"],
        expect=None,
        reason="waiting for the rollback",
    ),
    Case(
        "holders_of_the_head_gone_for_less_than_the_rollback_grace_are_awaited",
        [ask("g3", at=0.6), ask("g4", at=0.6)],
        0.6,
        prev=["g0", "g1", "g2"],
        reason="no live group holds the newest state (step 1)",
    ),
]


def build(case: Case) -> CoordinatorState:
    state = CoordinatorState(quorum_id=case.quorum_id, head=None if case.fresh else (0, GENESIS),
                             started_at=0.0, head_seen_at=0.0)
    if case.prev is not None:  # quorum 5 was issued at step 0 and its members committed it
        state.prev_quorum = prev_quorum(case.prev, 5)
        state.quorum_id = max(state.quorum_id, 5)
        state.head = (1, state.prev_quorum.next_chain())
    for req in case.asks:
        record_request(state, req)
    for group, seen in case.beats.items():  # heartbeats after the asks keep the askers fresh
        record_heartbeat(state, Heartbeat(rid(group), group, seen, 0))
    return state


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_compute_quorum_rules(case: Case) -> None:
    state = build(case)
    advance_head(case.now, state, opts(case.min_replicas))
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


def test_participants_hold_the_head_and_sources_are_round_robin() -> None:
    state = CoordinatorState(head=(10, "a" * 64), started_at=0.0, head_seen_at=0.0)
    for group, step, chain in [("g4", 9, GENESIS), ("g1", 10, "a" * 64), ("g0", 5, GENESIS),
                               ("g3", 10, "a" * 64), ("g2", 7, GENESIS), ("g5", 10, "b" * 64)]:
        record_request(state, ask(group, step=step, chain=chain))
    quorum, reason = decide(0.0, state, opts())
    assert quorum is not None, reason
    assert quorum.step == 10 and quorum.chain == "a" * 64
    assert quorum.participants == ["g1:a", "g3:a"]
    # g5 claims step 10 with another history (a fork): it recovers like anyone behind.
    assert quorum.recovering == ["g0:a", "g2:a", "g4:a", "g5:a"]
    assert quorum.sources == {"g0:a": "g1:a", "g2:a": "g3:a", "g4:a": "g1:a", "g5:a": "g3:a"}
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
    prev = prev_quorum(["g0", "g1"], 5)
    state = CoordinatorState(prev_quorum=prev, quorum_id=5, head=(1, prev.next_chain()), started_at=0.0)
    record_request(state, ask("g0", step=1, at=0.1, last=5, chain=prev.next_chain()))
    record_heartbeat(state, Heartbeat("g1:new", "g1", 0.1, 0))  # g1 restarted, has not asked yet
    quorum, reason = decide(0.1, state, opts())
    assert quorum is not None and quorum.replica_ids() == ["g0:a"] and quorum.quorum_id == 6, reason


def test_expire_drops_stale_heartbeats_and_their_requests() -> None:
    state = CoordinatorState()
    record_request(state, ask("g0", at=0.0))
    record_request(state, ask("g1", at=0.4))
    record_heartbeat(state, Heartbeat("g2:a", "g2", 0.2, 0))
    assert state.round_started == 0.0
    assert sorted(r for r, _ in expire(0.75, state, opts())) == ["g0:a", "g2:a"]
    assert list(state.heartbeats) == ["g1:a"] and list(state.pending) == ["g1:a"]
    assert expire(0.75, state, opts()) == []
    assert expire(1.0, state, opts()) == [("g1:a", "heartbeat timeout")]
    assert state.pending == {} and state.round_started is None


def test_commit_starts_a_new_round_and_withdraw_drops_only_the_current_request() -> None:
    state = CoordinatorState()
    first = ask("g0", at=0.0)
    record_request(state, first)
    quorum, _ = decide(0.0, state, opts())
    commit_quorum(state, quorum)
    assert state.prev_quorum is quorum and state.quorum_id == 1
    assert state.pending == {} and state.round_started is None
    assert not withdraw_request(state, first)
    newer = ask("g0", step=1, at=0.2, chain=quorum.next_chain())
    record_request(state, newer)
    assert state.round_started == 0.2
    assert not withdraw_request(state, ask("g0", step=1, at=0.2, chain=quorum.next_chain()))
    assert withdraw_request(state, newer)
    assert state.pending == {} and state.round_started is None


class Job:
    """Groups stepping through the pure rules with a hand-driven clock (a tiny simulator)."""

    def __init__(self, groups: list[str], options: QuorumOptions | None = None) -> None:
        self.o = options or QuorumOptions(min_replicas=1, join_timeout=JOIN, heartbeat_timeout=HB_TIMEOUT,
                                          expected_groups=len(groups))
        self.state = CoordinatorState()
        self.held = {g: (0, GENESIS) for g in groups}
        self.last = {g: 0 for g in groups}
        self.restores: list[Restore] = []
        self.ids: list[int] = []

    def ask(self, now: float, groups: list[str], failed: tuple[str, ...] = ()) -> Quorum | None:
        """Requests of ``groups``; one behind the head says it looked for a newer durable checkpoint
        (``disk_checked``) and found none, as a member told so (``reload_due``) does."""
        head = self.state.head[0] if self.state.head is not None else -1
        for g in groups:
            step, chain = self.held[g]
            record_request(self.state, MemberRequest(rid(g), g, step, self.last[g], g in failed, {}, now, chain,
                                                     (), head if step < head else -1))
        return self.tick(now)[0]

    def beat(self, now: float, groups: list[str]) -> None:
        for g in groups:
            step, chain = self.held[g]
            record_heartbeat(self.state, Heartbeat(rid(g), g, now, step, self.last[g], chain))

    def tick(self, now: float) -> tuple[Quorum | None, str]:
        expire(now, self.state, self.o)
        restores, waiting = advance_head(now, self.state, self.o)
        self.restores += restores
        quorum, reason = compute_quorum(now, self.state, self.o)
        if quorum is not None:
            commit_quorum(self.state, quorum)
            self.ids.append(quorum.quorum_id)
            for m in quorum.members:
                self.last[m.group] = quorum.quorum_id
        return quorum, waiting or reason

    def commit(self, quorum: Quorum, groups: list[str]) -> None:
        for g in groups:
            assert rid(g) in quorum.participants
            self.held[g] = (quorum.step + 1, quorum.next_chain())

    def recover(self, quorum: Quorum, g: str) -> None:
        self.held[g] = (quorum.step, quorum.chain)


def test_lagging_group_is_never_issued_a_step_below_a_live_committed_one() -> None:
    """A commits step n while B and C fail it; A asks again only after the join timeout. The
    majority {B, C} must not get a quorum at n: all three would later ask at n+1 as equal
    participants holding different bits."""
    job = Job(["A", "B", "C"])
    q = job.ask(0.0, ["A", "B", "C"])
    job.commit(q, ["A"])  # B and C failed the step
    job.beat(0.05, ["A"])
    assert job.ask(0.1, ["B", "C"], failed=("B", "C")) is None
    for t in (0.4, 0.7, 1.0, 1.5):  # far past the join timeout: still waiting for the holder
        job.beat(t, ["A", "B", "C"])
        quorum, reason = job.tick(t)
        assert quorum is None and "holders of step 1 (A)" in reason
    q2 = job.ask(1.6, ["A"])
    assert q2.participants == ["A:a"] and q2.recovering == ["B:a", "C:a"] and q2.step == 1
    assert q2.sources == {"B:a": "A:a", "C:a": "A:a"}


def test_a_live_participant_that_may_have_committed_is_awaited_not_forked() -> None:
    job = Job(["A", "B", "C"])
    q = job.ask(0.0, ["A", "B", "C"])
    # A committed but its report is still on the way; B and C failed and ask again.
    job.beat(0.3, ["A"])
    for t in (0.3, 0.9, 1.4):
        job.beat(t, ["A"])
        assert job.ask(t, ["B", "C"], failed=("B", "C")) is None
    job.commit(q, ["A"])
    job.beat(1.45, ["A"])
    q2 = job.ask(1.5, ["A"])
    assert q2.participants == ["A:a"] and q2.step == 1


def test_a_claim_out_of_any_plausible_range_does_not_wedge_the_job() -> None:
    """A heartbeat claiming step=10**15 must not make every later quorum answer 504."""
    job = Job(["A", "B"])
    q = job.ask(0.0, ["A", "B"])
    job.commit(q, ["A", "B"])
    record_heartbeat(job.state, Heartbeat("X:evil", "X", 0.1, 10**15, 10**15, "f" * 64))
    q2 = job.ask(0.1, ["A", "B"])
    assert q2 is not None and q2.participants == ["A:a", "B:a"] and q2.step == 1
    assert job.state.head == (1, q.next_chain())
    assert job.state.quorum_id <= 2**53  # the claimed id is capped, never overflowing a gauge


def test_every_holder_of_the_head_dead_is_an_explicit_rollback_never_a_silent_one() -> None:
    """Progress held only by dead groups comes back as a logged restore."""
    job = Job(["A", "B"])
    q = job.ask(0.0, ["A", "B"])
    job.commit(q, ["A"])  # only A committed step 0, then A died
    job.beat(0.1, ["A", "B"])
    assert job.ask(0.2, ["B"], failed=("B",)) is None
    job.beat(0.6, ["B"])
    quorum, reason = job.tick(0.8)  # A's heartbeat expired; the grace for it to return runs
    assert quorum is None and "rolling back" in reason and job.restores == []
    job.beat(1.5, ["B"])
    q2 = job.ask(1.9, ["B"])
    assert [(r.from_step, r.to_step, r.holders) for r in job.restores] == [(1, 0, ("B",))]
    assert q2 is not None and q2.step == 0 and q2.participants == ["B:a"]
    assert q2.quorum_id > q.quorum_id


def test_a_rollback_never_jumps_forward_to_an_absurd_claim() -> None:
    job = Job(["A", "B"])
    q = job.ask(0.0, ["A", "B"])
    job.commit(q, ["A"])
    job.beat(0.05, ["A", "B"])
    job.ask(0.1, ["B"], failed=("B",))
    for t in (0.3, 0.6, 0.9, 1.2, 1.5, 1.8):  # A died; a bogus member claims step 10**15
        job.beat(t, ["B"])
        record_heartbeat(job.state, Heartbeat("X:bogus", "X", t, 10**15, 0, "f" * 64))
        job.ask(t, ["B"])
    assert [(r.from_step, r.to_step, r.holders) for r in job.restores] == [(1, 0, ("B",))]


@pytest.mark.parametrize("claims,target", [
    ({"A": (40, "x"), "B": (40, "x")}, 40),  # both groups restarted from the newest checkpoint
    ({"A": (40, "x"), "B": (40, "x"), "C": (40, "y")}, 40),  # two of three
    ({"A": (40, "x"), "B": (40, "y")}, None),  # no two agree: each is one member's word
    ({"A": (40, "x"), "B": (40, "x"), "C": (30, "y"), "D": (30, "z")}, None),  # two of four: not most
])
def test_a_state_beyond_the_furthest_head_is_believed_only_when_most_live_groups_hold_it(
        claims: dict[str, tuple[int, str]], target: int | None) -> None:
    """A coordinator restarted after the job got further rebuilt from a group that restarted from
    an older checkpoint (step 2); the groups that restarted next loaded the newest one (step 40):
    refusing their state as beyond the furthest head was a livelock (sim seeds 10084, 10124)."""
    o = QuorumOptions(min_replicas=1, join_timeout=JOIN, heartbeat_timeout=HB_TIMEOUT)
    state = CoordinatorState(head=(2, "2" * 64), top=2, head_seen_at=0.0, started_at=0.0)
    now = o.rollback_seconds + 0.1  # the holders of step 2 are gone, the grace is over
    for g, (step, chain) in claims.items():
        record_heartbeat(state, Heartbeat(rid(g), g, now, step, 0, chain * 64))
    restores, reason = advance_head(now, state, o)
    if target is None:
        assert restores == [] and "or an older one" in reason and state.head == (2, "2" * 64)
    else:
        assert [(r.from_step, r.to_step) for r in restores] == [(2, target)]
        assert state.head == (target, "x" * 64)


def test_group_restored_from_a_checkpoint_behind_the_head_recovers_or_rolls_back() -> None:
    """A group restored from an older checkpoint recovers or the job rolls back: never 504s."""
    job = Job(["A", "B"])
    for _ in range(5):
        q = job.ask(0.0, ["A", "B"])
        job.commit(q, ["A", "B"])
    job.held["B"] = (2, "c" * 64)  # B restarted from a durable checkpoint of step 2
    q = job.ask(0.0, ["A", "B"])
    assert q.participants == ["A:a"] and q.recovering == ["B:a"]
    # Everyone restarts from the checkpoint (the whole job died): an explicit restore to step 2.
    job2 = Job(["A", "B"])
    job2.state = job.state
    job2.held = {"A": (2, "c" * 64), "B": (2, "c" * 64)}
    for t in (10.0, 10.5, 11.0, 12.0):
        job2.beat(t, ["A", "B"])
        q = job2.ask(t, ["A", "B"])
        if q is not None:
            break
    assert q is not None and q.step == 2 and q.participants == ["A:a", "B:a"]
    assert [(r.from_step, r.to_step) for r in job2.restores] == [(5, 2)]


def test_restarted_coordinator_gathers_claims_before_deciding() -> None:
    """A restarted coordinator must learn membership before judging anyone."""
    o = QuorumOptions(min_replicas=1, join_timeout=JOIN, heartbeat_timeout=HB_TIMEOUT, expected_groups=3)
    state = CoordinatorState()  # a fresh coordinator; the job is at step 7
    record_request(state, ask("g0", step=6, at=0.0, chain="6" * 64, last=9))
    assert advance_head(0.0, state, o) == ([], advance_head(0.0, state, o)[1])
    assert state.head is None and "rebuilding" in compute_quorum(0.0, state, o)[1]
    record_heartbeat(state, Heartbeat("g1:a", "g1", 0.1, 7, 9, "7" * 64))
    record_heartbeat(state, Heartbeat("g2:a", "g2", 0.2, 7, 9, "7" * 64))
    advance_head(0.2, state, o)  # every expected group reported: no need to wait out the grace
    assert state.head == (7, "7" * 64)
    quorum, _ = compute_quorum(0.2, state, o)
    assert quorum is None  # g1 and g2 hold the head and have not asked
    record_request(state, ask("g1", step=7, at=0.3, chain="7" * 64, last=9))
    record_request(state, ask("g2", step=7, at=0.3, chain="7" * 64, last=9))
    quorum, reason = compute_quorum(0.3, state, o)
    assert quorum is not None and quorum.participants == ["g1:a", "g2:a"], reason
    assert quorum.recovering == ["g0:a"] and quorum.quorum_id == 10


def test_restarted_coordinator_first_hearing_a_new_incarnation_does_not_take_it_for_a_fresh_job() -> None:
    """Soak finding: after a coordinator restart the first heartbeat came from a group restarted
    at step 0; the coordinator took the job for fresh and told the holder of step 637 to recover
    from it (only a lucky hang turned that into a visible restore)."""
    o = QuorumOptions(min_replicas=1, join_timeout=JOIN, heartbeat_timeout=HB_TIMEOUT, expected_groups=3)
    state = CoordinatorState()
    record_request(state, ask("g1", step=0, at=0.0, last=0))  # a new incarnation, nothing known
    assert advance_head(0.0, state, o) == ([], advance_head(0.0, state, o)[1]) and state.head is None
    record_heartbeat(state, Heartbeat("g0:a", "g0", 0.3, 637, 8, "6" * 64))  # the holder, a moment later
    advance_head(0.6, state, o)  # the grace passed (g2 is dead): the head is the newest claim
    assert state.head == (637, "6" * 64)
    record_request(state, ask("g0", step=637, at=0.6, last=8, chain="6" * 64))
    record_heartbeat(state, Heartbeat("g0:a", "g0", 1.05, 637, 8, "6" * 64))
    record_heartbeat(state, Heartbeat("g1:a", "g1", 1.05, 0, 0))
    quorum, reason = compute_quorum(1.1, state, o)
    assert quorum is not None and quorum.participants == ["g0:a"] and quorum.recovering == ["g1:a"], reason


def test_a_finished_job_is_never_rolled_back_for_a_late_group() -> None:
    """Soak finding: chaos killed a group after every group had finished and left; its restart
    at step 0 rolled the whole job back to 0 and trained it again alone."""
    job = Job(["A", "B"])
    for t in range(3):
        q = job.ask(0.01 * t, ["A", "B"])
        job.commit(q, ["A", "B"])
    job.beat(0.05, ["A", "B"])
    job.tick(0.05)
    assert job.state.head[0] == 3
    for g in ("A", "B"):
        remove_member(job.state, rid(g), 0.06, finished=True)
    job.held["A"] = (0, GENESIS)  # A restarts from scratch
    job.state.retired.clear()
    for t in (1.0, 2.0, 5.0):
        job.beat(t, ["A"])
        quorum, reason = job.tick(t)
        assert quorum is None and job.restores == []
    assert "the job finished at step 3" in reason


def test_a_group_whose_heartbeat_lives_without_progress_is_declared_hung_and_retired() -> None:
    """A hung non-leader rank or training thread must not stall the job for good."""
    o = QuorumOptions(min_replicas=1, join_timeout=JOIN, heartbeat_timeout=HB_TIMEOUT, progress_timeout=5.0)
    state = CoordinatorState()
    record_heartbeat(state, Heartbeat("g0:a", "g0", 0.0, 0, progress_at=0.0))
    record_heartbeat(state, Heartbeat("g1:a", "g1", 4.9, 0, progress_at=0.0))
    record_request(state, ask("g0", at=4.9))
    assert expire(5.0, state, o) == []
    record_heartbeat(state, Heartbeat("g1:a", "g1", 5.3, 0, progress_at=0.0))
    record_heartbeat(state, Heartbeat("g0:a", "g0", 5.3, 0, progress_at=4.9))
    gone = expire(5.3, state, o)
    assert [r for r, _ in gone] == ["g1:a"] and "no progress" in gone[0][1]
    assert "g0:a" in state.heartbeats  # waiting for a quorum is not a hang
    with pytest.raises(StaleIncarnation):
        record_heartbeat(state, Heartbeat("g1:a", "g1", 5.4, 0))


def test_quorum_json_round_trip_and_bad_shape() -> None:
    state = CoordinatorState()
    record_request(state, ask("g0", step=0))
    record_request(state, ask("g1", step=0))
    quorum, _ = decide(0.0, state, opts())
    assert Quorum.from_json(quorum.to_json()) == quorum
    import json

    assert Quorum.from_json(json.dumps(quorum.to_json())) == quorum
    with pytest.raises(ValueError, match="not a quorum"):
        Quorum.from_json({"quorum_id": 1})


def test_ids_never_go_backwards_over_failures_restarts_and_rollbacks() -> None:
    job = Job(["g0", "g1", "g2"])
    for t in (0.0, 0.1):
        q = job.ask(t, ["g0", "g1", "g2"])
        job.commit(q, ["g0", "g1", "g2"])
    q = job.ask(0.2, ["g0", "g1", "g2"], failed=("g1",))
    job.commit(q, ["g0", "g1", "g2"])
    job.beat(0.6, ["g0", "g1"])
    q = job.ask(0.8, ["g0", "g1"])  # g2 died: its heartbeat expired
    job.commit(q, ["g0", "g1"])
    job.state = CoordinatorState()  # the coordinator restarts and forgets everything
    job.beat(0.9, ["g0", "g1"])
    q = None
    for t in (0.9, 1.2, 1.5, 1.8, 2.1):  # one rebuild grace, then the first quorum's join timeout
        job.beat(t, ["g0", "g1"])
        q = job.ask(t, ["g0", "g1"]) or q
        if q is not None:
            break
    assert q is not None and q.step == 4
    assert job.ids == sorted(job.ids) and job.ids[0] == 1 and len(set(job.ids)) >= 4


# -- properties over random membership histories (hypothesis) --------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

GROUPS = ["g0", "g1", "g2", "g3"]
CHAIN_POOL = [GENESIS, "a" * 64, "b" * 64]

_action = st.one_of(
    st.tuples(st.just("ask"), st.sampled_from(GROUPS), st.integers(0, 4), st.sampled_from(CHAIN_POOL),
              st.booleans()),
    st.tuples(st.just("beat"), st.sampled_from(GROUPS), st.integers(0, 4), st.sampled_from(CHAIN_POOL),
              st.integers(-1, 2**53)),
    st.tuples(st.just("commit"), st.sampled_from(GROUPS)),
    st.tuples(st.just("wait"), st.floats(0.0, 1.5)),
    st.tuples(st.just("restart"), st.sampled_from(GROUPS)),
)


@settings(deadline=None, max_examples=600)
@given(st.lists(_action, max_size=40), st.integers(1, 2), st.integers(0, 4))
def test_quorum_rules_hold_over_random_histories(actions, min_replicas, expected) -> None:
    """Whatever members claim and however time passes: participants hold the head, everyone else
    recovers from a participant, ids never go back, the head moves one step at a time (or back only
    by an explicit restore), and deciding never mutates the state."""
    o = QuorumOptions(min_replicas=min_replicas, join_timeout=JOIN, heartbeat_timeout=HB_TIMEOUT,
                      expected_groups=expected, progress_timeout=3.0)
    state = CoordinatorState()
    now, incarnation = 0.0, {g: 0 for g in GROUPS}
    held: dict[str, tuple[int, str]] = {}
    last_id, last_head = 0, None
    for action in actions:
        kind = action[0]
        rid_of = lambda g: f"{g}:{incarnation[g]}"  # noqa: E731
        try:
            if kind == "ask":
                _, g, step, chain, failed = action
                step, chain = held.get(g, (step, chain))
                record_request(state, MemberRequest(rid_of(g), g, step, last_id, failed, {}, now, chain))
            elif kind == "beat":
                _, g, step, chain, qid = action
                record_heartbeat(state, Heartbeat(rid_of(g), g, now, step, qid, chain))
            elif kind == "commit" and state.prev_quorum is not None:
                q = state.prev_quorum
                r = rid_of(action[1])
                if r in q.participants:
                    held[action[1]] = (q.step + 1, q.next_chain())
            elif kind == "wait":
                now += action[1]
            elif kind == "restart":
                incarnation[action[1]] += 1
                held.pop(action[1], None)
        except StaleIncarnation:
            continue
        expire(now, state, o)
        restores, _ = advance_head(now, state, o)
        if last_head is not None and state.head is not None and state.head != last_head and not restores:
            assert state.head[0] == last_head[0] + 1, "the head jumped without a restore"
        last_head = state.head if state.head is not None else last_head
        before = copy.deepcopy(state)
        quorum, reason = compute_quorum(now, state, o)
        assert state == before and reason
        if quorum is None:
            continue
        assert quorum.quorum_id >= last_id and quorum.quorum_id >= 1
        assert (quorum.step, quorum.chain) == state.head
        by_id = {r: state.pending[r] for r in quorum.replica_ids()}  # what each member asked with
        assert quorum.participants and all((by_id[r].step, by_id[r].chain) == state.head
                                           for r in quorum.participants)
        assert all((by_id[r].step, by_id[r].chain) != state.head for r in quorum.recovering)
        assert set(quorum.sources) == set(quorum.recovering)
        assert set(quorum.sources.values()) <= set(quorum.participants)
        assert len(quorum.members) >= min_replicas
        commit_quorum(state, quorum)
        last_id = quorum.quorum_id


# ----------------------------------------------------------------- the index over the tables


def test_a_decision_before_expiry_counts_only_the_live_members() -> None:
    """``compute_quorum`` and ``advance_head`` read the index, which counts every heartbeat in the
    table: called before ``expire`` (a stale heartbeat still there) or with a request written
    without a heartbeat, they decide on the live members alone, as after ``expire``."""
    o = opts()
    state = CoordinatorState(head=(0, GENESIS), started_at=0.0, head_seen_at=0.0)
    for g in ("g0", "g1", "g2"):
        record_request(state, ask(g, at=0.0))
    state.heartbeats[rid("g2")] = Heartbeat(rid("g2"), "g2", 0.0, 0)  # g2 asked, then went silent
    for g in ("g0", "g1"):
        record_heartbeat(state, Heartbeat(rid(g), g, 0.4, 0))
    state.pending[rid("g3")] = ask("g3", at=0.4)  # a request without a heartbeat (a direct write)
    now = 0.1 + HB_TIMEOUT  # g2's heartbeat is stale, not expired yet
    assert advance_head(now, state, o) == ([], "") and state.head_seen_at == now  # g0, g1 hold it
    before = copy.deepcopy(state)
    quorum, reason = compute_quorum(now, state, o)
    assert state == before and quorum is not None
    assert quorum.replica_ids() == [rid("g0"), rid("g1")] and reason == "all 2 heartbeating groups asked"
    expired = copy.deepcopy(state)
    assert expire(now, expired, o) == [(rid("g2"), "heartbeat timeout")]
    del expired.pending[rid("g3")]
    after, why = compute_quorum(now, expired, o)
    assert after is not None and after.to_json() == quorum.to_json() and why == reason
