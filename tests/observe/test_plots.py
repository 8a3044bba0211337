"""The run report's PNG plots: drawn from the events, valid images, linked from report.md."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys

from ftlm.observe.plots import (PLOT_FILES, participants_series, stall_labels, throughput_series,
                                write_plots)
from ftlm.observe.report import write_report
from ftlm.observe.summary import build_summary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _summary(events):
    return build_summary(events, wall_seconds=11.2, state_hashes={"A": "a" * 64, "B": "a" * 64, "C": "a" * 64},
                         config={"run": {"name": "chaos-1"}}, groups=["A", "B", "C"])


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", "not a PNG file"
    return struct.unpack(">II", data[16:24])


def test_report_of_a_run_with_a_failure_writes_and_links_all_four_plots(runs, tmp_path) -> None:
    events = runs.failure_run(pause=1.3)
    summary = _summary(events)
    text = write_report(tmp_path, summary, events).read_text()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(["report.md", *PLOT_FILES.values()])  # no temporary files left behind
    for name in PLOT_FILES.values():
        data = (tmp_path / name).read_bytes()
        width, height = png_size(data)
        assert (width, height) == (700, 320)
        assert len(data) > 8000, f"{name} is nearly empty ({len(data)} bytes)"
    links = re.findall(r"!\[[^\]]+\]\(([^)]+)\)", text)
    assert sorted(links) == sorted(PLOT_FILES.values())  # relative: the run dir can move
    # Each image sits in its section, and the numbers are still there.
    assert text.index("stalls.png") > text.index("## Failures and rejoins")
    assert text.index("loss.png") > text.index("## Loss")
    assert "| stalls | 2 (median 0.60 s, max 1.20 s) |" in text


def test_failure_free_run_has_no_stall_plot_and_a_report_without_plots_has_none(runs, tmp_path) -> None:
    events = runs.steady_run(30)
    written = write_plots(tmp_path / "a", _summary(events), events)
    assert sorted(written) == ["loss", "participants", "throughput"]
    text = write_report(tmp_path / "b", _summary(events), events, plots=False).read_text()
    assert "![" not in text and [p.name for p in (tmp_path / "b").iterdir()] == ["report.md"]


def test_plots_show_the_events_numbers(runs) -> None:
    events = runs.steady_run(100)  # a commit of TOKENS every 0.1 s: TOKENS / 0.1 tokens/s
    series = throughput_series(events, bins=11)  # 9 intervals of 0.1 s per 0.9 s window
    width = series[1][0] - series[0][0]
    assert sum(rate for _, rate in series) * width == runs.TOKENS * 99  # every measured token counted once
    for _, rate in series:
        assert abs(rate - runs.TOKENS / 0.1) / (runs.TOKENS / 0.1) < 0.15
    paused = throughput_series(runs.failure_run(pause=3.0), bins=30)
    assert min(rate for _, rate in paused) == 0  # the 3 s stall is a window without commits
    participants = participants_series(runs.failure_run(pause=0.1))
    assert participants[0] == (0.0, 2) and len(participants) == 100  # one point per step


def test_drawing_does_not_use_pyplot(tmp_path) -> None:
    # The report is written at the end of training runs: no global backend switch, no GUI.
    code = ("import sys, json; from ftlm.observe.plots import plot_loss; "
            "plot_loss([{'ts': 1.0, 'kind': 'commit', 'group': 'A', 'step': 0, 'samples': [0, 8], "
            "'tokens': 8, 'loss': 2.0}], __import__('pathlib').Path(sys.argv[1])); "
            "print(json.dumps('matplotlib.pyplot' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "l.png")], capture_output=True,
                         text=True, timeout=60, check=True)
    assert json.loads(out.stdout) is False
    assert png_size((tmp_path / "l.png").read_bytes()) == (700, 320)


def test_stall_bars_are_labelled_by_signal(runs) -> None:
    events = runs.steady_run(60, groups=("A", "B", "C"))
    events += [runs.event(1001.0, "failure_injected", "supervisor", -1, target="B",
                          signal="SIGSTOP", incarnation="b1"),
               runs.event(1002.0, "failure_injected", "supervisor", -1, target="C",
                          signal="SIGKILL", incarnation="c1"),
               runs.event(1003.0, "member_dead", "coordinator", -1, target="A", replica_id="A:a1")]
    labels = stall_labels(_summary(events), events)
    assert labels == ["1: hung\nB", "2: killed\nC", "3: died\nA"]
