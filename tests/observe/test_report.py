"""report.md and the console summary show the numbers summary.json holds."""

from __future__ import annotations

import re

from ftlm.observe.report import format_summary, write_report
from ftlm.observe.summary import build_summary


def _summary(events, identical=True):
    hashes = {"A": "a" * 64, "B": "a" * 64, "C": ("a" if identical else "b") * 64}
    return build_summary(events, wall_seconds=11.2, state_hashes=hashes,
                         config={"run": {"name": "chaos-1"}}, groups=["A", "B", "C"])


def test_report_has_headline_numbers_group_table_and_sampled_loss(runs, tmp_path):
    events = runs.failure_run(pause=1.3)
    summary = _summary(events)
    path = write_report(tmp_path, summary, events)
    assert path == tmp_path / "report.md"
    text = path.read_text()
    assert "chaos-1" in text
    assert "| steps committed | 100 (0 failed) |" in text
    assert f"| tokens committed | {100 * runs.TOKENS:,} |" in text
    assert "| wall time | 11.20 s |" in text
    assert f"| ETT | {summary['ett']:.1%} |" in text
    assert "| failures injected / detected | 1 / 1 |" in text
    assert "| recoveries | 1 |" in text
    assert "| stalls | 2 (median 0.60 s, max 1.20 s) |" in text
    assert "| final loss | 4.0100 |" in text
    assert "| replicas identical | yes |" in text
    assert "| duplicates / gaps | 0 / 0 |" in text
    # Per group: A and B committed all 100 steps; C committed the first 41, was killed once,
    # detected dead once and recovered once.
    assert re.search(r"\| A \| 100 \| 0 \| 0 \| 0 \| 0 \| a{12} \|", text)
    assert re.search(r"\| C \| 41 \| 0 \| 1 \| 1 \| 1 \| a{12} \|", text)
    # Loss table: ~20 rows, first and last step included.
    loss_section = text.split("## Loss")[1]
    rows = [line for line in loss_section.splitlines() if re.match(r"\| \d+ \|", line)]
    assert 15 <= len(rows) <= 20
    assert rows[0].startswith("| 0 | 5.0000 |") and rows[-1].startswith("| 99 | 4.0100 |")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["report.md", "loss.png", "tokens_per_second.png", "participants.png", "stalls.png"])


def test_report_flags_diverged_replicas_and_data_problems(runs, tmp_path):
    events = [runs.commit(1.0, "A", 0, 0, 8), runs.commit(1.1, "A", 1, 4, 12)]
    summary = _summary(events, identical=False)
    text = write_report(tmp_path, summary, events).read_text()
    assert "| replicas identical | NO |" in text
    assert "| duplicates / gaps | 4 / 0 |" in text
    assert "No failures or rejoins." in text


def test_format_summary_is_a_few_lines_with_the_headline(runs):
    summary = _summary(runs.failure_run(pause=1.3))
    text = format_summary(summary)
    assert len(text.splitlines()) == 4
    assert "100 steps committed (0 failed)" in text
    assert f"ETT {summary['ett']:.1%}" in text
    assert "1 injected, 1 detected, 1 recoveries" in text
    assert "stalls 2 (median 0.60 s, max 1.20 s)" in text
    assert "replicas identical: yes" in text and "0 duplicates, 0 gaps" in text


def test_format_summary_warns_about_inconsistent_steps(runs):
    events = [runs.commit(1.0, "A", 0, 0, 8), runs.commit(1.0, "B", 0, 0, 9)]
    text = format_summary(_summary(events))
    assert "WARNING" in text and "[0]" in text


def test_single_group_run_says_single_group_not_identical_replicas(runs, tmp_path):
    events = runs.steady_run(5, groups=("A",))
    summary = build_summary(events, wall_seconds=1.0, state_hashes={"A": "a" * 64},
                            config={"run": {"name": "one"}}, groups=["A"])
    assert "replicas identical: single group;" in format_summary(summary)
    assert "hashes" not in format_summary(summary)
    text = write_report(tmp_path, summary, events, plots=False).read_text()
    assert "| replicas identical | single group |" in text


def test_report_shows_rollbacks_undetected_failures_and_problems(runs, tmp_path):
    events = runs.steady_run(10, groups=("A", "B"))
    events += [runs.event(1000.45, "failure_injected", "supervisor", -1, target="B",
                          signal="SIGSTOP", incarnation="b1"),
               runs.event(1000.95, "restore", "coordinator", -1, from_step=10, to_step=8,
                          reason="test", source="live"),
               runs.commit(1001.0, "A", 8, 64, 72), runs.commit(1001.1, "A", 9, 72, 80)]
    summary = build_summary(events, wall_seconds=1.0, state_hashes={"A": "a" * 64},
                            config={"train": {"steps": 10}}, groups=["A", "B"])
    text = write_report(tmp_path, summary, events, plots=False).read_text()
    assert "| failures injected / detected | 1 / 0 (1 injected never detected) |" in text
    assert "| rollbacks | 1 (2 committed steps superseded) |" in text
    assert "| PROBLEM | no final state from B (it did not finish) |" in text
    console = format_summary(summary)
    assert "1 rollback(s), 2 steps superseded" in console
    assert "WARNING: 1 injected failure(s) were never detected" in console


def test_report_shows_gpu_hours_by_state_and_cost_when_priced(runs, tmp_path):
    events = runs.failure_run(2.0)
    summary = build_summary(events, wall_seconds=1.0, state_hashes={},
                            config={"cost": {"spot_per_gpu_hour": 2.5}}, groups=["A", "B", "C"])
    text = write_report(tmp_path, summary, events, plots=False).read_text()
    assert "## GPU-hours" in text
    for state in ("training", "stalled", "recovering", "starting", "idle", "total"):
        assert re.search(rf"^\| {state} \| [0-9.e-]+ \| ", text, re.M), state
    assert "| spot | 2.5 USD |" in text
    assert "on-demand" not in text  # no on-demand price set


def test_failed_checkpoint_saves_are_counted_and_flagged(runs, tmp_path):
    """Training goes on when a durable checkpoint fails (a full disk): the end of the run says
    so, on the console and in report.md, from the ``checkpoint_failed`` events."""
    events = runs.steady_run(5, groups=("A",))
    assert _summary(events)["checkpoints_failed"] == 0
    assert "checkpoint" not in format_summary(_summary(events))
    events.append({"ts": events[-1]["ts"], "kind": "checkpoint_failed", "group": "A", "step": 4,
                   "error": "writing checkpoint step-00000004 failed: No space left on device"})
    summary = _summary(events)
    assert summary["checkpoints_failed"] == 1
    assert "WARNING: 1 durable checkpoint save(s) failed" in format_summary(summary)
    text = write_report(tmp_path, summary, events, plots=False).read_text()
    assert "| checkpoint saves failed | 1 (see the checkpoint_failed events) |" in text
