"""Stall of the healthy groups per graceful preemption (SIGTERM) under ``ftlm launch local``.

A spot reclaim, a node drain or a Slurm preemption reaches a group's trainer as SIGTERM: the
trainer finishes or abandons its step, leaves the quorum explicitly, writes ``group_exit`` and
exits 0; the platform brings the group back (a replaced pod, a requeued job), and the new
incarnation rejoins and catches up from a healthy group. The target: the healthy groups
stall less than one step per preemption.

One in-process ``LocalLauncher`` per repetition (3 groups of 1 rank, the soak's tiny model on the
demo data). Once the job has committed its first steps, a thread SIGTERMs the trainer of one
healthy participant every ``--every`` seconds, round robin over the groups; the launcher sees it
exit 0 before the last step and starts a new incarnation after ``ft.restart_delay``, as a
platform would. Per preemption it records the seconds from the SIGTERM to the process's exit, its
exit status and the trainer's own ``group_exit`` event.

The stall is ``ftlm.observe.summary.stall_seconds``, not a copy of its formula: a preemption is not
a failure in the run's record (the group left on purpose), so the benchmark hands the function the
run's events plus one ``failure_injected`` per SIGTERM (signal ``SIGTERM``, only in memory, never
written to ``events.jsonl``). The function then charges the gaps between the healthy groups'
commits around each SIGTERM to it (the *leave* stall), and those around the new incarnation's
``recovery_start`` to the rejoin, exactly as it does for a failure. Alongside, from the events:
SIGTERM to the coordinator's ``member_left``, to its next quorum and to the healthy groups' next
commit (where the time of a leave goes). It does not test anything; the graceful-stop tests are
in tests/launch and tests/train.

    python -m bench.preemption [--quick] [--reps R] [--preemptions P] [--every SECONDS] [--no-write]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import ensure_demo, section_header, table, write_section
from bench.soak import Settings, write_config

SECTION = "preemption"
GROUPS = 3
SETTLE_SECONDS = 3.0
"""Seconds of all groups training before the next SIGTERM."""


@dataclass
class Preemption:
    """One SIGTERM sent to a group's trainer, and how the process ended."""

    ts: float
    group: str
    incarnation: str
    exit_seconds: float | None = None  # SIGTERM to the process's exit; None: did not exit in time
    code: int | None = None
    measured: dict = field(default_factory=dict)  # filled from the events after the run


def _candidates(launcher) -> list:
    """Groups that may be preempted now: all of them once every group trains in the last quorum
    seen (the previous preemption's group has rejoined and caught up: each preemption is measured
    alone, not mixed with the end of the previous one's catch-up); none before."""
    try:
        status = launcher.coordinator.status()
    except Exception:  # noqa: BLE001 - being restarted or busy: no pick this time
        return []
    training = set((status.get("last_quorum") or {}).get("participants") or [])
    healthy = [g for g in launcher.groups if g.running() and not g.finished and g.restart_at is None
               and g.replica_id in training]
    return healthy if len(healthy) == len(launcher.groups) else []


def _preemptor(launcher, count: int, every: float, grace: float, done: threading.Event,
               log: list[Preemption]) -> None:
    """SIGTERM ``count`` trainers, ``every`` seconds apart (round robin over the healthy
    participants), once the job is past step 5; stop early when the run ends or nears its end."""
    while not done.is_set() and launcher._best[0] < 5:
        done.wait(0.2)
    turn = 0
    for _ in range(count):
        if done.wait(every):
            return
        deadline = time.monotonic() + 120
        while not (picks := _candidates(launcher)) and time.monotonic() < deadline:
            if done.wait(0.2):
                return
        if done.wait(SETTLE_SECONDS):  # a few steady steps after the rejoin
            return
        picks = _candidates(launcher)
        if not picks or launcher._ending(None):
            return
        g = picks[turn % len(picks)]
        turn += 1
        proc = g.procs[0]
        p = Preemption(ts=time.time(), group=g.name, incarnation=g.incarnation)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < grace:
            if done.wait(0.02):
                break
        if proc.returncode is not None:
            p.exit_seconds, p.code = time.monotonic() - t0, proc.returncode
        log.append(p)


def _first(events: list[dict], since: float, pred) -> dict | None:
    return next((e for e in events if e["ts"] >= since and pred(e)), None)


