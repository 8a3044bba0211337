"""Benchmark: does chaos change where training ends up? Held-out loss with and without failures.

The question of DESIGN.md (and issue 10): fault tolerance drops a failed group's slice from a
step (fewer samples that step, LR scaled by ``ft.lr_policy``) and replays updates into a
recovering group. Does the model still converge to the same place? For each seed the tiny config
(``configs/tiny.toml``) is trained as 3 replica groups by ``LocalLauncher`` twice, in turn:

* **no chaos**: no failure is injected;
* **chaos**: ``--chaos-mtbf`` SIGKILLs a random group at exponentially distributed times (seeded
  by the seed), so several groups die, restart and catch up during the run.

Both arms commit the same number of steps with the same LR schedule; the result is the held-out
loss (``eval`` event, ``train.eval_every``) of the model after the last step, on the same held-out
samples in every run (``data.eval_seed`` is fixed). Committed tokens are shown too: the chaos arm
trains fewer, because steps with a group down take 2 slices instead of 3.

Verdict: per arm the mean and sample standard deviation over seeds; the difference of the means
is *within noise* when ``|chaos - no chaos| < 2 * pooled std``, the pooled std being
``sqrt((s_chaos^2 + s_none^2) / 2)``: chaos moves the final loss less than changing the seed
does (about a 2-sigma band for a difference of two means of n=3 each, a rough test, not a
t-test). The paired difference per seed is listed as well.

    python -m bench.convergence [--quick] [--seeds N] [--steps N] [--mtbf S] [--no-write]

It does not measure speed or stalls (``ft_overhead``, ``ft_vs_torchft``) and changes nothing in
training: the arms differ only in the launcher's chaos.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import (DEMO_DIR, DEMO_SEQ_LEN, REPO_ROOT, ensure_demo, section_header, table,
                          write_section)
from ftlm.config import RunConfig, load_config

SECTION = "convergence"
GROUPS = 3
TINY_CONFIG = REPO_ROOT / "configs" / "tiny.toml"
NOISE_SIGMAS = 2.0
"""The difference of the arm means is within noise below this many pooled standard deviations."""
# Wider than tiny.toml's: three groups share two cores here, and a group that is merely slow must
# not drop out of the no-chaos arm (a failure nobody injected). The heartbeat timeout is how long
# a busy process may go unscheduled; the join timeout how far the groups' evaluations (done
# between a commit and the next quorum request) may finish apart before the slowest is left out
# of the next quorum and has to recover.
FT = {"heartbeat_timeout": 2.0, "allreduce_timeout": 10.0, "join_timeout": 5.0,
      "restart_delay": 0.5}


@dataclass(frozen=True)
class Plan:
    seeds: tuple[int, ...]
    steps: int
    eval_every: int
    eval_batches: int
    mtbf: float
    """Mean seconds between injected SIGKILLs in the chaos arm (0: that arm is skipped)."""


@dataclass
class Result:
    """One run."""

    seed: int
    chaos: bool
    eval_loss: float
    """Held-out loss after the last step (the ``eval`` events of that step; groups agree)."""
    eval_spread: float
    """Largest difference between the groups' final held-out losses (0: bitwise equal)."""
    tokens: int
    steps: int
    failures_injected: int
    failures_detected: int
    recoveries: int
    restarts: int
    replicas_identical: bool
    duplicates: int
    gaps: int
    problems: list[str]
    """Why the run does not prove fault-tolerant training correct (the launcher's check)."""
    wall_seconds: float


def run_config(plan: Plan, seed: int, run_dir: Path) -> RunConfig:
    """``configs/tiny.toml`` on the demo data, with this run's seed, length and directory."""
    overrides = {
        "run.name": f"bench-convergence-{seed}", "run.dir": str(run_dir), "run.seed": seed,
        "data.dir": str(DEMO_DIR), "data.seq_len": DEMO_SEQ_LEN,
        "train.steps": plan.steps, "train.eval_every": plan.eval_every,
        "train.eval_batches": plan.eval_batches,
        "checkpoint.every": 0, "checkpoint.resume": "false",
        "observe.progress": "false", "observe.log_every": 10**6,
        **{f"ft.{k}": v for k, v in FT.items()},
    }
    return load_config(TINY_CONFIG, [f"{k}={v}" for k, v in overrides.items()])


