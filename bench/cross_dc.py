"""Groups in 2-4 data centres: every-step sync, DiLoCo and streaming DiLoCo projected side by side.

``python -m bench.cross_dc`` writes BENCHMARKS.md's section from ``ftlm simulate --cross-dc``
(``ftlm.goodput.cross_dc``): a 70B model on 8 groups of 512 GPUs spread over 2 or 4 regions
joined by 1 or 10 Gbit/s links, with the step time, the traffic of one synchronisation, tokens
per second, ETT under failures and the days to 20 tokens per parameter of each mode. A projection
with its assumptions stated, not a measurement: the measured inputs are ftlm's stall per failure
and, for the loss per token, BENCHMARKS.md's DiLoCo table (pass ``--token-overhead``).
"""

from __future__ import annotations

import argparse
import sys

from bench.common import publish, section_header


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cross_dc", description=__doc__.split("\n\n")[0])
    p.add_argument("--token-overhead", type=float, default=0.0,
                   help="extra tokens the DiLoCo modes need for the same loss (default 0)")
    p.add_argument("--runs", type=int, default=8, help="seeded failure runs per ETT (default 8)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    from ftlm.goodput.cross_dc import CrossDC, format_table
    job = CrossDC(token_overhead=args.token_overhead)
    text = format_table(job, [2, 4], [1.0, 10.0], runs=args.runs)
    flags = [f"--token-overhead {args.token_overhead:g}", f"--runs {args.runs}"]
    body = (section_header("Groups in several data centres: `ftlm simulate --cross-dc`", "bench.cross_dc", flags)
            + "\n" + text + "\n\n" + READING)
    return publish("cross_dc", body, not args.no_write)


READING = (
    "A projection (`ftlm.goodput.cross_dc` states every assumption): the step time includes each "
    "mode's share of the traffic between regions (every step: bf16 gradients overlapped with the "
    "backward pass; DiLoCo: a float32 outer gradient every H steps; streaming: an int8 fragment "
    "every H/F steps overlapped with one step), ETT is the goodput engine's with each mode's cost "
    "per failure, and the loss per token is taken equal across modes: the DiLoCo papers report "
    "parity at billions of parameters, which the tiny models of the DiLoCo table cannot show. "
    "On such links every-step synchronisation spends nearly all of its time on the network; "
    "DiLoCo's single large exchange still does at 1 Gbit/s with a 70B model; streaming's "
    "fragments overlap with compute. When to choose which: docs/diloco.md.\n")


if __name__ == "__main__":
    sys.exit(main())
