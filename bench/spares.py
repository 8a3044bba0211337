"""Hot spares against none under the same failures: stall per failure, ETT, and the simulator.

``python -m bench.spares`` launches the tiny model on the demo data with ``ftlm launch local``'s
launcher, ``--groups`` training groups (4 by default), without a spare and with one
(``--spares 1``), interleaved, ``--reps`` times each. Both runs of a repetition get the same
seeded chaos (seed ``--seed`` plus the repetition: independent between repetitions): a SIGKILL
every ``--interval`` seconds exactly (30 by default), of a group that trained in the last quorum
(never a spare, a group still starting or recovering, or the last up-to-date group), so that
both runs see the same number of training failures. With several repetitions a second table
gives each side's stall per failure and ETT as a 95% t-interval over the repetitions.

Measured per run from ``summary.json`` and ``events.jsonl``: failures injected, the stall charged
to each failure (``stall_seconds``, median, also in median steps), ETT, the steps trained on
fewer than all places (degraded: fewer samples a step, a lower LR), promotions and the seconds
from a failure to its promotion. Each run is then calibrated (``ftlm simulate --calibrate`` on
its directory, before the directory is removed) and simulated with its own failures replayed:
the simulator's ETT against the measured one. It writes its section of BENCHMARKS.md unless
``--no-write``. The spare's cost in GPU-hours (one more group's resources) is the goodput
model's (``ftlm simulate --spares``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ensure_demo, median, section_header, t_interval, table, write_section


RESTART_DELAY = 0.2
"""Seconds before the launcher restarts a killed group (``ft.restart_delay``): at once."""


def stall_parts(events: list[dict], step: float) -> list[tuple[float, float, float]]:
    """Each injected kill's commit gap in three parts, in seconds: the doomed step (from the
    healthy groups' last commit before the kill to the first of them failing its collective:
    the step the failure takes with it), detection (from there to the coordinator's next quorum,
    which waits until it knows who failed), and restart (from that quorum to the next commit,
    less a median ``step``: the new process group and the step's slower start). Their sum is
    the gap less a median step, the failure's ``stall_seconds`` when this gap is its longest."""
    parts = []
    for kill in (e for e in events if e["kind"] == "failure_injected" and e.get("signal") == "SIGKILL"):
        t, dead = kill["ts"], kill.get("target")
        others = [e for e in events if e.get("group") not in (dead, "supervisor", "coordinator")]
        before = [e["ts"] for e in others if e["kind"] == "commit" and e["ts"] <= t]
        quorum = next((e["ts"] for e in events if e["kind"] == "quorum" and e["ts"] > t), None)
        if not before or quorum is None:
            continue
        after = next((e["ts"] for e in others if e["kind"] == "commit" and e["ts"] > quorum), None)
        failed = next((e["ts"] for e in others if e["kind"] == "step_failed" and t < e["ts"] <= quorum), None)
        if after is None:
            continue
        failed = failed if failed is not None else t  # no collective failed: the kill itself
        parts.append((failed - max(before), quorum - failed, after - quorum - step))
    return parts


def run_once(data: Path, groups: int, spares: int, steps: int, interval: float, seed: int,
             rep: int, dim: int = 64, layers: int = 2, restart_delay: float = RESTART_DELAY) -> dict:
    from ftlm.config import build_config
    from ftlm.goodput.calibrate import calibrate
    from ftlm.goodput.engine import run
    from ftlm.launch.chaos import Chaos
    from ftlm.launch.local import LocalLauncher
    from ftlm.observe.events import read_events

    with tempfile.TemporaryDirectory(prefix="ftlm-bench-spares-") as tmp:
        config = build_config({
            "run": {"name": "spares", "dir": str(Path(tmp) / "run"), "seed": 3},
            "model": {"size": "tiny", "vocab_size": 4096, "dim": dim, "n_layers": layers, "n_heads": 4,
                      "n_kv_heads": 2, "ffn_dim": 2 * dim, "max_seq_len": 128},
            "data": {"dir": str(data), "seq_len": 128, "prefetch": 2},
            "train": {"steps": steps, "batch_size": 4, "lr": 3e-3, "warmup_steps": 5, "threads": 1},
            "ft": {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0, "join_timeout": 15.0,
                   "allreduce_timeout": 5.0, "quorum_timeout": 30.0, "give_up_seconds": 90.0,
                   "restart_delay": restart_delay},
            "observe": {"progress": False},
        })
        t0 = time.monotonic()
        launcher = LocalLauncher(config, groups=groups, spares=spares, progress=False)
        launcher.chaos = Chaos(interval, seed, regular=True, participants_only=True)
        summary = launcher.run()
        if launcher.stopped_by:  # Ctrl-C or SIGTERM stopped this run: the bench stops with it
            raise KeyboardInterrupt(launcher.stopped_by)
        events = read_events(config.run.path / "events.jsonl")
        cal = calibrate(config.run.path)
        simulated = run(cal.replay_model(), 0).ett
    from ftlm.observe.summary import failure_events

    places = {e["step"]: e["participants"] for e in events if e["kind"] == "commit"}
    stalls = summary.get("stall_seconds") or []
    kinds = [f.how == "rejoin" for f in failure_events(events)]
    failure_stalls = [x for x, rejoin in zip(stalls, kinds) if not rejoin]
    rejoin_stalls = [x for x, rejoin in zip(stalls, kinds) if rejoin]
    wire = {True: [], False: []}
    for e in events:
        if e["kind"] == "commit" and isinstance(e.get("wire_bytes"), int):
            wire[bool(e.get("spare"))].append(e["wire_bytes"])
    spare = summary.get("spares") or {}
    delays = spare.get("failure_to_promotion_seconds") or []
    step = float(summary.get("median_step_seconds") or 0.0)
    parts = stall_parts(events, step)
    return {"parts": [median([p[i] for p in parts]) if parts else None for i in range(3)],
            "spares": spares, "rep": rep, "seconds": time.monotonic() - t0,
            "failures": summary.get("failures_injected", 0), "stalls": failure_stalls,
            "median_stall": median(failure_stalls) if failure_stalls else 0.0, "step": step,
            "median_rejoin": median(rejoin_stalls) if rejoin_stalls else None,
            "spare_wire": median(wire[True]) / median(wire[False]) if wire[True] and wire[False] else None,
            "ett": summary.get("ett", 0.0), "measured": cal.measured_ett, "simulated": simulated,
            "degraded": sum(1 for n in places.values() if n < groups),
            "promotions": spare.get("promotions", 0),
            "promotion_delay": median(delays) if delays else None,
            "problems": summary.get("problems") or []}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spares", description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=4, help="training groups (default 4)")
    p.add_argument("--interval", type=float, default=30.0,
                   help="seconds between SIGKILLs of a training group (default 30)")
    p.add_argument("--steps", type=int, default=1500, help="steps per run (default 1500)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the chaos (which group is killed); repetition r uses seed + r")
    p.add_argument("--reps", type=int, default=1, help="runs of each kind, interleaved (default 1)")
    p.add_argument("--dim", type=int, default=64,
                   help="model width (default 64; larger: longer steps, so detection is a smaller part of one)")
    p.add_argument("--layers", type=int, default=2, help="model layers (default 2)")
    p.add_argument("--restart-delay", type=float, default=RESTART_DELAY, metavar="S",
                   help=f"seconds before a killed group is restarted (default {RESTART_DELAY:g}: at once). "
                        "Longer emulates a replacement on another node: here, on 2 shared cores, a restart "
                        "at once takes CPU from the survivors' first steps after the kill; another value "
                        "writes its own section (spares_restart_delay)")
    p.add_argument("--quick", action="store_true", help="smoke size: 3 groups, 150 steps, a kill every 10 s")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    if args.restart_delay < 0:
        p.error("--restart-delay must be at least 0")
    if args.quick:
        args.groups, args.steps, args.interval = 3, 150, 10.0
    if args.groups < 2 or args.steps < 20 or args.interval <= 0 or args.reps < 1:
        p.error("--groups at least 2, --steps at least 20, --interval above 0, --reps at least 1")
    if args.dim < 16 or args.dim % 4 or args.layers < 1:
        p.error("--dim a multiple of 4 (its 4 heads), at least 16; --layers at least 1")
    data = ensure_demo()
    loads = [os.getloadavg()[0]]
    t0 = time.monotonic()
    runs = []
    for rep in range(args.reps):
        for spares in (0, 1):
            r = run_once(data, args.groups, spares, args.steps, args.interval, args.seed + rep, rep,
                         args.dim, args.layers, args.restart_delay)
            loads.append(os.getloadavg()[0])
            print(f"rep {rep} spares {spares}: {r}", flush=True)
            runs.append(r)
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    rows = [[r["rep"], r["spares"], r["failures"],
             f"{r['median_stall']:.2f} ({r['median_stall'] / r['step']:.1f})" if r["step"] else fmt(r["median_stall"]),
             " / ".join(fmt(x) for x in r["parts"]),
             fmt(r["median_rejoin"]), f"{r['step']:.3f}",
             f"{r['ett']:.3f}", f"{r['measured']:.3f}", f"{r['simulated']:.3f}",
             f"{100 * (r['simulated'] - r['measured']):+.1f}", r["degraded"], r["promotions"],
             fmt(r["promotion_delay"]), fmt(r["spare_wire"]),
             "; ".join(r["problems"])[:80] or "none"] for r in runs]
    headers = ["rep", "spares", "failures injected", "stall per failure s (steps), median",
               "doomed step / detection / restart s, medians", "rejoin stall s, median", "median step s", "ETT (summary)",
               "ETT (simulator's reference)", "simulated, failures replayed",
               "simulated - measured (points)", "degraded steps", "promotions",
               "failure to promotion s (median)", "spare's bytes / participant's", "problems"]
    text = table(headers, rows)
    if args.reps > 1:
        text += "\n\n" + over_reps(runs)
    print(text, flush=True)
    if not args.no_write:
        flags = ["--quick"] if args.quick else ["--groups", str(args.groups), "--interval",
                                                f"{args.interval:g}", "--steps", str(args.steps),
                                                "--seed", str(args.seed), "--reps", str(args.reps),
                                                "--dim", str(args.dim), "--layers", str(args.layers)]
        delayed = args.restart_delay != RESTART_DELAY
        if delayed:
            flags += ["--restart-delay", f"{args.restart_delay:g}"]
        title = "Hot spares: none against one under the same failures" + (
            f", the killed group restarted {args.restart_delay:g} s later (as on another node)" if delayed else "")
        body = section_header(title, "bench.spares", flags)
        body += (f"* Load average (1 min) during the runs: {min(loads):.1f} to {max(loads):.1f}; took "
                 f"{time.monotonic() - t0:.0f} s\n\n")
        body += text + "\n\n" + READING.format(groups=args.groups, interval=args.interval, dim=args.dim, layers=args.layers)
        if delayed:
            body += DELAYED.format(delay=args.restart_delay)
        write_section("spares_restart_delay" if delayed else "spares", body)
    return 0


def over_reps(runs: list[dict]) -> str:
    """Each side's per-repetition medians as 95% t-intervals over the repetitions (independent
    chaos seeds), and every failure's stall pooled."""
    rows = []
    for spares in (0, 1):
        side = [r for r in runs if r["spares"] == spares and r["step"]]
        if len(side) < 2:
            continue
        in_steps = [r["median_stall"] / r["step"] for r in side]
        pooled = [x / r["step"] for r in side for x in r["stalls"]]
        cell = lambda values, digits=2: "{:.{d}f} ± {:.{d}f}".format(*t_interval(values), d=digits)  # noqa: E731
        rows.append([spares, len(side), sum(len(r["stalls"]) for r in side), cell(in_steps),
                     f"{median(pooled):.2f}", f"{sum(x <= 1.0 for x in pooled)} of {len(pooled)}",
                     cell([r["measured"] for r in side], 3), cell([r["ett"] for r in side], 3)])
    return table(["spares", "repetitions", "failures", "stall per failure, steps (repetitions' medians)",
                  "stall per failure, steps (all failures' median)", "failures stalled one step or less",
                  "ETT (simulator's reference)", "ETT (summary)"], rows)


READING = (
    "{groups} training groups of a small Transformer (width {dim}, {layers} layers); every {interval:g} s one that trained in the last "
    "quorum is SIGKILLed (the same seeded kills for both sides of a repetition, other seeds for "
    "other repetitions). *Stall per failure*: the job's stall charged to "
    "a failure (`stall_seconds`: its longest commit gap less a median step), in seconds and in "
    "median steps, and in three parts: the *doomed step* (from the last commit before the kill to "
    "the first healthy group failing its collective: the step the failure takes with it), "
    "*detection* (to the coordinator's next quorum, which waits until it knows who failed) and "
    "*restart* (from that quorum to the next commit, less a median step); *rejoin stall*: the same for a repaired group's return. *Degraded steps*: trained on fewer than {groups} places "
    "(fewer samples, a lower LR); with a spare, only while no spare is current. *Simulated*: "
    "`ftlm simulate --calibrate` on the run, its own failures replayed, against the ETT of the "
    "simulator's reference (committed tokens over wall time at the all-places rate). *Spare's "
    "bytes*: what a spare sends in a step's all-reduce over what a participant sends (it enters "
    "it with zeros). ETT on 2 shared cores: the spare's process (its update each step) slows the "
    "others (see the median step). The second table (with several repetitions): each side's "
    "per-repetition medians as a 95% t-interval over the repetitions, every failure pooled, and "
    "the ETTs the same way. When a spare pays for itself: docs/ft-protocol.md, 'Hot spares'.\n")


DELAYED = (
    "Here the launcher restarts a killed group {delay:g} s after its death (`ft.restart_delay`), not at once: on a "
    "cluster the replacement starts on other hardware (another node, or the repaired one later), while on this "
    "2-core box a restart at once spends the survivors' CPU during the first steps after the kill. The section "
    "above restarts at once.\n")


if __name__ == "__main__":
    sys.exit(main())
