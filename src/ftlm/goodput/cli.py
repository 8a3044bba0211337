"""``ftlm simulate``: project goodput and cost of a training job with the goodput simulator.

Parses the options into a ``JobModel`` (a preset, then any option given), runs the simulation,
and prints ETT, lost GPU-hours by cause and GPU-hours by state; optionally sweeps, plots,
calibrates on a run directory and compares spot with on-demand capacity. It decides nothing
itself; ``ftlm.goodput`` does the work. Imports stay light until the command runs.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

PRESETS = ("paper-ft", "paper-sync", "ftlm")
DEFAULT_FTLM_STALL = 2.04
"""ftlm's SIGKILL stall beyond one step, tiny model, 3 groups (BENCHMARKS.md, ft_vs_torchft)."""
DEFAULT_FTLM_DETECTION = 1.0
"""ftlm's default heartbeat timeout (docs/design.md, 'Failure detection')."""

# Option -> JobModel field, for the options that set one field as given.
_FIELDS = {"groups": "groups", "gpus_per_group": "gpus_per_group", "spares": "spares",
           "mode": "mode", "detection": "detection", "stall": "stall", "restart": "restart",
           "state_bytes_per_gpu": "state_bytes_per_gpu", "bandwidth": "catchup_bandwidth",
           "catchup_extra": "catchup_extra", "rejoin_stall": "rejoin_stall",
           "checkpoint_cost": "checkpoint_cost", "checkpoint_interval": "checkpoint_interval",
           "startup": "startup", "gpu_mtbf_hours": "gpu_mtbf_hours"}


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``simulate`` subcommand."""
    p = sub.add_parser("simulate", help="goodput and cost simulation of a large training job "
                       "(ETT, lost GPU-hours, sweeps, calibration, spot vs on-demand)",
                       description="Discrete-event simulation of a training job at replica-group "
                       "granularity; see docs/goodput.md.")
    p.add_argument("--preset", choices=PRESETS, default="paper-ft",
                   help="starting point (default paper-ft): the FT-HSDP paper's FT-HSDP or "
                        "synchronous checkpoint-restart job at 98,304 GPUs, or ftlm at that scale")
    g = p.add_argument_group("job (each overrides the preset)")
    g.add_argument("--mode", choices=("ft", "checkpoint_restart"))
    g.add_argument("--groups", type=int, help="training replica groups")
    g.add_argument("--gpus-per-group", type=int, help="GPUs per replica group")
    g.add_argument("--spares", type=int, help="spare groups kept started (ft)")
    fail = g.add_mutually_exclusive_group()
    fail.add_argument("--gpu-mtbf-hours", type=float, help="mean hours between failures of one GPU")
    fail.add_argument("--job-mtbf-minutes", type=float,
                      help="mean minutes between failures of the whole allocation")
    fail.add_argument("--failures", choices=("llama3", "ft-hsdp"),
                      help="per-GPU failure rate of a published anchor: Llama 3 (466 in 54 days "
                           "on 16,384 GPUs) or the FT-HSDP paper (18 min at 98,304 GPUs)")
    g.add_argument("--detection", type=float, help="seconds to detect a failure")
    g.add_argument("--stall", type=float, help="ft: seconds every group stops per failure")
    g.add_argument("--restart", type=float, help="seconds from a failure until the failed group "
                   "(ft) or the job (checkpoint_restart) runs again")
    g.add_argument("--state-bytes-per-gpu", type=float, help="ft: state bytes each GPU fetches "
                   "when its group rejoins")
    g.add_argument("--bandwidth", type=float, help="ft: bytes/s per GPU of the state transfer")
    g.add_argument("--catchup-extra", type=float, help="ft: seconds of catch-up beyond the transfer")
    g.add_argument("--rejoin-stall", type=float, help="ft: seconds everyone stops per rejoin")
    g.add_argument("--checkpoint-cost", type=float, help="checkpoint_restart: blocking seconds "
                   "per checkpoint")
    g.add_argument("--checkpoint-interval", type=float, help="checkpoint_restart: seconds between "
                   "checkpoints (default: Young/Daly)")
    g.add_argument("--startup", type=float, help="seconds from launch to the first step")
    g.add_argument("--days", type=float, default=30.0, help="simulated days (default 30)")
    s = p.add_argument_group("simulation")
    s.add_argument("--runs", type=int, default=8, help="seeded runs to average (default 8)")
    s.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    s.add_argument("--sweep", action="append", default=[], metavar="NAME",
                   help="sweep ETT of this job, the paper's FT-HSDP and checkpoint-restart over "
                        "scale, group-size, mtbf, stall or spares (repeatable)")
    s.add_argument("--plots", metavar="DIR", help="write the timeline and sweep plots (PNG) here")
    s.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    c = p.add_argument_group("calibration and cost")
    c.add_argument("--calibrate", metavar="RUN_DIR",
                   help="measure detection, stall, restart, catch-up and speed on a finished run; "
                        "simulate that same job and compare with its measured ETT (the ftlm "
                        "preset then projects with the measured stall)")
    c.add_argument("--step-seconds", type=float, default=20.0,
                   help="ftlm preset: seconds of one step at scale, redone per failure (default "
                        "20, the paper's figure)")
    c.add_argument("--on-demand-price", type=float, help="price per on-demand GPU-hour")
    c.add_argument("--spot-price", type=float, help="price per spot GPU-hour")
    c.add_argument("--preemptions-per-gpu-hour", type=float, default=0.0,
                   help="spot preemptions per GPU-hour (with both prices: spot vs on-demand)")
    c.add_argument("--spot-notice", type=float, help="seconds of notice a preemption gives "
                   "(default 30)")
    x = p.add_argument_group("groups in several data centres (--cross-dc; docs/diloco.md)")
    x.add_argument("--cross-dc", action="store_true",
                   help="project every-step, DiLoCo and streaming DiLoCo with the groups spread over "
                        "regions joined by slow links: step time, tokens/s, ETT, days to target")
    x.add_argument("--params", type=float, default=70e9, help="model parameters (default 70e9)")
    x.add_argument("--regions", default="2,4", help="region counts to compare (default 2,4)")
    x.add_argument("--gbits", default="1,10", help="Gbit/s per link between regions (default 1,10)")
    x.add_argument("--rtt-ms", type=float, default=50.0, help="round trip between regions (default 50)")
    x.add_argument("--inner-steps", type=int, default=100, help="DiLoCo H (default 100)")
    x.add_argument("--fragments", type=int, default=4, help="streaming fragments (default 4)")
    x.add_argument("--token-overhead", type=float, default=0.0,
                   help="extra tokens the DiLoCo modes need for the same loss, a fraction (default 0)")
    p.set_defaults(fn=cmd_simulate)


def _check_args(args: argparse.Namespace) -> None:
    from ftlm.errors import ConfigError
    if args.runs < 1:
        raise ConfigError(f"--runs={args.runs} must be at least 1")
    if not (isinstance(args.days, float) and math.isfinite(args.days) and args.days > 0):
        raise ConfigError(f"--days={args.days} must be a number > 0")
    if args.job_mtbf_minutes is not None and not args.job_mtbf_minutes > 0:
        raise ConfigError(f"--job-mtbf-minutes={args.job_mtbf_minutes} must be > 0")
    from ftlm.goodput.sweep import SWEEPS
    unknown = [n for n in args.sweep if n not in SWEEPS]
    if unknown:
        raise ConfigError(f"--sweep {', '.join(unknown)}: unknown; valid: {', '.join(SWEEPS)}")
    if (args.on_demand_price is None) != (args.spot_price is None):
        raise ConfigError("spot vs on-demand needs both --on-demand-price and --spot-price")


def build_model(args: argparse.Namespace, calibration=None):
    """The ``JobModel`` the options describe: the preset, then every option given."""
    from ftlm.goodput import presets
    from ftlm.goodput.model import FT_HSDP_GPU_MTBF_HOURS, LLAMA3_GPU_MTBF_HOURS
    duration = args.days * presets.DAYS
    if args.preset == "paper-sync":
        model = presets.paper_sync(duration)
    elif args.preset == "ftlm":
        stall = calibration.stall if calibration else DEFAULT_FTLM_STALL
        detection = calibration.detection if calibration and calibration.detection else \
            DEFAULT_FTLM_DETECTION
        rejoin = calibration.rejoin_stall if calibration else 0.0
        model = presets.ftlm_projection(stall, detection, rejoin_stall=rejoin,
                                        step_seconds=args.step_seconds, duration=duration)
    else:
        model = presets.paper_ft(duration)
    changes = {field: getattr(args, opt) for opt, field in _FIELDS.items()
               if getattr(args, opt) is not None}
    if args.failures:
        changes["gpu_mtbf_hours"] = (LLAMA3_GPU_MTBF_HOURS if args.failures == "llama3"
                                     else FT_HSDP_GPU_MTBF_HOURS)
    if "stall" in changes and "detection" not in changes:
        changes["detection"] = min(model.detection, changes["stall"])
    if args.spot_notice is not None:
        changes["spot_notice"] = args.spot_notice
    if args.preemptions_per_gpu_hour:
        changes["spot_preemptions_per_gpu_hour"] = args.preemptions_per_gpu_hour
    model = model.with_changes(**changes)
    if args.job_mtbf_minutes is not None:
        model = model.with_changes(gpu_mtbf_hours=args.job_mtbf_minutes / 60 * model.allocated_gpus)
    return model


def _hours(values: dict[str, float]) -> str:
    total = sum(values.values()) or 1.0
    return ", ".join(f"{k} {v:,.0f} ({v / total:.1%})" for k, v in
                     sorted(values.items(), key=lambda kv: -kv[1]) if v)


def describe(model) -> str:
    """One line naming the job's layout and failure rate."""
    extra = (f"stall {model.stall:g} s, restart {model.restart:g} s, catch-up {model.catchup:.3g} s"
             if model.mode == "ft" else
             f"restart {model.restart:g} s, checkpoint {model.checkpoint_cost:g} s every "
             f"{model.interval:.0f} s")
    return (f"{model.groups} groups x {model.gpus_per_group:,} GPUs (+{model.spares} spares), "
            f"mode {model.mode}, job MTBF {model.job_mtbf / 60:.1f} min, {extra}")


