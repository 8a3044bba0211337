"""Hot spares against none under the same seeded chaos: stall per failure, ETT, degraded steps.

``python -m bench.spares`` launches the tiny model on the demo data with ``ftlm launch local``'s
launcher, three training groups, twice per chaos seed: without a spare and with one
(``--spares 1``), interleaved. The chaos schedule (``chaos_mtbf``, ``chaos_seed``) draws the same
moments in both runs; its victims are drawn among the groups running, so with a spare the spare
itself is struck now and then (its own failures are part of what a spare costs).

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


def run_once(data: Path, spares: int, steps: int, mtbf: float, seed: int) -> dict:
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
        summary = LocalLauncher(config, groups=TRAINING_GROUPS, spares=spares, progress=False,
                                chaos_mtbf=mtbf, chaos_seed=seed).run()
        events = read_events(config.run.path / "events.jsonl")
    places = {e["step"]: e["participants"] for e in events if e["kind"] == "commit"}
    stalls = summary.get("stall_seconds") or []
    spare = summary.get("spares") or {}
    delays = spare.get("failure_to_promotion_seconds") or []
    return {"spares": spares, "seed": seed, "seconds": time.monotonic() - t0,
            "failures": summary.get("failures_injected", 0), "stalls": stalls,
            "median_stall": median(stalls) if stalls else 0.0, "ett": summary.get("ett", 0.0),
            "degraded": sum(1 for n in places.values() if n < TRAINING_GROUPS),
            "promotions": spare.get("promotions", 0),
            "promotion_delay": median(delays) if delays else None,
            "problems": summary.get("problems") or []}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spares", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="1,2", help="chaos seeds, comma-separated (default 1,2)")
    p.add_argument("--steps", type=int, default=400, help="steps per run (default 400)")
    p.add_argument("--mtbf", type=float, default=8.0, help="chaos: mean seconds between failures")
    p.add_argument("--quick", action="store_true", help="smoke size: one seed, 120 steps")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    seeds = [1] if args.quick else [int(s) for s in args.seeds.split(",") if s.strip()]
    steps = 120 if args.quick else args.steps
    if not seeds or steps < 20 or args.mtbf <= 0:
        p.error("--seeds needs one seed or more, --steps at least 20, --mtbf above 0")
    data = ensure_demo()
    loads = [os.getloadavg()[0]]
    t0 = time.monotonic()
    runs = []
    for seed in seeds:
        for spares in (0, 1):
            r = run_once(data, spares, steps, args.mtbf, seed)
            loads.append(os.getloadavg()[0])
            print(f"seed {seed} spares {spares}: {r}", flush=True)
            runs.append(r)
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    rows = [[r["seed"], r["spares"], r["failures"], len(r["stalls"]), fmt(r["median_stall"]),
             f"{r['ett']:.3f}", r["degraded"], r["promotions"], fmt(r["promotion_delay"]),
             "; ".join(r["problems"])[:80] or "none"] for r in runs]
    headers = ["chaos seed", "spares", "failures injected", "stalls", "median stall s", "ETT",
               "degraded steps", "promotions", "failure to promotion s (median)", "problems"]
    text = table(headers, rows)
    print(text, flush=True)
    if not args.no_write:
        flags = ["--quick"] if args.quick else ["--seeds", args.seeds, "--steps", str(steps)]
        body = section_header("Hot spares: none against one under the same chaos", "bench.spares", flags)
        body += (f"* Load average (1 min) during the runs: {min(loads):.1f} to {max(loads):.1f}; took "
                 f"{time.monotonic() - t0:.0f} s\n\n")
        body += text + "\n\n" + READING
        write_section("spares", body)
    return 0


READING = """\
Each run: 3 training groups of the tiny model (batch 4 a group), SIGKILL chaos at the given mean
interval (`ftlm launch local --chaos-mtbf`, the same seed for both runs), `ft.heartbeat_timeout=1`.
*Degraded steps*: steps trained on fewer than three places (LR scaled by `ft.lr_policy`, fewer
samples a step). With a spare, a killed participant's place goes to the spare in the next quorum
(no catch-up): a step is degraded only while no spare is current (the spare itself was struck,
or the last one was promoted and the repaired group is still catching up). *When a spare pays for
itself* (docs/ft-protocol.md, 'Hot spares'): it costs one group's resources all the time and
gives back the degraded steps (the samples those steps did not train, and their lower LR) and
part of the stall; at N training groups it costs 1/N more GPUs and buys back
failures x (catch-up seconds) / N of training, so it pays where failures are frequent, groups are
few, or a catch-up is long (a large state over a slow link); the goodput model projects it at
scale (`ftlm simulate`: 93.9% ETT without a spare, 97.1% with one at 98,304 GPUs).
"""


if __name__ == "__main__":
    sys.exit(main())
