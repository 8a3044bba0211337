"""A slow link between groups: tokens per second of every-step sync, DiLoCo and streaming DiLoCo.

``python -m bench.slow_link`` runs the same job three times, one mode of ``ft.sync`` each, with
``ftlm launch local``'s coordinator and two groups in network namespaces of their own
(``ftlm.testing.netbed``) whose links are capped at ``--mbit`` Mbit/s by the kernel (``tc``; tbf
where the kernel has no netem). Each run trains ``--inner-steps`` inner steps per group of the
nemesis' small model; the modes are interleaved ``--reps`` times. Reported per run: steady tokens
per second (``summary.json``), wall seconds, bytes between groups per token, and the run's
invariants (identical final states, no problem). A delay (the issue's 50 ms) needs netem: without
it the links are rate-limited only, which the section says.

Needs root, ``ip``, ``tc`` and ``nft`` (``make system-deps``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ensure_demo, publish, section_header, table

MODES = {
    "every step": {"sync": "every_step"},
    "DiLoCo H=20": {"sync": "diloco", "diloco_inner_steps": 20},
    "streaming H=20 F=4 int8": {"sync": "diloco", "diloco_inner_steps": 20, "diloco_fragments": 4,
                                "diloco_wire_dtype": "int8"},
}


def protocol_steps(fields: dict, inner_steps: int) -> int:
    """``train.steps`` for ``inner_steps`` inner steps per group: one per synchronisation."""
    h = int(fields.get("diloco_inner_steps", 1))
    per_sync = h // int(fields.get("diloco_fragments", 1))
    if inner_steps % per_sync:
        raise SystemExit(f"--inner-steps {inner_steps} must be a multiple of {per_sync} (H/F of every mode)")
    return inner_steps // per_sync


def run_mode(name: str, mbit: float, inner_steps: int, delay_ms: float, data: Path) -> dict:
    from bench.nemesis import job_config, run_on_bed
    from ftlm.config import build_config
    from ftlm.testing.netbed import LinkShape, NetBed

    fields = MODES[name]
    with tempfile.TemporaryDirectory(prefix="ftlm-bench-slowlink-") as tmp:
        base = job_config(Path(tmp) / "run", data, protocol_steps(fields, inner_steps), checkpoint_every=0)
        raw = base.to_dict()
        raw["ft"].update(fields)
        raw["ft"]["allreduce_timeout"] = 20.0  # (a capped link: an all-reduce takes longer)
        config = build_config(raw)
        with NetBed(["coordinator", "g0", "g1"]) as bed:
            for g in ("g0", "g1"):
                bed.shape(g, LinkShape(rate_mbit=mbit, delay_ms=delay_ms))
            t0 = time.monotonic()
            outcome = run_on_bed(bed, config, 2)
            seconds = time.monotonic() - t0
    s = outcome.summary or {}
    hashes = s.get("state_hashes") or {}
    return {"mode": name, "tokens_per_second": float(s.get("steady_tokens_per_second") or 0.0),
            "wall": seconds, "tokens": s.get("tokens_committed", 0),
            "bytes_per_token": s.get("bytes_between_groups_per_token"),
            "identical": len(hashes) == 2 and len(set(hashes.values())) == 1,
            "problems": s.get("problems") or ([] if outcome.summary else ["no summary"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.slow_link", description=__doc__.split("\n\n")[0])
    p.add_argument("--mbit", type=float, default=100.0, help="link cap in Mbit/s (default 100)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (needs netem; default 0)")
    p.add_argument("--inner-steps", type=int, default=200, help="inner steps per group per run (default 200)")
    p.add_argument("--reps", type=int, default=1, help="interleaved repetitions of the three modes (default 1)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    if args.mbit <= 0 or args.inner_steps < 20 or args.reps < 1:
        p.error("--mbit above 0, --inner-steps at least 20, --reps at least 1")
    for fields in MODES.values():
        protocol_steps(fields, args.inner_steps)
    data = ensure_demo()
    runs, loads, t0 = [], [os.getloadavg()[0]], time.monotonic()
    for rep in range(args.reps):
        for name in MODES:
            r = run_mode(name, args.mbit, args.inner_steps, args.delay_ms, data)
            r["rep"] = rep
            loads.append(os.getloadavg()[0])
            print(f"rep {rep} {name}: {r}", flush=True)
            runs.append(r)
    base = statistics.fmean(r["tokens_per_second"] for r in runs if r["mode"] == "every step") or 1.0
    rows = [[r["rep"], r["mode"], f"{r['tokens_per_second']:,.0f}", f"{r['tokens_per_second'] / base:.2f}x",
             f"{r['wall']:.0f}", "n/a" if r["bytes_per_token"] is None else f"{r['bytes_per_token']:,.0f}",
             "yes" if r["identical"] else "NO", "; ".join(r["problems"])[:80] or "none"] for r in runs]
    text = table(["rep", "mode", "steady tokens/s", "vs every step", "wall s", "bytes between groups per token",
                  "identical final states", "problems"], rows)
    flags = [f"--mbit {args.mbit:g}", f"--delay-ms {args.delay_ms:g}", f"--inner-steps {args.inner_steps}",
             f"--reps {args.reps}"]
    link = f"{args.mbit:g} Mbit/s" + (f", {args.delay_ms:g} ms one way" if args.delay_ms else
                                      ", no added delay (this kernel's tc has no netem to delay with)")
    body = (section_header("A slow link between groups: every step vs DiLoCo vs streaming", "bench.slow_link", flags)
            + f"* Load average (1 min) during the runs: {min(loads):.1f} to {max(loads):.1f}; took "
            f"{time.monotonic() - t0:.0f} s\n\n"
            + f"Two groups and the coordinator in network namespaces; each group's link capped by `tc` at "
            f"{link}; {args.inner_steps} inner steps per group of the nemesis' model (336k parameters, "
            "float32 all-reduce) per run. Steady tokens/s from `summary.json` (start-up left out).\n\n"
            + text + "\n")
    return publish("slow_link", body, not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
