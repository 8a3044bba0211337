"""Benchmark: the step-time overhead of ftlm's fault tolerance against plain DDP.

The same model, batches, optimizer and thread count are trained two ways, alternately (ABAB) so
that noise on the shared machine hits both:

* **ftlm**: ``LocalLauncher(config, groups=2)``: a coordinator plus two single-rank replica groups
  as processes; every step asks the coordinator for a quorum, averages gradients across groups
  in flat buckets over gloo, and votes on the commit.
* **DDP**: two ranks of ``torch.nn.parallel.DistributedDataParallel`` over gloo (this module run
  with ``--ddp-worker``), each rank training participant ``rank`` of 2's slice of the same global
  batch through the same ``Loader``, with the same AdamW, clipping and ``apply_update``.

Step time on both sides is measured over the same span: from fetching the batch (ftlm: from asking
for the quorum) to the end of the optimizer step. It does not inject failures (see the fault tests).

    python -m bench.ft_overhead [--quick] [--reps N] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from bench.common import (DEMO_DIR, DEMO_SEQ_LEN, REPO_ROOT, commits_by_group, ensure_demo,
                          intervals, publish, median, section_header, steady, table)
from ftlm.config import RunConfig, build_config

SECTION = "ft_overhead"
GROUPS = 2
THREADS = 1  # per process: two processes on a 2-core box, and what train.threads gives each group
RUN_TIMEOUT_S = 600.0
HEARTBEAT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Case:
    size: str
    batch: int
    steps: int
    warmup: int
    """Leading steps left out (first quorum and process group, allocator, DDP bucket rebuild)."""


@dataclass
class Timing:
    """Steady-state step timings of one run."""

    step_seconds: list[float]
    """Per-step time over the measured span, both processes pooled."""
    intervals: list[float]
    """Seconds between consecutive step ends of the first process (everything per step)."""
    failed_steps: int = 0
    quorum_waits: list[float] | None = None
    """ftlm: seconds each measured step waited for its quorum answer at its start (after the
    early request of the step before: what was left of the round trip)."""


def build_run_config(case: Case, run_dir: Path) -> RunConfig:
    return build_config({
        "run": {"name": f"bench-ft-{case.size}", "dir": str(run_dir), "seed": 0},
        "model": {"size": case.size},
        "data": {"dir": str(DEMO_DIR), "seq_len": DEMO_SEQ_LEN},
        "train": {"steps": case.steps, "batch_size": case.batch, "threads": THREADS,
                  "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"every": 0, "resume": False},
        "observe": {"progress": False, "log_every": 10**6},
        # No failures are injected here: on a loaded shared box a 1 s heartbeat timeout can
        # declare a busy group dead and restart it, which would time recovery, not the step.
        "ft": {"heartbeat_timeout": HEARTBEAT_TIMEOUT_S,
               "allreduce_timeout": 4 * HEARTBEAT_TIMEOUT_S},  # the timeout chain: hb < all-reduce
    })


# -- ftlm ------------------------------------------------------------------------------------------
def run_ftlm(case: Case) -> Timing:
    from ftlm.launch.local import LocalLauncher
    from ftlm.observe.events import read_events
    with tempfile.TemporaryDirectory(prefix="ftlm-bench-ft-") as tmp:
        config = build_run_config(case, Path(tmp) / "run")
        summary = LocalLauncher(config, groups=GROUPS, progress=False).run()
        commits = commits_by_group(read_events(config.run.path / "events.jsonl"))
        if sorted(commits) != [f"g{i}" for i in range(GROUPS)] or not summary.get(
                "replicas_identical"):
            logs = Path(tmp) / "run" / "logs"
            tail = "".join((p.read_text()[-2000:] for p in sorted(logs.glob("*.log"))))
            raise RuntimeError(f"ftlm run did not finish cleanly: groups {sorted(commits)}, "
                               f"replicas_identical={summary.get('replicas_identical')}\n{tail}")
        finals = summary.get("final_steps") or {}
        if any(finals.get(f"g{i}") != case.steps for i in range(GROUPS)):
            # The launcher turns Ctrl-C / SIGTERM into an orderly early end of its run.
            raise RuntimeError(f"ftlm run ended early: final steps {finals} of {case.steps}, "
                               f"restarts {summary.get('restarts')}")
        # A group that starts more than ft.join_timeout after the other joins by live recovery
        # and commits its first steps later: time only the steps both groups trained together.
        both = {g: [e for e in c if e["participants"] == GROUPS] for g, c in commits.items()}
        seconds = [s for g in both.values()
                   for s in steady([e["step_seconds"] for e in g], case.warmup)]
        first = both["g0"]
        waits = [w for g in both.values()
                 for w in steady([e.get("quorum_wait", float("nan")) for e in g], case.warmup)]
        return Timing(seconds, steady(intervals([e["ts"] for e in first]), case.warmup),
                      summary.get("steps_failed", 0), waits)


# -- DDP -------------------------------------------------------------------------------------------
def run_ddp(case: Case) -> Timing:
    with tempfile.TemporaryDirectory(prefix="ftlm-bench-ddp-") as tmp:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        procs = []
        for rank in range(GROUPS):
            cmd = [sys.executable, "-m", "bench.ft_overhead", "--ddp-worker",
                   json.dumps({"size": case.size, "batch": case.batch, "steps": case.steps,
                               "rank": rank, "world": GROUPS, "dir": tmp})]
            procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
                       for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
        for p, out in zip(procs, outputs):
            if p.returncode != 0:
                raise RuntimeError(f"DDP worker exited with {p.returncode}:\n"
                                   f"{out.decode(errors='replace')[-3000:]}")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(GROUPS)]
    seconds = [s for r in ranks for s in steady(r["step_seconds"], case.warmup)]
    return Timing(seconds, steady(intervals(ranks[0]["ends"]), case.warmup))


def ddp_worker(spec: dict) -> None:
    """One DDP rank: trains ``steps`` steps and writes its step timings to ``rank<r>.json``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from ftlm.data.loader import Loader
    from ftlm.train.optim import apply_update, build_optimizer
    from ftlm.train.trainer import build_model, load_data

    rank, world, out_dir = spec["rank"], spec["world"], Path(spec["dir"])
    case = Case(spec["size"], spec["batch"], spec["steps"], 0)
    config = build_run_config(case, out_dir / "run")
    tc = config.train
    torch.set_num_threads(tc.threads)
    store = dist.FileStore(str(out_dir / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    _, dataset = load_data(config)
    loader = Loader(dataset, seed=config.run.seed, prefetch=config.data.prefetch)
    model = build_model(config, torch.device("cpu"))
    # 25 MiB buckets: the same as ftlm's default ft.bucket_bytes.
    ddp = DistributedDataParallel(model, bucket_cap_mb=config.ft.bucket_bytes / 2**20)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, tc)
    cursor, seconds, ends = 0, [], []
    try:
        for _ in range(tc.steps):
            t0 = time.perf_counter()
            batch = loader.batch(cursor, rank, world, tc.batch_size)
            inputs, targets = batch[:, :-1], batch[:, 1:]
            logits = ddp(inputs)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                   targets.reshape(-1))
            loss.backward()  # DDP averages the gradients across ranks here
            apply_update(params, optimizer, tc.lr, tc.grad_clip)
            cursor += world * tc.batch_size
            seconds.append(time.perf_counter() - t0)
            ends.append(time.time())
    finally:
        loader.close()
        dist.destroy_process_group()
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"step_seconds": seconds,
                                                          "ends": ends}))


