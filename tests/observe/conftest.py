"""Synthetic runs for the observe tests: event dicts shaped like the ones groups emit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

BATCH = 8
TOKENS = 8 * 128


def event(ts: float, kind: str, group: str = "", step: int = -1, **fields) -> dict:
    return {"ts": ts, "kind": kind, "group": group, "rank": 0, "step": step, **fields}


def commit(ts: float, group: str, step: int, start: int, end: int, *, tokens: int = TOKENS,
           loss: float | None = 3.0, participants: int = 2) -> dict:
    return event(ts, "commit", group, step, quorum_id=1, participants=participants,
                 samples=[start, end], loss=loss, tokens=tokens, lr=1e-3, step_seconds=0.1)


def steady_run(n_steps: int, *, dt: float = 0.1, groups=("A", "B"), t0: float = 1000.0,
               pause_after: int | None = None, pause: float = 0.0,
               stop: dict[str, int] | None = None) -> list[dict]:
    """Every group commits step k at the same moment, ``dt`` apart; after step ``pause_after``
    the next commit comes ``pause`` seconds later instead of ``dt``; ``stop[g] = k`` makes group
    ``g`` commit only steps below k. Loss falls from 5 by 0.01 per step."""
    stop = stop or {}
    events, ts = [], t0
    for step in range(n_steps):
        if step > 0:
            ts += pause if pause_after is not None and step == pause_after + 1 else dt
        for g in groups:
            if step < stop.get(g, n_steps):
                events.append(commit(ts, g, step, step * BATCH, (step + 1) * BATCH,
                                     loss=5.0 - 0.01 * step))
    return events


def failure_run(pause: float) -> list[dict]:
    """A, B, C commit every 0.1 s from t=1000; C is killed just after step 40 and commits no
    more; the healthy groups wait ``pause`` s between steps 40 and 41 (0.1 s: no stall); the
    coordinator reports C dead twice; C rejoins and recovers later."""
    events = steady_run(100, groups=("A", "B", "C"), pause_after=40, pause=pause, stop={"C": 41})
    t_fail = 1000.0 + 40 * 0.1 + 0.02
    events += [event(t_fail, "failure_injected", "", -1, target="C", how="SIGKILL"),
               event(t_fail + 1.0, "member_dead", "coordinator", -1, target="C:1f2e"),
               event(t_fail + 1.05, "member_dead", "coordinator", -1, target="C:1f2e"),
               event(t_fail + 3.0, "recovery_start", "C", 70, source="A"),
               event(t_fail + 4.0, "recovery_end", "C", 70, source="A", ok=True, seconds=1.0)]
    return events


@pytest.fixture
def runs() -> SimpleNamespace:
    """The synthetic-run builders above (test modules cannot import conftest under
    --import-mode=importlib)."""
    return SimpleNamespace(event=event, commit=commit, steady_run=steady_run,
                           failure_run=failure_run, BATCH=BATCH, TOKENS=TOKENS)
