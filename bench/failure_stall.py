"""Failure stall per SIGKILL without a local supervisor: peers' reports vs the heartbeat.

On Kubernetes and Slurm no supervisor posts ``/v1/dead`` when a group's process dies, so the
coordinator learns of the death from the group's peers (their all-reduce fails with a transport
error; they ask for the next quorum with ``failed``) corroborated by the dead group's silence for
``ft.suspect_window`` (docs/design.md, 'Failure detection'), or else from the heartbeat timeout.

``python -m bench.failure_stall`` runs the SIGKILL case of ``bench.ft_vs_torchft`` part 2 (3 groups of
the tiny model, g2 kills itself before the all-reduce of step 8, `ft.heartbeat_timeout=1`) under
three conditions, interleaved, ``--reps`` times each: the local supervisor reports the death (as
``ftlm launch local`` does); no supervisor report (``FTLM_SUPERVISOR_REPORTS=0``) with the default
``ft.suspect_window`` (two heartbeat intervals, 0.2 s); no supervisor report with the window at
0.95 s, close to the 1 s heartbeat timeout (what detection costs without the peers' reports).
It writes its section of BENCHMARKS.md unless ``--no-write``.

Measured per run, from the job's ``events.jsonl``: the stall of the healthy groups charged to the
kill (``ftlm.observe.summary.stall_seconds``: the longest gap between their commits around it,
minus the median step), the median step, and, from the injection: the coordinator's
``member_dead`` of g2 (with its reason), the survivors' next quorum and their next commit. Not
measured: hangs (SIGSTOP: no peer sees a reset).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench.baselines import JobResult, run_ftlm
from bench.common import median, section_header, table, write_section
from bench.ft_vs_torchft import _fault_plan, _stalls

CONDITIONS = [
    ("supervisor reports the death", "1", None),
    ("no supervisor: peers' reports, window 0.2 s", "0", None),
    ("no supervisor: window 0.95 s (about the heartbeat timeout)", "0", 0.95),
]


def _detection(res: JobResult) -> tuple[float | None, str, float | None, float | None]:
    """(injection to g2's ``member_dead``, its reason, injection to the survivors' next quorum,
    injection to their next commit)."""
    events = sorted(res.events, key=lambda e: e["ts"])
    t = next((e["ts"] for e in events if e["kind"] == "failure_injected" and str(e["group"]).startswith("g2")), None)
    if t is None:
        return None, "", None, None
    dead = next((e for e in events if e["kind"] == "member_dead" and e["ts"] >= t
                 and str(e.get("replica_id", e.get("group", ""))).startswith("g2")), None)
    quorum = next((e for e in events if e["kind"] == "quorum" and e["ts"] >= t), None)
    commit = next((e for e in events if e["kind"] == "commit" and e["ts"] >= t
                   and not str(e["group"]).startswith("g2")), None)
    since = lambda e: e["ts"] - t if e is not None else None  # noqa: E731
    return since(dead), str(dead.get("reason", "")) if dead else "", since(quorum), since(commit)


def run_once(reports: str, window: float | None, duration: float) -> dict:
    plan = _fault_plan("tiny", 8, "kill@8", duration)
    if window is not None:
        plan.ft = {**plan.ft, "suspect_window": window}
    previous = os.environ.get("FTLM_SUPERVISOR_REPORTS")
    os.environ["FTLM_SUPERVISOR_REPORTS"] = reports
    try:
        res = run_ftlm(plan)
    finally:
        if previous is None:
            os.environ.pop("FTLM_SUPERVISOR_REPORTS", None)
        else:
            os.environ["FTLM_SUPERVISOR_REPORTS"] = previous
    out = _stalls(res)
    out["detect"], out["reason"], out["quorum"], out["commit"] = _detection(res)
    if out["failure"] is None:
        kinds = sorted({e["kind"] for e in res.events})
        print(f"no stall charged to g2's kill in this run (events: {', '.join(kinds)})", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.failure_stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2, help="runs per condition, interleaved (default 2)")
    p.add_argument("--duration", type=float, default=240.0, help="seconds a run may take at most")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    t0 = time.monotonic()
    loads = [os.getloadavg()[0]]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in CONDITIONS}
    for rep in range(args.reps):
        for name, reports, window in CONDITIONS:
            r = run_once(reports, window, args.duration)
            loads.append(os.getloadavg()[0])
            print(f"rep {rep} {name}: {r}", flush=True)
            results[name].append(r)
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    rows = []
    for name, _, _ in CONDITIONS:
        rs = results[name]
        stalls = [r["failure"] for r in rs if r["failure"] is not None]
        detects = [r["detect"] for r in rs if r["detect"] is not None]
        reason = next((r["reason"] for r in rs if r["reason"]), "")
        each = lambda key: ", ".join(fmt(r[key]) for r in rs)  # noqa: E731
        rows.append([name, each("failure"), fmt(median(stalls) if stalls else None),
                     each("median"), each("detect"), fmt(median(detects) if detects else None),
                     each("quorum"), each("commit"), reason[:90]])
    headers = ["condition", "stall s (each run)", "median stall s", "median step s (each run)",
               "detected s (each run)", "median detected s", "next quorum s", "next commit s",
               "g2's member_dead reason"]
    print(table(headers, rows), flush=True)
    if not args.no_write:
        body = section_header("Failure stall per SIGKILL without a supervisor", "bench.failure_stall",
                              ["--reps", str(args.reps)])
        body += (f"* Load average (1 min) during the runs: {min(loads):.1f} to {max(loads):.1f}; took "
                 f"{time.monotonic() - t0:.0f} s\n\n")
        body += table(headers, rows) + "\n\n" + READING
        write_section("failure_stall", body)
    return 0


READING = """\
Each run: 3 groups of the tiny model (1.3M parameters, batch 8), `ft.heartbeat_interval=0.1`,
`ft.heartbeat_timeout=1`, `ft.join_timeout=2`; g2 SIGKILLs itself before the all-reduce of step 8
(`bench.ft_vs_torchft`'s plan). *Stall*: the healthy groups' longest gap between commits around
the kill minus the median step (docs/design.md, 'summary.json'). *Detected*: from the injection to the
coordinator's `member_dead` of g2; *next quorum*, *next commit*: the survivors'. Without a supervisor, the survivors' all-reduce fails on the
reset connections, they ask for the next quorum with `failed` (the report), and the coordinator
declares dead the members of that quorum it has not heard from since the first report once
`ft.suspect_window` has passed: a report never expires a member that still heartbeats or asks.
Target: stall per SIGKILL under 1 s plus one step with the supervisor's report off.
"""


if __name__ == "__main__":
    sys.exit(main())
