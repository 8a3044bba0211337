"""The snapshot reserve in whole jobs: the 82M rejoin with ``ft.snapshot_reserve`` on and off.

``python -m bench.reserve_ab [--reps 3] [--out FILE]``. Runs ``bench.ft_vs_torchft``'s rejoin case
of the ``large`` model (3 groups, g2 SIGKILLed at step 4 and restarted, ftlm only), reserve on
and off interleaved, and prints one JSON line per run: the stall charged to g2's failure and to
its rejoin (``ftlm.observe.summary.stall_seconds``), the median step, the first step each
healthy group committed after the rejoin began (the one that overlaps the source's snapshot
copy), and the transfer. Its numbers are in BENCHMARKS.md's transfer section (typed in, not
written by this script: a few runs are a reading, not a table of their own).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def one_run(reserve: bool) -> dict:
    from bench.baselines import run_ftlm
    from bench.ft_vs_torchft import _fault_plan, _stalls
    plan = _fault_plan("large", 1, "kill@4", 300)
    plan.ft["snapshot_reserve"] = reserve
    t0, load = time.time(), os.getloadavg()[0]
    res = run_ftlm(plan)
    events = sorted(res.events, key=lambda e: e["ts"])
    stalls = _stalls(res)
    began = next((e["ts"] for e in events if e["kind"] == "recovery_start" and e["group"] == "g2"), None)
    first: dict[str, float | None] = {}
    for e in events:
        if (began is not None and e["kind"] == "commit" and e["ts"] > began
                and e["group"] in ("g0", "g1") and e["group"] not in first):
            first[e["group"]] = e.get("step_seconds")  # None: that group was replaying itself
    end = next((e for e in events if e["kind"] == "recovery_end" and e["group"] == "g2"), {})
    return {"reserve": reserve, "load": round(load, 1), "median_step": stalls["median"],
            "rejoin_stall": stalls["rejoin"], "failure_stall": stalls["failure"],
            "first_steps": first, "transfer_seconds": end.get("transfer_seconds"),
            "replayed": end.get("replayed"), "seconds": round(time.time() - t0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reserve_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3, help="repetitions of each setting (default 3)")
    p.add_argument("--out", default="", help="also write the runs here as a JSON list")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error(f"--reps={args.reps} must be at least 1")
    runs = []
    for rep in range(args.reps):
        for reserve in (True, False):  # interleaved
            row = {"rep": rep, **one_run(reserve)}
            print(json.dumps(row), flush=True)
            runs.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
