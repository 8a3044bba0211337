"""The index over the coordinator's tables (``ftlm.ft.quorum.index``): it follows direct writes
and copies, its deadline heaps answer what a pass over the tables would, a quorum's requests leave
it at once, and a message costs the same at 2,000 groups as at 200."""

from __future__ import annotations

import copy
import gc
import time

from ftlm.ft.history import GENESIS
from ftlm.ft.quorum import (
    CoordinatorState,
    Heartbeat,
    Member,
    MemberRequest,
    Quorum,
    QuorumOptions,
    expire,
    record_request,
)
from ftlm.ft.quorum.index import progress_at

HB_TIMEOUT = 0.5


def ask(group: str, step: int = 0, at: float = 0.0) -> MemberRequest:
    return MemberRequest(f"{group}:a", group, step, 0, False, {}, at, GENESIS)


def test_the_index_follows_direct_writes_and_copies() -> None:
    state = CoordinatorState(head=(0, GENESIS), started_at=0.0, head_seen_at=0.0)
    state.heartbeats["g0:a"] = Heartbeat("g0:a", "g0", 0.0, 0)
    record_request(state, ask("g1", at=0.1))
    twin = copy.deepcopy(state)
    assert twin == state and twin.index.hb_claims == state.index.hb_claims
    state.heartbeats.pop("g0:a")
    assert list(state.index.hb_groups) == ["g1"] and list(twin.index.hb_groups) == ["g0", "g1"]
    state.pending = {}  # assigning a table keeps the index in step
    assert state.index.idle == {"g1:a": None} and state.round_started == 0.1
    assert expire(0.1 + HB_TIMEOUT, state, QuorumOptions(1, 1.0, HB_TIMEOUT, rebuild_grace=0.0)) == [("g1:a", "heartbeat timeout")]
    assert not state.heartbeats and not state.index.hb_claims and not state.index.idle



def test_the_deadline_bounds_answer_what_a_scan_answers() -> None:
    """The heaps of heartbeat and progress deadlines hold lower bounds refreshed only when they
    look overdue: after any mix of heartbeats (progress times that move back included), requests,
    answers and removals, they say exactly what a pass over the tables says."""
    import random

    rng = random.Random(16)
    for trial in range(40):
        state = CoordinatorState(head=(0, GENESIS), started_at=0.0, head_seen_at=0.0)
        index, now = state.index, 0.0
        timeout, progress_timeout = rng.choice([0.5, 2.0]), rng.choice([1.0, 3.0])
        for _ in range(300):
            now += rng.expovariate(20.0)
            rid = f"g{rng.randrange(6)}:a"
            op = rng.random()
            if op < 0.5:
                hb = Heartbeat(rid, rid[:2], now, 0, progress_at=now - rng.choice([0.0, 0.0, 0.5, 2.5, 4.0]))
                state.heartbeats[rid] = hb
            elif op < 0.7 and rid in state.heartbeats:
                state.pending[rid] = ask(rid[:2], at=now)
            elif op < 0.85:
                state.pending.pop(rid, None)
            else:
                state.heartbeats.pop(rid, None)
                state.pending.pop(rid, None)
            probe = now + rng.choice([0.0, 0.4, 1.0, 3.5])
            stale = any(probe - hb.last_seen >= timeout for hb in state.heartbeats.values())
            overdue = any(probe - progress_at(hb) > progress_timeout
                          for r, hb in state.heartbeats.items() if r not in state.pending)
            assert index.oldest_fresh_violation(probe, timeout) == stale, (trial, probe)
            assert index.progress_overdue(probe, progress_timeout) == overdue, (trial, probe)
            assert len(index.seen) <= 2 * len(state.heartbeats) + 12  # bounded: about one entry each



