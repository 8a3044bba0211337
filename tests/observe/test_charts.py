"""The coordinator page's charts: bounded history from the quorums, drawn as SVG in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ftlm.ft.dashboard import DashboardLog, render_page
from ftlm.ft.quorum import Quorum
from ftlm.observe.charts import (
    BUCKET_SECONDS,
    TIMELINE_GROUPS,
    WINDOW_SECONDS,
    ChartHistory,
)
from ftlm.observe.summary import build_summary


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def run_job(history: ChartHistory, clock: Clock, steps: int, groups: list[str], step_seconds: float = 1.0,
            quorum_id: int = 1, first_step: int = 0, recovering: list[str] = ()) -> None:
    for step in range(first_step, first_step + steps):
        history.record_quorum(quorum_id, step, groups, list(recovering))
        clock.now += step_seconds


def test_points_follow_the_quorums_one_per_bucket() -> None:
    clock = Clock()
    h = ChartHistory(clock)
    run_job(h, clock, 20, ["g0:a", "g1:a", "g2:a"])
    run_job(h, clock, 10, ["g0:a", "g1:a"], quorum_id=2, first_step=20)  # g2 died
    view = h.to_json()
    points = view["points"]
    assert len(points) == 30 / BUCKET_SECONDS
    assert [p[0] for p in points] == sorted({p[0] for p in points})
    assert points[-1][1:4] == [29, 2, 0]
    assert sum(p[4] for p in points) == 1  # one group dropped out, once
    assert points[0][2] == 3 and points[-1][2] == 2


def test_timeline_shows_each_groups_states_and_is_bounded() -> None:
    clock = Clock()
    h = ChartHistory(clock)
    run_job(h, clock, 5, ["g0:a", "g1:a"])
    t_dead = clock.now
    run_job(h, clock, 5, ["g0:a"], quorum_id=2, first_step=5)
    t_back = clock.now
    run_job(h, clock, 5, ["g0:a"], quorum_id=3, first_step=10, recovering=["g1:b"])
    run_job(h, clock, 5, ["g0:a", "g1:b"], quorum_id=4, first_step=15)
    timeline = h.to_json()["timeline"]
    assert [s[1] for s in timeline["g1"]] == ["participating", "absent", "recovering", "participating"]
    assert [s[0] for s in timeline["g1"]][1:3] == [t_dead, t_back]
    assert [s[1] for s in timeline["g0"]] == ["participating"]
    clock.now += WINDOW_SECONDS + 10  # old segments leave the window with the next change
    run_job(h, clock, 1, ["g0:a"], quorum_id=5, first_step=20)
    assert len(h.timeline["g1"]) == 2 and h.timeline["g1"][-1][1] == "absent"
    many = [f"g{i}:a" for i in range(TIMELINE_GROUPS + 1)]
    run_job(h, clock, 1, many, quorum_id=6, first_step=21)
    assert h.to_json()["timeline"] == {}  # too many to draw: counts only
    assert h.to_json()["points"][-1][2] == TIMELINE_GROUPS + 1


def test_ett_estimate_is_the_summary_ett_of_the_quorum_record() -> None:
    clock = Clock()
    h = ChartHistory(clock)
    started = clock.now
    assert h.to_json()["ett"] is None
    run_job(h, clock, 30, ["g0:a", "g1:a"])
    steady = h.ett.value()
    assert steady == pytest.approx(1.0, abs=0.05)
    clock.now += 20.0  # a 20 s stall: the coordinator issues nothing
    run_job(h, clock, 30, ["g0:a"], quorum_id=2, first_step=30)
    records = [dict(e) for e in h.ett._events]
    clock.now += 5.1  # past the cache
    expected = build_summary(records, wall_seconds=clock.now - started, state_hashes={}, config={},
                             groups=["g0"])["ett"]
    assert h.to_json()["ett"] == pytest.approx(expected, abs=1e-3)
    assert expected < 0.8


def _quorum(qid: int, step: int, participants: list[str], recovering: list[str] = ()) -> Quorum:
    return Quorum(qid, step, [], participants, list(recovering), {r: participants[0] for r in recovering}, 0.0,
                  "all asked")


def page_status(log: DashboardLog) -> dict:
    """A /status as the coordinator serves it, around the dashboard log's part."""
    return {"quorum_id": 3, "reason": "all asked", "head_step": 40, "members": [], "members_total": 0,
            "next_offset": None, "last_quorum": None, "dead": [], "dead_total": 0, "min_replicas": 1,
            "convicted": [{"group": "g2", "times": 1}], "hot_path": "compiled (mypyc)", **log.to_json()}


def test_the_coordinator_status_carries_the_charts() -> None:
    log = DashboardLog()
    import time
    now = time.time()
    for step in range(40):
        log.quorum_issued(_quorum(1 if step < 20 else 2, step, ["g0:a", "g1:a"] if step < 20 else ["g0:a"]),
                          unix=now - 40 + step)
    charts = page_status(log)["charts"]
    assert charts["points"] and charts["points"][-1][1] == 39
    assert set(charts["timeline"]) == {"g0", "g1"}
    assert len(json.dumps(charts)) < 64_000  # small enough to poll every 2 s


def test_page_draws_the_charts_in_headless_chromium(tmp_path: Path) -> None:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("chromium not installed (Debian package 'chromium'; `make system-deps` installs it)")
    import time
    log = DashboardLog()
    now = time.time()
    for step in range(120):  # 2 minutes: g2 dies at step 40 and comes back recovering at 70
        members = ["g0:a", "g1:a", "g2:a"] if step < 40 or step >= 90 else ["g0:a", "g1:a"]
        recovering = ["g2:b"] if 70 <= step < 90 else []
        qid = 1 if step < 40 else 2 if step < 70 else 3 if step < 90 else 4
        log.quorum_issued(_quorum(qid, step, members, recovering), unix=now - 120 + step)
    page = tmp_path / "page.html"
    page.write_text(render_page(page_status(log)))  # the first paint needs no request
    out = subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update",
                          "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
                          "--virtual-time-budget=3000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    dom = out.stdout
    titles = re.findall(r'<svg[^>]*data-title="([^"]+)"', dom)
    assert titles == ["quorum size", "committed steps / min", "groups dropped from the quorum", "states"], titles
    polylines = re.findall(r'<polyline points="([^"]+)"', dom)
    assert len(polylines) == 3 and all(len(p.split()) >= 40 for p in polylines)  # participants, recovering, rate
    assert "NaN" not in dom
    assert "hot path compiled (mypyc)" in dom and "<li>g2: 1 time</li>" in dom
    states = re.findall(r'data-group="(g\d)" data-state="(\w+)"', dom)
    assert [s for g, s in states if g == "g2"] == ["participating", "absent", "recovering", "participating"]
    assert re.search(r"live ETT \(coordinator's estimate from its quorums\): \d+\.\d%", dom)
    # No asset is loaded from anywhere: everything is inline.
    assert not re.search(r'<(script|link|img)[^>]+(src|href)=', dom)
