"""Where a run's time without progress went: commit-gap stalls per failure, and the start-up,
the longest gap between commits and the end of the run reported apart; failures nobody injected
listed with their reason."""

from __future__ import annotations

import pytest

from ftlm.observe.report import format_summary, write_report
from ftlm.observe.summary import build_summary, median_step_seconds, stall_seconds

GROUPS = ["A", "B", "C"]


def _summary(events, groups=GROUPS):
    hashes = {g: "a" * 64 for g in groups}
    return build_summary(events, wall_seconds=1.0, state_hashes=hashes, config={}, groups=groups)


def test_rejoin_20_s_after_the_last_commit_of_a_finished_job_is_no_stall(runs):
    """The demo's "max stall 32.93 s": C was killed, the others committed to the last step, and
    C rejoined 20 s after the last commit, when nothing was left to wait for."""
    events = runs.steady_run(50, groups=("A", "B", "C"), stop={"C": 31})
    last = max(e["ts"] for e in events)
    events += [runs.event(1003.02, "failure_injected", "supervisor", -1, target="C",
                          signal="SIGKILL"),
               runs.event(last + 20.0, "recovery_start", "C", 49, source="A"),
               runs.event(last + 22.0, "run_end", "", -1)]
    assert stall_seconds(events, median_step_seconds(events)) == [0.0, 0.0]
    summary = _summary(events)
    assert summary["stall_seconds"] == [0.0, 0.0]
    assert summary["timeline"]["end_seconds"] == pytest.approx(22.0, abs=1e-3)
    assert summary["timeline"]["max_commit_gap_seconds"] == pytest.approx(0.1, abs=1e-3)


def test_start_up_longest_commit_gap_and_end_are_reported_apart(runs):
    """A rank hung at start for 34 s, one 5.2 s gap between commits, 109 s waiting at the end."""
    events = [runs.event(966.0, "run_start", "", -1, groups=2)]
    events += runs.steady_run(40, groups=("A", "B"), pause_after=20, pause=5.2)
    last = max(e["ts"] for e in events)
    events.append(runs.event(last + 109.0, "run_end", "", -1))
    timeline = _summary(events, ["A", "B"])["timeline"]
    assert timeline == {"startup_seconds": pytest.approx(34.0, abs=1e-3),
                        "max_commit_gap_seconds": pytest.approx(5.2, abs=1e-3),
                        "max_commit_gap_step": 21,
                        "end_seconds": pytest.approx(109.0, abs=1e-3)}


def test_a_relaunch_is_a_start_up_not_a_gap_between_commits(runs):
    """A resumed record: the downtime between two launches and the relaunch's start-up are no
    gap of a running job."""
    first = runs.steady_run(10, groups=("A",))
    second = [dict(e, ts=e["ts"] + 500.0, step=e["step"] + 10,
                   samples=[s + 10 * runs.BATCH for s in e["samples"]]) for e in first]
    events = [runs.event(998.0, "run_start", "", -1), *first, runs.event(1001.0, "run_end", "", -1),
              runs.event(1492.0, "run_start", "", -1), *second]
    timeline = _summary(events, ["A"])["timeline"]
    assert timeline["startup_seconds"] == pytest.approx(8.0, abs=1e-3)  # the longer of 2 and 8
    assert timeline["max_commit_gap_seconds"] == pytest.approx(0.1, abs=1e-3)
    assert timeline["end_seconds"] == 0.0


def test_report_and_console_headline_show_start_up_longest_gap_and_end(runs, tmp_path):
    events = [runs.event(966.0, "run_start", "", -1, groups=2)]
    events += runs.steady_run(40, groups=("A", "B"), pause_after=20, pause=5.2)
    last = max(e["ts"] for e in events)
    events.append(runs.event(last + 109.0, "run_end", "", -1))
    summary = _summary(events, ["A", "B"])
    text = write_report(tmp_path, summary, events, plots=False).read_text()
    assert "| start-up | 34.00 s (to the first commit) |" in text
    assert "| longest gap between commits | 5.20 s (before step 21) |" in text
    assert "| end | 109.00 s (from the last commit) |" in text
    console = format_summary(summary)
    assert ("start-up 34.00 s, longest gap between commits 5.20 s (before step 21), "
            "end 109.00 s after the last commit") in console


def test_failures_nobody_injected_are_listed_with_their_reason(runs, tmp_path):
    """11 / 16 at load 11: a start-up timeout killed groups that were only slow; the report says
    what the two numbers are and why the extra 5 were detected."""
    events = runs.steady_run(20, groups=("A", "B", "C"))
    events += [runs.event(1000.5, "failure_injected", "supervisor", -1, target="A",
                          signal="SIGKILL", incarnation="a1"),
               runs.event(1000.6, "group_exit", "supervisor", -1, target="A", incarnation="a1",
                          ok=False, code=-9, cause="chaos"),
               runs.event(1001.0, "member_killed", "supervisor", -1, target="B", incarnation="b2",
                          reason="start-up timeout", stopped=False),
               runs.event(1001.1, "group_exit", "supervisor", -1, target="B", incarnation="b2",
                          ok=False, code=-9, cause="hung"),
               runs.event(1001.5, "group_exit", "supervisor", -1, target="C", incarnation="c1",
                          ok=False, code=1, cause="crash")]
    summary = _summary(events)
    assert (summary["failures_injected"], summary["failures_detected"],
            summary["failures_unexplained"]) == (1, 3, 2)
    assert [(u["group"], u["detected_by"], u["reason"]) for u in summary["unexplained_failures"]] \
        == [("B", "member_killed", "start-up timeout"), ("C", "group_exit", "crash, exit status 1")]
    assert summary["unexplained_failures"][0]["t"] == pytest.approx(1.0, abs=1e-3)
    text = write_report(tmp_path, summary, events, plots=False).read_text()
    assert ("| failures injected / detected | 1 / 3 (2 of the 3 detected were not injected: "
            "see Unexplained failures) |") in text
    assert "## Unexplained failures" in text
    assert "| 1.00 | B | member_killed | start-up timeout |" in text
    assert "| 1.50 | C | group_exit | crash, exit status 1 |" in text
    console = format_summary(summary)
    assert "1 injected, 3 detected (2 not injected)" in console
    assert ("WARNING: 2 detected failure(s) nobody injected: B at 1.00 s (member_killed: "
            "start-up timeout), C at 1.50 s (group_exit: crash, exit status 1)") in console
