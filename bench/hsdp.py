"""Benchmark: step time of HSDP (2 groups x 2 ranks) against FSDP and DDP over the same 4 ranks.

The same model, per-rank batch (so the same global batch), optimizer and thread count are trained
three ways, one after the other within each repetition (ABC ABC ...), so that the background load
of the shared machine hits all three:

* **HSDP**: ``LocalLauncher(config, groups=2, ranks_per_group=2)``: a coordinator plus two
  replica groups of two processes each; FSDP2 shards the model over a group's two ranks, rank r
  of both groups all-reduces gradient shard r across groups, the leaders ask for a quorum every
  step and the whole group votes on the commit.
* **FSDP**: one group of four ranks without a coordinator: four processes of
  ``python -m ftlm.cli train`` with the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR,
  MASTER_PORT), i.e. plain FSDP2 over four ranks through the same ``Trainer``.
* **DDP**: four ranks of ``torch.nn.parallel.DistributedDataParallel`` over gloo (the worker of
  ``bench.ft_overhead`` with a world of four): the same ``Transformer``, ``Loader``, AdamW and
  clipping.

HSDP and FSDP step times are the ``step_seconds`` of the ``commit`` events (written by rank 0 of
each group); DDP times the same span, batch fetch to the end of the optimizer step, per rank.
No failures are injected.

    python -m bench.hsdp [--quick] [--reps N] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import (DEMO_DIR, DEMO_SEQ_LEN, REPO_ROOT, commits_by_group, ensure_demo,
                          median, publish, section_header, spread, steady, table, usable_cores)
from ftlm.config import RunConfig, build_config, save_config

SECTION = "hsdp"
RANKS = 4  # every layout uses four processes
GROUPS, RANKS_PER_GROUP = 2, 2
THREADS = 1  # per process: four processes already oversubscribe a 2-core box
RUN_TIMEOUT_S = 600.0
HEARTBEAT_TIMEOUT_S = 5.0
LAYOUTS = ("HSDP", "FSDP", "DDP")


@dataclass(frozen=True)
class Case:
    size: str
    batch: int
    """Samples per rank per step; the global batch is ``RANKS`` times this in every layout."""
    steps: int
    warmup: int
    """Leading steps left out (first quorum, process groups, allocator, DDP bucket rebuild)."""


@dataclass
class Timing:
    step_seconds: list[float]
    """Steady-state per-step times, pooled over the processes that record them."""


def build_run_config(case: Case, run_dir: Path, group_batch: int) -> RunConfig:
    """The run config of one layout; ``group_batch`` is what one replica group trains per step."""
    return build_config({
        "run": {"name": f"bench-hsdp-{case.size}", "dir": str(run_dir), "seed": 0},
        "model": {"size": case.size},
        "data": {"dir": str(DEMO_DIR), "seq_len": DEMO_SEQ_LEN},
        "train": {"steps": case.steps, "batch_size": group_batch, "threads": THREADS,
                  "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"every": 0, "resume": False},
        "observe": {"progress": False, "log_every": 10**6},
        # Four processes on two cores are slow to answer: a 1 s heartbeat timeout could declare a
        # busy group dead, and the benchmark would time a recovery instead of a step. Both groups
        # must be in every quorum (min_replicas=2), so every timed step is a 2-group step.
        "ft": {"heartbeat_timeout": HEARTBEAT_TIMEOUT_S, "min_replicas": GROUPS,
               "join_timeout": 30.0, "allreduce_timeout": 4 * HEARTBEAT_TIMEOUT_S,
               "quorum_timeout": 120.0, "give_up_seconds": 300.0},
    })


def _pythonpath_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))


def _wait_all(procs: list[subprocess.Popen], what: str) -> None:
    """Wait for every process (bounded), kill leftovers, raise with the output of a failed one."""
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
                   for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            raise RuntimeError(f"{what} rank {rank} exited with {p.returncode}:\n"
                               f"{(out or b'').decode(errors='replace')[-3000:]}")


# -- the three layouts -----------------------------------------------------------------------------
def run_hsdp(case: Case) -> Timing:
    from ftlm.launch.local import LocalLauncher
    from ftlm.observe.events import read_events
    with tempfile.TemporaryDirectory(prefix="ftlm-bench-hsdp-") as tmp:
        config = build_run_config(case, Path(tmp) / "run", RANKS_PER_GROUP * case.batch)
        summary = LocalLauncher(config, groups=GROUPS, ranks_per_group=RANKS_PER_GROUP,
                                progress=False).run()
        commits = commits_by_group(read_events(config.run.path / "events.jsonl"))
        finals = summary.get("final_steps") or {}
        if (sorted(commits) != [f"g{i}" for i in range(GROUPS)]
                or not summary.get("replicas_identical")
                or any(finals.get(f"g{i}") != case.steps for i in range(GROUPS))):
            logs = Path(tmp) / "run" / "logs"
            tail = "".join(p.read_text()[-1500:] for p in sorted(logs.glob("*.log")))
            raise RuntimeError(f"HSDP run did not finish cleanly: groups {sorted(commits)}, "
                               f"final steps {finals}, restarts {summary.get('restarts')}, "
                               f"replicas_identical={summary.get('replicas_identical')}\n{tail}")
        both = [[e["step_seconds"] for e in c if e["participants"] == GROUPS]
                for c in commits.values()]
        return Timing([s for g in both for s in steady(g, case.warmup)])


def run_fsdp(case: Case) -> Timing:
    from ftlm.observe.events import read_events
    with tempfile.TemporaryDirectory(prefix="ftlm-bench-fsdp-") as tmp:
        config = build_run_config(case, Path(tmp) / "run", RANKS * case.batch)
        path = Path(tmp) / "config.toml"
        save_config(config, path)
        with socket.socket() as s:  # a free port for the group's rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(RANKS):
            env = _pythonpath_env()
            env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(RANKS),
                        "LOCAL_WORLD_SIZE": str(RANKS), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"})
            env.pop("FTLM_COORDINATOR", None)  # one plain FSDP group, no fault tolerance
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "ftlm.cli", "train", str(path)], cwd=REPO_ROOT, env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        _wait_all(procs, "FSDP")
        commits = commits_by_group(read_events(config.run.path / "events.jsonl"))
        seconds = [e["step_seconds"] for c in commits.values() for e in c]
        if len(seconds) != case.steps:
            raise RuntimeError(f"FSDP run committed {len(seconds)} of {case.steps} steps")
        return Timing(steady(seconds, case.warmup))


def run_ddp(case: Case) -> Timing:
    with tempfile.TemporaryDirectory(prefix="ftlm-bench-ddp4-") as tmp:
        procs = []
        for rank in range(RANKS):
            spec = {"size": case.size, "batch": case.batch, "steps": case.steps, "rank": rank,
                    "world": RANKS, "dir": tmp}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "bench.ft_overhead", "--ddp-worker", json.dumps(spec)],
                cwd=REPO_ROOT, env=_pythonpath_env(), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        _wait_all(procs, "DDP")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(RANKS)]
    return Timing([s for r in ranks for s in steady(r["step_seconds"], case.warmup)])


RUNNERS = {"HSDP": run_hsdp, "FSDP": run_fsdp, "DDP": run_ddp}


# -- the benchmark ---------------------------------------------------------------------------------
def plan(quick: bool) -> tuple[list[Case], int]:
    if quick:
        return [Case("tiny", 8, 8, 3)], 1
    return [Case("tiny", 8, 25, 5), Case("small", 8, 10, 3)], 3


def run(cases: list[Case], reps: int) -> tuple[list[list[object]], float]:
    t0 = time.perf_counter()
    results: dict[tuple[str, str], list[float]] = {}
    for rep in range(reps):
        for case in cases:
            for layout in LAYOUTS:  # alternating: every repetition runs all three in turn
                m = median(RUNNERS[layout](case).step_seconds)
                results.setdefault((case.size, layout), []).append(m)
                print(f"  rep {rep + 1}/{reps} {case.size:>5} {layout:>4}: {m:.4f} s/step",
                      flush=True)
    rows = []
    for case in cases:
        ddp = results[(case.size, "DDP")]
        for layout in LAYOUTS:
            per_rep = results[(case.size, layout)]
            step = median(per_rep)
            tokens = RANKS * case.batch * DEMO_SEQ_LEN / step
            paired = [a / b for a, b in zip(per_rep, ddp)]  # each run vs DDP of the same rep
            layout_name = {"HSDP": f"HSDP {GROUPS} groups x {RANKS_PER_GROUP} ranks (ftlm FT)",
                           "FSDP": f"FSDP2, 1 group x {RANKS} ranks (ftlm, no FT)",
                           "DDP": f"DDP, {RANKS} ranks (torch)"}[layout]
            rows.append([case.size, layout_name, RANKS, case.batch, RANKS * case.batch,
                         f"{step:.4f}", spread(per_rep), f"{tokens:,.0f}",
                         f"{step / median(ddp):.2f}x",
                         ", ".join(f"{r:.2f}" for r in paired)])
    return rows, time.perf_counter() - t0


HEADERS = ["model", "layout", "ranks", "batch/rank", "global batch", "median step s",
           "per-rep medians (min-max)", "tokens/s", "step time vs DDP", "per-rep ratios"]


def render(rows: list[list[object]], cases: list[Case], reps: int, seconds: float,
           flags: list[str]) -> str:
    steps = ", ".join(f"{c.size}: {c.steps} steps, first {c.warmup} skipped" for c in cases)
    return (section_header(f"HSDP ({GROUPS} x {RANKS_PER_GROUP}) vs FSDP ({RANKS} ranks) vs DDP "
                           f"({RANKS} ranks)", "bench.hsdp", flags)
            + f"* Method: {reps} repetition(s), each running HSDP, FSDP, DDP in turn per model "
              f"({steps}); {RANKS} processes per layout, {THREADS} torch thread each, seq_len "
              f"{DEMO_SEQ_LEN}, gloo, the same per-rank batch and so the same global batch. "
              f"HSDP: `LocalLauncher(groups={GROUPS}, ranks_per_group={RANKS_PER_GROUP})`, "
              f"`ft.min_replicas={GROUPS}`, `ft.heartbeat_timeout={HEARTBEAT_TIMEOUT_S:g}`, no "
              f"failures injected, only steps both groups committed together are timed. FSDP: "
              f"{RANKS} processes of `python -m ftlm.cli train` with the torchrun environment and "
              f"no coordinator. DDP: `DistributedDataParallel` with 25 MiB buckets (the worker "
              f"of `bench.ft_overhead`). *Median step s*: per run, the median per-step time "
              f"(HSDP, FSDP: `step_seconds` of the `commit` events of each group's rank 0, "
              f"quorum request to end of the optimizer step; DDP: every rank, batch fetch to end "
              f"of the optimizer step), then the median over repetitions. *tokens/s*: global "
              f"batch x seq_len / median step. *Step time vs DDP*: median step / DDP's median "
              f"step (below 1 is faster); per-rep ratios pair each run with the DDP run of the "
              f"same repetition. Took {seconds:.0f} s.\n\n"
            + table(HEADERS, rows) + "\n\n" + _READING.format(cores=usable_cores()))


_READING = """\
How to read it: every layout runs 4 training processes with 1 thread each on this machine's
{cores} core(s), so on a small box they are heavily oversubscribed (and the machine is shared:
see the load average). Every collective is a rendezvous of processes that the kernel
time-slices, so a step's time is mostly compute plus waiting for the slowest process to be
scheduled, not network time; absolute figures say little and the ratios measured in the same run
are what to read. The layouts do the same forward and backward FLOPs per step (same model, same
global batch) and differ in what surrounds them: DDP all-reduces full gradients from backward
hooks and runs AdamW on the full model in every rank; FSDP all-gathers each block's parameters
before its forward and backward, reduce-scatters its gradients and updates a quarter of the
model per rank; HSDP shards over 2 ranks, all-reduces half-model gradient shards across the two
groups and adds ftlm's per-step fault-tolerance work (a quorum request to the coordinator by each
leader, broadcast to its ranks, and a commit vote in each group). On a GPU cluster the
interconnect, not process scheduling, would decide these ratios; this table does not predict
them."""


def _flags(args: argparse.Namespace) -> list[str]:
    """The flags that change the measurement (not where the result goes)."""
    return (["--quick"] if args.quick else []) + ([f"--reps {args.reps}"] if args.reps else [])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.hsdp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run of under two minutes")
    p.add_argument("--reps", type=int, default=None, help="repetitions of the three layouts "
                   "(default 3, 1 with --quick)")
    p.add_argument("--no-write", action="store_true", help="print the table, leave "
                   "BENCHMARKS.md alone")
    args = p.parse_args(argv)
    ensure_demo()
    cases, reps = plan(args.quick)
    reps = args.reps or reps
    if reps < 1:
        p.error(f"--reps={reps} must be at least 1")
    print(f"hsdp: {len(cases)} model(s) x {reps} repetition(s) x {len(LAYOUTS)} layouts",
          flush=True)
    rows, seconds = run(cases, reps)
    body = render(rows, cases, reps, seconds, _flags(args))
    return publish(SECTION, body, write=not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