def test_a_quorum_of_every_pending_request_leaves_the_index_as_one_removal_after_another() -> None:
    """``discard_all`` of all the pending requests at once (a steady step) leaves the index in
    the state that removing them one by one does: counts, idle order, orphans, deadlines."""
    import random

    rng = random.Random(7)
    for trial in range(30):
        state = CoordinatorState(head=(0, GENESIS), started_at=0.0, head_seen_at=0.0)
        rids = [f"g{i}:a" for i in range(12)]
        for i, rid in enumerate(rids):
            if rng.random() < 0.8:
                state.heartbeats[rid] = Heartbeat(rid, rid[:-2], 0.1 * i, rng.choice([0, 1]),
                                                  progress_at=rng.choice([None, 0.01 * i]))
            if rng.random() < 0.7:
                state.pending[rid] = ask(rid[:-2], step=rng.choice([0, 1]), at=0.2 + 0.01 * i)
        state.index.track_prev(Quorum(1, 0, [Member(r, r[:-2], 0, {}) for r in rids[::2]],
                                      [r for r in rids[::2]], [], {}, 0.0, "test", GENESIS, "e"))
        answered = list(state.pending)
        rng.shuffle(answered)
        one_by_one = copy.deepcopy(state)
        for rid in answered:
            one_by_one.pending.pop(rid, None)
        state.pending.discard_all(answered)
        a, b = state.index, one_by_one.index
        assert dict(state.pending) == dict(one_by_one.pending) == {}
        assert (a.pending_claims, a.pending_groups, list(a.idle), a.orphans, a.prev_idle, a.progress_low) == (
            b.pending_claims, b.pending_groups, list(b.idle), b.orphans, b.prev_idle, b.progress_low), trial
        assert sorted(e[0::2] for e in a.progress) == sorted(e[0::2] for e in b.progress)
        assert a.oldest_request() is None and b.oldest_request() is None



def test_discarding_some_pending_requests_leaves_the_others() -> None:
    state = CoordinatorState(head=(0, GENESIS), started_at=0.0, head_seen_at=0.0)
    for g in ("g0", "g1"):
        state.heartbeats[f"{g}:a"] = Heartbeat(f"{g}:a", g, 0.0, 0)
        state.pending[f"{g}:a"] = ask(g, at=0.1)
    state.pending.discard_all(["g0:a", "g0:a"])  # as many ids as requests, not all of them
    assert list(state.pending) == ["g1:a"] and state.index.pending_groups == {"g1": {"g1:a": None}}
    assert state.index.oldest_request() == 0.1


# -------------------------------------------------- per-message work does not grow with the job


def _seconds_per_message(groups: int, steps: int = 3, budget: float = float("inf")) -> float:
    """Seconds per heartbeat or quorum request of a steady job of ``groups`` groups: the best of
    3 trials, each timing ``steps`` steps after an untimed warm-up step (the job's first quorum).
    A trial that passes ``budget`` seconds stops there and counts what it measured, so a slow
    implementation fails in seconds; a pause of the whole process (a collection of the suite's
    heap, a noisy neighbour) spoils one trial, not the measurement, and the collector is off while
    timing."""
    from ftlm.ft.membership import Issued, Membership

    def trial() -> float:
        m = Membership(QuorumOptions(1, 5.0, 30.0, groups), epoch="e")
        rids = [f"g{i:05d}:a" for i in range(groups)]
        now = 0.0
        for r in rids:
            m.heartbeat(now, Heartbeat(r, r[:6], now, 0))
        claims = dict.fromkeys(rids, (0, GENESIS, -1))
        sent, start = 0, time.perf_counter()
        for done in range(steps + 1):
            if done == 1:  # the first step is warm-up: not timed
                sent, start = 0, time.perf_counter()
            quorum = None
            for r in rids:  # a step: everyone asks, the last request completes the quorum
                now += 1e-4
                step, chain, qid = claims[r]
                for o in m.request(now, MemberRequest(r, r[:6], step, qid, False, {}, now, chain)):
                    quorum = o.quorum if isinstance(o, Issued) else quorum
                sent += 1
                if done and time.perf_counter() - start > budget:
                    return (time.perf_counter() - start) / sent
            assert quorum is not None, m.reason
            step, chain, qid = quorum.step + 1, quorum.next_chain(), quorum.quorum_id
            for r in rids:  # then everyone reports the commit in a heartbeat
                now += 1e-4
                claims[r] = (step, chain, qid)
                m.heartbeat(now, Heartbeat(r, r[:6], now, step, qid, chain))
                sent += 1
        return (time.perf_counter() - start) / sent

    gc.collect()
    gc.disable()
    try:
        return min(trial() for _ in range(3))
    finally:
        gc.enable()


def test_per_message_work_does_not_grow_with_the_number_of_groups() -> None:
    """A heartbeat or a request costs about the same with 2,000 groups as with 200 (a pass over
    the members on each message made it 7 to 20 times as much). A quorum itself is built once per
    step, O(n log n), and is counted in; the bound is generous for a loaded machine."""
    small = _seconds_per_message(200, steps=10)
    large = _seconds_per_message(2000, budget=4000 * 20 * small)  # a slow one fails in seconds
    assert large < 4 * small, f"{large * 1e6:.0f} us per message at 2,000 groups vs {small * 1e6:.0f} us at 200"
