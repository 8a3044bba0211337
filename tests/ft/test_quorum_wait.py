"""The wait for a quorum as a pure state machine with a hand-driven clock: what counts against
``ft.quorum_timeout`` (answers without a quorum) and what does not (an outage)."""

from __future__ import annotations

from ftlm.ft.quorum_wait import PROGRESS_EVERY, QuorumWait


def test_answers_without_a_quorum_give_up_after_quorum_timeout() -> None:
    wait = QuorumWait(quorum_timeout=3.0, outage_timeout=0.0, started=100.0)
    assert wait.give_up(102.9) is None
    assert wait.remaining(102.0) == 1.0
    assert "ft.quorum_timeout=3" in wait.give_up(103.0)


def test_an_outage_longer_than_quorum_timeout_does_not_give_up_by_default() -> None:
    wait = QuorumWait(quorum_timeout=3.0, outage_timeout=0.0, started=0.0)
    assert wait.unreachable(sent_at=1.0, now=4.0)  # the request of t=1 timed out at t=4
    assert not wait.unreachable(sent_at=4.5, now=4.5)  # the same outage
    for now in (10.0, 100.0, 10_000.0):
        assert wait.give_up(now) is None
        assert wait.remaining(now) == 3.0  # an outage uses none of quorum_timeout
    assert wait.outage_seconds(10_000.0) == 9_999.0


def test_the_coordinators_return_starts_quorum_timeout_afresh() -> None:
    wait = QuorumWait(quorum_timeout=3.0, outage_timeout=0.0, started=0.0)
    wait.unreachable(sent_at=2.5, now=2.6)  # 2.5 s of the budget were used before the outage
    assert wait.answered(40.0) == 37.5  # the outage's length, from the first unanswered request
    assert wait.answered(40.1) is None  # no outage in progress any more
    assert wait.give_up(42.9) is None
    assert wait.give_up(43.0) is not None


def test_coordinator_outage_timeout_bounds_one_outage() -> None:
    wait = QuorumWait(quorum_timeout=3.0, outage_timeout=30.0, started=0.0)
    wait.unreachable(sent_at=1.0, now=1.0)
    assert wait.give_up(30.9) is None
    assert "ft.coordinator_outage_timeout=30" in wait.give_up(31.0)


def test_an_outage_is_reported_at_its_start_then_every_progress_interval() -> None:
    wait = QuorumWait(quorum_timeout=3.0, outage_timeout=0.0, started=0.0)
    assert not wait.report_due(50.0)  # no outage: nothing to say
    wait.unreachable(sent_at=1.0, now=2.0)  # reported by the caller at its start
    due = [t for t in range(2, 40) if wait.report_due(float(t))]
    assert due == [2 + PROGRESS_EVERY, 2 + 2 * PROGRESS_EVERY, 2 + 3 * PROGRESS_EVERY]