def run_one(plan: Plan, seed: int, chaos: bool) -> Result:
    from ftlm.launch.local import LocalLauncher
    from ftlm.observe.events import read_events
    with tempfile.TemporaryDirectory(prefix="ftlm-bench-conv-") as tmp:
        config = run_config(plan, seed, Path(tmp) / "run")
        t0 = time.perf_counter()
        summary = LocalLauncher(config, groups=GROUPS, progress=False,
                                chaos_mtbf=plan.mtbf if chaos else 0.0, chaos_seed=seed).run()
        wall = time.perf_counter() - t0
        events = read_events(config.run.path / "events.jsonl")
        final = [e["loss"] for e in events if e["kind"] == "eval" and e["step"] == plan.steps]
        if not final:
            logs = config.run.path / "logs"
            tail = "".join(p.read_text()[-1500:] for p in sorted(logs.glob("*.log")))
            raise RuntimeError(f"seed {seed} {'chaos' if chaos else 'no chaos'}: no eval event at "
                               f"step {plan.steps} (steps committed {summary['steps_committed']}, "
                               f"final steps {summary.get('final_steps')})\n{tail}")
    data = summary["data"]
    problems = list(summary.get("problems") or [])
    if max(final) != min(final):  # the groups hold the same bits, so they must agree exactly
        problems.append(f"groups' final held-out losses differ by {max(final) - min(final):.3g}")
    return Result(seed=seed, chaos=chaos, eval_loss=final[0], eval_spread=max(final) - min(final),
                  tokens=summary["tokens_committed"], steps=summary["steps_committed"],
                  failures_injected=summary["failures_injected"],
                  failures_detected=summary["failures_detected"],
                  recoveries=summary["recoveries"],
                  restarts=sum((summary.get("restarts") or {}).values()),
                  replicas_identical=bool(summary["replicas_identical"]),
                  duplicates=data["duplicates"], gaps=data["gaps"],
                  problems=problems, wall_seconds=wall)


@dataclass(frozen=True)
class Verdict:
    mean_none: float
    std_none: float
    mean_chaos: float
    std_chaos: float
    diff: float
    """mean(chaos) - mean(no chaos)."""
    pooled_std: float
    paired: tuple[float, ...]
    """chaos - no chaos per seed."""
    within_noise: bool


def compare(none: list[float], chaos: list[float]) -> Verdict:
    """The two arms' final losses (same seeds, same order) against the seed-to-seed noise."""
    if len(none) != len(chaos) or len(none) < 2:
        raise ValueError(f"need at least 2 seeds per arm, paired; got {len(none)} and {len(chaos)}")
    s_none, s_chaos = statistics.stdev(none), statistics.stdev(chaos)
    pooled = math.sqrt((s_none ** 2 + s_chaos ** 2) / 2)
    diff = statistics.fmean(chaos) - statistics.fmean(none)
    return Verdict(statistics.fmean(none), s_none, statistics.fmean(chaos), s_chaos, diff, pooled,
                   tuple(c - n for n, c in zip(none, chaos)), abs(diff) < NOISE_SIGMAS * pooled)


READING = ("*Reading:* the arms commit the same steps, not the same tokens: the difference "
           "includes the slices that steps with a group down did not train (and their lower LR "
           "under `ft.lr_policy`), and this benchmark does not separate that from any damage done "
           "by the faults themselves (a no-chaos arm trained on as many tokens would). Every run "
           "is also checked end to end: identical replicas, no sample trained twice or skipped.")

RUN_HEADERS = ["seed", "arm", "held-out loss", "committed tokens", "steps", "kills injected",
               "failures detected", "recoveries", "restarts", "replicas identical",
               "duplicates / gaps", "problems", "wall s"]


def run_row(r: Result) -> list[object]:
    return [r.seed, "chaos" if r.chaos else "no chaos", f"{r.eval_loss:.4f}", f"{r.tokens:,}",
            r.steps, r.failures_injected, r.failures_detected, r.recoveries, r.restarts,
            "yes" if r.replicas_identical else "NO", f"{r.duplicates} / {r.gaps}",
            "; ".join(r.problems) or "none", f"{r.wall_seconds:.0f}"]


