"""Human-readable views of a finished run: ``report.md`` and the console summary.

Renders what ``summary.py`` computed plus a few per-group and per-step tables taken from the
events; it computes no metric of its own, so the report and ``summary.json`` always agree. The PNG
plots are drawn by ``ftlm.observe.plots`` next to ``report.md``, which links them by relative path
(the run directory can be moved or published as a whole). It does not decide anything.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from ftlm.observe.events import NOT_FAILURES
from ftlm.observe.summary import (affected_group, commit_steps, detected_failures, failure_events,
                                  final_history)

LOSS_ROWS = 20
"""About how many rows the loss-vs-step table keeps (first and last step always included)."""
TIMELINE_ROWS = 50
"""At most this many failures are listed one by one."""
CONSOLE_UNEXPLAINED = 5
"""At most this many unexplained failures are named on the console."""


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 120:
        return f"{value / 60:.1f} min"
    return f"{value:.2f} s"


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _stalls(stalls: list[float]) -> str:
    if not stalls:
        return "none"
    return (f"{len(stalls)} (median {_seconds(statistics.median(stalls))}, "
            f"max {_seconds(max(stalls))})")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _sample_indices(n: int, k: int) -> list[int]:
    """About ``k`` evenly spaced indices of ``range(n)``, always with the first and last."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _identical(summary: dict) -> str:
    """``yes``, ``NO`` or ``single group`` (one replica has nothing to be identical to)."""
    if len(summary.get("groups") or summary.get("state_hashes") or []) == 1:
        return "single group" if summary["replicas_identical"] else "NO (no final state)"
    return "yes" if summary["replicas_identical"] else "NO"


def _failures(summary: dict) -> str:
    """``injected / detected``, with why the two differ: detections of failures nobody injected,
    injections nobody detected."""
    detected = summary["failures_detected"]
    notes = []
    if summary.get("failures_unexplained"):
        notes.append(f"{summary['failures_unexplained']} of the {detected} detected were not "
                     "injected: see Unexplained failures")
    if summary.get("failures_undetected"):
        notes.append(f"{summary['failures_undetected']} injected never detected")
    text = f"{summary['failures_injected']} / {detected}"
    return text + (f" ({'; '.join(notes)})" if notes else "")


def _timeline_rows(summary: dict) -> list[list[str]]:
    """Start-up, longest gap between commits and end (``summary["timeline"]``; none in a summary
    written before it existed)."""
    timeline = summary.get("timeline")
    if not timeline:
        return []
    step = timeline.get("max_commit_gap_step")
    return [["start-up", f"{_seconds(timeline['startup_seconds'])} (to the first commit)"],
            ["longest gap between commits", _seconds(timeline["max_commit_gap_seconds"])
             + (f" (before step {step})" if step is not None else "")],
            ["end", f"{_seconds(timeline['end_seconds'])} (from the last commit)"]]


def _console_timeline(summary: dict) -> str:
    """The console's line on where the time without progress fell, and the stalls."""
    timeline = summary.get("timeline")
    stalls = f"stalls {_stalls(summary['stall_seconds'])}"
    if not timeline:
        return stalls
    step = timeline.get("max_commit_gap_step")
    return (f"start-up {_seconds(timeline['startup_seconds'])}, longest gap between commits "
            f"{_seconds(timeline['max_commit_gap_seconds'])}"
            + (f" (before step {step})" if step is not None else "")
            + f", end {_seconds(timeline['end_seconds'])} after the last commit; {stalls}")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _headline(summary: dict) -> list[str]:
    data = summary.get("data", {})
    inconsistent = data.get("inconsistent_steps", [])
    rows = [
        ["steps committed", f"{summary['steps_committed']} ({summary['steps_failed']} failed)"],
        ["tokens committed", f"{summary['tokens_committed']:,}"],
        ["wall time", _seconds(summary["wall_seconds"])],
        ["ETT", f"{summary['ett']:.1%}"],
        ["steady rate", f"{summary.get('steady_tokens_per_second', 0):,.0f} tokens/s"],
        ["median step", _seconds(summary.get("median_step_seconds"))],
        *_timeline_rows(summary),
        ["failures injected / detected", _failures(summary)],
        ["recoveries", str(summary["recoveries"])],
        ["stalls", _stalls(summary["stall_seconds"])],
        ["final loss", _loss(summary["final_loss"])],
        ["replicas identical", _identical(summary)],
        ["samples committed", f"{data.get('samples_committed', 0):,}"],
        ["duplicates / gaps", f"{data.get('duplicates', 0)} / {data.get('gaps', 0)}"
         + (f" (inconsistent steps: {inconsistent[:10]})" if inconsistent else "")],
    ]
    if data.get("restores"):
        rows.append(["rollbacks", f"{data['restores']} ({data.get('rolled_back_steps', 0)} "
                                  "committed steps superseded)"])
    if summary.get("crashes"):
        rows.append(["group crashes", str(len(summary["crashes"]))])
    if summary.get("checkpoints_failed"):
        rows.append(["checkpoint saves failed", f"{summary['checkpoints_failed']} (see the "
                                                "checkpoint_failed events)"])
    for problem in summary.get("problems") or []:
        rows.append(["PROBLEM", problem])
    return _table(["metric", "value"], rows)


