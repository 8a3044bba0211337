"""Benchmark: does chaos change where training ends up? Held-out loss at equal committed tokens.

The question: fault tolerance drops a failed group's slice from a
step (fewer samples that step, LR scaled by ``ft.lr_policy``) and replays updates into a
recovering group. After the same number of committed tokens, is the model as good as one trained
without failures? For each seed the tiny config (``configs/tiny.toml``) is trained as 3 replica
groups by ``LocalLauncher``, in turn:

* **chaos**: ``--chaos-mtbf`` SIGKILLs a random group at exponentially distributed times (seeded
  by the seed) during ``--steps`` committed steps; it commits ``T`` tokens, fewer than
  ``steps x 3 slices``, since a step with a group down trains 2 slices instead of 3;
* **no chaos, equal tokens** (the comparison): the same seed without failures, with
  ``train.steps = round(T / tokens of a 3-slice step)``, so it commits the same tokens (to within
  one slice, shown per seed);
* **no chaos, equal steps** (``--equal-steps``, secondary and off by default: three more runs):
  the same seed without failures for ``--steps`` steps, the comparison the first version made.

Why a run of its own, not the no-chaos curve read at ``T``: the LR schedule is a function of the
step (cosine over ``train.steps``). A 150-step no-chaos run reaches the chaos run's tokens about
20 steps before its end, with its LR not yet decayed, and an interpolated eval there would charge
it for an anneal it has not finished. Both runs of a seed here end their own schedule (LR at
``train.min_lr_ratio`` at the last step) and, with the same seed, start from the same weights and
train the same samples: the loader's order is a function of the seed and both train positions
``[0, cursor)`` of it, the cursors at most one slice apart. What still differs is what fault tolerance does by design: the
chaos run spreads those tokens over more, smaller updates (a step with a group down averages 2
slices, a noisier gradient, at LR x sqrt(2/3) under ``ft.lr_policy=sqrt``) on a longer schedule.
The difference is therefore the cost per token of degraded-mode steps under this LR policy; it
cannot separate that from damage done by recovery itself, which every run checks directly
instead (identical replicas, no sample trained twice or skipped: recovery replays exactly the
committed updates).

Verdict: per arm the mean and sample standard deviation over seeds; the difference of the means
is *within noise* when ``|chaos - no chaos| < 2 * pooled std``, the pooled std being
``sqrt((s_chaos^2 + s_none^2) / 2)``: chaos moves the loss less than changing the seed does
(about a 2-sigma band for a difference of two means of n=3 each, a rough test, not a t-test).
The paired difference per seed is listed as well.

    python -m bench.convergence [--quick] [--seeds N] [--steps N] [--mtbf S] [--equal-steps]
                                [--no-write]

It does not measure speed or stalls (``ft_overhead``, ``ft_vs_torchft``) and changes nothing in
training: the arms differ only in the launcher's chaos and the no-chaos arm's ``train.steps``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.common import (
    DEMO_DIR,
    DEMO_SEQ_LEN,
    REPO_ROOT,
    ensure_demo,
    publish,
    section_header,
    table,
)
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

CHAOS, EQUAL_TOKENS, EQUAL_STEPS = "chaos", "no chaos, equal tokens", "no chaos, equal steps"
"""The arms: the chaos run of a seed, and the no-chaos runs matched to its tokens or steps."""


@dataclass(frozen=True)
class Plan:
    seeds: tuple[int, ...]
    steps: int
    """Committed steps of the chaos arm (and of the equal-steps arm)."""
    eval_every: int
    eval_batches: int
    mtbf: float
    """Mean seconds between injected SIGKILLs in the chaos arm."""
    equal_steps: bool
    """Also run the no-chaos arm at the chaos arm's step count (the secondary comparison)."""


@dataclass(frozen=True)
class RunStats:
    """What the comparison needs from one run's ``events.jsonl``."""

    eval_losses: tuple[float, ...]
    """The groups' held-out losses after the last step (they hold the same bits: all equal)."""
    eval_tokens: int
    """Committed tokens of the evaluated model (the ``eval`` event's ``tokens``)."""
    updates: int
    """Distinct committed steps (optimizer updates)."""
    degraded: int
    """Committed steps that fewer than all groups took part in."""
    lr_sum: float
    """Sum of the LR over the committed steps (the degraded-mode scale included)."""


