"""Fault matrix: every named fault point x every rank of a 2-rank group x kill / hang / stop.

The chaos soak (``bench.soak``) strikes processes at random moments; this strikes each moment of
the step protocol on purpose, in each rank, with each kind of fault, in a job of 2 groups x 2
ranks (FSDP2 inside a group, fault tolerance across groups), so that a fault in a non-leader rank
or in the middle of a transfer is visited every time, not when a seed happens to land there. A
cell is one ``LocalLauncher`` run (the real coordinator, group processes and supervisor) with
``FTLM_FAULT`` plans (see ``ftlm.ft.faults``):

* *steady*: ``before_allreduce``, ``inside_allreduce``, ``after_allreduce``, ``before_commit`` at
  step 10, in rank 0 or rank 1 of g1;
* *recovery*: g1 is killed at step 10, and its next incarnation is struck ``during_receive``
  (after the first chunk of state arrived) or ``during_replay`` (after its first buffered update;
  the source's first transfer is slowed so that there are updates to replay), in rank 0 or 1; or
  the source, g0, is struck ``during_serve`` in rank 0 or 1 while g1 pulls from it;

and the kind of fault: SIGKILL (*kill*), SIGSTOP (*hang*: only the progress timeout or the
heartbeat timeout catches it) or SIGTERM to that one rank (*stop*: a preemption notice reaching one
rank; the group must stop as one, leave and come back). A cell passes when the launch ends
normally with 2 identical final hashes, 0 duplicated and 0 skipped samples, every step committed,
no crash or failure detection that the fault does not explain (``bench.soak.launch_reasons``), every injected failure detected,
and the planned fault fired (a cell whose moment never came is reported, not passed).

Each cell runs in a child process under a time limit; results are appended to ``--results`` (one
JSON line per cell, resumable: recorded cells are skipped) and the table goes to BENCHMARKS.md.

With ``--diloco H`` the same cells run in DiLoCo mode (``ft.sync = "diloco"``, H inner steps per
synchronisation): each protocol step is then one outer synchronisation, so a point ``@10`` strikes
the 10th synchronisation, and the table goes to its own section.

    python -m bench.fault_matrix [--quick] [--only SUBSTRING] [--steps N] [--diloco H] [--fresh] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import REPO_ROOT, ensure_demo, section_header, table, write_section
from bench.soak import Settings, _events, launch_reasons, run_logged, write_config

SECTION = "fault_matrix"
STEADY = ("before_allreduce", "inside_allreduce", "after_allreduce", "before_commit")
KINDS = {"kill": "", "hang": "hang:", "stop": "term:"}
CELL_TIMEOUT_S = 900.0
FIRST_FAULT = "before_allreduce@10+"


@dataclass(frozen=True)
class Cell:
    """One run of the matrix: where, in which rank, what kind of fault."""

    point: str
    rank: int
    kind: str
    faults: dict[str, list[str]] = field(hash=False, compare=False)
    env: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    @property
    def name(self) -> str:
        return f"{self.point}.r{self.rank}.{self.kind}"

    @property
    def target(self) -> str:
        """The process the planned fault strikes: group and rank."""
        for key, plans in self.faults.items():
            if any(self.point in p for p in plans):
                return key if "." in key else f"{key}.r0"
        raise AssertionError(self.name)


def cells() -> list[Cell]:
    out = []
    for kind, prefix in KINDS.items():
        for rank in (0, 1):
            key = "g1" if rank == 0 else "g1.r1"
            for point in STEADY:
                out.append(Cell(point, rank, kind, {key: [f"{prefix}{point}@10+"]}))
            # g1's first incarnation dies at step 10 (its rank 0 is killed); the second one is
            # struck while it catches up.
            recv = ({"g1": [FIRST_FAULT, f"{prefix}during_receive"]} if rank == 0 else
                    {"g1": [FIRST_FAULT], "g1.r1": ["", f"{prefix}during_receive"]})
            out.append(Cell("during_receive", rank, kind, recv))
            slow = {"FTLM_FAULT_STEPS": "4", "FTLM_FAULT_SECONDS": "60"}
            replay = ({"g1": [FIRST_FAULT, f"{prefix}during_replay"], "g0": ["slow_serve"]}
                      if rank == 0 else
                      {"g1": [FIRST_FAULT], "g1.r1": ["", f"{prefix}during_replay"],
                       "g0": ["slow_serve"]})
            out.append(Cell("during_replay", rank, kind, replay, slow))
            source = "g0" if rank == 0 else "g0.r1"
            out.append(Cell("during_serve", rank, kind,
                            {"g1": [FIRST_FAULT], source: [f"{prefix}during_serve"]}))
    return out


def diloco_ft(h: int) -> tuple[tuple[str, str], ...]:
    """The ``[ft]`` settings of DiLoCo mode with ``h`` inner steps (none for ``h`` 0)."""
    return (("sync", '"diloco"'), ("diloco_inner_steps", str(h))) if h else ()


def run_cell(cell: Cell, run_dir: Path, steps: int, diloco: int = 0) -> None:
    """In the child: one launch of 2 groups x 2 ranks with the cell's fault plans."""
    from ftlm.config import load_config
    from ftlm.launch.local import LocalLauncher

    config = load_config(write_config(run_dir, Settings(steps=steps, mtbf=0.0, ft=diloco_ft(diloco))))
    LocalLauncher(config, groups=2, ranks_per_group=2, faults=cell.faults, extra_env=cell.env,
                  progress=False).run()


