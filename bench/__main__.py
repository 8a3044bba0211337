"""Run every benchmark in turn: ``python -m bench [--quick] [--only NAME ...]``.

Each benchmark rewrites its own section of BENCHMARKS.md; a failing one is reported and the
others still run (the exit status is non-zero if any failed).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import importlib

# Modules under bench/, each with main(argv) that rewrites its own BENCHMARKS.md section;
# imported when they run (some import heavy optional dependencies).
NAMES = ("train_throughput", "ft_overhead", "hsdp", "ft_vs_torchft", "soak", "convergence",
         "transfer", "coordinator_load", "coordinator_crash", "goodput", "inference", "lifecycle",
         "test_time_scaling", "preemption", "serve_impact", "fault_matrix")
# Those without a --quick size run only in a full `python -m bench`.
NO_QUICK = {"coordinator_load"}


def _runner(name: str):
    return lambda argv: importlib.import_module(f"bench.{name}").main(argv)


BENCHMARKS = {name: _runner(name) for name in NAMES}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="smoke-test sizes (each well under a "
                   "minute on 2 cores)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), default=list(BENCHMARKS),
                   help="run only these benchmarks")
    args = p.parse_args(argv)
    flags = [f for f, on in (("--quick", args.quick), ("--no-write", args.no_write)) if on]
    failed = []
    for name in args.only:
        if args.quick and name in NO_QUICK:
            print(f"== bench {name}: skipped (no --quick size)", flush=True)
            continue
        t0 = time.perf_counter()
        print(f"== bench {name} {' '.join(flags)}".rstrip(), flush=True)
        try:
            if BENCHMARKS[name](flags):  # a non-zero status: it ran, and its checks failed
                failed.append(name)
        except Exception:  # noqa: BLE001 - report it and run the next benchmark
            traceback.print_exc()
            failed.append(name)
        print(f"== {name}: {'FAILED' if name in failed else 'done'} in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    if failed:
        print(f"failed benchmarks: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
