"""Stall of the healthy groups when the coordinator process dies under ``ftlm launch local``.

The local launcher restarts a dead coordinator on the same port (``LocalLauncher``); the new one
holds no state and rebuilds membership from the groups' next heartbeats (DESIGN.md section 5).
This benchmark measures what that costs the groups: one in-process ``LocalLauncher`` per
repetition (3 groups of 1 rank, the soak's tiny model on the demo data), and a thread that, once
the job has committed its first steps, SIGKILLs the coordinator every ``--every`` seconds through
``LocalLauncher.restart_coordinator`` (kill, then start a fresh process on the same port at once:
what the launcher's watch loop does for a crash, without its 0.1 s polling delay). Every kill is a
``failure_injected`` event with target ``coordinator``, so ``ftlm.observe.summary`` charges it
its stall like any other failure: the longest gap between the job's commits around it, minus the
median step time.

Each repetition is two launches: coordinator restarts cold (a new ``ftlm coordinator`` process,
as before the standby existed) then warm (the launcher's standby takes over). Reported per
launch: the coordinator's downtime (kill to the new process answering), the
stall per kill, and whether the run still proves itself (identical replicas, exactly-once data).
It does not test anything; the tests of coordinator restarts are in tests/launch and tests/ft.

    python -m bench.coordinator_crash [--quick] [--reps R] [--kills K] [--every SECONDS] [--no-write]
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench.common import ensure_demo, section_header, table, write_section
from bench.soak import Settings, write_config

SECTION = "coordinator_crash"
GROUPS = 3


def _killer(launcher, kills: int, every: float, first_step: int, done: threading.Event,
            log: list[float]) -> None:
    """Kill the coordinator ``kills`` times, ``every`` seconds apart, once the job is past
    ``first_step``; stop early when the run ends."""
    while not done.is_set() and launcher._best[0] < first_step:
        done.wait(0.2)
    for _ in range(kills):
        if done.wait(every):
            return
        t0 = time.time()
        launcher.restart_coordinator()
        log.append(time.time() - t0)


def commit_gaps(events: list[dict]) -> list[float]:
    """For each coordinator kill, the longest gap between the job's commits (each step's
    earliest) that overlaps the outage, from the kill to the replacement answering: the raw
    pause, a normal step included, whatever else happened meanwhile."""
    first: dict[int, float] = {}
    for e in events:
        if e["kind"] == "commit":
            first[e["step"]] = min(first.get(e["step"], e["ts"]), e["ts"])
    times = sorted(first.values())
    restarts = sorted(e["ts"] for e in events if e["kind"] == "coordinator_restart")
    gaps = []
    for e in events:
        if e["kind"] != "failure_injected" or e.get("target") != "coordinator":
            continue
        later = restarts[bisect.bisect_left(restarts, e["ts"]):]
        back = later[0] if later else e["ts"]  # when the replacement answered
        overlapping = [b - a for a, b in zip(times, times[1:]) if b > e["ts"] and a <= back]
        if overlapping:
            gaps.append(max(overlapping))
    return gaps


def run_one(root: Path, steps: int, kills: int, every: float, standby: bool) -> dict:
    """One launch with ``kills`` coordinator crashes (replaced by the warm standby, or started
    cold); its summary figures for the table."""
    from ftlm.config import load_config
    from ftlm.launch.local import LocalLauncher
    from ftlm.observe.events import read_events
    from ftlm.observe.summary import failure_events

    run_dir = root / f"run-{time.time_ns()}"
    config = load_config(write_config(run_dir, Settings(steps=steps, mtbf=0.0)),
                         # Start-up and give-up room for a loaded shared box (group start-up
                         # is not what this measures).
                         [f"run.dir={run_dir}", "ft.startup_timeout=150", "ft.give_up_seconds=300"])
    launcher = LocalLauncher(config, groups=GROUPS, progress=False, coordinator_standby=standby)
    done, downtimes = threading.Event(), []
    killer = threading.Thread(target=_killer, args=(launcher, kills, every, 5, done, downtimes),
                              daemon=True)
    killer.start()
    try:
        summary = launcher.run()
    finally:
        done.set()
        killer.join(timeout=60)
        # A kill racing the launcher's own shutdown may have started one more coordinator.
        launcher.coordinator.stop()
    events = read_events(run_dir / "events.jsonl")
    fails = failure_events(sorted(events, key=lambda e: e["ts"]))
    stalls = [s for f, s in zip(fails, summary["stall_seconds"]) if f.group == "coordinator"]
    return {"standby": standby, "kills": len(downtimes), "downtime": downtimes, "stalls": stalls,
            "gaps": commit_gaps(events),
            "median_step": summary["median_step_seconds"], "steps": summary["steps_committed"],
            "ett": summary["ett"], "problems": summary["problems"]}


def render(results: list[dict], flags: list[str], steps: int, every: float, took: float) -> str:
    rows = []
    for i, r in enumerate(results):
        stalls = r["stalls"] or [float("nan")]
        rows.append([i // 2 + 1, "warm standby" if r["standby"] else "cold start", r["kills"],
                     f"{r['median_step']:.3f}",
                     f"{statistics.median(r['downtime']):.2f}" if r["downtime"] else "-",
                     f"{statistics.median(stalls):.3f}", f"{max(stalls):.3f}",
                     " ".join(f"{s:.2f}" for s in r["stalls"]),
                     " ".join(f"{s:.2f}" for s in r["gaps"]), r["steps"], f"{r['ett']:.3f}",
                     "; ".join(r["problems"]) or "none"])
    head = section_header("Coordinator crash under `ftlm launch local` (issue 14)",
                          "bench.coordinator_crash", flags)
    lines = [head.rstrip("\n"),
             f"* Method: {GROUPS} groups x 1 rank, the soak's tiny model, {steps} steps, "
             f"`ft.heartbeat_timeout=2`; from step 5 on the coordinator is SIGKILLed every "
             f"{every:g} s and the launcher starts a fresh one on the same port at once "
             "(`LocalLauncher.restart_coordinator`): cold (a new `ftlm coordinator` process) or "
             "from the warm standby (`ftlm.launch.coordinator_standby`), alternating launch by "
             "launch. Downtime: kill to the new process answering. "
             "Stall: `ftlm.observe.summary`'s stall of each kill (longest gap between the job's "
             "commits around it, minus the median step; a load-induced failure overlapping a "
             "kill takes the charge). Commit gap: the longest raw gap between the job's commits "
             "that overlaps the outage, kill to replacement answering (a normal step included).",
             f"* Took {took:.0f} s.", "",
             table(["rep", "restart", "kills", "median step s", "median downtime s", "median stall s",
                    "max stall s", "stall per kill s", "commit gap per kill s", "steps", "ETT",
                    "problems"], rows), ""]
    for standby in (False, True):
        mine = [r for r in results if r["standby"] == standby]
        stalls = [x for r in mine for x in r["stalls"]]
        down = [x for r in mine for x in r["downtime"]]
        gaps = [x for r in mine for x in r["gaps"]]
        if stalls and gaps:
            lines.append(f"* {'Warm standby' if standby else 'Cold start'}: {len(stalls)} kills, stall "
                         f"median {statistics.median(stalls):.3f} s (max {max(stalls):.3f} s), "
                         f"commit gap median {statistics.median(gaps):.2f} s (max {max(gaps):.2f} s), "
                         f"coordinator downtime median {statistics.median(down):.2f} s.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.coordinator_crash", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one repetition, 2 kills")
    p.add_argument("--reps", type=int, default=2, help="pairs of launches, cold then warm (default 2)")
    p.add_argument("--kills", type=int, default=4, help="coordinator kills per launch (default 4)")
    p.add_argument("--every", type=float, default=10.0, help="seconds between kills (default 10)")
    p.add_argument("--steps", type=int, default=0, help="steps per launch (default: enough for the kills)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    reps, kills = (1, 2) if args.quick else (args.reps, args.kills)
    # About 0.1-0.3 s per step on a loaded 2-core box: room for every kill and a tail after the last.
    steps = args.steps or int((kills + 2) * args.every * 8) + 40
    ensure_demo()
    t0 = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="ftlm-coordcrash-") as tmp:
        for rep, standby in ((rep, standby) for rep in range(reps) for standby in (False, True)):
            r = run_one(Path(tmp), steps, kills, args.every, standby)
            print(f"rep {rep + 1} standby={standby}: kills {r['kills']}, stalls {r['stalls']}, downtime "
                  f"{[round(d, 2) for d in r['downtime']]}, problems {r['problems']}", flush=True)
            results.append(r)
    flags = [f for f, on in (("--quick", args.quick),) if on]
    text = render(results, flags, steps, args.every, time.monotonic() - t0)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
    return 0 if all(not r["problems"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
