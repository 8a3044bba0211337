"""Benchmark: training throughput (tokens/s) and MFU of one replica group.

Runs the real ``Trainer`` (no fault tolerance) on the demo dataset for the ``tiny`` and ``small``
models at one and at all usable threads, reads each committed step's ``step_seconds`` from the
run's events, and divides the achieved model FLOP/s (``ftlm.model.flops_per_token``) by the matmul
peak of this machine measured in the same run (``ftlm.train.mfu.measure_matmul_peak``) at the same
thread count. Repetitions are interleaved so that noise on the shared machine hits every case.
It does not test correctness and makes no claim about GPUs unless it ran on one.

    python -m bench.train_throughput [--quick] [--reps N] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import (DEMO_DIR, DEMO_SEQ_LEN, commits_by_group, ensure_demo, median,
                          section_header, spread, steady, table, usable_cores, write_section)
from ftlm.config import RunConfig, build_config
from ftlm.model import flops_per_token, param_count
from ftlm.observe.events import read_events
from ftlm.train.mfu import measure_matmul_peak
from ftlm.train.trainer import Trainer

SECTION = "train_throughput"


@dataclass(frozen=True)
class Case:
    """One trainer configuration to time."""

    size: str
    batch: int
    threads: int
    steps: int
    warmup: int
    """Leading steps left out of the timing (allocator, caches, first data reads)."""
    dtype: str = "auto"
    """train.dtype: auto (float32 on CPU, bf16 autocast on CUDA) or bfloat16 (CPU autocast)."""


def build_run_config(case: Case, run_dir: Path) -> RunConfig:
    return build_config({
        "run": {"name": f"bench-{case.size}", "dir": str(run_dir), "seed": 0},
        "model": {"size": case.size},
        "data": {"dir": str(DEMO_DIR), "seq_len": DEMO_SEQ_LEN},
        "train": {"steps": case.steps, "batch_size": case.batch, "threads": case.threads,
                  "warmup_steps": 0, "dtype": case.dtype},
        "checkpoint": {"every": 0, "resume": False},
        "observe": {"progress": False, "log_every": 10**6},
    })


def time_trainer(case: Case) -> list[float]:
    """Steady-state seconds per committed step of one fresh training run."""
    with tempfile.TemporaryDirectory(prefix="ftlm-bench-") as tmp:
        config = build_run_config(case, Path(tmp) / "run")
        # The trainer prints a summary line per run; keep the benchmark's output to its table.
        with contextlib.redirect_stderr(io.StringIO()):
            Trainer.for_run(config).train()
        commits = commits_by_group(read_events(config.run.path / "events.jsonl"))
        (group_commits,) = commits.values()
        return steady([e["step_seconds"] for e in group_commits], case.warmup)


def measure_peak(threads: int, device: str, seconds: float, dtype: str = "auto") -> float:
    """Best matmul FLOP/s at ``threads`` intra-op threads (on CPU float32, or bfloat16 when the
    case trains under bf16 autocast; bfloat16 on CUDA)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if device == "cuda":
            return measure_matmul_peak("cuda", torch.bfloat16, size=8192, seconds=seconds)
        cpu_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        return measure_matmul_peak("cpu", cpu_dtype, size=1024, seconds=seconds)
    finally:
        torch.set_num_threads(before)


def plan(quick: bool, device: str, dtype: str = "auto") -> tuple[list[Case], int]:
    """The cases and the number of interleaved repetitions."""
    cores = usable_cores()
    threads = [cores] if quick or device == "cuda" else sorted({1, cores})
    batches = [8] if device == "cpu" else [8, 64]  # a GPU idles at batch 8 with these models
    tiny_steps, small_steps, warmup = (8, 4, 1) if quick else (40, 20, 5)
    cases = [Case(size, b, t, steps, warmup, dtype) for t in threads for b in batches
             for size, steps in (("tiny", tiny_steps), ("small", small_steps))]
    return cases, 1 if quick else 3


