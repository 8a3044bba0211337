"""Nemesis: seeded network chaos on a real network test bed, each run checked end to end.

Every run is a real job of ``ftlm.launch.local.LocalLauncher`` whose coordinator and groups each
run in a network namespace of their own (``ftlm.testing.netbed``), while a seeded nemesis, in
another thread, injects faults one after another: partitions of every shape (a group cut off
from everyone, from the coordinator only, from one peer only, in one direction only), a link that
flaps, a slow or lossy link (``tc``), a group killed (SIGKILL) or hung (SIGSTOP, resumed
later). Every fault is written to the run's ``events.jsonl`` (``failure_injected``: signal
``partition``, ``SIGKILL``, ``SIGSTOP`` for a failure the job must detect, ``none`` for a
disturbance it must ride out). A run passes when (``verdict``):

* the launch returned a summary with n identical final state hashes for the n groups,
* 0 duplicated and 0 skipped samples, every step committed (``summary.problems`` empty),
  quorum ids never went backwards,
* no group crashed on its own, every fault that must be detected was, and no failure was detected
  that no fault explains (``failures_undetected`` and ``failures_unexplained`` are 0).

Results are appended, one JSON line per run, to ``--results`` (default
``runs/nemesis/results.jsonl``), so a long nemesis can be stopped and resumed; ``--write`` puts
the table of every recorded run of these settings into BENCHMARKS.md.

    python -m bench.nemesis [--runs N] [--seed S] [--steps N] [--write]

Needs root, ``ip``, ``tc`` and ``nft`` (``make system-deps``); delay, jitter and reordering
need a kernel with netem, and without it the nemesis shapes links by loss and rate alone.

The tests (tests/net/) use ``job_config``, ``run_on_bed`` and ``verdict`` to run their scenarios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench.common import (DEMO_SEQ_LEN, DEMO_VOCAB, REPO_ROOT, ensure_demo, publish,
                          section_header, table)

SECTION = "nemesis"
FT = {"heartbeat_interval": 0.1, "heartbeat_timeout": 2.0, "join_timeout": 2.0,
      "allreduce_timeout": 6.0, "progress_timeout": 25.0, "quorum_timeout": 40.0,
      "give_up_seconds": 180.0, "restart_delay": 0.5, "startup_timeout": 120.0,
      "bucket_bytes": 65536}
"""Timeouts of a run: the soak's (a loaded 2-core machine running 4 or 5 processes), with the
all-reduce timeout lower so that a vanished peer costs seconds, not tens of seconds, and the
start-up timeout at its default (a group's start took over 45 s at a load of 28)."""
DETECTION_BOUND = FT["heartbeat_timeout"] + 3.0
"""A partition held longer than this must be detected (heartbeats stop reaching the
coordinator, or the step's all-reduce times out); shorter ones are disturbances."""


def job_config(run_dir: Path, data_dir: Path, steps: int, seq_len: int = DEMO_SEQ_LEN,
               vocab: int = DEMO_VOCAB, ft: dict | None = None, checkpoint_every: int = 50,
               resume: bool = True):
    """A 100k-parameter model on ``data_dir`` (fast steps: the runs are about faults);
    ``resume`` False: a restarted group never resumes from a checkpoint, it pulls from a peer."""
    from ftlm.config import build_config
    return build_config({
        "run": {"name": "nemesis", "dir": str(run_dir), "seed": 0},
        "model": {"size": "tiny", "vocab_size": vocab, "dim": 64, "n_layers": 2, "n_heads": 4,
                  "n_kv_heads": 2, "ffn_dim": 128, "max_seq_len": seq_len},
        "data": {"dir": str(data_dir), "seq_len": seq_len},
        "train": {"steps": steps, "batch_size": 4, "lr": 3e-3, "warmup_steps": 5, "threads": 1},
        "checkpoint": {"every": checkpoint_every, "keep": 2, "resume": resume},
        "ft": {**FT, **(ft or {})},
        "observe": {"progress": False},
    })


# -- one job on a bed ---------------------------------------------------------------------------
class Watch:
    """What a fault script sees of a running job: its events and its group processes."""

    def __init__(self, run_dir: Path, launcher) -> None:
        self.run_dir, self.launcher = run_dir, launcher
        self.events_path = run_dir / "events.jsonl"
        self.stop = threading.Event()  # the job ended: scripts stop waiting

    def events(self) -> list[dict]:
        from ftlm.errors import DataError
        from ftlm.observe.events import read_events
        try:
            return read_events(self.events_path)
        except (OSError, ValueError, DataError):  # not written yet
            return []

    def top_step(self) -> int:
        """The highest step any group committed so far (-1 before the first commit)."""
        return max((e["step"] for e in self.events() if e["kind"] == "commit"), default=-1)

    def wait_until(self, what: str, check: Callable[[list[dict]], bool], timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until ``check(events)`` holds; False when the job ended
        first. ``TimeoutError`` naming ``what`` when it never does."""
        deadline = time.monotonic() + timeout
        while not self.stop.is_set():
            if check(self.events()):
                return True
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not seen within {timeout:g} s")
            self.stop.wait(0.1)
        return False

    def wait_step(self, step: int, timeout: float = 120.0) -> bool:
        """Wait until some group committed ``step``."""
        return self.wait_until(f"a commit of step {step}",
                               lambda ev: any(e["kind"] == "commit" and e["step"] >= step for e in ev),
                               timeout)

    def wait_commits_after(self, ts: float, groups: set[str], commits: int = 3,
                           timeout: float = 120.0) -> bool:
        """Wait until each of ``groups`` committed ``commits`` steps after time ``ts``."""
        def done(ev: list[dict]) -> bool:
            return all(sum(1 for e in ev if e["kind"] == "commit" and e["group"] == g
                           and e["ts"] > ts) >= commits for g in groups)
        return self.wait_until(f"{commits} commits of {sorted(groups)} after the fault", done, timeout)

    def pids(self, group: str) -> tuple[str, list[int]]:
        """The incarnation of the group's current processes and their PIDs (one per rank)."""
        g = next(g for g in self.launcher.groups if g.name == group)
        return g.incarnation, [p.pid for p in g.procs if p.poll() is None]

    def record(self, target: str, signal_name: str, expect: str = "detected", **fields: object) -> None:
        """A signal the script sent a group, in the run's events (``expect``: see
        ``ftlm.testing.netbed.EXPECTATIONS``)."""
        from ftlm.observe.events import EventLog
        with EventLog(self.events_path, group="netbed") as log:
            log.emit("failure_injected", step=-1, target=target, signal=signal_name,
                     expect=expect, **fields)


@dataclass
class Outcome:
    summary: dict
    events: list[dict]
    script_error: str = ""
    wall_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def run_on_bed(bed, config, groups: int, script: Callable[[Watch], None] | None = None,
               **options) -> Outcome:
    """Run the job of ``config`` with its coordinator in bed node ``coordinator``, group ``gI``
    in node ``gI`` and, for a multi-node group, its rank R in node ``gI.rR`` (``options``: more
    ``LocalLauncher`` arguments), and ``script`` (the faults) in a thread of its own; the
    summary, the events, and the script's error if it raised."""
    from ftlm.launch.local import LocalLauncher
    from ftlm.observe.events import read_events
    places = {name: bed.node(name) for name in bed.names}  # "g1.r1": a node of its own
    launcher = LocalLauncher(config, groups=groups, progress=False, places=places, **options)
    watch = Watch(config.run.path, launcher)
    errors: list[str] = []

    def run_script() -> None:
        try:
            # Faults go into the run's record once the launch has set its events file up.
            if watch.wait_step(0, timeout=float(config.ft.startup_timeout) + 60):
                bed.record_to(watch.events_path)
                script(watch)
        except Exception:  # the verdict reports it: a fault that was not injected proves nothing
            errors.append(traceback.format_exc(limit=4))
        finally:
            bed.record_to(None)

    thread = threading.Thread(target=run_script, name="nemesis", daemon=True)
    t0 = time.monotonic()
    if script is not None:
        thread.start()
    try:
        summary = launcher.run()
    finally:
        watch.stop.set()
        if script is not None:
            thread.join(timeout=60)
        bed.heal()
    return Outcome(summary, read_events(config.run.path / "events.jsonl"),
                   "\n".join(errors), time.monotonic() - t0)


SETTLE_SECONDS = 60.0
"""A conviction this long after a fault ended is still its consequence (a group cut off long
enough is declared dead, killed as hung and restarted; a restart took 47 s at a load of 38)."""


def _group(name: object) -> str:
    """The group of an incarnation (``g1:abc``) or of a node of it (``g1.r1``)."""
    return str(name or "").partition(":")[0].partition(".")[0]


def network_ledger(events: list[dict], detect_within: float) -> tuple[list[dict], list[dict]]:
    """The faults of the bed and the script (``group`` netbed), and the groups' own planned
    faults (``FTLM_FAULT``), matched with what the job did:
    ``(undetected, unexplained)``. A fault with ``expect`` ``detected`` must be followed, while it
    lasts or ``detect_within`` s after, by a detection involving its group or its peer (a
    ``member_dead``, ``member_killed``, failed ``group_exit`` or ``step_failed``); a conviction
    (a failure the summary's ``failure_ledger`` detected) must fall within ``SETTLE_SECONDS`` of
    a fault involving its group whose ``expect`` is ``detected`` or ``either``: a ``tolerated``
    one convicts nobody."""
    ordered = sorted(events, key=lambda e: e["ts"])
    faults = [e for e in ordered if e["kind"] == "failure_injected" and e.get("group") == "netbed"]
    # A group's own planned fault (``FTLM_FAULT``: it killed or stopped itself) is one too; a
    # stop may be resumed before anyone could notice.
    faults += [dict(e, target=e["group"], expect="detected" if e["signal"] == "SIGKILL" else "either")
               for e in ordered
               if e["kind"] == "failure_injected" and e.get("group") != "netbed"
               and e.get("signal") in ("SIGKILL", "SIGSTOP") and "point" in e]
    faults.sort(key=lambda e: e["ts"])
    heals = [e for e in ordered if e["kind"] == "network_healed"]

    def involved(f: dict) -> set[str]:
        return {_group(f.get("target")), _group(f.get("peer"))} - {"", "coordinator"}

    def end(f: dict) -> float:
        if f.get("signal") in ("SIGKILL", "SIGSTOP"):
            return f["ts"] + float(f.get("seconds") or 0.0)
        later = [h["ts"] for h in heals if h["ts"] >= f["ts"]
                 and h.get("target") in ("*", f.get("target"), f.get("peer"))]
        return later[0] if later else ordered[-1]["ts"]

    detections = [e for e in ordered if e["kind"] in ("member_dead", "member_killed", "step_failed")
                  or (e["kind"] == "group_exit" and e.get("ok") is False)]
    about = lambda e: _group(e.get("target") if e["kind"] != "step_failed" else e.get("group"))  # noqa: E731
    undetected = [f for f in faults if f.get("expect") == "detected" and not any(
        about(d) in involved(f) and f["ts"] <= d["ts"] <= end(f) + detect_within for d in detections)]
    # Convictions as the run's summary counts them (``failure_ledger``): one per failed
    # incarnation; a member declared dead that went on and ended cleanly is none.
    from ftlm.observe.summary import failure_ledger
    convicted = [{"ts": d.ts, "kind": d.kind, "target": d.group, "reason": d.reason}
                 for d in failure_ledger(events).detected if d.group != "coordinator"]
    unexplained = [d for d in convicted if not any(
        f.get("expect") in ("detected", "either") and about(d) in involved(f)
        and f["ts"] <= d["ts"] <= end(f) + SETTLE_SECONDS for f in faults)]
    return undetected, unexplained


def verdict(outcome: Outcome, groups: int, steps: int, detect_within: float = DETECTION_BOUND) -> list[str]:
    """Why a run does not pass (empty when it does); see the module docstring."""
    s, events = outcome.summary, outcome.events
    reasons = list(s.get("problems") or [])
    if outcome.script_error:
        reasons.append(f"the fault script failed: {outcome.script_error.strip().splitlines()[-1]}")
    hashes = s.get("state_hashes") or {}
    if len(hashes) != groups or not s.get("replicas_identical"):
        reasons.append(f"final hashes: {len(set(hashes.values()))} distinct of {len(hashes)} "
                       f"for {groups} groups")
    data = s.get("data") or {}
    if data.get("duplicates") or data.get("gaps"):
        reasons.append(f"{data.get('duplicates')} duplicate(s), {data.get('gaps')} gap(s)")
    committed = {e["step"] for e in events if e["kind"] == "commit"}
    if committed != set(range(steps)):
        reasons.append(f"steps never committed: {sorted(set(range(steps)) - committed)[:10]}")
    ids = [e["quorum_id"] for e in sorted(events, key=lambda e: e["ts"]) if e["kind"] == "quorum"]
    if ids != sorted(ids):
        reasons.append("quorum ids went backwards")
    # The script's own signals are crashes to the launcher, which did not send them.
    signalled = {f.get("incarnation") for f in faults_of(events) if f.get("incarnation")}
    crashes = [c for c in s.get("crashes") or [] if c.get("incarnation") not in signalled]
    if crashes:
        reasons.append(f"groups crashed on their own: {crashes}")
    undetected, unexplained = network_ledger(events, detect_within)
    for f in undetected:
        reasons.append(f"fault never detected: {f.get('fault') or f.get('signal')} of {f.get('target')}"
                       + (f" from {f['peer']}" if f.get("peer") else "") + f" at ts {f['ts']:.2f}")
    for d in unexplained:
        reasons.append(f"conviction no fault explains: {d['kind']} of {d.get('target')} at ts "
                       f"{d['ts']:.2f} ({d.get('reason') or d.get('cause') or ''})")
    return reasons


def faults_of(events: list[dict]) -> list[dict]:
    return [e for e in events if e["kind"] == "failure_injected" and e.get("group") == "netbed"]


# -- the seeded nemesis -------------------------------------------------------------------------
FAULTS = ("isolate", "from_coordinator", "from_peer", "one_way", "flap", "shape", "kill", "hang")


@dataclass(frozen=True)
class Settings:
    steps: int
    groups: int = 3
    faults_per_run: int = 10

    def key(self) -> str:
        return f"steps={self.steps} groups={self.groups} faults={self.faults_per_run}"


def nemesis_script(seed: int, settings: Settings, bed, netem: bool) -> Callable[[Watch], None]:
    """The seeded faults of one run: one at a time, each held a drawn time, then healed, and the
    next one only after every group committed again (so each fault is judged on its own)."""
    from ftlm.testing.netbed import LinkShape
    rng = random.Random(seed)
    names = [f"g{i}" for i in range(settings.groups)]

    def script(watch: Watch) -> None:
        # Every group in the job first: a group cut off before it registered is no member the
        # coordinator could declare dead, and its fault would go undetected by design.
        if not watch.wait_commits_after(0.0, set(names), commits=1, timeout=240):
            return
        for _ in range(settings.faults_per_run):
            if watch.stop.is_set() or watch.top_step() >= settings.steps - 40:
                return
            kind = rng.choice(FAULTS)
            victim = rng.choice(names)
            peer = rng.choice([n for n in names if n != victim])
            long = rng.random() < 0.6
            hold = rng.uniform(DETECTION_BOUND + 1, DETECTION_BOUND + 6) if long else rng.uniform(0.3, 1.2)
            expect = "detected" if long else "either"
            if kind == "isolate":
                bed.isolate(victim, expect=expect)
            elif kind == "from_coordinator":
                bed.block(victim, "coordinator", expect=expect)
            elif kind == "from_peer":
                bed.block(victim, peer, expect=expect)
            elif kind == "one_way":
                bed.block(victim, rng.choice(["coordinator", peer]), both_ways=False, expect=expect)
            elif kind == "flap":
                with bed.flapping(victim, peer, down_s=rng.uniform(0.2, 0.8), up_s=rng.uniform(0.5, 2)):
                    watch.stop.wait(rng.uniform(4, 10))
            elif kind == "shape":
                shape = LinkShape(delay_ms=rng.choice([5, 20, 50]) if netem else 0,
                                  jitter_ms=rng.choice([0, 5]) if netem else 0,
                                  loss_pct=rng.choice([0.5, 1, 3]),
                                  rate_mbit=rng.choice([0, 20, 100]))
                bed.shape(victim, shape)
                watch.stop.wait(rng.uniform(4, 10))
                bed.shape(victim, None)
            elif kind in ("kill", "hang"):
                incarnation, pids = watch.pids(victim)
                if not pids:
                    continue
                sig = signal.SIGKILL if kind == "kill" else signal.SIGSTOP
                # A stop shorter than the heartbeat timeout may pass unnoticed.
                watch.record(victim, sig.name, pid=pids[0], incarnation=incarnation,
                             seconds=round(hold, 2) if kind == "hang" else 0,
                             expect="detected" if kind == "kill" or long else "either")
                os.kill(pids[0], sig)
                if kind == "hang":
                    watch.stop.wait(hold)
                    try:
                        os.kill(pids[0], signal.SIGCONT)
                    except ProcessLookupError:
                        pass  # killed as hung meanwhile, as it should be
            if kind in ("isolate", "from_coordinator", "from_peer", "one_way"):
                watch.stop.wait(hold)
                bed.heal()
            watch.wait_commits_after(time.time(), set(names), commits=3, timeout=240)

    return script


def run_one(seed: int, settings: Settings, root: Path, data_dir: Path) -> dict:
    from ftlm.testing.netbed import NetBed
    run_dir = root / f"seed-{seed:04d}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a relaunch into an old one would resume
    config = job_config(run_dir, data_dir, settings.steps)
    names = ["coordinator"] + [f"g{i}" for i in range(settings.groups)]
    with NetBed(names) as bed:
        script = nemesis_script(seed, settings, bed, bed.netem)
        try:
            outcome = run_on_bed(bed, config, settings.groups, script)
        except Exception as e:  # the launch stopped with an error: the run fails, with why
            outcome = Outcome({}, [], script_error=f"launch: {e}")
    return record_of(seed, settings, outcome, run_dir)


def rejudge(record: dict, settings: Settings) -> dict:
    """A recorded run judged again from its run directory by this version of ``verdict`` (the
    record as it stands when the directory is gone)."""
    from ftlm.errors import DataError
    from ftlm.observe.events import read_events
    run_dir = Path(record["run_dir"])
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        events = read_events(run_dir / "events.jsonl")
    except (OSError, ValueError, DataError):
        return record
    outcome = Outcome(summary, events, record.get("script_error", ""), record["wall_seconds"])
    return record_of(record["seed"], settings, outcome, run_dir)


def record_of(seed: int, settings: Settings, outcome: Outcome, run_dir: Path) -> dict:
    """The result record of one run: its faults by kind, the verdict and its counts."""
    faults = faults_of(outcome.events)
    reasons = verdict(outcome, settings.groups, settings.steps)
    undetected, unexplained = network_ledger(outcome.events, DETECTION_BOUND)
    s = outcome.summary
    count = lambda pred: sum(1 for f in faults if pred(f))  # noqa: E731
    return {
        "settings": settings.key(), "seed": seed, "wall_seconds": round(outcome.wall_seconds, 1),
        "faults": len(faults),
        "partitions": count(lambda f: f.get("fault") in ("block", "isolate") and not f.get("flap")),
        "flaps": count(lambda f: f.get("flap") is True),
        "shapes": count(lambda f: f.get("fault") == "shape"),
        "kills": count(lambda f: f.get("signal") == "SIGKILL"),
        "hangs": count(lambda f: f.get("signal") == "SIGSTOP"),
        "must_detect": count(lambda f: f.get("expect") == "detected"),
        "undetected": len(undetected), "unexplained": len(unexplained),
        "member_dead": sum(1 for e in outcome.events if e["kind"] == "member_dead"),
        "restarts": sum((s.get("restarts") or {}).values()),
        "steps_failed": sum(1 for e in outcome.events if e["kind"] == "step_failed"),
        "identical": bool(s.get("replicas_identical")),
        "duplicates": (s.get("data") or {}).get("duplicates"),
        "gaps": (s.get("data") or {}).get("gaps"),
        "ok": not reasons, "reasons": reasons, "run_dir": str(run_dir),
        "stopped": s.get("stopped") or "", "script_error": outcome.script_error,
    }


COLUMNS = ["faults", "partitions", "flaps", "shapes", "kills", "hangs", "must_detect",
           "undetected", "unexplained", "member_dead", "restarts", "steps_failed", "duplicates", "gaps"]


def render(records: list[dict], settings: Settings, flags: list[str], netem: bool) -> str:
    passed = sum(r["ok"] for r in records)
    faults = sum(r["faults"] for r in records)
    rows = [[r["seed"], r["wall_seconds"], *(r.get(c) for c in COLUMNS),
             "pass" if r["ok"] else "FAIL: " + "; ".join(r["reasons"])[:160]]
            for r in sorted(records, key=lambda r: r["seed"])]
    totals = ["all", round(sum(r["wall_seconds"] for r in records)),
              *(sum(r.get(c) or 0 for r in records) for c in COLUMNS), f"{passed} of {len(records)} passed"]
    return (section_header("Nemesis: network faults on a real network test bed", "bench.nemesis", flags)
            + f"* Method: per seed, one job of {settings.groups} groups x 1 rank, {settings.steps} "
              f"steps of a 100k-parameter model on the demo data, its coordinator and each group "
              f"in a network namespace of their own joined by a bridge (`ftlm.testing.netbed`); "
              f"a seeded nemesis injects up to {settings.faults_per_run} faults one after another "
              f"(partitions from everyone, from the coordinator, from one peer, one way; a "
              f"flapping link; a lossy or rate-limited link{' with delay and jitter' if netem else ''}; "
              f"SIGKILL; SIGSTOP), a partition or stop held {DETECTION_BOUND + 1:g}-"
              f"{DETECTION_BOUND + 6:g} s (must be detected: a member declared dead or a failed "
              f"step) or 0.3-1.2 s (may be), a flap or a shaped link 4-10 s (a shaped link must "
              f"convict nobody), and waits for 3 commits of every group before the next. A run "
              f"passes with n identical final hashes, 0 duplicates, 0 gaps, every step "
              f"committed, no crash, every fault that must be detected detected and every "
              f"conviction (a member declared dead or killed, a failed exit) within "
              f"{SETTLE_SECONDS:g} s of a fault of its group that may convict.\n"
            + ("" if netem else "* This kernel has no netem qdisc: links were shaped by loss "
               "(nftables) and rate (tbf) only, without delay.\n")
            + f"* Result: {passed} of {len(records)} run(s) passed; {faults} faults injected.\n\n"
            + table(["seed", "wall s", *COLUMNS, "result"], rows + [totals]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.nemesis", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=30, help="runs, one seed each (default 30)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first run (default 0)")
    p.add_argument("--steps", type=int, default=600, help="steps per run (default 600)")
    p.add_argument("--faults", type=int, default=10, help="faults per run at most (default 10)")
    p.add_argument("--results", default=str(REPO_ROOT / "runs" / "nemesis" / "results.jsonl"),
                   help="JSON lines of finished runs: resumed from, appended to")
    p.add_argument("--fresh", action="store_true", help="rerun seeds already in --results")
    p.add_argument("--write", action="store_true", help="put the table into BENCHMARKS.md")
    p.add_argument("--no-write", action="store_true",
                   help="leave BENCHMARKS.md alone, --write or not (`python -m bench --no-write`)")
    args = p.parse_args(argv)
    if args.runs < 1 or args.steps < 100 or args.faults < 1:
        p.error("--runs and --faults must be >= 1 and --steps >= 100 (faults stop 40 steps "
                "before the end)")
    from ftlm.testing.netbed import netem_available, unavailable_reason
    reason = unavailable_reason()
    if reason:
        print(f"nemesis: {reason}", file=sys.stderr)
        return 2
    settings = Settings(steps=args.steps, faults_per_run=args.faults)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    data_dir = ensure_demo()
    done: dict[int, dict] = {}
    if not args.fresh and results.is_file():
        for line in results.read_text().splitlines():
            record = json.loads(line)
            if record.get("settings") == settings.key():
                done[record["seed"]] = rejudge(record, settings)
    seeds = range(args.seed, args.seed + args.runs)
    print(f"nemesis: {len(seeds)} run(s), {settings.key()}; "
          f"{sum(s in done for s in seeds)} already recorded in {results}", flush=True)
    for seed in seeds:
        if seed not in done:
            record = run_one(seed, settings, results.parent, data_dir)
            if record["stopped"]:  # Ctrl-C or SIGTERM: the run proves nothing; stop here
                print(f"nemesis: stopped ({record['stopped']}) during seed {seed}; not recorded",
                      file=sys.stderr)
                return 130
            done[seed] = record
            with open(results, "a") as f:
                f.write(json.dumps(done[seed]) + "\n")
        r = done[seed]
        print(f"seed {seed}: {r['faults']} faults, {r['wall_seconds']} s, "
              + ("pass" if r["ok"] else "FAIL: " + "; ".join(r["reasons"])), flush=True)
    flags = [f"--runs {args.runs}", f"--seed {args.seed}", f"--steps {args.steps}",
             f"--faults {args.faults}"]
    return publish(SECTION, render([done[s] for s in seeds], settings, flags, netem_available()),
                   args.write and not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