def verdict(cell: Cell, code: int | None, wall: float, run_dir: Path, steps: int) -> dict:
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    events = _events(run_dir / "events.jsonl")
    group, _, rank = cell.target.partition(".r")
    fired = [e for e in events if e["kind"] == "failure_injected" and e.get("point") == cell.point
             and e.get("group") == group and e.get("rank", 0) == int(rank)]
    stopped = [e for e in events if e["kind"] == "group_exit" and e.get("target") == group
               and e.get("preempted")]
    data = summary.get("data") or {}
    reasons = launch_reasons(summary, code, CELL_TIMEOUT_S)
    exercised = bool(stopped) if cell.kind == "stop" else bool(fired)
    return {"cell": cell.name, "point": cell.point, "rank": cell.rank, "kind": cell.kind,
            "target": cell.target, "steps": steps, "exit": code, "wall_seconds": round(wall, 1),
            "exercised": exercised, "fired_at_step": fired[0]["step"] if fired else None,
            "restarts": sum((summary.get("restarts") or {}).values()),
            "detected": summary.get("failures_detected"),
            "rollbacks": data.get("restores", 0),
            "identical": bool(summary.get("replicas_identical")),
            "duplicates": data.get("duplicates"), "gaps": data.get("gaps"),
            "ok": not reasons and exercised,
            "reasons": reasons + ([] if exercised else ["the planned fault never fired"]),
            "run_dir": str(run_dir)}


def _commit() -> str:
    """The short commit of the code under test ("?" outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, text=True,
                              capture_output=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def run_one(cell: Cell, root: Path, steps: int, diloco: int = 0) -> dict:
    run_dir = root / cell.name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "bench.fault_matrix", "--cell", cell.name,
           "--run-dir", str(run_dir), "--steps", str(steps), "--diloco", str(diloco)]
    t0 = time.monotonic()
    code = run_logged(cmd, run_dir / "launch.log", CELL_TIMEOUT_S,
                      dict(os.environ, PYTHONPATH=f"{REPO_ROOT / 'src'}:{REPO_ROOT}"), cwd=REPO_ROOT)
    return {**verdict(cell, code, time.monotonic() - t0, run_dir, steps), "commit": _commit(),
            "diloco": diloco}


READING = (
    "Reading: *fired at step* is the struck process's step when its fault fired (a recovering "
    "group reports the step of the state it holds: it restarted from the durable checkpoint of "
    "step 50, then pulls the rest); a SIGTERM logs no event of its own, so a *stop* cell counts "
    "as exercised by its group's preempted exit; *code* is the commit the cell ran. In the "
    "*during_serve* cells g1 was killed at step 10 and is still pulling from g0, so g0 is the only "
    "group that holds the newest state: killed or hung there, it takes that state with it and the "
    "job continues from the newest durable checkpoint (`checkpoint.every` 50), the steps after it "
    "redone (a `restore`, exactly-once intact). Stopped by SIGTERM, it saves its step before it "
    "leaves (`checkpoint.on_stop`, the checkpoint writer of its last step) and the recovering g1 "
    "loads it from disk: no rollback (before that option, those cells rolled back once too).")


HEADERS = ["point", "rank", "kind", "struck", "fired at step", "wall s", "restarts", "rollbacks",
           "identical", "duplicates", "gaps", "code", "result"]


def outcome(r: dict) -> str:
    """One cell of the section's table: the verdict and what the run took."""
    if not r["ok"]:
        return "FAIL: " + "; ".join(r["reasons"])[:200]
    step = "" if r["fired_at_step"] is None else f"step {r['fired_at_step']}, "
    rollbacks = f", {r['rollbacks']} rollback(s)" if r["rollbacks"] else ""
    return f"pass ({step}{r['wall_seconds']:.0f} s, {r['restarts']} restart(s){rollbacks})"