def run(cases: list[Case], reps: int, peak_seconds: float,
        device: str) -> tuple[list[list[object]], float]:
    per_rep: dict[Case, list[float]] = {c: [] for c in cases}
    peaks: dict[int, float] = {}
    t0 = time.perf_counter()
    for rep in range(reps):
        for case in cases:
            # The peak at this thread count, re-measured every repetition; the best one counts.
            peaks[case.threads] = max(peaks.get(case.threads, 0.0),
                                      measure_peak(case.threads, device, peak_seconds, case.dtype))
            per_rep[case].append(median(time_trainer(case)))
            print(f"  rep {rep + 1}/{reps} {case.size:>5} batch={case.batch} "
                  f"threads={case.threads}: "
                  f"{per_rep[case][-1]:.4f} s/step", flush=True)
    rows = []
    for case in cases:
        cfg = build_run_config(case, Path("unused")).model
        step_s = median(per_rep[case])
        tokens_s = case.batch * DEMO_SEQ_LEN / step_s
        achieved = tokens_s * flops_per_token(cfg, DEMO_SEQ_LEN)
        peak = peaks[case.threads]
        rows.append([case.size, f"{param_count(cfg) / 1e6:.2f}M", DEMO_SEQ_LEN, case.batch,
                     case.threads, f"{step_s:.4f}", spread(per_rep[case]), f"{tokens_s:,.0f}",
                     f"{achieved / 1e9:,.1f}", f"{peak / 1e9:,.1f}", f"{100 * achieved / peak:.1f}%"])
    return rows, time.perf_counter() - t0


HEADERS = ["model", "params", "seq_len", "batch", "threads", "median step s",
           "per-rep medians (min-max)", "tokens/s", "achieved GFLOP/s", "peak GFLOP/s", "MFU"]


def render(rows: list[list[object]], reps: int, cases: list[Case], seconds: float,
           flags: list[str], device: str, dtype: str = "auto") -> str:
    steps = ", ".join(sorted({f"{c.size}: {c.steps} steps, first {c.warmup} skipped"
                              for c in cases}))
    cpu_dtype = "bfloat16" if dtype == "bfloat16" else "float32"
    peak = (f"best {cpu_dtype} 1024x1024 matmul rate at the same thread count" if device == "cpu"
            else "best bfloat16 8192x8192 matmul rate (training runs under bf16 autocast)")
    title = f"Training throughput and MFU on {device.upper()} (one group, no fault tolerance)"
    if device == "cpu" and dtype == "bfloat16":
        title = ("Training throughput and MFU on CPU under bf16 autocast (one group, no fault "
                 "tolerance; float32 weights and optimizer state)")
    return (section_header(title, "bench.train_throughput", flags)
            + f"* Method: `Trainer.for_run(config).train()` on the demo data; per-step `step_seconds` "
              f"from the `commit` events ({steps}); median per run, then the median of {reps} "
              f"interleaved repetition(s). Peak: {peak} (`measure_matmul_peak`), measured "
              f"before every run; the best measurement counts. FLOPs per token: "
              f"`flops_per_token` (6N + attention, PaLM convention). Took {seconds:.0f} s.\n\n"
            + table(HEADERS, rows) + "\n")


def _flags(args: argparse.Namespace) -> list[str]:
    """The flags that change the measurement (not where the result goes)."""
    return ((["--quick"] if args.quick else []) + ([f"--reps {args.reps}"] if args.reps else [])
            + ([f"--dtype {args.dtype}"] if args.dtype != "auto" else []))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.train_throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run of well under a minute")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 3, "
                   "1 with --quick)")
    p.add_argument("--no-write", action="store_true", help="print the table, leave "
                   "BENCHMARKS.md alone")
    p.add_argument("--dtype", choices=["auto", "bfloat16"], default="auto",
                   help="train.dtype of every case; bfloat16 on CPU measures bf16 autocast "
                        "against the bf16 matmul peak (its own section)")
    args = p.parse_args(argv)
    ensure_demo()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases, reps = plan(args.quick, device, args.dtype)
    reps = args.reps or reps
    if reps < 1:
        p.error(f"--reps={reps} must be at least 1")
    print(f"train_throughput: {len(cases)} cases x {reps} repetition(s)", flush=True)
    rows, seconds = run(cases, reps, 0.3 if args.quick else 1.0, device)
    body = render(rows, reps, cases, seconds, _flags(args), device, args.dtype)
    print(body)
    if not args.no_write:
        # A GPU run and a CPU bf16 run get sections of their own, never replacing the CPU fp32 one.
        name = f"{SECTION}_gpu" if device == "cuda" else (
            f"{SECTION}_bf16" if args.dtype == "bfloat16" else SECTION)
        write_section(name, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
