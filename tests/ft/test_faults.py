"""Fault schedules: the ``FTLM_FAULT`` points of one process (chaos drills, fault tests)."""

from __future__ import annotations

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