def _numbers(text: str, name: str, kind=float) -> list:
    from ftlm.errors import ConfigError
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise ConfigError(f"--{name}={text!r}: give comma-separated numbers, e.g. --{name} 2,4")
    return values


def cmd_cross_dc(args: argparse.Namespace) -> int:
    """``--cross-dc``: the modes of ``ft.sync`` side by side (``ftlm.goodput.cross_dc``)."""
    from ftlm.goodput.cross_dc import CrossDC, format_table
    fields = {"params": args.params, "rtt": args.rtt_ms / 1e3, "inner_steps": args.inner_steps,
              "fragments": args.fragments, "token_overhead": args.token_overhead, "days": args.days}
    for opt, field in (("groups", "groups"), ("gpus_per_group", "gpus_per_group"),
                       ("gpu_mtbf_hours", "gpu_mtbf_hours")):
        if getattr(args, opt) is not None:
            fields[field] = getattr(args, opt)
    job = CrossDC(**fields)
    text = format_table(job, _numbers(args.regions, "regions", int), _numbers(args.gbits, "gbits"),
                        runs=args.runs)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"cross_dc": text}, indent=2) + "\n")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    _check_args(args)
    if args.cross_dc:
        return cmd_cross_dc(args)
    from ftlm.goodput import presets
    from ftlm.goodput.engine import estimate, run
    out: dict = {}
    calibration = None
    if args.calibrate:
        from ftlm.goodput.calibrate import calibrate
        calibration = calibrate(Path(args.calibrate))
        local = estimate(calibration.local_model(), runs=max(args.runs, 16), seed=args.seed)
        replay = run(calibration.replay_model(), args.seed)
        out["calibration"] = {**calibration.__dict__, "simulated_ett": local.ett,
                              "simulated_ett_std": local.ett_std, "replayed_ett": replay.ett}
        print(format_calibration(calibration, local.ett, local.ett_std, replay.ett))
    model = build_model(args, calibration)
    est = estimate(model, runs=args.runs, seed=args.seed)
    print(f"job: {describe(model)}")
    print(f"ETT {est.ett:.1%} (std {est.ett_std:.1%} over {args.runs} runs of {args.days:g} days; "
          f"{_per_run(est, 'failures'):.0f} failures per run)")
    print(f"lost GPU-hours by cause: {_hours(est.mean('lost_gpu_hours')) or 'none'}")
    print(f"GPU-hours by state: {_hours(est.mean('gpu_hours'))}")
    out["model"] = model.__dict__ | {"speed_by_participants": list(model.speed_by_participants)}
    out["ett"], out["ett_std"] = est.ett, est.ett_std
    out["lost_gpu_hours"], out["gpu_hours"] = est.mean("lost_gpu_hours"), est.mean("gpu_hours")
    if args.on_demand_price is not None:
        from ftlm.goodput.spot import compare_spot
        rows = compare_spot(model, args.on_demand_price, args.spot_price,
                            args.preemptions_per_gpu_hour, args.spot_notice, runs=args.runs)
        print(format_spot(rows))
        out["spot"] = [r.__dict__ | {"total": r.total,
                                     "per_effective_gpu_hour": r.per_effective_gpu_hour}
                       for r in rows]
    comparison = {"this job": model, "paper FT-HSDP": presets.paper_ft(model.duration),
                  "paper checkpoint-restart": presets.paper_sync(model.duration)}
    if args.plots:
        from ftlm.goodput.sweep import plot_timeline
        path = Path(args.plots) / "timeline.png"
        plot_timeline({k: run(m, args.seed, record=True) for k, m in comparison.items()}, path)
        print(f"timeline plot: {path}")
    for name in args.sweep:
        from ftlm.goodput.sweep import plot_sweep, run_sweep
        sweep = run_sweep(name, comparison, runs=max(1, min(args.runs, 3)))
        print(format_sweep(sweep))
        out.setdefault("sweeps", {})[name] = {"values": list(sweep.values), "ett": sweep.ett}
        if args.plots:
            print(f"plot: {plot_sweep(sweep, Path(args.plots) / f'sweep_{name}.png')}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


def _per_run(est, attr: str) -> float:
    """Mean of a per-run count (``failures``, ``preemptions``)."""
    return sum(getattr(r, attr) for r in est.results) / len(est.results)


def format_calibration(cal, simulated: float, std: float, replayed: float) -> str:
    """The calibration of one run and the simulated vs measured ETT of that same job: with
    random failures at the run's rate, and with the run's own failures replayed."""
    speeds = ", ".join(f"{s:.2f}" for s in cal.speed_by_participants)
    spares = ""
    if cal.spares:
        promotion = "none" if cal.promotion is None else f"{cal.promotion:.2f} s after a failure"
        spares = f" (+{cal.spares} spare{'s' if cal.spares > 1 else ''}; promotion {promotion})"
    lines = [f"calibration from {cal.run_dir}: {cal.groups} groups{spares}, {cal.duration:.0f} s, "
             f"{cal.failures} failures (job MTBF {cal.job_mtbf:.1f} s)",
             f"  start-up {cal.startup:.1f} s; teardown {cal.teardown:.1f} s; detection {cal.detection:.2f} s; stall per failure "
             f"{cal.stall:.2f} s; rejoin stall {cal.rejoin_stall:.2f} s",
             f"  restart {cal.restart:.1f} s; catch-up {cal.catchup:.2f} s; median step "
             f"{cal.median_step:.3f} s; speed with 1..{cal.groups} groups: {speeds}",
             f"  ETT measured {cal.measured_ett:.1%} (summary.json: {cal.ett_summary:.1%}); "
             f"simulated with the run's failures replayed {replayed:.1%} "
             f"({100 * (replayed - cal.measured_ett):+.1f} points), with random failures at its "
             f"rate {simulated:.1%} ({100 * (simulated - cal.measured_ett):+.1f} points; std of "
             f"one run {std:.1%})"]
    return "\n".join(lines)


def format_spot(rows) -> str:
    """On-demand vs spot as a few lines."""
    lines = ["capacity: ETT, paid GPU-hours, cost, cost per effective GPU-hour"]
    for r in rows:
        lines.append(f"  {r.capacity}: {r.ett:.1%}, {r.paid_gpu_hours:,.0f}, {r.total:,.0f}, "
                     f"{r.per_effective_gpu_hour:.3f} ({r.preemptions:.0f} preemptions)")
    od, spot = rows
    if od.per_effective_gpu_hour:
        lines.append(f"  spot saves {1 - spot.per_effective_gpu_hour / od.per_effective_gpu_hour:.1%}"
                     f" per effective GPU-hour and costs {100 * (od.ett - spot.ett):.1f} ETT points")
    return "\n".join(lines)


def format_sweep(sweep) -> str:
    """A sweep as a small text table."""
    head = f"ETT vs {sweep.label}: " + " | ".join(f"{v:g}" for v in sweep.values)
    rows = [f"  {k}: " + " | ".join(f"{e:.1%}" for e in etts) for k, etts in sweep.ett.items()]
    return "\n".join([head, *rows])