def _longest_gap(events: list[dict], p: Preemption, rejoin: dict | None,
                 lead: float = 0.0) -> tuple[float | None, str]:
    """Where the longest gap between the healthy groups' commits from ``p.ts`` to ``rejoin``
    (or 30 s) lies: its start, in seconds after ``p.ts``, and the events of the run inside it."""
    until = (rejoin["ts"] if rejoin else p.ts + 30) + lead
    first: dict[int, float] = {}
    for e in events:
        if e["kind"] == "commit" and str(e["group"]).partition(":")[0] != p.group:
            first[e["step"]] = min(first.get(e["step"], e["ts"]), e["ts"])
    times = sorted(t for t in first.values() if p.ts - 2 <= t <= until + 2)
    gaps = [(b - a, a, b) for a, b in zip(times, times[1:]) if b > p.ts and a < until]
    if not gaps:
        return None, ""
    _, a, b = max(gaps)
    inside = [f"{e['kind']}({str(e.get('group', '')).partition(':')[0]})" for e in events
              if a < e["ts"] < b and e["kind"] not in ("commit", "quorum")]
    return a - p.ts, " ".join(dict.fromkeys(inside))


def _gap_around(events: list[dict], group: str, ts: float | None, median_step: float) -> float | None:
    """The gap between the healthy groups' commits (each step's earliest, ``group`` left out)
    that contains ``ts``, minus the median step: what that one moment cost them directly."""
    if ts is None:
        return None
    first: dict[int, float] = {}
    for e in events:
        if e["kind"] == "commit" and str(e["group"]).partition(":")[0] != group:
            first[e["step"]] = min(first.get(e["step"], e["ts"]), e["ts"])
    times = sorted(first.values())
    gap = next((b - a for a, b in zip(times, times[1:]) if a <= ts < b), None)
    return None if gap is None else max(0.0, gap - median_step)


def measure(events: list[dict], preemptions: list[Preemption], median_step: float) -> None:
    """Fill each preemption's ``measured`` figures from the run's events (time order)."""
    from ftlm.observe.summary import failure_events, stall_seconds

    marks = [{"ts": p.ts, "kind": "failure_injected", "group": "bench", "target": p.group,
              "signal": "SIGTERM", "incarnation": p.incarnation, "step": -1} for p in preemptions]
    ordered = sorted(events + marks, key=lambda e: (e["ts"], e["kind"] != "failure_injected"))
    fails = failure_events(ordered)
    stalls = stall_seconds(ordered, median_step)
    by_key = {(f.ts, f.kind, f.group): s for f, s in zip(fails, stalls)}
    for p in preemptions:
        m = p.measured
        m["leave_stall"] = by_key.get((p.ts, "failure_injected", p.group))
        rejoin = _first(ordered, p.ts, lambda e: e["kind"] == "recovery_start" and e["group"] == p.group)
        m["rejoin_stall"] = by_key.get((rejoin["ts"], "recovery_start", p.group)) if rejoin else None
        left = _first(ordered, p.ts, lambda e: e["kind"] == "member_left"
                      and str(e.get("replica_id", "")).startswith(f"{p.group}:"))
        m["left"] = left["ts"] - p.ts if left else None
        m["leave_gap"] = _gap_around(ordered, p.group, left["ts"] if left else None, median_step)
        m["reason"] = left.get("reason", "") if left else ""
        healthy = lambda e: str(e.get("group", "")).partition(":")[0] not in (p.group, "coordinator", "supervisor", "bench")  # noqa: E731
        quorum = _first(ordered, p.ts, lambda e: e["kind"] == "quorum")  # the coordinator's
        m["next_quorum"] = quorum["ts"] - p.ts if quorum else None
        commit = _first(ordered, quorum["ts"] if quorum else p.ts,
                        lambda e: e["kind"] == "commit" and healthy(e))
        m["next_commit"] = commit["ts"] - p.ts if commit else None
        m["healthy_step_failed"] = any(
            e["kind"] == "step_failed" and healthy(e) and p.ts <= e["ts"] <= p.ts + 5 for e in ordered)
        m["gap_at"], m["gap_during"] = _longest_gap(ordered, p, rejoin)
        if rejoin is not None:
            back = _first(ordered, rejoin["ts"], lambda e: e["kind"] == "recovery_end"
                          and e["group"] == p.group and e.get("ok"))
            m["rejoin_gap_at"], m["rejoin_gap_during"] = _longest_gap(
                ordered, Preemption(rejoin["ts"], p.group, ""), back, lead=2.0)
            m["restart"] = rejoin["ts"] - p.ts  # SIGTERM to the new incarnation's recovery_start
            m["caught_up"] = back["ts"] - rejoin["ts"] if back else None
            m["join_gap"] = _gap_around(ordered, p.group, rejoin["ts"], median_step)
            m["caught_up_gap"] = _gap_around(ordered, p.group, back["ts"] if back else None, median_step)
        exit_event = _first(ordered, p.ts, lambda e: e["kind"] == "group_exit" and e["group"] == p.group)
        m["group_exit_ok"] = bool(exit_event and exit_event.get("ok") is True)


