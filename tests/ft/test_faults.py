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
