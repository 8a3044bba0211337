"""Run every benchmark in turn: ``python -m bench [--quick] [--only SECTION ...]``.

Each job below regenerates one section of BENCHMARKS.md with the flags of the table the file
shows; a failing one is reported and the others still run (the exit status is non-zero if any
failed). ``--list`` prints each section's command. Jobs that need more than this repository (a
Slurm cluster) run only when named in ``--only``. With ``--quick`` each job runs at its smoke
size instead (well under a minute each on 2 cores) and jobs without one are skipped.

It does not hold any benchmark's logic: each lives in its own ``bench/NAME.py`` with its own
``--help``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    section: str
    """The BENCHMARKS.md section it rewrites (``<!-- bench:SECTION -->``)."""
    module: str
    """``bench.MODULE``, whose ``main(argv)`` runs it."""
    args: tuple[str, ...] = ()
    """The flags of the table BENCHMARKS.md shows."""
    quick: tuple[str, ...] | None = ("--quick",)
    """The flags of its smoke run (None: it has none)."""
    needs: str = ""
    """What it needs beyond this repository; such a job runs only when named in --only."""
    gpu_section: str = ""
    """The section the same command writes instead when it runs on a CUDA machine."""

    def command(self, quick: bool = False) -> str:
        flags = self.quick if quick else self.args
        return " ".join(["python -m", f"bench.{self.module}", *(flags or ())])


SOAK_END = ("--layout", "4x1", "--steps", "200", "--mtbf", "12", "--checkpoint-every", "0",
            "--seeds", "12")
COORDINATOR_SWEEP = ("--sweep", "100,500,1000,2000,3000,4000,2000@1.5", "--seconds", "60",
                     "--trace")
LIFECYCLE = ("--table",)
DILOCO = ("--seeds", "3", "--sizes", "tiny:2000,small:300", "--jobs", "2", "--write")
NEMESIS = ("--runs", "8", "--seed", "1", "--steps", "400", "--faults", "10", "--write")
TEST_TIME_SCALING = ("--from-json", "bench/results/test_time_scaling/study.json",
                     "--note-file", "bench/results/test_time_scaling/models.md")

JOBS = (
    Job("train_throughput", "train_throughput", gpu_section="train_throughput_gpu"),
    Job("train_throughput_bf16", "train_throughput", ("--dtype", "bfloat16"),
        ("--quick", "--dtype", "bfloat16")),
    Job("ft_overhead", "ft_overhead", ("--reps", "5")),
    Job("integrity", "integrity"),
    Job("hsdp", "hsdp"),
    Job("ft_vs_torchft", "ft_vs_torchft", ("--repeat", "3")),
    Job("failure_stall", "failure_stall", ("--reps", "3"), ("--reps", "1")),
    Job("spares", "spares", ("--groups", "4", "--interval", "30", "--steps", "900", "--reps", "1",
                             "--dim", "256", "--layers", "4")),
    Job("spares_restart_delay", "spares", ("--groups", "4", "--interval", "30", "--steps", "900", "--reps",
                                           "3", "--dim", "256", "--layers", "4", "--restart-delay", "10"),
        None),
    Job("preemption", "preemption", ("--reps", "2", "--preemptions", "4", "--every", "10",
                                     "--steps", "900")),
    Job("convergence", "convergence"),
    Job("diloco", "diloco", DILOCO),
    Job("cross_dc", "cross_dc", (), ("--runs", "1", "--no-write")),
    Job("diloco_chaos", "diloco_chaos", (), ("--groups", "3", "--steps", "100", "--interval", "10",
                                             "--no-write")),
    Job("soak_preempt", "soak", ("--preempt", "--seeds", "24"), ("--quick", "--preempt")),
    Job("soak_4x1", "soak", SOAK_END, None),
    Job("fault_matrix", "fault_matrix"),
    Job("fault_matrix_diloco", "fault_matrix", ("--diloco", "4", "--steps", "200", "--only", ".kill,.stop"),
        ("--quick", "--diloco", "4", "--steps", "200", "--no-write")),
    Job("coordinator_crash", "coordinator_crash", ("--reps", "2", "--kills", "3")),
    Job("coordinator_crash_slurm", "coordinator_crash", ("--slurm", "--kills", "4", "--every",
                                                         "10"), None,
        needs="a one-node Slurm, as root (`make system-deps-cluster`)"),
    Job("coordinator_takeover", "coordinator_takeover", ("--trials", "5"),
        ("--trials", "1", "--faults", "drain", "--no-write", "--json", ""),
        needs="root, ip and nft for network namespaces (`make system-deps`)"),
    Job("coordinator_load", "coordinator_load", COORDINATOR_SWEEP, None),
    Job("nemesis", "nemesis", NEMESIS, None,
        needs="root, ip, tc and nft for network namespaces (`make system-deps`)"),
    Job("slow_link", "slow_link", ("--reps", "2"), ("--inner-steps", "40", "--no-write"),
        needs="root, ip, tc and nft for network namespaces (`make system-deps`)"),
    Job("transfer", "transfer"),
    Job("serve_impact", "serve_impact"),
    Job("transfer_priority", "transfer_priority", (), None),
    Job("goodput", "goodput", ("--real-runs", "5", "--steps", "400")),
    Job("inference", "inference", gpu_section="inference_gpu"),
    Job("lifecycle", "lifecycle", LIFECYCLE),
    Job("test_time_scaling", "test_time_scaling", TEST_TIME_SCALING),
)
BENCHMARKS = {job.section: job for job in JOBS}


def run(job: Job, argv: list[str]) -> int | None:
    return importlib.import_module(f"bench.{job.module}").main(argv)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke-test sizes (each well under a "
                   "minute on 2 cores)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), default=None,
                   metavar="SECTION", help="run only these sections' benchmarks (choices: "
                   f"{', '.join(sorted(BENCHMARKS))})")
    p.add_argument("--list", action="store_true", help="print each section's command, run none")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        for job in JOBS:
            print(f"{job.section}: {job.command(args.quick)}"
                  + (f"  (needs {job.needs})" if job.needs else "")
                  + (f"  (on a CUDA machine: {job.gpu_section})" if job.gpu_section else ""))
        return 0
    chosen = [BENCHMARKS[s] for s in args.only] if args.only else [j for j in JOBS if not j.needs]
    failed = []
    for job in chosen:
        if args.quick and job.quick is None:
            print(f"== bench {job.section}: skipped (no --quick size)", flush=True)
            continue
        flags = list(job.quick if args.quick else job.args) + (
            ["--no-write"] if args.no_write else [])
        t0 = time.perf_counter()
        print(f"== bench {job.section}: python -m bench.{job.module} {' '.join(flags)}".rstrip(),
              flush=True)
        try:
            if run(job, flags):  # a non-zero status: it ran, and its checks failed
                failed.append(job.section)
        except SystemExit as e:  # an argparse error or a refusal: report it, go on
            if e.code:
                print(f"{job.section}: exited with {e.code}", file=sys.stderr, flush=True)
                failed.append(job.section)
        except Exception:  # noqa: BLE001 - report it and run the next benchmark
            traceback.print_exc()
            failed.append(job.section)
        print(f"== {job.section}: {'FAILED' if job.section in failed else 'done'} in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    if failed:
        print(f"failed benchmarks: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