def render(plan: Plan, results: list[Result], seconds: float, flags: list[str]) -> str:
    none = [r for r in results if not r.chaos]
    chaos = [r for r in results if r.chaos]
    config = run_config(plan, 0, Path("unused"))
    text = (section_header("Convergence under chaos: held-out loss with and without failures",
                           "bench.convergence", flags)
            + f"* Method: `configs/tiny.toml` (tiny model, batch {config.train.batch_size} per "
              f"group, seq_len {DEMO_SEQ_LEN}, `ft.lr_policy={config.ft.lr_policy}`, "
              f"{config.train.schedule} LR schedule) as {GROUPS} replica groups "
              f"(`LocalLauncher`, 1 thread each), {plan.steps} committed steps per run, seeds "
              f"{', '.join(map(str, plan.seeds))}, each seed run without chaos and then with "
              f"`chaos_mtbf={plan.mtbf:g}` s (SIGKILL of a random group, seeded by the seed). "
              f"Held-out loss: the `eval` event after the last step, mean cross-entropy over "
              f"{plan.eval_batches} x {config.train.batch_size} held-out samples "
              f"(`data.eval_samples={config.data.eval_samples}`, `data.eval_seed="
              f"{config.data.eval_seed}`: the same samples in every run). Committed tokens "
              f"differ: a step with a group down trains 2 slices instead of 3 (the LR scaled by "
              f"the policy); steps are equal. Verdict: *within noise* "
              f"when |mean(chaos) - mean(no chaos)| < {NOISE_SIGMAS:g} x pooled std, pooled std "
              f"= sqrt((s_chaos^2 + s_none^2) / 2) over seeds (sample std, n={len(plan.seeds)}). "
              f"Ft timeouts: {', '.join(f'{k}={v:g}' for k, v in FT.items())}. "
              f"Took {seconds:.0f} s.\n\n"
            + table(RUN_HEADERS, [run_row(r) for r in results]) + "\n")
    if len(none) >= 2 and len(none) == len(chaos):
        v = compare([r.eval_loss for r in none], [r.eval_loss for r in chaos])
        tokens = statistics.fmean(r.tokens for r in chaos) / statistics.fmean(r.tokens for r in none)
        text += "\n" + table(
            ["arm", "held-out loss (mean ± std)", "committed tokens (mean)"],
            [["no chaos", f"{v.mean_none:.4f} ± {v.std_none:.4f}",
              f"{statistics.fmean(r.tokens for r in none):,.0f}"],
             ["chaos", f"{v.mean_chaos:.4f} ± {v.std_chaos:.4f}",
              f"{statistics.fmean(r.tokens for r in chaos):,.0f} ({100 * tokens:.1f}%)"]]) + "\n"
        text += (f"\n**Difference** chaos - no chaos: {v.diff:+.4f} (per seed: "
                 f"{', '.join(f'{d:+.4f}' for d in v.paired)}); pooled std {v.pooled_std:.4f}; "
                 f"{abs(v.diff) / v.pooled_std if v.pooled_std else math.inf:.2f} pooled std. "
                 f"**Verdict: {'within noise' if v.within_noise else 'NOT within noise'}** "
                 f"(threshold {NOISE_SIGMAS:g} pooled std).\n")
        text += f"\n{READING}\n"
    return text


DEFAULTS = {"seeds": 3, "mtbf": 20.0}


def plan_for(args: argparse.Namespace) -> Plan:
    if args.quick:  # a smoke test: one seed, no chaos, a few steps
        return Plan(seeds=(0,), steps=args.steps or 20, eval_every=10, eval_batches=4, mtbf=0.0)
    return Plan(seeds=tuple(range(args.seeds)), steps=args.steps or 150, eval_every=50,
                eval_batches=8, mtbf=args.mtbf)


def _flags(args: argparse.Namespace) -> list[str]:
    """The flags that change the measurement (not where the result goes)."""
    out = ["--quick"] if args.quick else []
    for name in ("seeds", "steps", "mtbf"):
        value = getattr(args, name)
        if value is not None and value != DEFAULTS.get(name):
            out.append(f"--{name} {value:g}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.convergence", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke test: 1 seed, no chaos, 20 steps")
    p.add_argument("--seeds", type=int, default=DEFAULTS["seeds"], help="seeds per arm (default 3)")
    p.add_argument("--steps", type=int, default=None, help="committed steps per run (default 150)")
    p.add_argument("--mtbf", type=float, default=DEFAULTS["mtbf"],
                   help="mean seconds between kills in the chaos arm (default 20)")
    p.add_argument("--no-write", action="store_true", help="print the table, leave "
                   "BENCHMARKS.md alone")
    args = p.parse_args(argv)
    if args.seeds < 2 and not args.quick:
        p.error(f"--seeds={args.seeds}: the noise estimate needs at least 2 seeds")
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps={args.steps} must be at least 1")
    if args.mtbf <= 0:
        p.error(f"--mtbf={args.mtbf} must be > 0 seconds")
    ensure_demo()
    plan = plan_for(args)
    arms = (False, True) if plan.mtbf else (False,)
    print(f"convergence: {len(plan.seeds)} seed(s) x {len(arms)} arm(s), {GROUPS} groups, "
          f"{plan.steps} steps each", flush=True)
    t0 = time.perf_counter()
    results = []
    for seed in plan.seeds:
        for chaos in arms:
            r = run_one(plan, seed, chaos)
            results.append(r)
            print(f"  seed {seed} {'chaos   ' if chaos else 'no chaos'}: held-out loss "
                  f"{r.eval_loss:.4f}, {r.tokens:,} tokens, {r.failures_injected} kill(s), "
                  f"{r.recoveries} recover(ies), {r.wall_seconds:.0f} s"
                  + (f"; PROBLEMS: {'; '.join(r.problems)}" if r.problems else ""), flush=True)
    body = render(plan, results, time.perf_counter() - t0, _flags(args))
    print(body)
    if not args.no_write:
        write_section(SECTION, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
