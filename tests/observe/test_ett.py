"""ETT can never exceed 1 (docs/design.md, 'summary.json'): resumed runs, noisy runs, launcher
restarts.

ETT = tokens_committed / (wall_seconds * steady_tokens_per_second). These tests build event
records the way the trainer and the launcher write them (one ``events.jsonl`` appended to by every
incarnation) and check that the summary's own figures reproduce its ETT, which stays in [0, 1].
"""

from __future__ import annotations

import pytest

from ftlm.observe.summary import build_summary, steady_tokens_per_second


def _summary(events: list[dict], wall: float) -> dict:
    return build_summary(events, wall_seconds=wall, state_hashes={"A": "h"}, config={},
                         groups=["A"])


def _consistent(summary: dict) -> None:
    """ETT in [0, 1], and equal to what the summary's own figures give."""
    assert 0.0 <= summary["ett"] <= 1.0, summary["ett"]
    if summary["ett"] > 0:
        again = summary["tokens_committed"] / (summary["wall_seconds"]
                                               * summary["steady_tokens_per_second"])
        assert summary["ett"] == pytest.approx(again, rel=2e-3)


def _incarnation(runs, t0: float, first_step: int, n: int, dt: float) -> list[dict]:
    """One standalone trainer process: group_start, then ``n`` commits ``dt`` apart."""
    events = [runs.event(t0, "group_start", "A", first_step)]
    for k in range(n):
        step = first_step + k
        events.append(runs.commit(t0 + 0.5 + k * dt, "A", step, step * runs.BATCH,
                                  (step + 1) * runs.BATCH))
    return events


def test_resumed_run_measures_the_downtime_between_incarnations(runs) -> None:
    # The tester's case: 8 steps committed, a restart in the middle. The first incarnation ran
    # steps 0..3, the process was restarted 25 s later from the checkpoint at step 4; the
    # trainer passes the wall time of the whole record (first event to now).
    events = _incarnation(runs, 1000.0, 0, 4, dt=1.0) + _incarnation(runs, 1030.0, 4, 4, dt=1.0)
    summary = _summary(events, wall=33.65)
    _consistent(summary)
    # 8 steps of ~1 s each in 33.65 s: about a quarter of the time trained.
    assert summary["ett"] < 0.5
    assert summary["steady_tokens_per_second"] == pytest.approx(runs.TOKENS / 1.0, rel=0.01)


def test_launcher_relaunch_passes_only_its_own_wall_time(runs) -> None:
    # `ftlm launch local` run twice on one run directory: the second launcher measures only its
    # own 12 s, but the record (and its tokens) spans both launches.
    events = [runs.event(1000.0, "run_start")] + _incarnation(runs, 1001.0, 0, 10, dt=1.0)
    events += [runs.event(1012.0, "run_end"), runs.event(1100.0, "run_start")]
    events += _incarnation(runs, 1101.0, 10, 10, dt=1.0) + [runs.event(1112.0, "run_end")]
    summary = _summary(events, wall=12.0)
    _consistent(summary)
    assert summary["wall_seconds"] == pytest.approx(112.0)
    assert summary["ett"] == pytest.approx(20 / 112, rel=0.05)


def test_warm_up_faster_than_the_steady_windows_does_not_exceed_one(runs) -> None:
    # A plain run on a shared CPU: the first steps ran fast, later ones slowed down (another
    # process took a core). The steady windows then see a lower rate than the run as a whole.
    events = [runs.event(1000.0, "group_start", "A", 0)]
    ts = 1000.0
    for step in range(50):
        ts += 0.05 if step < 6 else 0.1
        events.append(runs.commit(ts, "A", step, step * runs.BATCH, (step + 1) * runs.BATCH))
    summary = _summary(events, wall=ts - 1000.0)
    _consistent(summary)
    assert summary["ett"] == pytest.approx(1.0)


def test_steady_rate_windows_are_cut_at_restarts(runs) -> None:
    # Without a cut at the second group_start, the window would span the 60 s of downtime.
    events = _incarnation(runs, 1000.0, 0, 20, dt=0.1) + _incarnation(runs, 1062.0, 20, 20,
                                                                        dt=0.1)
    summary = _summary(events, wall=64.5)
    assert summary["steady_tokens_per_second"] == pytest.approx(runs.TOKENS / 0.1, rel=1e-6)
    _consistent(summary)
    # The explicit form: restarts are cut points like failures.
    starts = [e["ts"] for e in events if e["kind"] == "group_start"]
    assert steady_tokens_per_second(events, starts, margin=0.5) == pytest.approx(
        runs.TOKENS / 0.1, rel=1e-6)


def test_too_short_runs_fall_back_to_the_rate_between_restarts(runs) -> None:
    # Two incarnations of 4 steps each: no window survives warm-up and margins, so the rate is
    # measured over each incarnation's own commits, never across the restart.
    events = _incarnation(runs, 1000.0, 0, 4, dt=0.2) + _incarnation(runs, 1030.0, 4, 4, dt=0.2)
    summary = _summary(events, wall=31.5)
    _consistent(summary)
    assert summary["steady_tokens_per_second"] == pytest.approx(runs.TOKENS / 0.2, rel=1e-6)
    assert summary["ett"] == pytest.approx(8 * runs.TOKENS / (31.5 * runs.TOKENS / 0.2),
                                           rel=1e-3)
