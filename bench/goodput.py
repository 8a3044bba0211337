"""Goodput simulator: the paper's two numbers, ftlm at 98,304 GPUs, calibration on real runs, spot.

Four tables into the ``goodput`` section of BENCHMARKS.md:

1. Reproduction: the FT-HSDP paper's ETTs (synchronous checkpoint-restart ~44%, FT-HSDP ~80%,
   98,304 GPUs in 12 groups, a failure every ~18 minutes) next to the simulator's.
2. Projection: ftlm at the same scale with its measured stall (and the parameters used), with
   and without spares, and the sweep plots (ETT vs scale, group size, MTBF, stall, spares),
   written to ``docs/goodput/``.
3. Calibration: real ``ftlm launch local`` chaos runs (4 groups, tiny model, a kill every ~30 s)
   measured by ``ftlm.goodput.calibrate`` and simulated as the same job: projected vs measured ETT.
4. Spot vs on-demand at the projection's scale.

    python -m bench.goodput [--quick] [--real-runs K] [--steps N] [--calibrate DIR ...]

``--real-runs K`` runs K chaos jobs (seeds 1..K, each a few minutes on 2 cores) in
``runs/goodput/``; ``--calibrate`` reuses finished run directories instead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO_ROOT, ensure_demo, publish, section_header, table
from ftlm.goodput import estimate, run
from ftlm.goodput.calibrate import GAP_STEPS, Calibration, calibrate
from ftlm.goodput.model import JobModel
from ftlm.goodput.presets import DAYS, PAPER_ETT, ftlm_projection, paper_ft, paper_sync
from ftlm.goodput.spot import compare_spot
from ftlm.goodput.sweep import SWEEPS, plot_sweep, plot_timeline, run_sweep
from ftlm.observe.events import read_events
from ftlm.observe.summary import commit_steps, final_history

SECTION = "goodput"
PLOTS = REPO_ROOT / "docs" / "goodput"
RUNS_DIR = REPO_ROOT / "runs" / "goodput"
BENCH_STALL = 2.04
"""ftlm's SIGKILL stall beyond one step measured by bench.ft_vs_torchft (tiny, 3 groups)."""
BENCH_DETECTION = 1.0
"""ftlm's heartbeat timeout."""


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def reproduction(days: float, runs: int) -> str:
    rows = []
    for name, model, key in (("synchronous + checkpoint-restart", paper_sync(days * DAYS),
                              "checkpoint_restart"),
                             ("FT-HSDP (3 min stall)", paper_ft(days * DAYS), "ft")):
        est = estimate(model, runs=runs)
        params = (f"restart {model.restart:.0f} s (60 s detection incl.), checkpoint "
                  f"{model.checkpoint_cost:.0f} s every {model.interval:.0f} s (Young/Daly)"
                  if key == "checkpoint_restart" else
                  f"stall {model.stall:.0f} s, group back {model.restart:.0f} s after the failure")
        rows.append([name, _pct(PAPER_ETT[key]), f"{_pct(est.ett)} ± {_pct(est.ett_std)}",
                     f"{100 * (est.ett - PAPER_ETT[key]):+.1f}", params])
    return table(["job (98,304 GPUs, 12 x 8,192, MTBF 18 min)", "paper ETT", "simulated ETT",
                  "points", "simulator parameters"], rows)


def projection_models(cal: list[Calibration], days: float) -> tuple[dict[str, JobModel], str]:
    """ftlm's projection models and where their stall came from."""
    if cal:
        stall = sum(c.stall for c in cal) / len(cal)
        detection = sum(c.detection for c in cal) / len(cal) or BENCH_DETECTION
        rejoin = sum(c.rejoin_stall for c in cal) / len(cal)
        source = (f"mean of the {len(cal)} calibration run(s) below: stall beyond a step "
                  f"{stall:.2f} s, detection {detection:.2f} s, rejoin stall {rejoin:.2f} s")
    else:
        stall, detection, rejoin = BENCH_STALL, BENCH_DETECTION, 0.0
        source = f"BENCHMARKS.md ft_vs_torchft: stall beyond a step {stall} s, detection 1 s"
    base = ftlm_projection(stall, detection, rejoin_stall=rejoin, duration=days * DAYS)
    return {"ftlm": base, "ftlm + 1 spare": base.with_changes(spares=1),
            "ftlm, paper's 60 s detection": base.with_changes(
                detection=60.0, stall=base.stall + 59.0)}, source


