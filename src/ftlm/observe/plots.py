"""PNG plots of a recorded run, drawn from its events with matplotlib, for ``report.md``.

Responsible for: turning the events (and the summary's stall list) into four figures: loss vs
step, tokens/s over time, participants over time with failure and recovery marks, and the stall of
each failure. Uses matplotlib's object API with the Agg canvas, never pyplot, so it changes no
global backend state and is safe in any thread or headless process.

Not responsible for: computing metrics (``ftlm.observe.summary`` does; a plot shows its numbers),
or the Markdown around the images (``ftlm.observe.report``).
"""

from __future__ import annotations

import os
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ftlm.observe.summary import commit_steps, failure_events

PLOT_FILES = {
    "loss": "loss.png",
    "throughput": "tokens_per_second.png",
    "participants": "participants.png",
    "stalls": "stalls.png",
}
"""Plot name -> file name next to report.md."""
THROUGHPUT_BINS = 60
"""Tokens/s is averaged over about this many equal time windows of the run."""
_SIZE = (7.0, 3.2)
_DPI = 100
_FAILURE_COLOR, _RECOVERY_COLOR = "tab:red", "tab:green"


def _figure() -> tuple[Figure, object]:
    fig = Figure(figsize=_SIZE, dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig: Figure, path: Path) -> Path:
    # Write then rename, so a reader never sees half a PNG (same as report.md).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, format="png", metadata={"Software": None})
    os.replace(tmp, path)
    return path


def plot_loss(events: list[dict], path: Path) -> Path | None:
    """Mean committed loss per step; None (no file) when no step has a finite loss."""
    points = [(s.step, s.loss) for s in commit_steps(events) if s.loss is not None]
    if not points:
        return None
    fig, ax = _figure()
    ax.plot([p[0] for p in points], [p[1] for p in points], color="tab:blue", linewidth=1.2)
    ax.set(title="Loss", xlabel="step", ylabel="loss")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def throughput_series(events: list[dict], bins: int = THROUGHPUT_BINS) -> list[tuple[float, float]]:
    """(window midpoint in seconds since the first event, committed tokens/s in the window)."""
    steps = commit_steps(events)
    if len(steps) < 2:
        return []
    t0 = min(e["ts"] for e in events)
    first, last = steps[0].ts, steps[-1].ts
    width = max((last - first) / bins, 1e-9)
    totals = [0.0] * bins
    for s in steps[1:]:  # the first commit closes no interval: its time is not measured
        totals[min(int((s.ts - first) / width), bins - 1)] += s.tokens
    return [(first - t0 + (i + 0.5) * width, total / width) for i, total in enumerate(totals)]


def _mark_failures(ax: object, events: list[dict], t0: float) -> None:
    """Vertical lines: red at each failure, green dashed at each rejoin (``recovery_start``) and
    green dotted where a recovery completed; one legend entry per kind of line."""
    marks = [(f.ts, "failure" if f.kind != "recovery_start" else "rejoin") for f in failure_events(events)]
    marks += [(e["ts"], "recovered") for e in events if e["kind"] == "recovery_end" and e.get("ok") is True]
    style = {"failure": (_FAILURE_COLOR, "--"), "rejoin": (_RECOVERY_COLOR, "--"),
             "recovered": (_RECOVERY_COLOR, ":")}
    labelled: set[str] = set()
    for ts, kind in sorted(marks):
        color, line = style[kind]
        ax.axvline(ts - t0, color=color, linestyle=line, linewidth=1, label=None if kind in labelled else kind)
        labelled.add(kind)
    if labelled:
        ax.legend(loc="lower left", fontsize=8)


def plot_throughput(events: list[dict], path: Path) -> Path | None:
    series = throughput_series(events)
    if not series:
        return None
    fig, ax = _figure()
    ax.plot([p[0] for p in series], [p[1] for p in series], color="tab:purple", linewidth=1.2)
    _mark_failures(ax, events, min(e["ts"] for e in events))
    ax.set(title="Committed tokens per second", xlabel="time (s)", ylabel="tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def participants_series(events: list[dict]) -> list[tuple[float, int]]:
    """(seconds since the first event, participants) at each committed step."""
    commits = sorted((e for e in events if e["kind"] == "commit"), key=lambda e: e["ts"])
    if not commits:
        return []
    t0 = min(e["ts"] for e in events)
    seen: dict[int, tuple[float, int]] = {}
    for e in commits:
        n = e.get("participants")
        if isinstance(n, int) and not isinstance(n, bool) and e["step"] not in seen:
            seen[e["step"]] = (e["ts"] - t0, n)
    return sorted(seen.values())


def plot_participants(events: list[dict], path: Path) -> Path | None:
    series = participants_series(events)
    if not series:
        return None
    fig, ax = _figure()
    ax.step([p[0] for p in series], [p[1] for p in series], where="post", color="tab:blue", linewidth=1.5)
    _mark_failures(ax, events, min(e["ts"] for e in events))
    ax.set(title="Participating replica groups", xlabel="time (s)", ylabel="groups")
    ax.set_ylim(0, max(p[1] for p in series) + 1)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def stall_labels(summary: dict, events: list[dict]) -> list[str]:
    """The x labels of the stall plot: number, what happened (``killed`` for SIGKILL, ``hung``
    for SIGSTOP, ``died`` / ``exited`` for a failure nobody injected, ``rejoin``...) and group."""
    fails = failure_events(events)
    return [f"{i + 1}: {fails[i].how or fails[i].kind}\n{fails[i].group or '-'}"
            if i < len(fails) else str(i + 1)
            for i in range(len(summary.get("stall_seconds") or []))]


def plot_stalls(summary: dict, events: list[dict], path: Path) -> Path | None:
    """One bar per failure or rejoin (summary's ``stall_seconds``); None when there was none."""
    stalls = list(summary.get("stall_seconds") or [])
    if not stalls:
        return None
    labels = stall_labels(summary, events)
    fig, ax = _figure()
    ax.bar(range(len(stalls)), stalls, color="tab:orange")
    ax.set_xticks(range(len(stalls)), labels, fontsize=7 if len(stalls) > 8 else 9)
    ax.set(title="Stall per failure (healthy groups)", ylabel="seconds")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def write_plots(run_dir: Path, summary: dict, events: list[dict]) -> dict[str, Path]:
    """Draw every plot that has data into ``run_dir``; returns plot name -> path of those written."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    drawn = {
        "loss": plot_loss(events, run_dir / PLOT_FILES["loss"]),
        "throughput": plot_throughput(events, run_dir / PLOT_FILES["throughput"]),
        "participants": plot_participants(events, run_dir / PLOT_FILES["participants"]),
        "stalls": plot_stalls(summary, events, run_dir / PLOT_FILES["stalls"]),
    }
    return {name: path for name, path in drawn.items() if path is not None}
