"""The per-step protocol of ``Manager`` against a real in-process coordinator, groups as threads."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ftlm.ft.config import FTConfig
from ftlm.ft.coordinator import Coordinator
from ftlm.ft.history import GENESIS
from ftlm.ft.manager import Manager, TooManyFailures

FT = dict(heartbeat_interval=0.05, heartbeat_timeout=0.5, join_timeout=2.0, allreduce_timeout=5.0,
          quorum_timeout=10.0, give_up_seconds=60.0)


@pytest.fixture
def coordinator():
    # groups=2: the first quorum waits for both threads, which start at slightly different times.
    c = Coordinator(FTConfig(**FT, groups=2).coordinator_config())
    c.start()
    yield c
    c.stop()


def snapshot():
    return {"w": torch.zeros(3)}, {"note": "test"}


def run_groups(fn, n: int, timeout: float = 30.0) -> list:
    results: list = [None] * n
    errors: list = []

    def target(i: int) -> None:
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a group thread did not finish in time"
    if errors:
        raise errors[0]
    return results


def joined(config: FTConfig, group: str, incarnation: str, url: str) -> Manager:
    m = Manager(config, group, incarnation, url)
    m.join(0, GENESIS)
    return m


def test_two_groups_average_gradients_and_commit(coordinator):
    def group(i: int):
        m = joined(FTConfig(**FT), f"g{i}", f"inc{i}", coordinator.url)
        try:
            seen, chain = [], GENESIS
            for step in range(3):
                plan = m.start_step(step, chain, snapshot)
                grad = torch.full((5,), float(i + 1 + step))
                loss = torch.tensor([10.0 * (i + 1)])
                m.allreduce([grad, loss])
                ok = m.commit()
                chain = plan.quorum.next_chain()
                seen.append((plan.quorum_id, plan.participants, plan.participant_index,
                             grad.tolist(), loss.item(), ok, chain))
            return seen
        finally:
            m.close()

    a, b = run_groups(group, 2)
    for step in range(3):
        qa, pa, ia, ga, la, ca, ha = a[step]
        qb, pb, ib, gb, lb, cb, hb = b[step]
        assert qa == qb and pa == pb == 2 and {ia, ib} == {0, 1}
        expected = (1 + step + 2 + step) / 2
        assert ga == gb == [expected] * 5
        assert la == lb == 15.0
        assert ca and cb
        assert ha == hb  # the same committed history
    assert len({a[s][0] for s in range(3)}) == 1  # same members stepping forward: one quorum id


def test_the_quorum_asked_for_right_after_the_vote_is_the_one_the_next_step_gets(coordinator):
    """``ask`` sends the next quorum request while the update is applied; ``start_step`` then
    waits for that answer and sends nothing: one request per step, the same quorums."""
    def group(i: int):
        m = joined(FTConfig(**FT), f"g{i}", f"inc{i}", coordinator.url)
        requests = []
        ask = m.client.quorum
        m.client.quorum = lambda *a, **k: (requests.append(
            (a[0], threading.current_thread().name.startswith("ftlm-quorum"))), ask(*a, **k))[1]
        try:
            seen, chain = [], GENESIS
            for step in range(4):
                plan = m.start_step(step, chain, snapshot)
                grad = torch.full((3,), float(i + step))
                m.allreduce([grad])
                assert m.commit()
                chain = plan.quorum.next_chain()
                m.ask(step + 1, chain)  # then the trainer applies the update
                seen.append((plan.quorum_id, plan.step, plan.participants, grad.tolist()))
            assert m.start_step(4, chain, snapshot).step == 4  # the answer to the last ask
            return seen, requests
        finally:
            m.close()

    (a, ra), (b, rb) = run_groups(group, 2)
    assert a == b and [s[1] for s in a] == [0, 1, 2, 3] and {s[2] for s in a} == {2}
    assert [s[3] for s in a] == [[(0 + 1 + 2 * step) / 2] * 3 for step in range(4)]
    for requests in (ra, rb):  # (a long poll that times out repeats a request: same thread)
        assert {step for step, helper in requests if not helper} == {0}
        assert {step for step, helper in requests if helper} == {1, 2, 3, 4}


def test_member_dying_mid_step_fails_the_step_then_survivor_continues(coordinator):
    config = FTConfig(**FT)
    survivor = joined(config, "g0", "a", coordinator.url)
    victim = joined(config, "g1", "b", coordinator.url)
    try:
        plans = run_groups(lambda i: (survivor, victim)[i].start_step(0, GENESIS, snapshot), 2)
        assert plans[0].quorum_id == plans[1].quorum_id and plans[0].participants == 2
        victim.close()  # stops heartbeating and never enters the all-reduce
        t0 = time.monotonic()
        grad = torch.ones(4)
        survivor.allreduce([grad])
        # Pushed detection: aborted by the heartbeat loss, well before the all-reduce timeout.
        assert time.monotonic() - t0 < config.allreduce_timeout
        assert survivor.commit() is False
        plan = survivor.start_step(0, GENESIS, snapshot)
        assert plan.quorum_id > plans[0].quorum_id and plan.participants == 1
        grad = torch.full((4,), 3.0)
        survivor.allreduce([grad])
        assert survivor.commit() and grad.tolist() == [3.0] * 4
    finally:
        survivor.close()


def test_consecutive_own_failures_end_the_group_with_a_clear_error(coordinator):
    config = FTConfig(**{**FT, "max_consecutive_failures": 2})
    managers = [joined(config, f"g{i}", "a", coordinator.url) for i in range(2)]

    def group(i: int) -> None:
        m = managers[i]
        for _ in range(3):  # the same members fail the same step again and again
            m.start_step(0, GENESIS, snapshot)
            m.fail_step("injected")
            assert m.commit() is False

    try:
        with pytest.raises(TooManyFailures, match="2 consecutive steps failed with the same members"):
            run_groups(group, 2)
    finally:
        for m in managers:
            m.close()


def test_failures_caused_by_a_peer_that_died_do_not_count(coordinator):
    """A crash-looping joiner must not end a healthy group."""
    config = FTConfig(**{**FT, "max_consecutive_failures": 2, "join_timeout": 0.5})
    healthy = joined(config, "g0", "a", coordinator.url)
    try:
        for attempt in range(3):
            victim = joined(config, "g1", f"v{attempt}", coordinator.url)

            def start(i: int, victim=victim):
                if i == 0:  # the healthy group asks once the joiner waits: both in one quorum
                    deadline = time.monotonic() + 10
                    while not any(m["pending"] for m in coordinator.status()["members"]
                                  if m["replica_id"] == victim.replica_id):
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
                return (healthy, victim)[i].start_step(0, GENESIS, snapshot)

            plans = run_groups(start, 2)
            assert plans[0].participants == 2
            victim.close()  # the joiner dies mid-step, every time
            healthy.allreduce([torch.ones(2)])
            assert healthy.commit() is False
            coordinator.report_dead(victim.replica_id)
        plan = healthy.start_step(0, GENESIS, snapshot)  # no TooManyFailures: the peer failed
        assert plan.participants == 1
    finally:
        healthy.close()


def test_a_group_starting_while_the_coordinator_is_down_waits_for_it():
    """Soak finding: chaos killed the coordinator while a group started; the group's first
    heartbeat raised and the healthy process exited with a traceback."""
    import socket

    from ftlm.ft.config import CoordinatorConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = Manager(FTConfig(**FT), "g0", "a", f"http://127.0.0.1:{port}")
    coordinator = None
    try:
        m.join(0, GENESIS)  # no coordinator yet: not an error
        coordinator = Coordinator(CoordinatorConfig(port=port, heartbeat_timeout=0.5))
        coordinator.start()
        plan = m.start_step(0, GENESIS, snapshot)
        assert plan.participants == 1 and plan.participating
    finally:
        m.close()
        if coordinator is not None:
            coordinator.stop()


def test_a_stop_request_ends_the_wait_for_a_quorum_at_once():
    """SIGTERM while the group waits for a quorum (here: min_replicas=2 and the other group never
    comes) ends the wait at once; waiting up to ft.quorum_timeout would outlast the grace period."""
    from ftlm.ft.manager import STOP_POLL_SECONDS
    from ftlm.ft.protocol import StopRequested

    config = FTConfig(**{**FT, "quorum_timeout": 60.0, "give_up_seconds": 120.0, "min_replicas": 2})
    coordinator = Coordinator(FTConfig(**FT, groups=2, min_replicas=2).coordinator_config())
    coordinator.start()
    m = joined(config, "g0", "a", coordinator.url)
    waiting = threading.Timer(0.3, m.request_stop)  # what the trainer's SIGTERM handler calls
    try:
        waiting.start()
        started = time.monotonic()
        with pytest.raises(StopRequested, match="asked to stop while waiting for a quorum"):
            m.start_step(0, GENESIS, snapshot)
        assert time.monotonic() - started < 0.3 + STOP_POLL_SECONDS + 5.0  # not the 60 s timeout
    finally:
        waiting.cancel()
        m.close()
        coordinator.stop()


class _Events:
    def __init__(self) -> None:
        self.kinds: list[str] = []

    def emit(self, kind: str, **fields) -> None:
        self.kinds.append(kind)


def test_a_joiner_that_replays_its_backlog_over_several_steps_pulls_the_state_once():
    """A pull that arrived used to end the recovery request at once (``fetch_finished``); a
    joiner still replaying its backlog at the next quorum then pulled the whole state a second
    time and its source copied a new snapshot for it (two ``recovery_start`` events and a 12 s
    pull of the 82M model in ``bench.ft_vs_torchft``'s rejoin case). Only the end of the replay
    (``caught_up``) or its rejection (``restart_recovery``) ends it."""
    c = Coordinator(FTConfig(**FT, groups=1).coordinator_config())
    c.start()
    replay_steps = 2
    published, g0_ahead, g1_done = [], threading.Event(), threading.Event()

    def group(i: int):
        events = _Events()
        if i == 1:
            assert g0_ahead.wait(20), "g0 did not commit its first steps"
        m = Manager(FTConfig(**FT), f"g{i}", f"inc{i}", c.url, events=events)
        if i == 0:
            publish = m.server.publish
            m.server.publish = lambda snap: (published.append(snap.step), publish(snap))[1]
        try:
            step, chain, arrived_at, participated = 0, GENESIS, None, 0
            m.join(step, chain)
            while not (g1_done.is_set() if i == 0 else participated == 2):
                plan = m.start_step(step, chain, snapshot)
                m.allreduce([torch.zeros(3) if plan.recovering else torch.ones(3)])
                assert m.commit()
                if not plan.recovering:
                    step, chain = plan.step + 1, plan.quorum.next_chain()
                    participated += 1
                    if step == 3:
                        g0_ahead.set()
                    continue
                if arrived_at is None and m.poll_recovery() is not None:
                    arrived_at = plan.step  # the trainer now replays its backlog for a while
                if arrived_at is not None and plan.step >= arrived_at + replay_steps:
                    step, chain = plan.step + 1, plan.quorum.next_chain()
                    m.caught_up(step, chain)
            g1_done.set()
            return events.kinds, arrived_at
        finally:
            m.close()

    try:
        (kinds0, _), (kinds1, arrived_at) = run_groups(group, 2, timeout=60)
    finally:
        c.stop()
    assert arrived_at is not None
    assert kinds1.count("recovery_start") == 1, kinds1
    assert len(published) == 1  # the source copied its state for this joiner once


def test_a_source_writes_the_joiners_snapshot_into_memory_it_prepared_ahead():
    """A snapshot written into new memory pays a page fault per page on the step every
    healthy group waits for. A participant prepares the next snapshot's memory while nobody
    pulls (``ftlm.ft.snapshot_reserve``), the joiner's snapshot is written into it, and once
    the joiner no longer pulls, new memory is prepared for the next one."""
    c = Coordinator(FTConfig(**FT, groups=1).coordinator_config())
    c.start()
    reserved, published = [], []
    g0_ready, g1_done = threading.Event(), threading.Event()

    def group(i: int):
        if i == 1:
            assert g0_ready.wait(20), "g0 prepared no snapshot memory"
        m = Manager(FTConfig(**FT, snapshot_reserve=True), f"g{i}", f"inc{i}", c.url)
        if i == 0:
            publish = m.server.publish
            m.server.publish = lambda snap: (published.append(snap.shared), publish(snap))[1]
        try:
            step, chain = 0, GENESIS
            m.join(step, chain)
            while not (g1_done.is_set() and (i == 1 or m.reserve.wait(10))):
                plan = m.start_step(step, chain, snapshot)
                m.allreduce([torch.zeros(3) if plan.recovering else torch.ones(3)])
                assert m.commit()
                if i == 0 and step >= 2 and not g0_ready.is_set() and m.reserve.wait(10):
                    reserved.append(m.reserve._ready.memory)  # held: its identity stays its own
                    g0_ready.set()
                if not plan.recovering:
                    step, chain = plan.step + 1, plan.quorum.next_chain()
                    if i == 1:
                        g1_done.set()
                elif m.poll_recovery() is not None:
                    step, chain = plan.step + 1, plan.quorum.next_chain()
                    m.caught_up(step, chain)
            return m.reserve._ready.memory if i == 0 else None
        finally:
            m.close()

    try:
        (again, _) = run_groups(group, 2, timeout=60)
    finally:
        c.stop()
    assert len(published) == 1 and published[0] is reserved[0]  # written into the prepared pages
    assert again is not None and again is not reserved[0]  # prepared anew after the pull


class _RecordedEvents:
    """Events a manager emits, with a wait for one of a kind."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict]] = []
        self.changed = threading.Condition()

    def emit(self, kind: str, step: int, **fields) -> dict:
        with self.changed:
            self.records.append((kind, fields))
            self.changed.notify_all()
        return fields

    def wait_for(self, kind: str, timeout: float) -> dict:
        with self.changed:
            assert self.changed.wait_for(lambda: any(k == kind for k, _ in self.records), timeout), (
                f"no {kind} event within {timeout} s: {self.records}")
            return next(f for k, f in self.records if k == kind)


OUTAGE_FT = dict(heartbeat_interval=0.05, heartbeat_timeout=0.3, allreduce_timeout=0.5,
                 quorum_timeout=1.0, give_up_seconds=60.0)


def test_a_coordinator_outage_longer_than_quorum_timeout_is_waited_out_at_a_new_address(tmp_path):
    """The coordinator goes away for 3x ``ft.quorum_timeout`` and comes back on another port,
    written to the group's address file: the group keeps its state, says why it waits, and
    gets its next quorum from the new coordinator."""
    from ftlm.ft.config import CoordinatorConfig
    from ftlm.ft.coordinator_address import write_address

    address = tmp_path / "coordinator.url"
    first = Coordinator(CoordinatorConfig(heartbeat_timeout=0.3))
    first.start()
    write_address(address, first.url)
    events = _RecordedEvents()
    m = Manager(FTConfig(**OUTAGE_FT), "g0", "a", first.url, events=events)
    m.client.address.file = address  # as FTLM_COORDINATOR_FILE would name it
    second = None
    try:
        m.join(0, GENESIS)
        plan = m.start_step(0, GENESIS, snapshot)
        assert plan.participating and m.commit()
        chain = plan.quorum.next_chain()
        first.stop()
        outage_started = time.monotonic()
        box: dict = {}
        waiting = threading.Thread(target=lambda: box.update(plan=m.start_step(1, chain, snapshot)),
                                   daemon=True)
        waiting.start()
        unreachable = events.wait_for("coordinator_unreachable", timeout=10.0)
        assert unreachable["address"] == first.url
        time.sleep(3 * OUTAGE_FT["quorum_timeout"])  # the outage itself: longer than quorum_timeout
        assert waiting.is_alive() and not box  # still waiting, not given up
        second = Coordinator(CoordinatorConfig(heartbeat_timeout=0.3))
        second.start()
        assert second.port != first.port
        write_address(address, second.url)
        waiting.join(timeout=15.0)
        assert "plan" in box, "no quorum from the coordinator at its new address"
        assert box["plan"].step == 1 and box["plan"].participating
        back = events.wait_for("coordinator_back", timeout=1.0)
        assert back["address"] == second.url
        assert 3 * OUTAGE_FT["quorum_timeout"] <= back["seconds"] <= time.monotonic() - outage_started + 0.5
    finally:
        m.close()
        first.stop()
        if second is not None:
            second.stop()


def test_a_stop_request_ends_the_wait_through_a_coordinator_outage():
    """SIGTERM during an outage: the group stops gracefully within a request's timeout."""
    from ftlm.ft.manager import STOP_POLL_SECONDS
    from ftlm.ft.protocol import StopRequested

    coordinator = Coordinator(FTConfig(**OUTAGE_FT).coordinator_config())
    coordinator.start()
    events = _RecordedEvents()
    m = Manager(FTConfig(**OUTAGE_FT), "g0", "a", coordinator.url, events=events)
    try:
        m.join(0, GENESIS)
        plan = m.start_step(0, GENESIS, snapshot)
        assert plan.participating and m.commit()
        coordinator.stop()
        box: dict = {}

        def wait() -> None:
            try:
                m.start_step(1, plan.quorum.next_chain(), snapshot)
            except StopRequested as e:
                box["stopped"] = e

        waiting = threading.Thread(target=wait, daemon=True)
        waiting.start()
        events.wait_for("coordinator_unreachable", timeout=10.0)
        asked = time.monotonic()
        m.request_stop()
        waiting.join(timeout=STOP_POLL_SECONDS + 5.0)
        assert "stopped" in box and time.monotonic() - asked < STOP_POLL_SECONDS + 5.0
    finally:
        m.close()
        coordinator.stop()


class _FlakyClient:
    """A coordinator client whose first ``down`` leaves find nobody listening."""

    def __init__(self, down: int) -> None:
        self.down = down
        self.calls: list[tuple[str, object]] = []

    def leave(self, reason: str, at: object = None) -> None:
        from ftlm.ft.client import CoordinatorUnreachable

        self.calls.append((reason, at))
        if len(self.calls) <= self.down:
            raise CoordinatorUnreachable("connection refused", time.monotonic())


def _leaver(client: _FlakyClient):
    from types import SimpleNamespace

    return SimpleNamespace(_left=False, client=client, heartbeater=None, replica_id="g0:a")


def test_a_finished_leave_is_told_again_while_the_coordinator_restarts(monkeypatch) -> None:
    """A group that finished while the coordinator was down tells it again until it answers
    (the last group at the final state would otherwise wait for it); other leaves once."""
    import ftlm.ft.manager as manager_module

    slept: list[float] = []
    monkeypatch.setattr(manager_module.time, "sleep", slept.append)
    finished = _FlakyClient(down=3)
    Manager.leave(_leaver(finished), "finished", (7, "c" * 64))
    assert finished.calls == [("finished", (7, "c" * 64))] * 4 and slept == [0.2, 0.4, 0.8]
    stopped = _FlakyClient(down=1)
    Manager.leave(_leaver(stopped), "stopped")
    assert len(stopped.calls) == 1
    never = _FlakyClient(down=10**6)  # the coordinator never comes back: it gives up
    clock = iter(range(0, 10**6, 5))
    monkeypatch.setattr(manager_module.time, "monotonic", lambda: float(next(clock)))
    Manager.leave(_leaver(never), "finished", (7, "c" * 64))
    assert 2 <= len(never.calls) <= 8