def run_one(root: Path, steps: int, count: int, every: float, grace: float) -> dict:
    """One launch with ``count`` preemptions; its figures for the table."""
    from ftlm.config import load_config
    from ftlm.launch.local import LocalLauncher
    from ftlm.observe.events import read_events

    run_dir = root / f"run-{time.time_ns()}"
    config = load_config(write_config(run_dir, Settings(steps=steps, mtbf=0.0)),
                         # Start-up and give-up room for a loaded shared box (start-up is not
                         # what this measures).
                         [f"run.dir={run_dir}", "ft.startup_timeout=150", "ft.give_up_seconds=300",
                          # No periodic evaluation or checkpoint: their pauses of every group are
                          # no preemption's doing, and the stall formula would charge them to one.
                          "train.eval_every=0", "checkpoint.every=0"])
    launcher = LocalLauncher(config, groups=GROUPS, progress=False)
    done, log = threading.Event(), []
    thread = threading.Thread(target=_preemptor, args=(launcher, count, every, grace, done, log),
                              daemon=True)
    thread.start()
    try:
        summary = launcher.run()
    finally:
        done.set()
        thread.join(timeout=grace + 10)
    events = sorted(read_events(run_dir / "events.jsonl"), key=lambda e: e["ts"])
    measure(events, log, summary["median_step_seconds"])
    return {"preemptions": log, "median_step": summary["median_step_seconds"],
            "steps": summary["steps_committed"], "restarts": summary.get("restarts", {}),
            "ett": summary["ett"], "problems": summary["problems"]}


def _fmt(values: list, digits: int = 2) -> str:
    return " ".join("-" if v is None else f"{v:.{digits}f}" for v in values)


def _med(values: list) -> float:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else float("nan")