def run_stats(events: list[dict], last_step: int, groups: int) -> RunStats:
    """The final held-out loss and the update statistics of a run from its events.

    Raises ``ValueError`` when no group evaluated ``last_step`` or the evaluations disagree on the
    tokens (they evaluate the same committed state, so they cannot unless something is wrong).
    """
    final = [e for e in events if e["kind"] == "eval" and e["step"] == last_step]
    if not final:
        raise ValueError(f"no eval event at step {last_step}")
    tokens = {int(e["tokens"]) for e in final}
    if len(tokens) != 1:
        raise ValueError(f"eval events of step {last_step} disagree on tokens: {sorted(tokens)}")
    commits: dict[int, dict] = {}
    for e in events:  # every participant logs the step's commit, with the same fields
        if e["kind"] == "commit":
            commits.setdefault(e["step"], e)
    return RunStats(eval_losses=tuple(float(e["loss"]) for e in final), eval_tokens=tokens.pop(),
                    updates=len(commits),
                    degraded=sum(1 for e in commits.values() if e["participants"] < groups),
                    lr_sum=math.fsum(float(e["lr"]) for e in commits.values()))


def matched_steps(tokens: int, step_tokens: int) -> int:
    """Steps of a run without failures (every step ``step_tokens``) that commits closest to
    ``tokens`` (half a step rounds up); the result differs from ``tokens`` by at most half a step.
    """
    if tokens < 1 or step_tokens < 1:
        raise ValueError(f"tokens={tokens} and step_tokens={step_tokens} must be positive")
    return max(1, (2 * tokens + step_tokens) // (2 * step_tokens))


@dataclass
class Result:
    """One run."""

    seed: int
    arm: str
    train_steps: int
    """``train.steps`` of the run (its LR schedule's length)."""
    eval_loss: float
    """Held-out loss after the last step (the ``eval`` events of that step; groups agree)."""
    eval_spread: float
    """Largest difference between the groups' final held-out losses (0: bitwise equal)."""
    tokens: int
    """Committed tokens of the evaluated model."""
    steps: int
    degraded: int
    lr_sum: float
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


def run_config(plan: Plan, seed: int, run_dir: Path, steps: int | None = None) -> RunConfig:
    """``configs/tiny.toml`` on the demo data, with this run's seed, length and directory."""
    overrides = {
        "run.name": f"bench-convergence-{seed}", "run.dir": str(run_dir), "run.seed": seed,
        "data.dir": str(DEMO_DIR), "data.seq_len": DEMO_SEQ_LEN,
        "train.steps": steps or plan.steps, "train.eval_every": plan.eval_every,
        "train.eval_batches": plan.eval_batches,
        "checkpoint.every": 0, "checkpoint.resume": "false",
        "observe.progress": "false", "observe.log_every": 10**6,
        **{f"ft.{k}": v for k, v in FT.items()},
    }
    return load_config(TINY_CONFIG, [f"{k}={v}" for k, v in overrides.items()])


def step_tokens(plan: Plan) -> int:
    """Tokens of a step with every group taking part."""
    config = run_config(plan, 0, Path("unused"))
    return GROUPS * config.train.batch_size * config.data.seq_len


def run_one(plan: Plan, seed: int, arm: str, steps: int) -> Result:
    from ftlm.launch.local import LocalLauncher
    from ftlm.observe.events import read_events
    chaos = arm == CHAOS
    with tempfile.TemporaryDirectory(prefix="ftlm-bench-conv-") as tmp:
        config = run_config(plan, seed, Path(tmp) / "run", steps)
        t0 = time.perf_counter()
        summary = LocalLauncher(config, groups=GROUPS, progress=False,
                                chaos_mtbf=plan.mtbf if chaos else 0.0, chaos_seed=seed).run()
        wall = time.perf_counter() - t0
        events = read_events(config.run.path / "events.jsonl")
        try:
            stats = run_stats(events, steps, GROUPS)
        except ValueError as e:
            logs = config.run.path / "logs"
            tail = "".join(p.read_text()[-1500:] for p in sorted(logs.glob("*.log")))
            raise RuntimeError(f"seed {seed} {arm}: {e} (steps committed "
                               f"{summary['steps_committed']}, final steps "
                               f"{summary.get('final_steps')})\n{tail}") from None
    data = summary["data"]
    problems = list(summary.get("problems") or [])
    final = stats.eval_losses
    if max(final) != min(final):  # the groups hold the same bits, so they must agree exactly
        problems.append(f"groups' final held-out losses differ by {max(final) - min(final):.3g}")
    if stats.eval_tokens != summary["tokens_committed"]:
        problems.append(f"evaluated model has {stats.eval_tokens} tokens, the run committed "
                        f"{summary['tokens_committed']}")
    return Result(seed=seed, arm=arm, train_steps=steps, eval_loss=final[0],
                  eval_spread=max(final) - min(final), tokens=stats.eval_tokens,
                  steps=summary["steps_committed"], degraded=stats.degraded, lr_sum=stats.lr_sum,
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


READING = (
    "*Reading:* at equal tokens the two runs of a seed start from the same weights and train "
    "the same samples (the loader's order is a function of the seed: one run's samples are the "
    "other's plus at most one slice), each to the end of its own cosine schedule; the no-chaos run is not read off a longer run's curve, where its LR "
    "would not yet have decayed. What differs is what degraded mode does by design: the chaos run "
    "takes those tokens in more, smaller updates (steps with a group down average 2 slices at LR "
    "x sqrt(2/3), `ft.lr_policy=sqrt`) on a longer schedule (see the updates and sum-of-LR "
    "columns). So the difference measures the cost per token of degraded-mode steps under this "
    "LR policy; it cannot tell that apart from damage done by recovery, which each run checks "
    "directly instead: identical replicas, no sample trained twice or skipped. T differs "
    "between seeds (the kills are random), and the no-chaos run's updates with it, so each "
    "arm's std holds that spread as well as seed noise; the paired per-seed differences do "
    "not. It does not show "
    "what happens with larger models, longer runs, more groups, other LR policies or rarer "
    "failures, and n=3 seeds make the noise test a rough one.")

RUN_HEADERS = ["seed", "arm", "train.steps", "held-out loss", "committed tokens",
               "updates (with a group down)", "sum of LR", "kills injected", "failures detected",
               "recoveries", "restarts", "replicas identical", "duplicates / gaps", "problems",
               "wall s"]


def run_row(r: Result) -> list[object]:
    return [r.seed, r.arm, r.train_steps, f"{r.eval_loss:.4f}", f"{r.tokens:,}",
            f"{r.steps} ({r.degraded})", f"{r.lr_sum:.4f}", r.failures_injected,
            r.failures_detected, r.recoveries, r.restarts,
            "yes" if r.replicas_identical else "NO", f"{r.duplicates} / {r.gaps}",
            "; ".join(r.problems) or "none", f"{r.wall_seconds:.0f}"]


def _arm(results: list[Result], arm: str) -> list[Result]:
    return sorted((r for r in results if r.arm == arm), key=lambda r: r.seed)


def comparison(chaos: list[Result], none: list[Result], label: str) -> str:
    """The summary table and verdict of the chaos arm against one no-chaos arm (paired seeds)."""
    v = compare([r.eval_loss for r in none], [r.eval_loss for r in chaos])
    mean_tokens = {arm: statistics.fmean(r.tokens for r in runs)
                   for arm, runs in (("none", none), ("chaos", chaos))}
    text = "\n" + table(
        ["arm", "held-out loss (mean ± std)", "committed tokens (mean)", "updates (mean)"],
        [[none[0].arm, f"{v.mean_none:.4f} ± {v.std_none:.4f}", f"{mean_tokens['none']:,.0f}",
          f"{statistics.fmean(r.steps for r in none):.1f}"],
         [CHAOS, f"{v.mean_chaos:.4f} ± {v.std_chaos:.4f}",
          f"{mean_tokens['chaos']:,.0f} ({100 * mean_tokens['chaos'] / mean_tokens['none']:.1f}%)",
          f"{statistics.fmean(r.steps for r in chaos):.1f}"]]) + "\n"
    sigmas = abs(v.diff) / v.pooled_std if v.pooled_std else math.inf
    return text + (
        f"\n**{label}:** chaos - no chaos {v.diff:+.4f} (per seed: "
        f"{', '.join(f'{r.seed}: {d:+.4f}' for r, d in zip(chaos, v.paired))}); pooled std "
        f"{v.pooled_std:.4f}; {sigmas:.2f} pooled std. "
        f"**Verdict: {'within noise' if v.within_noise else 'NOT within noise'}** "
        f"(rule: |diff| < {NOISE_SIGMAS:g} x pooled std).\n")


def render(plan: Plan, results: list[Result], seconds: float, flags: list[str]) -> str:
    config = run_config(plan, 0, Path("unused"))
    tc = config.train
    text = (section_header("Convergence under chaos: held-out loss at equal committed tokens",
                           "bench.convergence", flags)
            + f"* Method: `configs/tiny.toml` (tiny model, batch {tc.batch_size} per group, "
              f"seq_len {DEMO_SEQ_LEN}, {tc.schedule} LR schedule with {tc.warmup_steps} warm-up "
              f"steps down to {tc.min_lr_ratio:g} x lr at `train.steps`, "
              f"`ft.lr_policy={config.ft.lr_policy}`) as {GROUPS} replica groups "
              f"(`LocalLauncher`, 1 thread each), seeds {', '.join(map(str, plan.seeds))}. "
              f"Per seed: a *chaos* run of {plan.steps} committed steps with "
              f"`chaos_mtbf={plan.mtbf:g}` s (SIGKILL of a random group, seeded by the seed), "
              f"which commits T tokens; then a *no chaos, equal tokens* run of the same seed "
              f"with `train.steps` = round(T / {step_tokens(plan):,}) (the tokens of a step with "
              f"all {GROUPS} groups), which commits T to within one slice and ends its own "
              f"schedule there"
              + (f"; then a *no chaos, equal steps* run of {plan.steps} steps" if plan.equal_steps
                 else "") +
              f". Held-out loss: the `eval` event after each run's last step, mean cross-entropy "
              f"over {plan.eval_batches} x {tc.batch_size} held-out samples "
              f"(`data.eval_samples={config.data.eval_samples}`, `data.eval_seed="
              f"{config.data.eval_seed}`: the same samples in every run); no interpolation. "
              f"Verdict: *within noise* when |mean(chaos) - mean(no chaos)| < {NOISE_SIGMAS:g} x "
              f"pooled std, pooled std = sqrt((s_chaos^2 + s_none^2) / 2) over seeds (sample "
              f"std, n={len(plan.seeds)}). Ft timeouts: "
              f"{', '.join(f'{k}={v:g}' for k, v in FT.items())}. Took {seconds:.0f} s.\n\n"
            + table(RUN_HEADERS, [run_row(r) for r in results]) + "\n")
    chaos, equal_tokens = _arm(results, CHAOS), _arm(results, EQUAL_TOKENS)
    if len(chaos) >= 2 and len(chaos) == len(equal_tokens):
        gaps = [n.tokens - c.tokens for c, n in zip(chaos, equal_tokens)]
        text += ("\nTokens compared at (chaos run = T; no-chaos run - T): "
                 + ", ".join(f"seed {c.seed}: {c.tokens:,} ({g:+,})"
                             for c, g in zip(chaos, gaps)) + ".\n")
        text += comparison(chaos, equal_tokens, "Equal committed tokens (the comparison)")
        equal_steps = _arm(results, EQUAL_STEPS)
        if len(equal_steps) == len(chaos):
            text += comparison(chaos, equal_steps, "Equal committed steps (secondary: the chaos "
                               "arm trained fewer tokens)")
        else:
            text += ("\nEqual committed steps (secondary) not run this time: "
                     "`--equal-steps` adds it (3 more runs).\n")
        text += f"\n{READING}\n"
    return text


DEFAULTS = {"seeds": 3, "mtbf": 20.0}


def plan_for(args: argparse.Namespace) -> Plan:
    if args.quick:  # a smoke test: one seed, a chaos run of a few steps and its matched run
        return Plan(seeds=(0,), steps=args.steps or 20, eval_every=10, eval_batches=4,
                    mtbf=args.mtbf, equal_steps=args.equal_steps)
    return Plan(seeds=tuple(range(args.seeds)), steps=args.steps or 150, eval_every=50,
                eval_batches=8, mtbf=args.mtbf, equal_steps=args.equal_steps)


def _flags(args: argparse.Namespace) -> list[str]:
    """The flags that change the measurement (not where the result goes)."""
    out = ["--quick"] if args.quick else []
    for name in ("seeds", "steps", "mtbf"):
        value = getattr(args, name)
        if value is not None and value != DEFAULTS.get(name):
            out.append(f"--{name} {value:g}")
    return out + (["--equal-steps"] if args.equal_steps else [])


def run_seed(plan: Plan, seed: int, elapsed: Callable[[], float]) -> list[Result]:
    """The runs of one seed: chaos, then no chaos at its tokens (and at its steps)."""
    todo: list[tuple[str, int | None]] = [(CHAOS, plan.steps), (EQUAL_TOKENS, None)]
    if plan.equal_steps:
        todo.append((EQUAL_STEPS, plan.steps))
    results: list[Result] = []
    for arm, steps in todo:
        if steps is None:  # matched to the chaos run just done
            steps = matched_steps(results[0].tokens, step_tokens(plan))
        print(f"  [{elapsed():4.0f} s] seed {seed} {arm}: {steps} steps ...", flush=True)
        r = run_one(plan, seed, arm, steps)
        results.append(r)
        print(f"  [{elapsed():4.0f} s] seed {seed} {arm}: held-out loss {r.eval_loss:.4f}, "
              f"{r.tokens:,} tokens, {r.steps} updates ({r.degraded} with a group down), "
              f"{r.failures_injected} kill(s), {r.recoveries} recover(ies), "
              f"{r.wall_seconds:.0f} s" + (f"; PROBLEMS: {'; '.join(r.problems)}"
                                           if r.problems else ""), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.convergence", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke test: 1 seed, 20 steps")
    p.add_argument("--seeds", type=int, default=DEFAULTS["seeds"], help="seeds per arm (default 3)")
    p.add_argument("--steps", type=int, default=None,
                   help="committed steps of the chaos run (default 150)")
    p.add_argument("--mtbf", type=float, default=DEFAULTS["mtbf"],
                   help="mean seconds between kills in the chaos arm (default 20)")
    p.add_argument("--equal-steps", action="store_true", help="also compare at equal committed "
                   "steps (a no-chaos run of --steps per seed: 3 more runs)")
    p.add_argument("--no-write", action="store_true", help="print the table, leave "
                   "BENCHMARKS.md alone")
    args = p.parse_args(argv)
    if args.seeds < 2 and not args.quick:
        p.error(f"--seeds={args.seeds}: the noise estimate needs at least 2 seeds")
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps={args.steps} must be at least 1")
    if not args.mtbf > 0 or math.isinf(args.mtbf):
        p.error(f"--mtbf={args.mtbf} must be a finite number of seconds > 0")
    ensure_demo()
    plan = plan_for(args)
    runs = 2 + plan.equal_steps
    print(f"convergence: {len(plan.seeds)} seed(s) x {runs} runs, {GROUPS} groups, chaos runs of "
          f"{plan.steps} steps", flush=True)
    t0 = time.perf_counter()
    results = []
    for seed in plan.seeds:
        results += run_seed(plan, seed, lambda: time.perf_counter() - t0)
    body = render(plan, results, time.perf_counter() - t0, _flags(args))
    return publish(SECTION, body, write=not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
