"""Hot spares against none under the same failures: stall per failure, ETT, degraded steps.

``python -m bench.spares`` launches the tiny model on the demo data with ``ftlm launch local``'s
launcher, three training groups, without a spare and with one (``--spares 1``), interleaved,
``--reps`` times each. Both runs get the same failures: a SIGKILL of g0, g1, g2 in turn (training
groups in both runs), before the all-reduce of the steps ``--kills`` names (``FTLM_FAULT``'s
named point, so the same step whatever the machine's speed; the launcher's time-based chaos
struck groups still starting on a loaded 2-core box, and nothing trained).

Measured per run from ``summary.json`` and ``events.jsonl``: failures injected, the stall charged
to each failure or rejoin (``stall_seconds``, median), ETT, the steps trained on fewer than three
places (degraded: the LR was scaled down and fewer samples a step were trained), promotions and
the seconds from a failure to its promotion. It writes its section of BENCHMARKS.md unless
``--no-write``. It does not measure the spare's cost in GPU-hours (a fourth group's resources):
that is the goodput model's (``ftlm simulate``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ensure_demo, median, section_header, table, write_section

TRAINING_GROUPS = 3


def run_once(data: Path, spares: int, steps: int, kills: list[int], rep: int) -> dict:
    from ftlm.config import build_config
    from ftlm.launch.local import LocalLauncher
    from ftlm.observe.events import read_events

    with tempfile.TemporaryDirectory(prefix="ftlm-bench-spares-") as tmp:
        config = build_config({
            "run": {"name": "spares", "dir": str(Path(tmp) / "run"), "seed": 3},
            "model": {"size": "tiny", "vocab_size": 4096, "dim": 64, "n_layers": 2, "n_heads": 4,
                      "n_kv_heads": 2, "ffn_dim": 128, "max_seq_len": 128},
            "data": {"dir": str(data), "seq_len": 128, "prefetch": 2},
            "train": {"steps": steps, "batch_size": 4, "lr": 3e-3, "warmup_steps": 5, "threads": 1},
            "ft": {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0, "join_timeout": 15.0,
                   "allreduce_timeout": 5.0, "quorum_timeout": 30.0, "give_up_seconds": 90.0,
                   "restart_delay": 0.2},
            "observe": {"progress": False},
        })
        t0 = time.monotonic()
        faults = {f"g{i % TRAINING_GROUPS}": [f"before_allreduce@{step}+"] for i, step in enumerate(kills)}
        summary = LocalLauncher(config, groups=TRAINING_GROUPS, spares=spares, progress=False,
                                faults=faults).run()
        events = read_events(config.run.path / "events.jsonl")
    places = {e["step"]: e["participants"] for e in events if e["kind"] == "commit"}
    stalls = summary.get("stall_seconds") or []
    spare = summary.get("spares") or {}
    delays = spare.get("failure_to_promotion_seconds") or []
    return {"spares": spares, "rep": rep, "seconds": time.monotonic() - t0,
            "failures": summary.get("failures_injected", 0), "stalls": stalls,
            "median_stall": median(stalls) if stalls else 0.0, "ett": summary.get("ett", 0.0),
            "degraded": sum(1 for n in places.values() if n < TRAINING_GROUPS),
            "promotions": spare.get("promotions", 0),
            "promotion_delay": median(delays) if delays else None,
            "problems": summary.get("problems") or []}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spares", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", default="30,200,370",
                   help="steps at which g0, g1, g2 (in turn) are killed, comma-separated (default 30,200,370)")
    p.add_argument("--steps", type=int, default=500, help="steps per run (default 500)")
    p.add_argument("--reps", type=int, default=1, help="runs of each kind, interleaved (default 1)")
    p.add_argument("--quick", action="store_true", help="smoke size: one kill at step 30, 150 steps")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    kills = [30] if args.quick else [int(s) for s in args.kills.split(",") if s.strip()]
    steps = 150 if args.quick else args.steps
    if not kills or max(kills) >= steps or args.reps < 1:
        p.error("--kills needs one step or more, each below --steps; --reps at least 1")
    data = ensure_demo()
    loads = [os.getloadavg()[0]]
    t0 = time.monotonic()
    runs = []
    for rep in range(args.reps):
        for spares in (0, 1):
            r = run_once(data, spares, steps, kills, rep)
            loads.append(os.getloadavg()[0])
            print(f"rep {rep} spares {spares}: {r}", flush=True)
            runs.append(r)
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    rows = [[r["rep"], r["spares"], r["failures"], len(r["stalls"]), fmt(r["median_stall"]),
             f"{r['ett']:.3f}", r["degraded"], r["promotions"], fmt(r["promotion_delay"]),
             "; ".join(r["problems"])[:80] or "none"] for r in runs]
    headers = ["rep", "spares", "failures injected", "stalls", "median stall s", "ETT",
               "degraded steps", "promotions", "failure to promotion s (median)", "problems"]
    text = table(headers, rows)
    print(text, flush=True)
    if not args.no_write:
        flags = ["--quick"] if args.quick else ["--kills", args.kills, "--steps", str(steps),
                                                "--reps", str(args.reps)]
        body = section_header("Hot spares: none against one under the same failures", "bench.spares", flags)
        body += (f"* Load average (1 min) during the runs: {min(loads):.1f} to {max(loads):.1f}; took "
                 f"{time.monotonic() - t0:.0f} s\n\n")
        body += text + "\n\n" + READING
        write_section("spares", body)
    return 0


READING = (
    "3 training groups of the tiny model, g0, g1, g2 SIGKILLed in turn before the all-reduce of "
    "the `--kills` steps. *Degraded steps*: trained on fewer than three places (fewer samples, a "
    "lower LR); with a spare, only while no spare is current. ETT on 2 shared cores: the spare's "
    "process (its update each step) slows the others. When a spare pays for itself: "
    "docs/ft-protocol.md, 'Hot spares'.\n")


if __name__ == "__main__":
    sys.exit(main())