def projection(models: dict[str, JobModel], runs: int) -> str:
    rows = []
    for name, model in models.items():
        est = estimate(model, runs=runs)
        lost = est.mean("lost_gpu_hours")
        total = sum(lost.values()) or 1.0
        causes = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(lost.items(), key=lambda kv: -kv[1])
                           if v / total >= 0.005)
        rows.append([name, f"{model.stall:.1f}", f"{model.catchup:.2f}", str(model.spares),
                     f"{_pct(est.ett)} ± {_pct(est.ett_std)}", causes])
    return table(["job (98,304 GPUs, MTBF 18 min)", "stall s", "catch-up s", "spares", "ETT",
                  "lost GPU-hours by cause"], rows)


def sweeps(models: dict[str, JobModel], days: float, runs: int, names: list[str]) -> str:
    comparison = {"ftlm": models["ftlm"], "paper FT-HSDP": paper_ft(days * DAYS),
                  "checkpoint-restart": paper_sync(days * DAYS)}
    plot_timeline({k: run(m, 0, record=True) for k, m in comparison.items()},
                  PLOTS / "timeline.png", hours=3.0)
    # One row per sweep, its points in order: five sweeps in one table (plots in docs/goodput/).
    rows = []
    for name in names:
        sweep = run_sweep(name, comparison, runs=runs)
        plot_sweep(sweep, PLOTS / f"sweep_{name}.png")
        rows.append([f"{sweep.label}: {' / '.join(f'{v:g}' for v in sweep.values)}"]
                    + [" / ".join(f"{e * 100:.1f}" for e in sweep.ett[job]) for job in comparison])
    return ("ETT (%) along each sweep, the other settings as in table 2 (plots: "
            "`docs/goodput/sweep_*.png`, a 3-hour timeline: `docs/goodput/timeline.png`):\n\n"
            + table(["sweep", *comparison], rows) + "\n")


def real_runs(k: int, steps: int, mtbf: float) -> list[Path]:
    ensure_demo()
    dirs = []
    for seed in range(1, k + 1):
        run_dir = RUNS_DIR / f"cal-seed{seed}"
        cmd = [sys.executable, "-m", "ftlm.cli", "launch", "local", "configs/tiny.toml",
               "--groups", "4", "--chaos-mtbf", f"{mtbf:g}", "--chaos-seed", str(seed),
               "--set", f"run.dir={run_dir}", "--set", f"train.steps={steps}",
               "--set", "observe.progress=false"]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=REPO_ROOT, check=False, timeout=1800)
        dirs.append(run_dir)
    return dirs


