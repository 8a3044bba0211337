"""Soak: real-process chaos runs of ``ftlm launch local``, one per seed, each checked end to end.

Every run is the real command a user types (``python -m ftlm.cli launch local CONFIG ...``, as a
subprocess in its own run directory) with chaos on: SIGKILL and SIGSTOP of group processes at
any moment, start-up included (``--chaos-hang``), SIGKILL of the coordinator process
(``--chaos-coordinator``). Seeds alternate between two layouts: 3 groups of 1 rank, and 2 groups
of 2 ranks, where a hang can hit a non-leader rank (its group's heartbeat lives on: only the
progress timeout catches it). A run passes when:

* ``launch local`` exited 0, and its ``summary.json`` shows
* n identical final state hashes for the n groups,
* 0 duplicated and 0 skipped samples (over the final history, after any rollback),
* no healthy group crashed: no group process failed that chaos did not hit (``crashes``), and
  no failure was detected that chaos did not inject (``failures_unexplained``: a false hang
  alarm restarts a healthy group),
* every injected failure was detected (``failures_undetected`` is 0).

Results are appended, one JSON line per run, to ``--results`` (default ``runs/soak/results.jsonl``)
and printed as they come, so a long soak can be stopped and resumed: seeds already in the file
(for the same settings) are skipped. The table of every recorded run of these settings goes to
BENCHMARKS.md.

    python -m bench.soak [--quick] [--seeds K] [--first-seed S] [--mtbf SECONDS] [--steps N] [--preempt]

``--preempt`` adds preemptions to the chaos (``--chaos-preempt``: SIGTERM to every rank of a group,
or to one rank alone, at any moment); its runs are recorded under their own settings and table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import (DEMO_DIR, DEMO_SEQ_LEN, DEMO_VOCAB, REPO_ROOT, ensure_demo,
                          section_header, table, write_section)

SECTION = "soak"
LAYOUTS = ((3, 1), (2, 2))
"""(groups, ranks per group), alternating by seed."""
RUN_TIMEOUT_S = 1800.0
"""A run still going after this long is stopped and counted as failed (a hang of the job)."""


@dataclass(frozen=True)
class Settings:
    steps: int
    mtbf: float
    hang: bool = True
    coordinator: bool = True
    preempt: bool = False
    layout: tuple[int, int] | None = None
    """(groups, ranks per group) of every run; None: alternate ``LAYOUTS`` by seed."""
    checkpoint_every: int = 50
    ft: tuple[tuple[str, str], ...] = ()
    """More ``[ft]`` settings, (name, TOML value) each (the fault matrix's ``--diloco``)."""

    def key(self) -> str:
        """Results of the same settings are comparable (and resumable)."""
        key = f"steps={self.steps} mtbf={self.mtbf:g} hang={self.hang} coord={self.coordinator}"
        key += " preempt=True" if self.preempt else ""
        key += f" layout={self.layout[0]}x{self.layout[1]}" if self.layout else ""
        key += "".join(f" {k}={v}" for k, v in self.ft)
        return key + (f" every={self.checkpoint_every}" if self.checkpoint_every != 50 else "")

    def section(self) -> str:
        """The BENCHMARKS.md section of these settings' table."""
        name = SECTION + ("_preempt" if self.preempt else "")
        return name + (f"_{self.layout[0]}x{self.layout[1]}" if self.layout else "")


def layout(seed: int, settings: Settings | None = None) -> tuple[int, int]:
    if settings is not None and settings.layout is not None:
        return settings.layout
    return LAYOUTS[seed % len(LAYOUTS)]


def write_config(run_dir: Path, settings: Settings) -> Path:
    """A small model on the demo data (fast steps: the soak is about faults, not speed), with
    timeouts sized for a loaded 2-core machine running 4 or 5 processes."""
    extra_ft = "".join(f"{k} = {v}\n" for k, v in settings.ft)
    text = f"""\
[run]
name = "soak"
dir = "{run_dir}"
seed = 0

[model]
size = "tiny"
vocab_size = {DEMO_VOCAB}
dim = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
ffn_dim = 128
max_seq_len = {DEMO_SEQ_LEN}

[data]
dir = "{DEMO_DIR}"
seq_len = {DEMO_SEQ_LEN}

[train]
steps = {settings.steps}
batch_size = 4
lr = 0.003
warmup_steps = 5
threads = 1

[checkpoint]
# Durable checkpoints: when chaos takes every group holding the newest state, the job rolls back
# (an explicit restore) to the newest intact checkpoint instead of to step 0.
every = {settings.checkpoint_every}
keep = 2

[ft]
heartbeat_interval = 0.1
heartbeat_timeout = 2.0
join_timeout = 2.0
allreduce_timeout = 10.0
progress_timeout = 25.0
quorum_timeout = 40.0
give_up_seconds = 180.0
restart_delay = 0.5
startup_timeout = 45.0
bucket_bytes = 65536
{extra_ft}
[observe]
progress = false
"""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "soak.toml"
    path.write_text(text)
    return path


def run_one(seed: int, settings: Settings, root: Path) -> dict:
    """One chaos run of ``launch local``; returns its result record (see ``verdict``)."""
    groups, ranks = layout(seed, settings)
    run_dir = root / f"seed-{seed:04d}"
    # A fresh directory: a relaunch into an old one would resume from its checkpoints.
    shutil.rmtree(run_dir, ignore_errors=True)
    config = write_config(run_dir, settings)
    cmd = [sys.executable, "-m", "ftlm.cli", "launch", "local", str(config),
           "--groups", str(groups), "--ranks-per-group", str(ranks),
           "--chaos-mtbf", str(settings.mtbf), "--chaos-seed", str(seed)]
    cmd += ["--chaos-hang"] if settings.hang else []
    cmd += ["--chaos-coordinator"] if settings.coordinator else []
    cmd += ["--chaos-preempt"] if settings.preempt else []
    t0 = time.monotonic()
    code = run_logged(cmd, run_dir / "launch.log", RUN_TIMEOUT_S,
                      dict(os.environ, PYTHONPATH=str(REPO_ROOT / "src")))
    wall = time.monotonic() - t0
    return verdict(seed, groups, ranks, settings, code, wall, run_dir)


def run_logged(cmd: list[str], log_path: Path, timeout_s: float, env: dict[str, str],
               cwd: Path | None = None) -> int | None:
    """Run ``cmd`` to its end, its output into ``log_path``; its exit status, or None when it
    overstayed ``timeout_s``: it runs in a session of its own, so that every process it started
    is then stopped with it (SIGTERM, SIGKILL a minute later)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env, cwd=cwd)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop_session(proc)
            return None
        except BaseException:  # Ctrl-C, or SIGTERM to the bench (``main``): the run goes with it
            _stop_session(proc)
            raise


def _interrupted(*_: object) -> None:
    raise KeyboardInterrupt("SIGTERM")


def _stop_session(proc: subprocess.Popen) -> None:
    """SIGTERM to every process of ``proc``'s session (a launch stops its groups), SIGKILL a
    minute later if any is still there."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _events(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill
    return out


def launch_reasons(summary: dict, code: int | None, timeout_s: float) -> list[str]:
    """Why a finished launch is not a pass (empty when it is): it overstayed (``code`` None) or
    exited non-zero, left no summary, its summary's proof failed (hashes, duplicates, gaps, steps
    committed), a healthy group crashed, an injected failure went undetected, or a failure was
    detected that nobody injected."""
    reasons = []
    if code is None:
        reasons.append(f"still running after {timeout_s:.0f} s")
    elif code != 0:
        reasons.append(f"launch local exited {code}")
    if not summary:
        reasons.append("no summary.json")
    reasons += summary.get("problems") or []
    if summary.get("crashes"):
        reasons.append(f"healthy groups crashed: {summary['crashes']}")
    if summary.get("failures_undetected"):
        reasons.append(f"{summary['failures_undetected']} injected failure(s) never detected")
    if summary.get("failures_unexplained"):
        reasons.append(f"{summary['failures_unexplained']} failure(s) nobody injected (a healthy "
                       "group crashed or was taken for hung)")
    return reasons


def verdict(seed: int, groups: int, ranks: int, settings: Settings, code: int | None,
            wall: float, run_dir: Path) -> dict:
    """The result record of one run: faults injected by kind, what the summary proves, pass/fail
    with the reasons."""
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    injected = [e for e in _events(run_dir / "events.jsonl") if e["kind"] == "failure_injected"
                and e.get("group") == "supervisor"]
    hashes = summary.get("state_hashes") or {}
    data = summary.get("data") or {}
    reasons = launch_reasons(summary, code, RUN_TIMEOUT_S)
    model = summary.get("model") or {}
    if summary and model.get("step") != settings.steps:
        reasons.append(f"model.safetensors holds step {model.get('step')}, not the final step "
                       f"{settings.steps}")
    return {
        "settings": settings.key(), "seed": seed, "groups": groups, "ranks": ranks,
        "wall_seconds": round(wall, 1), "exit": code,
        "kills": sum(1 for e in injected if e.get("signal") == "SIGKILL"
                     and e.get("target") != "coordinator"),
        "hangs": sum(1 for e in injected if e.get("signal") == "SIGSTOP"),
        "nonleader_hangs": sum(1 for e in injected if e.get("signal") == "SIGSTOP"
                               and e.get("target_rank", 0) > 0),
        "at_startup": sum(1 for e in injected if e.get("registered") is False),
        "coordinator_kills": sum(1 for e in injected if e.get("target") == "coordinator"),
        "preemptions": sum(1 for e in injected if e.get("signal") == "SIGTERM"),
        "one_rank_preemptions": sum(1 for e in injected if e.get("signal") == "SIGTERM"
                                    and e.get("target_rank", -1) >= 0),
        "preempted_exits": sum(1 for e in _events(run_dir / "events.jsonl")
                               if e["kind"] == "group_exit" and e.get("preempted")),
        "detected": summary.get("failures_detected"),
        "undetected": summary.get("failures_undetected"),
        "unexplained": summary.get("failures_unexplained"),
        "restarts": sum((summary.get("restarts") or {}).values()),
        "rollbacks": data.get("restores", 0),
        "hashes": f"{len(set(hashes.values()))} distinct of {len(hashes)} for {groups} groups",
        "identical": bool(summary.get("replicas_identical")),
        "duplicates": data.get("duplicates"), "gaps": data.get("gaps"),
        "crashes": len(summary.get("crashes") or []),
        "steps_committed": summary.get("steps_committed"),
        "model_step": model.get("step"),
        "ok": not reasons, "reasons": reasons, "run_dir": str(run_dir),
    }


def load(results: Path, settings: Settings) -> dict[int, dict]:
    """Recorded runs of these settings, by seed (the last record of a seed wins)."""
    out: dict[int, dict] = {}
    for record in _events(results):
        if record.get("settings") == settings.key():
            out[record["seed"]] = record
    return out


def row(r: dict, preempt: bool = False) -> list[object]:
    faults = r["kills"] + r["hangs"] + r["coordinator_kills"] + r.get("preemptions", 0)
    preempted = ([r["preemptions"], r["one_rank_preemptions"], r["preempted_exits"]] if preempt
                 else [])
    return [r["seed"], f"{r['groups']}x{r['ranks']}", r["wall_seconds"], faults, r["kills"],
            r["hangs"], r["nonleader_hangs"], r["at_startup"], r["coordinator_kills"], *preempted,
            r["detected"], r["unexplained"], r["restarts"], r["rollbacks"], r["hashes"], r["duplicates"], r["gaps"],
            r["crashes"], "pass" if r["ok"] else "FAIL: " + "; ".join(r["reasons"])[:200]]


HEADERS = ["seed", "groups x ranks", "wall s", "faults", "group kills", "group hangs",
           "of which non-leader", "at start-up", "coordinator kills", "detected",
           "not injected", "restarts",
           "rollbacks", "final hashes", "duplicates", "gaps", "crashes", "result"]
"""Of one run's line on the console (``row``)."""
PREEMPT_HEADERS = ["preemptions", "of which one rank", "preempted exits"]
"""With ``--preempt``: after ``coordinator kills``."""
SUMMED = ["kills", "hangs", "nonleader_hangs", "at_startup", "coordinator_kills", "detected",
          "unexplained", "restarts", "rollbacks", "duplicates", "gaps", "crashes"]
"""The record fields the section's table sums over the runs of a layout, in its column order."""
PREEMPT_SUMMED = ["preemptions", "one_rank_preemptions", "preempted_exits"]


def headers(preempt: bool) -> list[str]:
    at = HEADERS.index("coordinator kills") + 1
    return HEADERS[:at] + (PREEMPT_HEADERS if preempt else []) + HEADERS[at:]


def layout_headers(preempt: bool) -> list[str]:
    at = HEADERS.index("coordinator kills") + 1
    return (["groups x ranks", "runs", "passed", "median wall s", "faults"] + HEADERS[4:at]
            + (PREEMPT_HEADERS if preempt else []) + HEADERS[at:13]
            + ["identical final hashes", "duplicates", "gaps", "crashes"])


def layout_rows(records: list[dict], preempt: bool) -> list[list[object]]:
    """One row per layout: its runs, how many passed, and every count summed over them (a run's
    own line is on the console and in the results file)."""
    rows = []
    for groups, ranks in sorted({(r["groups"], r["ranks"]) for r in records}, reverse=True):
        runs = [r for r in records if (r["groups"], r["ranks"]) == (groups, ranks)]
        total = {k: sum(r.get(k, 0) for r in runs) for k in SUMMED + PREEMPT_SUMMED}
        faults = (total["kills"] + total["hangs"] + total["coordinator_kills"]
                  + total["preemptions"])
        at = SUMMED.index("coordinator_kills") + 1
        counts = ([total[k] for k in SUMMED[:at]]
                  + ([total[k] for k in PREEMPT_SUMMED] if preempt else [])
                  + [total[k] for k in SUMMED[at:at + 4]]
                  + [f"{sum(r['hashes'].startswith('1 distinct') for r in runs)} of {len(runs)}"]
                  + [total[k] for k in SUMMED[at + 4:]])
        wall = statistics.median(r["wall_seconds"] for r in runs)
        rows.append([f"{groups}x{ranks}", len(runs), sum(r["ok"] for r in runs), f"{wall:.0f}",
                     faults, *counts])
    return rows


def render(records: list[dict], settings: Settings, flags: list[str]) -> str:
    passed = sum(r["ok"] for r in records)
    faults = sum(r["kills"] + r["hangs"] + r["coordinator_kills"] + r.get("preemptions", 0)
                 for r in records)
    # One title per section (settings.section()): BENCHMARKS.md has no heading twice.
    title = ("Soak: chaos runs of `ftlm launch local`"
             + (", with preemptions" if settings.preempt else "")
             + (f", {settings.layout[0]} groups x {settings.layout[1]} rank(s), {settings.steps} "
                f"steps" if settings.layout else ""))
    preempt = (" `--chaos-preempt` (a third of the groups' failures are SIGTERMs, to every rank or, "
               "one time in three with 2 ranks, to one rank alone: the group must leave gracefully, "
               "exit 0 and come back; a preemption is not a failure to detect)" if settings.preempt else "")
    return (section_header(title, "bench.soak", flags)
            + f"* Method: one `python -m ftlm.cli launch local` per seed with `--chaos-mtbf "
              f"{settings.mtbf:g}`{' --chaos-hang' if settings.hang else ''}"
              f"{' --chaos-coordinator' if settings.coordinator else ''}{preempt} and `--chaos-seed` = "
              f"seed, {settings.steps} steps of a 100k-parameter model on the demo data; "
              + (f"{settings.layout[0]} groups x {settings.layout[1]} rank(s) each run"
                 if settings.layout else "seeds alternate 3 groups x 1 rank and 2 groups x 2 ranks")
              + (f", durable checkpoints every {settings.checkpoint_every} steps"
                 if settings.checkpoint_every else ", no periodic checkpoint (the final step only)")
              + ". A run passes when `launch "
              f"local` exits 0 (n identical final hashes for n groups, 0 duplicates, 0 gaps, "
              f"all steps committed, `model.safetensors` holding the final step), no group "
              f"crashed or was taken for hung that chaos did not hit, and every injected "
              f"failure was detected.\n"
            + f"* Result: {passed} of {len(records)} run(s) passed; {faults} faults injected.\n\n"
            + table(layout_headers(settings.preempt), layout_rows(records, settings.preempt))
            + "".join(f"\n\nSeed {r['seed']} ({r['groups']}x{r['ranks']}) failed: "
                      + "; ".join(r["reasons"])[:300]
                      for r in sorted(records, key=lambda r: r["seed"]) if not r["ok"]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 2 seeds (one of each layout) of 300 steps")
    p.add_argument("--seeds", type=int, default=None, help="runs (default 20, 2 with --quick)")
    p.add_argument("--first-seed", type=int, default=0, help="seed of the first run (default 0)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 800)")
    p.add_argument("--mtbf", type=float, default=8.0,
                   help="mean seconds between injected failures (default 8)")
    p.add_argument("--results", default=str(REPO_ROOT / "runs" / "soak" / "results.jsonl"),
                   help="JSON lines of finished runs: resumed from, appended to")
    p.add_argument("--fresh", action="store_true", help="rerun seeds already in --results")
    p.add_argument("--preempt", action="store_true",
                   help="chaos also preempts groups (--chaos-preempt); its own BENCHMARKS section")
    p.add_argument("--layout", default="", metavar="GxR",
                   help="every run with G groups of R ranks (default: alternate 3x1 and 2x2)")
    p.add_argument("--checkpoint-every", type=int, default=50,
                   help="durable checkpoints every N steps (0: the final step only, as "
                        "configs/tiny.toml ships; default 50)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    fixed = None
    if args.layout:
        try:
            g, r = (int(x) for x in args.layout.lower().split("x"))
        except ValueError:
            p.error(f"--layout={args.layout!r} must read GxR, e.g. 4x1")
        if g < 1 or r < 1:
            p.error(f"--layout={args.layout!r}: groups and ranks must be at least 1")
        fixed = (g, r)
    seeds = args.seeds if args.seeds is not None else (2 if args.quick else 20)
    steps = args.steps if args.steps is not None else (300 if args.quick else 800)
    if seeds < 1 or steps < 1 or args.mtbf <= 0:
        p.error("--seeds, --steps and --mtbf must be positive")
    if args.checkpoint_every < 0:
        p.error("--checkpoint-every must be >= 0")
    settings = Settings(steps=steps, mtbf=args.mtbf, preempt=args.preempt, layout=fixed,
                        checkpoint_every=args.checkpoint_every)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    ensure_demo()
    # SIGTERM ends the bench as Ctrl-C does, stopping the run in progress (``run_logged``).
    signal.signal(signal.SIGTERM, _interrupted)
    done = {} if args.fresh else load(results, settings)
    wanted = range(args.first_seed, args.first_seed + seeds)
    print(f"soak: {len(wanted)} run(s), {settings.key()}; "
          f"{sum(s in done for s in wanted)} already recorded in {results}", flush=True)
    print(" | ".join(headers(settings.preempt)), flush=True)
    for seed in wanted:
        if seed in done:
            print(" | ".join(map(str, row(done[seed], settings.preempt))) + " (recorded)", flush=True)
            continue
        record = run_one(seed, settings, results.parent)
        with open(results, "a") as f:
            f.write(json.dumps(record) + "\n")
        done[seed] = record
        print(" | ".join(map(str, row(record, settings.preempt))), flush=True)
    records = [done[s] for s in wanted]
    flags = (["--quick"] if args.quick else []) + [f"--seeds {seeds}", f"--steps {steps}",
                                                   f"--mtbf {args.mtbf:g}"]
    flags += ["--preempt"] if args.preempt else []
    flags += [f"--layout {args.layout}"] if fixed else []
    flags += [f"--checkpoint-every {args.checkpoint_every}"] if args.checkpoint_every != 50 else []
    body = render(records, settings, flags)
    print(body)
    if not args.no_write:
        write_section(settings.section(), body)
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