# -- the benchmark ---------------------------------------------------------------------------------
def plan(quick: bool) -> tuple[list[Case], int]:
    if quick:
        return [Case("tiny", 8, 10, 3)], 1
    return [Case("tiny", 8, 30, 5), Case("small", 8, 12, 3)], 3


def run(cases: list[Case], reps: int) -> tuple[list[list[object]], float]:
    t0 = time.perf_counter()
    results: dict[tuple[str, str], list[Timing]] = {}
    for rep in range(reps):
        for case in cases:
            for side, fn in (("ftlm", run_ftlm), ("ddp", run_ddp)):  # ABAB
                timing = fn(case)
                results.setdefault((case.size, side), []).append(timing)
                print(f"  rep {rep + 1}/{reps} {case.size:>5} {side:>4}: "
                      f"{median(timing.step_seconds):.4f} s/step", flush=True)
    rows = []
    for case in cases:
        ft, ddp = results[(case.size, "ftlm")], results[(case.size, "ddp")]
        ft_step = median(median(t.step_seconds) for t in ft)
        ddp_step = median(median(t.step_seconds) for t in ddp)
        paired = [100 * (median(a.step_seconds) / median(b.step_seconds) - 1)
                  for a, b in zip(ft, ddp)]
        ft_iv = median(median(t.intervals) for t in ft)
        ddp_iv = median(median(t.intervals) for t in ddp)
        rows.append([case.size, case.batch, f"{ft_step:.4f}", f"{ddp_step:.4f}",
                     f"{100 * (ft_step / ddp_step - 1):+.1f}%",
                     ", ".join(f"{p:+.1f}%" for p in paired),
                     f"{ft_iv:.4f}", f"{ddp_iv:.4f}", f"{100 * (ft_iv / ddp_iv - 1):+.1f}%",
                     f"{1000 * median(median(t.quorum_waits) for t in ft):.1f}",
                     sum(t.failed_steps for t in ft)])
    return rows, time.perf_counter() - t0


