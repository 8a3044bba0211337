"""The per-step protocol of ``Manager`` against a real in-process coordinator, groups as threads."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ftlm.ft.config import FTConfig
from ftlm.ft.coordinator import Coordinator
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


def test_two_groups_average_gradients_and_commit(coordinator):
    def group(i: int):
        m = Manager(FTConfig(**FT), f"g{i}", f"inc{i}", coordinator.url)
        try:
            seen = []
            for step in range(3):
                plan = m.start_step(step, step * 4, snapshot)
                grad = torch.full((5,), float(i + 1 + step))
                loss = torch.tensor([10.0 * (i + 1)])
                m.allreduce([grad, loss])
                seen.append((plan.quorum_id, plan.participants, plan.participant_index,
                             grad.tolist(), loss.item(), m.commit()))
            return seen
        finally:
            m.close()

    a, b = run_groups(group, 2)
    for step in range(3):
        qa, pa, ia, ga, la, ca = a[step]
        qb, pb, ib, gb, lb, cb = b[step]
        assert qa == qb and pa == pb == 2 and {ia, ib} == {0, 1}
        expected = (1 + step + 2 + step) / 2
        assert ga == gb == [expected] * 5
        assert la == lb == 15.0
        assert ca and cb


def test_member_dying_mid_step_fails_the_step_then_survivor_continues(coordinator):
    config = FTConfig(**FT)
    survivor = Manager(config, "g0", "a", coordinator.url)
    victim = Manager(config, "g1", "b", coordinator.url)
    try:
        plans = run_groups(lambda i: (survivor, victim)[i].start_step(0, 0, snapshot), 2)
        assert plans[0].quorum_id == plans[1].quorum_id and plans[0].participants == 2
        victim.close()  # stops heartbeating and never enters the all-reduce
        t0 = time.monotonic()
        grad = torch.ones(4)
        survivor.allreduce([grad])
        # Pushed detection: aborted by the heartbeat loss, well before the all-reduce timeout.
        assert time.monotonic() - t0 < config.allreduce_timeout
        assert survivor.commit() is False
        plan = survivor.start_step(0, 0, snapshot)
        assert plan.quorum_id > plans[0].quorum_id and plan.participants == 1
        grad = torch.full((4,), 3.0)
        survivor.allreduce([grad])
        assert survivor.commit() and grad.tolist() == [3.0] * 4
    finally:
        survivor.close()


def test_consecutive_failures_end_the_group_with_a_clear_error(coordinator):
    config = FTConfig(**{**FT, "max_consecutive_failures": 2})
    survivor = Manager(config, "g0", "a", coordinator.url)
    victim = Manager(config, "g1", "b", coordinator.url)
    try:
        run_groups(lambda i: (survivor, victim)[i].start_step(0, 0, snapshot), 2)
        victim.close()
        survivor.allreduce([torch.ones(2)])
        assert survivor.commit() is False
        survivor._fail("injected")  # a second failed step in a row
        with pytest.raises(TooManyFailures, match="2 consecutive steps failed"):
            survivor.commit()
    finally:
        survivor.close()