def _gpu_hours(summary: dict) -> list[str]:
    """GPU-hours by state (``ftlm.observe.cost``) and, when priced, the cost of the run."""
    hours = summary.get("gpu_hours")
    if not hours:
        return ["No GPU-hours recorded."]
    total = hours.get("total") or 0.0
    rows = [[state, f"{hours.get(state, 0.0):.4g}",
             f"{hours.get(state, 0.0) / total:.1%}" if total else "-"]
            for state in ("training", "stalled", "recovering", "starting", "idle")]
    rows.append(["total", f"{total:.4g}", "100.0%" if total else "-"])
    lines = _table(["state", "GPU-hours", "share"], rows)
    cost = summary.get("cost")
    if cost:
        unit = cost.get("currency", "")
        priced = [[name.replace("_", "-"), f"{cost[f'{name}_per_gpu_hour']:g} {unit}",
                   f"{cost[f'{name}_total']:.4g} {unit}",
                   "-" if cost.get(f"{name}_per_million_tokens") is None
                   else f"{cost[f'{name}_per_million_tokens']:.4g} {unit}"]
                  for name in ("on_demand", "spot") if f"{name}_total" in cost]
        lines += ["", *_table(["capacity", "per GPU-hour", "run", "per million committed tokens"],
                              priced)]
    return lines


_GROUP_KINDS = ("commit", "step_failed", "failure_injected", "member_dead", "recovery_start",
                "recovery_end")


def _per_group(summary: dict, events: list[dict]) -> list[str]:
    names = list(summary.get("groups", []))
    for event in events:
        group = affected_group(event)
        if group and group not in names and event["kind"] in _GROUP_KINDS:
            names.append(group)
    counts = {g: {"commit": 0, "step_failed": 0, "failure_injected": 0, "recovery_end": 0}
              for g in names}
    for event in events:
        row = counts.get(affected_group(event))
        kind = event["kind"]
        if row is None or kind not in row:
            continue
        if kind == "failure_injected" and (event.get("signal") or event.get("how")) in NOT_FAILURES:
            continue  # a slowdown or a preemption
        if kind != "recovery_end" or event.get("ok") is True:
            row[kind] += 1
    deaths = {g: 0 for g in names}
    for death in detected_failures(events):
        if death.group in deaths:
            deaths[death.group] += 1
    hashes = summary.get("state_hashes", {})
    rows = [[g, str(c["commit"]), str(c["step_failed"]), str(c["failure_injected"]),
             str(deaths[g]), str(c["recovery_end"]), (hashes.get(g) or "-")[:12]]
            for g, c in counts.items()]
    return _table(["group", "commits", "steps failed", "failures injected", "failures detected",
                   "recoveries", "state hash"], rows)


def _timeline(summary: dict, events: list[dict]) -> list[str]:
    fails = failure_events(events)
    if not fails:
        return ["No failures or rejoins."]
    t0 = min(e["ts"] for e in events)
    stalls = summary["stall_seconds"]
    rows = [[f"{f.ts - t0:.2f}", f.kind, f.group or "-",
             _seconds(stalls[i]) if i < len(stalls) else "-"]
            for i, f in enumerate(fails[:TIMELINE_ROWS])]
    more = [f"({len(fails) - TIMELINE_ROWS} more not listed)"] if len(fails) > TIMELINE_ROWS else []
    return _table(["t (s)", "event", "group", "stall"], rows) + more


def _unexplained(summary: dict) -> list[str]:
    """The "Unexplained failures" section: each detected failure nobody injected, with the
    detector's reason; empty when there is none."""
    rows = summary.get("unexplained_failures") or []
    if not rows:
        return []
    table = [[f"{u['t']:.2f}", _cell(u["group"] or "-"), u["detected_by"], _cell(u["reason"] or "-")]
             for u in rows[:TIMELINE_ROWS]]
    more = [f"({len(rows) - TIMELINE_ROWS} more not listed)"] if len(rows) > TIMELINE_ROWS else []
    return ["## Unexplained failures", "",
            "Detected failures that chaos did not inject: a process that crashed, or one the "
            "supervisor or the coordinator took for hung (a start-up timeout or a missed "
            "heartbeat of a process that was only slow).", "",
            *_table(["t (s)", "group", "detected by", "reason"], table), *more, ""]