def matrix(records: list[dict]) -> str:
    """The section's table: one row per fault point and rank, one column per kind of fault (a
    cell's whole record is on the console and in the results file), and the commits they ran."""
    kinds = [k for k in KINDS if any(r["kind"] == k for r in records)]
    places = list(dict.fromkeys((r["point"], r["rank"]) for r in records))
    by = {(r["point"], r["rank"], r["kind"]): r for r in records}
    rows = []
    for point, rank in places:
        struck = dict.fromkeys(by[point, rank, k]["target"] for k in kinds
                               if (point, rank, k) in by)
        rows.append([point, rank, ", ".join(struck)]
                    + [outcome(by[point, rank, k]) if (point, rank, k) in by else "not run"
                       for k in kinds])
    codes = "; ".join(
        f"{k}: {', '.join(sorted({r.get('commit', '?') for r in records if r['kind'] == k}))}"
        for k in kinds)
    return (table(["point", "rank", "struck", *kinds], rows)
            + "\n\nEvery passing cell: 2 identical final hashes, 0 duplicates, 0 gaps. Code run: "
            + f"{codes}.")


def row(r: dict) -> list[object]:
    return [r["point"], r["rank"], r["kind"], r["target"], r["fired_at_step"], r["wall_seconds"],
            r["restarts"], r["rollbacks"], r["identical"], r["duplicates"], r["gaps"],
            r.get("commit", "?"), "pass" if r["ok"] else "FAIL: " + "; ".join(r["reasons"])[:200]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fault_matrix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: one cell (a kill inside the all-reduce, in rank 1)")
    p.add_argument("--only", default="",
                   help="cells whose name contains this, or one of these, comma-separated (e.g. '.r1.' "
                        "or '.kill,.stop')")
    p.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    p.add_argument("--results", default="",
                   help="JSON lines of finished cells: resumed from, appended to (default "
                        "runs/fault_matrix/results.jsonl, runs/fault_matrix_diloco/results.jsonl "
                        "with --diloco)")
    p.add_argument("--diloco", type=int, default=0, metavar="H",
                   help="run the cells in DiLoCo mode with H inner steps per synchronisation "
                        "(default 0: every step)")
    p.add_argument("--fresh", action="store_true", help="rerun cells already in --results")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--cell", help=argparse.SUPPRESS)  # the child: run this one cell
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.diloco < 0:
        p.error(f"--diloco {args.diloco}: H must be 1 or more (0: every step)")
    by_name = {c.name: c for c in cells()}
    if args.cell:
        run_cell(by_name[args.cell], Path(args.run_dir), args.steps, args.diloco)
        return 0
    ensure_demo()
    section = SECTION + ("_diloco" if args.diloco else "")
    results = Path(args.results or REPO_ROOT / "runs" / section / "results.jsonl")
    results.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if not args.fresh:
        done = {r["cell"]: r for r in _events(results)
                if r.get("steps") == args.steps and r.get("diloco", 0) == args.diloco}
    only = "inside_allreduce.r1.kill" if args.quick and not args.only else args.only
    wanted = [c for c in cells() if any(part in c.name for part in only.split(","))]
    if not wanted:
        p.error(f"--only {only!r} matches no cell; cells are named POINT.rRANK.KIND, e.g. "
                f"{cells()[0].name}")
    print(f"fault matrix: {len(wanted)} cell(s), {args.steps} steps, "
          f"{sum(c.name in done for c in wanted)} already recorded in {results}", flush=True)
    for cell in wanted:
        if cell.name not in done:
            record = run_one(cell, results.parent, args.steps, args.diloco)
            with open(results, "a") as f:
                f.write(json.dumps(record) + "\n")
            done[cell.name] = record
            if record["ok"]:  # keep failed runs' directories for reading
                shutil.rmtree(record["run_dir"], ignore_errors=True)
        print(" | ".join(map(str, row(done[cell.name]))), flush=True)
    records = [done[c.name] for c in wanted]
    passed = sum(r["ok"] for r in records)
    flags = ([f"--steps {args.steps}"] + ([f"--diloco {args.diloco}"] if args.diloco else [])
             + ([f"--only {only}"] if only else []))
    title = "Fault matrix: every fault point x rank x kind in 2 groups x 2 ranks"
    mode = ""
    if args.diloco:
        title = f"Fault matrix in DiLoCo mode (H={args.diloco}): fault points x rank x kind in 2 groups x 2 ranks"
        mode = (f" in DiLoCo mode (`ft.sync = \"diloco\"`: a step is a synchronisation of {args.diloco} "
                f"inner steps, {args.steps * args.diloco} inner steps a group in all; a point `@10` strikes "
                "the 10th synchronisation)")
    body = (section_header(title, "bench.fault_matrix", flags)
            + "* Method: see `bench/fault_matrix.py`: one `LocalLauncher` run per cell, 2 groups "
              f"x 2 ranks, {args.steps} steps of the soak's model and timeouts{mode}, the cell's "
              "`FTLM_FAULT` plans; pass = clean exit, 2 identical hashes, 0 duplicates, 0 gaps, "
              "every step committed, every failure explained and detected, the fault fired.\n"
            + f"* Result: {passed} of {len(records)} cell(s) passed.\n\n"
            + matrix(records) + ("" if args.diloco else "\n\n" + READING))
    print(body)
    if not args.no_write:
        write_section(section, body)
    return 0 if passed == len(records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