HEADERS = ["model", "batch/rank", "ftlm median step s", "DDP median step s", "overhead",
           "per-rep overheads", "ftlm median interval s", "DDP median interval s",
           "interval overhead", "ftlm median quorum wait ms", "ftlm failed steps"]


def render(rows: list[list[object]], cases: list[Case], reps: int, seconds: float,
           flags: list[str]) -> str:
    steps = ", ".join(f"{c.size}: {c.steps} steps, first {c.warmup} skipped" for c in cases)
    return (section_header("Fault-tolerance overhead: ftlm (2 replica groups) vs DDP (2 ranks)",
                           "bench.ft_overhead", flags)
            + f"* Method: {reps} repetition(s), each running ftlm then DDP (ABAB) per model "
              f"({steps}); {THREADS} torch thread per process (`train.threads`), seq_len "
              f"{DEMO_SEQ_LEN}, gloo, 25 MiB buckets on both sides, ftlm with "
              f"`ft.heartbeat_timeout={HEARTBEAT_TIMEOUT_S:g}` (no failures are injected); "
              f"only ftlm steps that both groups committed together are timed (a group that "
              f"starts more than `ft.join_timeout` late catches up by live recovery first). "
              f"*Step s*: median over both "
              f"processes of the per-step time from the quorum request (DDP: the batch fetch) "
              f"to the end of the optimizer step (ftlm: `step_seconds` of the `commit` events), "
              f"then the median over repetitions. *Interval s*: median gap between consecutive "
              f"step ends of the first process (everything a step costs, loop included). "
              f"*Overhead*: ftlm / DDP - 1; per-rep overheads pair each ftlm run with the DDP "
              f"run right after it. *Quorum wait*: what a step's start waited for its quorum "
              f"answer (`quorum_wait` of the `commit` events), asked for right after the "
              f"previous step's vote; the forward pass starts once it is there. "
              f"Took {seconds:.0f} s.\n\n"
            + table(HEADERS, rows) + "\n")


def _flags(args: argparse.Namespace) -> list[str]:
    """The flags that change the measurement (not where the result goes)."""
    return (["--quick"] if args.quick else []) + ([f"--reps {args.reps}"] if args.reps else [])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ddp-worker"]:
        ddp_worker(json.loads(argv[1]))
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.ft_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run of well under a minute")
    p.add_argument("--reps", type=int, default=None, help="ABAB repetitions (default 3, 1 with "
                   "--quick)")
    p.add_argument("--no-write", action="store_true", help="print the table, leave "
                   "BENCHMARKS.md alone")
    args = p.parse_args(argv)
    ensure_demo()
    cases, reps = plan(args.quick)
    reps = args.reps or reps
    if reps < 1:
        p.error(f"--reps={reps} must be at least 1")
    print(f"ft_overhead: {len(cases)} models x {reps} ABAB repetition(s)", flush=True)
    rows, seconds = run(cases, reps)
    body = render(rows, cases, reps, seconds, _flags(args))
    return publish(SECTION, body, write=not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