def render(results: list[dict], flags: list[str], steps: int, every: float, grace: float,
           took: float) -> str:
    rows = []
    for i, r in enumerate(results):
        ps = r["preemptions"]
        m = [p.measured for p in ps]
        rows.append([i + 1, len(ps), f"{r['median_step']:.3f}",
                     f"{_med([x['leave_stall'] for x in m]):.3f}", _fmt([x["leave_stall"] for x in m]),
                     _fmt([x.get("leave_gap") for x in m]),
                     _fmt([x.get("join_gap") for x in m]) + " / " + _fmt([x.get("caught_up_gap") for x in m]),
                     f"{_med([x['rejoin_stall'] for x in m]):.3f}", _fmt([x["rejoin_stall"] for x in m]),
                     _fmt([p.exit_seconds for p in ps]),
                     " ".join(str(p.code) for p in ps),
                     sum(x["group_exit_ok"] for x in m), r["steps"], f"{r['ett']:.3f}",
                     "; ".join(r["problems"]) or "none"])
    head = section_header("Graceful preemption under `ftlm launch local`",
                          "bench.preemption", flags)
    lines = [head.rstrip("\n"),
             f"* Method: {GROUPS} groups x 1 rank, the soak's tiny model, {steps} steps, "
             f"`ft.heartbeat_timeout=2`, no periodic evaluation or checkpoint (`train.eval_every=0`, "
             "`checkpoint.every=0`: their pauses would be charged to the nearest preemption); "
             f"from step 5 on, at least {every:g} s apart and once every group has rejoined and "
             f"trained {SETTLE_SECONDS:g} s, the trainer of one "
             "healthy participant (round robin) gets SIGTERM, as a spot reclaim, a drain or a "
             "Slurm preemption sends it; it leaves the quorum and exits 0, and the launcher "
             "starts a new incarnation after `ft.restart_delay` (0.5 s), which rejoins and catches "
             "up live. Stall: `ftlm.observe.summary.stall_seconds` over the run's events plus one "
             "in-memory `failure_injected` per SIGTERM (a preemption is not a failure in the "
             "record): the longest gap between the healthy groups' commits around the SIGTERM "
             "(leave) or the new incarnation's `recovery_start` (rejoin), minus the median step. "
             f"Exit: SIGTERM to the process's exit (bound: {grace:g} s, "
             "`cluster.grace_seconds`' default); `group_exit ok`: the trainer's own event.",
             f"* Took {took:.0f} s.", "",
             table(["launch", "preemptions", "median step s", "median leave stall s",
                    "leave stall per preemption s", "leave's own gap s",
                    "rejoin's own gaps s (join / caught up)", "median rejoin stall s",
                    "rejoin stall per preemption s", "SIGTERM to exit s", "exit status",
                    "group_exit ok", "steps", "ETT", "problems"], rows), ""]
    every_p = [p for r in results for p in r["preemptions"]]
    m = [p.measured for p in every_p]
    steps_med = statistics.median([r["median_step"] for r in results]) if results else float("nan")
    if every_p:
        leave = [x["leave_stall"] for x in m if x["leave_stall"] is not None]
        rejoin = [x["rejoin_stall"] for x in m if x["rejoin_stall"] is not None]
        lines.append(
            f"* All launches: {len(every_p)} preemptions; median step {steps_med:.3f} s; leave stall "
            f"median {_med(leave):.3f} s (max {max(leave, default=float('nan')):.3f} s, "
            f"{sum(s < steps_med for s in leave)} of {len(leave)} under one median step); rejoin "
            f"stall median {_med(rejoin):.3f} s (max {max(rejoin, default=float('nan')):.3f} s); "
            f"exit 0 within the grace: {sum(p.code == 0 for p in every_p)} of {len(every_p)} "
            f"(slowest {max((p.exit_seconds or 0 for p in every_p), default=0):.2f} s); trainer's "
            f"`group_exit` ok: {sum(x['group_exit_ok'] for x in m)} of {len(m)}.")
        own = [x["leave_gap"] for x in m if x.get("leave_gap") is not None]
        joins = [x[k] for x in m for k in ("join_gap", "caught_up_gap") if x.get(k) is not None]
        lines.append(
            f"* Own gaps (the one commit gap that contains the moment, minus the median step): the "
            f"leave (`member_left`) median {_med(own):.3f} s (max {max(own, default=float('nan')):.3f} s, "
            f"{sum(g < steps_med for g in own)} of {len(own)} under one median step); the rejoin's "
            f"two membership changes (`recovery_start`, `recovery_end`) median {_med(joins):.3f} s "
            f"(max {max(joins, default=float('nan')):.3f} s).")
        lines.append(
            f"* Where a leave's time goes (medians from the SIGTERM): coordinator's `member_left` "
            f"{_med([x['left'] for x in m]):.2f} s, its next quorum "
            f"{_med([x['next_quorum'] for x in m]):.2f} s, their next commit "
            f"{_med([x['next_commit'] for x in m]):.2f} s; a healthy group failed a step within "
            f"5 s of the SIGTERM in {sum(x['healthy_step_failed'] for x in m)} of {len(m)}.")
        lines.append("* Longest commit gap of the healthy groups between each SIGTERM and its rejoin: "
                     "start after the SIGTERM, and what happened inside it: " + "; ".join(
                         f"{p.group} +{p.measured['gap_at']:.2f} s [{p.measured['gap_during'] or 'nothing'}]"
                         for p in every_p if p.measured.get("gap_at") is not None) + ".")
        lines.append("* Rejoins: SIGTERM to the new incarnation's `recovery_start` / to its `recovery_end`, "
                     "and the longest commit gap of the healthy groups in between (start after "
                     "`recovery_start`, events inside): " + "; ".join(
                         f"{p.group} {p.measured['restart']:.1f} s / "
                         f"{(p.measured['restart'] + p.measured['caught_up']) if p.measured.get('caught_up') is not None else float('nan'):.1f} s, "
                         f"+{p.measured['rejoin_gap_at']:.2f} s [{p.measured['rejoin_gap_during'] or 'nothing'}]"
                         for p in every_p if p.measured.get("rejoin_gap_at") is not None) + ".")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from ftlm.launch.cluster_config import ClusterConfig

    p = argparse.ArgumentParser(prog="python -m bench.preemption", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one launch, 2 preemptions")
    p.add_argument("--reps", type=int, default=2, help="launches (default 2)")
    p.add_argument("--preemptions", type=int, default=5, help="SIGTERMs per launch (default 5)")
    p.add_argument("--every", type=float, default=15.0, help="seconds between SIGTERMs (default 15)")
    p.add_argument("--steps", type=int, default=0, help="steps per launch (default: enough for all)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--save", type=Path, help="also pickle the raw results there (to render again)")
    args = p.parse_args(argv)
    reps, count = (1, 2) if args.quick else (args.reps, args.preemptions)
    grace = float(ClusterConfig().grace_seconds)
    # About 0.1-0.3 s per step on a loaded 2-core box: room for every SIGTERM and a tail after it.
    steps = args.steps or int((count + 2) * args.every * 8) + 40
    ensure_demo()
    t0 = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="ftlm-preempt-") as tmp:
        for rep in range(reps):
            r = run_one(Path(tmp), steps, count, args.every, grace)
            print(f"launch {rep + 1}: {[(p.group, p.code, p.measured) for p in r['preemptions']]}, "
                  f"median step {r['median_step']:.3f}, problems {r['problems']}", flush=True)
            results.append(r)
    if args.save:
        import pickle
        args.save.write_bytes(pickle.dumps((results, steps, args.every, grace, time.monotonic() - t0)))
    flags = [f for f, on in (("--quick", args.quick),) if on]
    text = render(results, flags, steps, args.every, grace, time.monotonic() - t0)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
    ok = all(not r["problems"] and all(p.code == 0 for p in r["preemptions"]) for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
