"""Fault schedules: the ``FTLM_FAULT`` points of one process (chaos drills, fault tests)."""

from __future__ import annotations

import os
import signal

import pytest

from ftlm.errors import ConfigError
from ftlm.ft.faults import FaultSchedule


def test_several_points_fire_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    schedule = FaultSchedule.parse("slow_serve, hang:during_serve@7")
    assert schedule is not None and schedule.points == {"slow_serve", "during_serve"}
    assert [(p.point, p.step, p.hang) for p in schedule.plans] == [("slow_serve", None, False),
                                                                   ("during_serve", 7, True)]
    monkeypatch.setenv("FTLM_FAULT_SECONDS", "0")  # a slow link of no length: fires, does not block
    fired: list[tuple] = []
    emit = lambda kind, **f: fired.append((kind, f["point"]))  # noqa: E731
    for step in (3, 4):
        schedule.maybe_fire("slow_serve", step, emit)
        schedule.maybe_fire("during_serve", step, emit)  # not its step: the SIGSTOP is not sent
    assert fired == [("failure_injected", "slow_serve")]  # once, however often reached
    assert not schedule.plans[1].fired
    assert FaultSchedule.parse("") is None and FaultSchedule.parse(" , ") is None


def test_a_bad_point_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="unknown point 'meteor'.*before_commit"):
        FaultSchedule.parse("before_commit@3,meteor")


def test_term_sends_this_process_sigterm_once_and_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    schedule = FaultSchedule.parse("term:before_commit@5")
    assert schedule is not None and [(p.point, p.step, p.term, p.hang) for p in schedule.plans] == [
        ("before_commit", 5, True, False)]
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr("ftlm.ft.faults.os.kill", lambda pid, sig: sent.append((pid, sig)))
    fired: list[str] = []
    for step in (4, 5, 5):
        schedule.maybe_fire("before_commit", step, lambda kind, **f: fired.append(kind))
    assert sent == [(os.getpid(), signal.SIGTERM)] and fired == []  # a stop request, not a failure
    with pytest.raises(ConfigError, match="slow_serve is a slow link"):
        FaultSchedule.parse("term:slow_serve")


def test_nonfinite_conditions_hold_every_attempt_they_cover_and_kill_nothing(monkeypatch) -> None:
    monkeypatch.setattr("ftlm.ft.faults.os.kill", lambda pid, sig: pytest.fail("a condition sent a signal"))
    device = FaultSchedule.parse("nonfinite@5")
    assert [device.nonfinite(step, 0, 4) for step in (3, 4, 5, 5, 6, 90)] == [False] * 2 + [True] * 4
    assert FaultSchedule.parse("nonfinite").nonfinite(0, 0, 4)  # every step
    data = FaultSchedule.parse("nonfinite_sample@29")
    assert [data.nonfinite(3, a, a + 4) for a in (24, 25, 26, 29, 30)] == [False, False, True, True, False]
    device.maybe_fire("before_commit", 6, lambda *a, **k: pytest.fail("a condition fired"))
    recorded: list[tuple] = []
    emit = lambda kind, **f: recorded.append((kind, f["step"], f["point"], f["how"]))  # noqa: E731
    again = FaultSchedule.parse("nonfinite@5,nonfinite_sample@29")
    for step, start in ((5, 0), (6, 4), (7, 28)):
        assert again.nonfinite(step, start, start + 4, emit)
    assert recorded == [("failure_injected", 5, "nonfinite", "nonfinite")]  # once; data is no failure


@pytest.mark.parametrize("text, why", [("hang:nonfinite@3", "no 'hang:' or 'term:'"),
                                       ("term:nonfinite", "no 'hang:' or 'term:'"),
                                       ("nonfinite_sample", "needs '@POSITION'"),
                                       ("nonfinite@x", "must be an integer")])
def test_a_misused_nonfinite_condition_says_how_to_write_it(text, why) -> None:
    with pytest.raises(ConfigError, match=why):
        FaultSchedule.parse(text)


def test_allreduce_fails_holds_from_its_step_on(monkeypatch) -> None:
    monkeypatch.setattr("ftlm.ft.faults.os.kill", lambda pid, sig: pytest.fail("a condition sent a signal"))
    link = FaultSchedule.parse("allreduce_fails@12")
    assert [link.allreduce_fails(s) for s in (11, 12, 12, 40)] == [False, True, True, True]
    assert not link.nonfinite(40, 0, 4)
    with pytest.raises(ConfigError, match="no 'hang:' or 'term:'"):
        FaultSchedule.parse("term:allreduce_fails@3")


def test_a_point_at_a_step_or_later_fires_the_first_time_it_is_reached_from_that_step_on(monkeypatch) -> None:
    """``before_allreduce@10+``: a group that started late recovered through step 10 (it never
    reached the point at step 10) and is killed at the first step after it where it does;
    ``@10`` alone would never fire there."""
    sent: list[int] = []
    monkeypatch.setattr("ftlm.ft.faults.os.kill", lambda pid, sig: sent.append(sig))
    schedule = FaultSchedule.parse("before_allreduce@10+,hang:before_commit@3+")
    assert [(p.point, p.step, p.or_later, p.hang) for p in schedule.plans] == [
        ("before_allreduce", 10, True, False), ("before_commit", 3, True, True)]
    fired: list[tuple] = []
    emit = lambda kind, **f: fired.append((f["point"], f["step"]))  # noqa: E731
    for step in (0, 9, 57, 58):  # recovering at 0 (its committed step), then caught up at 57
        schedule.maybe_fire("before_allreduce", step, emit)
    assert fired == [("before_allreduce", 57)] and sent == [signal.SIGKILL]
    schedule.maybe_fire("before_commit", 3, emit)  # the step itself still counts
    assert fired[-1] == ("before_commit", 3) and sent[-1] == signal.SIGSTOP
    exact = FaultSchedule.parse("before_allreduce@10")
    exact.maybe_fire("before_allreduce", 57, emit)
    assert not exact.plans[0].fired


@pytest.mark.parametrize("text, why", [("before_allreduce@+", "must be an integer"),
                                       ("nonfinite@5+", "condition, not a moment: no '\\+'"),
                                       ("allreduce_fails@5+", "condition, not a moment: no '\\+'")])
def test_a_misplaced_or_later_says_why(text, why) -> None:
    with pytest.raises(ConfigError, match=why):
        FaultSchedule.parse(text)
