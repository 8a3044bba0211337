"""DiLoCo under chaos: every-step sync and DiLoCo side by side under the same seeded kills.

``python -m bench.diloco_chaos`` launches ``--groups`` groups (4) of the tiny model on the demo
data with ``ftlm launch local``'s launcher, once with ``ft.sync = "every_step"`` and once with
DiLoCo (``--inner-steps`` H, 20 by default), ``--reps`` times, interleaved. Both get the same
chaos: a SIGKILL every ``--interval`` seconds (30) of a group that trained in the last quorum.
Both train ``--steps`` inner steps per group. Reported per run, from ``summary.json``: kills, ETT, held-out
loss at the end (``final_eval_loss``), steady tokens per second, and the soak's invariants:
identical final states (n hashes for n groups), duplicated and skipped samples, and the run's
problems.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ensure_demo, publish, section_header, table


def run_once(data: Path, groups: int, mode: str, h: int, steps: int, interval: float, seed: int) -> dict:
    from ftlm.config import build_config
    from ftlm.launch.chaos import Chaos
    from ftlm.launch.local import LocalLauncher

    diloco = mode == "diloco"
    with tempfile.TemporaryDirectory(prefix="ftlm-bench-diloco-chaos-") as tmp:
        config = build_config({
            "run": {"name": "diloco-chaos", "dir": str(Path(tmp) / "run"), "seed": 3},
            "model": {"size": "tiny", "vocab_size": 4096, "dim": 64, "n_layers": 2, "n_heads": 4,
                      "n_kv_heads": 2, "ffn_dim": 128, "max_seq_len": 128},
            "data": {"dir": str(data), "seq_len": 128, "prefetch": 2},
            "train": {"steps": steps // h if diloco else steps, "batch_size": 4, "lr": 3e-3,
                      "warmup_steps": 5, "threads": 1},
            "checkpoint": {"every": 0},
            "ft": {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0, "join_timeout": 15.0,
                   "allreduce_timeout": 5.0, "quorum_timeout": 30.0, "give_up_seconds": 120.0,
                   "restart_delay": 0.2, "sync": mode,
                   **({"diloco_inner_steps": h} if diloco else {})},
            "observe": {"progress": False},
        })
        launcher = LocalLauncher(config, groups=groups, progress=False)
        launcher.chaos = Chaos(interval, seed, regular=True, participants_only=True)
        t0 = time.monotonic()
        summary = launcher.run()
        if launcher.stopped_by:
            raise KeyboardInterrupt(launcher.stopped_by)
    hashes = summary.get("state_hashes") or {}
    data_acc = summary.get("data") or {}
    return {"mode": f"DiLoCo H={h}" if diloco else "every step", "seconds": time.monotonic() - t0,
            "kills": summary.get("failures_injected", 0), "ett": summary.get("ett", 0.0),
            "loss": summary.get("final_eval_loss"), "rate": summary.get("steady_tokens_per_second", 0.0),
            "identical": len(hashes) == groups and len(set(hashes.values())) == 1,
            "duplicates": data_acc.get("duplicates"), "gaps": data_acc.get("gaps"),
            "problems": summary.get("problems") or []}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.diloco_chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=4, help="groups (default 4)")
    p.add_argument("--inner-steps", type=int, default=20, help="DiLoCo H (default 20)")
    p.add_argument("--steps", type=int, default=1000, help="inner steps per group per run (default 1000)")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between SIGKILLs (default 30)")
    p.add_argument("--seed", type=int, default=0, help="seed of the chaos (default 0)")
    p.add_argument("--reps", type=int, default=1, help="interleaved repetitions (default 1)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    if args.groups < 2 or args.inner_steps < 2 or args.steps % args.inner_steps or args.reps < 1:
        p.error("--groups at least 2, --inner-steps at least 2 dividing --steps, --reps at least 1")
    data = ensure_demo()
    runs, loads, t0 = [], [os.getloadavg()[0]], time.monotonic()
    for rep in range(args.reps):
        for mode in ("every_step", "diloco"):
            r = run_once(data, args.groups, mode, args.inner_steps, args.steps, args.interval, args.seed)
            r["rep"] = rep
            loads.append(os.getloadavg()[0])
            print(f"rep {rep} {mode}: {r}", flush=True)
            runs.append(r)
    fmt = lambda x, f: "n/a" if x is None else format(x, f)  # noqa: E731
    rows = [[r["rep"], r["mode"], r["kills"], f"{r['ett']:.3f}", fmt(r["loss"], ".4f"), f"{r['rate']:,.0f}",
             f"{r['seconds']:.0f}", "yes" if r["identical"] else "NO", fmt(r["duplicates"], "d"),
             fmt(r["gaps"], "d"), "; ".join(r["problems"])[:80] or "none"] for r in runs]
    text = table(["rep", "mode", "kills", "ETT", "held-out loss", "steady tokens/s", "wall s",
                  f"{args.groups} identical final states", "duplicated samples", "skipped samples",
                  "problems"], rows)
    flags = [f"--groups {args.groups}", f"--inner-steps {args.inner_steps}", f"--steps {args.steps}",
             f"--interval {args.interval:g}", f"--seed {args.seed}", f"--reps {args.reps}"]
    body = (section_header("DiLoCo under chaos: every step vs DiLoCo, the same kills", "bench.diloco_chaos", flags)
            + f"* Load average (1 min) during the runs: {min(loads):.1f} to {max(loads):.1f}; took "
            f"{time.monotonic() - t0:.0f} s\n\n"
            + f"{args.groups} groups of the tiny model, {args.steps} inner steps per group per run; every "
            f"{args.interval:g} s a group that trained in the last quorum is SIGKILLed (the same seed for both "
            "modes). DiLoCo: a kill during an inner phase fails that outer step for every group; it is "
            "retried without the killed group, and every sample of the failed phase is given out again "
            "(none counted twice, none skipped).\n\n" + text + "\n")
    return publish("diloco_chaos", body, not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