def rate_by_thirds(run_dir: Path, groups: int) -> list[float | None]:
    """The token rate with all groups committing in each third of the run (tokens per second;
    None where a third has no such step): the model takes it to be constant, which it is only on
    a box whose speed does not change under the job."""
    events = sorted(final_history(read_events(run_dir / "events.jsonl"))[0], key=lambda e: e["ts"])
    steps = sorted(commit_steps(events), key=lambda r: r.ts)
    participants: dict[int, int] = {}
    for e in events:
        if e["kind"] == "commit" and isinstance(e.get("participants"), int):
            participants[e["step"]] = max(participants.get(e["step"], 0), e["participants"])
    if len(steps) < 2:
        return [None, None, None]
    first, span = steps[0].ts, (steps[-1].ts - steps[0].ts) or 1.0
    gaps = sorted(b.ts - a.ts for a, b in itertools.pairwise(steps))
    longest = GAP_STEPS * gaps[len(gaps) // 2]  # a longer gap is a stall, as in the calibration
    thirds = [[0.0, 0.0] for _ in range(3)]
    for prev, rec in itertools.pairwise(steps):
        dt = rec.ts - prev.ts
        if participants.get(rec.step) == groups and 0 < dt <= longest:
            third = thirds[min(2, int(3 * (rec.ts - first) / span))]
            third[0] += rec.tokens
            third[1] += dt
    return [tokens / seconds if seconds else None for tokens, seconds in thirds]


def calibration_table(cal: list[Calibration], runs: int) -> tuple[str, list[float]]:
    rows, diffs = [], []
    for c in cal:
        est = estimate(c.local_model(), runs=runs)
        replay = run(c.replay_model(), 0).ett
        diffs.append((100 * (replay - c.measured_ett), 100 * (est.ett - c.measured_ett)))
        thirds = ", ".join("-" if r is None else f"{r:,.0f}" for r in rate_by_thirds(Path(c.run_dir), c.groups))
        rows.append([Path(c.run_dir).name, f"{c.duration:.0f}", str(c.failures),
                     f"{c.startup:.1f}", f"{c.teardown:.1f}", f"{c.detection:.2f}",
                     f"{c.stall:.2f}", f"{c.rejoin_stall:.2f}", f"{c.restart:.1f}",
                     f"{c.catchup:.2f}", ", ".join(f"{s:.2f}" for s in c.speed_by_participants), thirds,
                     _pct(c.ett_summary), _pct(c.measured_ett),
                     f"{_pct(replay)} ({diffs[-1][0]:+.1f})",
                     f"{_pct(est.ett)} ± {_pct(est.ett_std)} ({diffs[-1][1]:+.1f})"])
    return table(["run", "wall s", "failures", "start-up s", "teardown s", "detection s",
                  "stall s", "rejoin stall s", "restart s", "catch-up s",
                  "speed with 1..4 groups", "all-groups tok/s by thirds of the run", "ETT (summary.json)",
                  "ETT measured",
                  "simulated, failures replayed (points)",
                  "simulated, random failures (points)"], rows), diffs


def _run_command(run_dir: Path) -> str:
    """The ``launch local`` command of a calibration run, from what its record says."""
    summary = json.loads((run_dir / "summary.json").read_text())
    config = summary.get("config") or {}
    steps = (config.get("train") or {}).get("steps")
    start = next((e for e in read_events(run_dir / "events.jsonl") if e["kind"] == "run_start"), {})
    try:
        where = run_dir.resolve().relative_to(REPO_ROOT)
    except ValueError:
        where = run_dir
    seed = re.search(r"(\d+)$", run_dir.name)
    return (f"ftlm launch local configs/tiny.toml --groups {len(summary.get('groups') or [])} "
            f"--chaos-mtbf {start.get('chaos_mtbf', '?'):g} --chaos-seed "
            f"{seed.group(1) if seed else '?'} --set train.steps={steps} "
            f"--set observe.progress=false --set run.dir={where}")


def _agreement(diffs: list[tuple[float, float]]) -> str:
    """One line: how far simulated and measured ETT are apart, replayed and random."""
    replay = [d[0] for d in diffs]
    random_ = [d[1] for d in diffs]
    return (f"Simulated minus measured, failures replayed: largest {max(map(abs, replay)):.1f} "
            f"points, mean {sum(replay) / len(replay):+.1f}; random failures at each run's rate: "
            f"largest {max(map(abs, random_)):.1f}, mean {sum(random_) / len(random_):+.1f} "
            "points.")


def spot_table(model: JobModel, runs: int) -> str:
    rows = []
    for rate, notice in ((1e-6, 30.0), (1e-5, 30.0), (1e-5, 0.0), (1e-4, 30.0)):
        od, spot = compare_spot(model, 4.0, 1.5, rate, notice, runs=runs)
        for r in (od, spot) if not rows else (spot,):
            label = "on-demand" if r is od else (f"spot, {rate * 1e6:g} preemptions per million "
                                                 f"GPU-hours, {notice:g} s notice")
            rows.append([label, f"{r.price_per_gpu_hour:g}", _pct(r.ett),
                         f"{r.preemptions:.0f}", f"{r.paid_gpu_hours / 1e6:.2f}",
                         f"{r.per_effective_gpu_hour:.3f}",
                         "-" if r is od else f"{1 - r.per_effective_gpu_hour / od.per_effective_gpu_hour:.1%}"])
    return table(["capacity", "price per GPU-hour", "ETT", "preemptions", "paid M GPU-hours",
                  "price per effective GPU-hour", "saving"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short simulations, no real runs")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--real-runs", type=int, default=0, help="real chaos runs to make (default 0)")
    p.add_argument("--steps", type=int, default=100, help="steps per real run (default 100)")
    p.add_argument("--mtbf", type=float, default=30.0, help="chaos MTBF of real runs (default 30)")
    p.add_argument("--calibrate", nargs="*", default=None, metavar="RUN_DIR",
                   help="finished run directories to calibrate on (default: runs/goodput/cal-*)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    days, runs = (3.0, 2) if args.quick else (30.0, 8)
    dirs = real_runs(args.real_runs, args.steps, args.mtbf) if args.real_runs else [
        Path(d) for d in (args.calibrate if args.calibrate is not None
                          else sorted(str(d) for d in RUNS_DIR.glob("cal-*")))]
    cal = [calibrate(d) for d in dirs if (Path(d) / "summary.json").is_file()]
    models, source = projection_models(cal, days)
    parts = [section_header("Goodput simulator: `ftlm simulate`", "bench.goodput",
                            ["--quick"] if args.quick else []),
             f"* Simulation: {runs} seeded runs of {days:g} simulated days per figure (± is the "
             "standard deviation of one run); exponential failures at a constant rate per GPU.",
             "", "### 1. Reproduction of the FT-HSDP paper", "", reproduction(days, runs), "",
             "### 2. ftlm at 98,304 GPUs (12 x 8,192)", "",
             f"Stall per failure = measured stall beyond one step ({source}) + one 20 s step "
             "redone at that scale; the failed group's nodes come back as slowly as the paper's "
             "(600 s from the failure); catch-up fetches a 405B model's AdamW state (12 bytes "
             "per parameter, 8,192 shards) at 10 GB/s per GPU without stopping anyone.", "",
             projection(models, runs), "",
             sweeps(models, days if not args.quick else 1.0, 2 if not args.quick else 1,
                    list(SWEEPS)), ""]
    if cal:
        text, diffs = calibration_table(cal, max(runs, 32))
        commands = "; ".join(f"`{_run_command(Path(c.run_dir))}`" for c in cal)
        parts += ["### 3. Calibration: simulated vs measured on this machine", "",
                  f"Runs: {commands}, each "
                  "measured by `ftlm simulate --calibrate RUN_DIR` and simulated as the same job "
                  "(same duration, start-up, failure rate, stall, restart, catch-up and speed by "
                  "participants), once with the run's own failures replayed (times and groups) "
                  "and as the mean of 32 seeded runs with random failures at the run's rate (± "
                  "the standard deviation of one run). *ETT measured* and the simulated ETTs "
                  "divide by the same reference rate (steps with all 4 groups committing, or the "
                  "summary's steady rate when there are fewer than 10 of them), so their "
                  "difference is that of committed tokens; *summary.json* is the run's own ETT.", "",
                  text, "", _agreement(diffs)]
    else:
        parts += ["### 3. Calibration", "", "No calibration run directory was given."]
    parts += ["", "### 4. Spot vs on-demand (ftlm at 98,304 GPUs, no spares)", "",
              "On-demand 4.0 and spot 1.5 per GPU-hour (illustrative prices); a preemption with "
              "at least 10 s of notice is a clean leave (no failure stall), the capacity comes "
              "back after 600 s, then the group restarts (600 s) and catches up. Preempted "
              "capacity is not paid for.", "", spot_table(models["ftlm"], runs), "",
              f"* Took {time.perf_counter() - t0:.0f} s."]
    body = "\n".join(parts)
    return publish(SECTION, body, write=not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