def _loss_table(events: list[dict]) -> list[str]:
    steps = commit_steps(events)
    if not steps:
        return ["No step was committed."]
    t0 = min(e["ts"] for e in events)
    rows = [[str(steps[i].step), _loss(steps[i].loss), f"{steps[i].ts - t0:.2f}"]
            for i in _sample_indices(len(steps), LOSS_ROWS)]
    return _table(["step", "loss", "t (s)"], rows)


_PLOT_TITLES = {"throughput": "Committed tokens per second", "participants": "Participating groups",
                "stalls": "Stall per failure", "loss": "Loss vs step"}


def _image(plots: dict[str, str], name: str) -> list[str]:
    return [f"![{_PLOT_TITLES[name]}]({plots[name]})", ""] if name in plots else []


def render_report(summary: dict, events: list[dict], title: str = "run",
                  plots: dict[str, str] | None = None) -> str:
    """The Markdown text of ``report.md``; ``plots`` maps plot name (``ftlm.observe.plots``) to the
    image's path relative to the report, and each is shown in its section."""
    plots = plots or {}
    events = final_history(events)[0]  # the tables show the history that stands
    parts = [f"# ftlm run report: {title}", "", *_headline(summary), "",
             *_image(plots, "throughput"), *_image(plots, "participants"),
             "## Groups", "", *_per_group(summary, events), "",
             "## GPU-hours", "", *_gpu_hours(summary), "",
             "## Failures and rejoins", "", *_image(plots, "stalls"), *_timeline(summary, events), "",
             *_unexplained(summary),
             "## Loss", "", *_image(plots, "loss"), *_loss_table(events), ""]
    return "\n".join(parts)


def write_report(run_dir: Path, summary: dict, events: list[dict], plots: bool = True) -> Path:
    """Write the PNG plots (unless ``plots`` is False) and ``run_dir/report.md`` (atomically) that
    links them; returns the report's path."""
    run_dir = Path(run_dir)
    run_cfg = summary.get("config", {}).get("run", {})
    title = run_cfg.get("name") if isinstance(run_cfg, dict) else None
    images: dict[str, str] = {}
    if plots:
        from ftlm.observe.plots import write_plots  # matplotlib takes a second to import: only when drawing

        images = {name: path.name for name, path in write_plots(run_dir, summary, events).items()}
    text = render_report(summary, events, title=title or run_dir.name, plots=images)
    path = run_dir / "report.md"
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".report.md.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def format_summary(summary: dict) -> str:
    """The few lines printed on the console at the end of a run."""
    data = summary.get("data", {})
    identical = _identical(summary)
    hashes = "" if identical == "single group" else f" ({len(summary['state_hashes'])} hashes)"
    lines = [
        f"{summary['steps_committed']} steps committed ({summary['steps_failed']} failed), "
        f"{summary['tokens_committed']:,} tokens in {_seconds(summary['wall_seconds'])}, "
        f"ETT {summary['ett']:.1%}",
        f"failures: {summary['failures_injected']} injected, {summary['failures_detected']} "
        f"detected"
        + (f" ({summary['failures_unexplained']} not injected)"
           if summary.get("failures_unexplained") else "")
        + f", {summary['recoveries']} recoveries",
        _console_timeline(summary),
        f"final loss {_loss(summary['final_loss'])}; replicas identical: {identical}{hashes}; "
        f"data: {data.get('duplicates', 0)} duplicates, {data.get('gaps', 0)} gaps"
        + (f"; {data['restores']} rollback(s), {data.get('rolled_back_steps', 0)} steps superseded"
           if data.get("restores") else ""),
    ]
    if data.get("inconsistent_steps"):
        lines.append(f"WARNING: groups disagreed on the samples of steps "
                     f"{data['inconsistent_steps'][:10]}")
    if summary.get("failures_undetected"):
        lines.append(f"WARNING: {summary['failures_undetected']} injected failure(s) were never "
                     "detected")
    unexplained = summary.get("unexplained_failures") or []
    if unexplained:
        named = ", ".join(f"{u['group']} at {u['t']:.2f} s ({u['detected_by']}: {u['reason'] or '-'})"
                          for u in unexplained[:CONSOLE_UNEXPLAINED])
        more = (f" and {len(unexplained) - CONSOLE_UNEXPLAINED} more (report.md)"
                if len(unexplained) > CONSOLE_UNEXPLAINED else "")
        lines.append(f"WARNING: {len(unexplained)} detected failure(s) nobody injected: {named}{more}")
    if summary.get("checkpoints_failed"):
        lines.append(f"WARNING: {summary['checkpoints_failed']} durable checkpoint save(s) failed "
                     "(checkpoint_failed events in events.jsonl); training went on")
    return "\n".join(lines)
