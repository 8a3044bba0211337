"""Running one job of each system the head-to-head benchmark compares, under one failure plan.

* ``run_ftlm``: ftlm's own ``LocalLauncher`` (coordinator + N groups, restarts, chaos).
* ``run_torchft``: torchft's lighthouse (the ``torchft_lighthouse`` binary) and N
  ``bench.baseline_worker`` processes in ``torchft`` mode; a dead group is restarted alone after
  ``ft.restart_delay`` and heals from a peer, as torchft's own supervisors do.
* ``run_ckpt_restart``: N ranks of one plain DDP job (``ddp`` mode) that checkpoint every few
  steps; on any failure every rank is killed and the whole job restarts from the latest durable
  checkpoint after ``ft.restart_delay``, as torchrun elastic does.

All three take the same ``Plan``: the same model, batch, group count, named-point faults, late
joiner and chaos schedule (the same seeded draws as the ``LocalLauncher``'s), and a stop rule
over the events, and return the job's events in ftlm's format plus the wall time, so that the
caller measures all of them with ``ftlm.observe.summary``. Nothing here computes a metric.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench.baseline_worker import run_config
from bench.common import REPO_ROOT

POLL_S = 0.2


@dataclass
class Plan:
    model: dict
    batch: int
    groups: int
    threads: int = 1
    steps: int = 10**6
    """Hard cap on steps; most plans end by ``stop`` or ``duration`` instead."""
    faults: dict[str, str] = field(default_factory=dict)
    """Group -> ``kill@N`` or ``stop@N`` for its first incarnation."""
    start_delays: dict[str, float] = field(default_factory=dict)
    chaos_mtbf: float = 0.0
    chaos_seed: int = 0
    duration: float = 600.0
    """Seconds after which the job is stopped whatever happened."""
    stop: Callable[[list[dict]], bool] | None = None
    """Ends the job early once it returns True on the events so far."""
    ft: dict = field(default_factory=dict)
    """``[ft]`` settings for ftlm; the baselines take their timeouts from the same values."""
    ckpt_every: int = 10
    hang_kill_after: float | None = None
    """Baselines: seconds after which the supervisor kills a SIGSTOPped worker so that it can
    restart (None: ftlm's heartbeat timeout, as ftlm's launcher does)."""

    def ft_value(self, name: str):
        from ftlm.ft.config import FTConfig
        return self.ft.get(name, getattr(FTConfig(), name))


@dataclass
class JobResult:
    events: list[dict]
    wall: float
    summary: dict | None = None
    """ftlm's own summary.json (ftlm only)."""


def read_jsonl(paths) -> list[dict]:
    out = []
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line being written
    return sorted(out, key=lambda e: e["ts"])


# -- ftlm -----------------------------------------------------------------------------------------
def run_ftlm(plan: Plan) -> JobResult:
    from ftlm.config import build_config
    from ftlm.launch.local import LocalLauncher
    from ftlm.observe.events import read_events
    with tempfile.TemporaryDirectory(prefix="ftlm-bench-vs-") as tmp:
        base = run_config(plan.model, plan.batch, plan.threads, str(Path(tmp) / "run"))
        raw = base.to_dict()
        raw["train"]["steps"] = plan.steps
        raw["ft"].update(plan.ft)
        config = build_config(raw)
        faults = {g: [("hang:" if f.startswith("stop") else "") + "before_allreduce@"
                      + f.partition("@")[2]] for g, f in plan.faults.items()}
        # Chaos is injected here, not by the launcher's own chaos_mtbf: in this tree
        # LocalLauncher._inject raises (it emits a `rank` field, which EventLog reserves), and
        # one chaos loop for all three systems keeps the schedules identical anyway.
        launcher = LocalLauncher(config, groups=plan.groups, progress=False, faults=faults,
                                 start_delays=plan.start_delays)
        path = config.run.path / "events.jsonl"
        done = threading.Event()
        injected: list[dict] = []

        def watch() -> None:  # the launcher has no time limit or stop rule of its own
            t0 = time.time()
            rng = random.Random(plan.chaos_seed)
            next_chaos = t0 + rng.expovariate(1 / plan.chaos_mtbf) if plan.chaos_mtbf else None
            while not done.wait(POLL_S):
                now = time.time()
                events = read_jsonl([path]) if path.is_file() else []
                if now - t0 > plan.duration or (plan.stop and plan.stop(events)):
                    launcher._stop.set()  # what its SIGTERM handler does
                    return
                if next_chaos is not None and now >= next_chaos:
                    _chaos_kill(launcher, rng, events, injected)
                    next_chaos = time.time() + rng.expovariate(1 / plan.chaos_mtbf)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            summary = launcher.run()
        finally:
            done.set()
            watcher.join(timeout=5)
        if injected:
            summary = None  # the launcher's summary does not know these failures
        _keep(config.run.path, "ftlm")
        events = sorted(list(read_events(path)) + injected, key=lambda e: e["ts"])
        wall = max(e["ts"] for e in events) - min(e["ts"] for e in events)
        return JobResult(events, summary["wall_seconds"] if summary else wall, summary)


def _chaos_kill(launcher, rng: random.Random, events: list[dict], injected: list[dict]) -> None:
    """SIGKILL one live ftlm group, drawn as ``_Supervisor`` draws (never a job in which no
    live group has committed since it was last started)."""
    live = [g for g in launcher.groups if g.running() and not g.finished and not g.stopped]
    trained = {str(e["group"]).partition(":")[0] for e in events if e["kind"] == "commit"
               and e["ts"] > next((g.started for g in launcher.groups
                                   if g.name == str(e["group"]).partition(":")[0]), 0)}
    if not (any(g.name in trained for g in live) and len(live) > 1):
        return
    g = rng.choice(live)
    injected.append({"ts": time.time(), "kind": "failure_injected", "group": "supervisor",
                     "step": -1, "target": g.name, "signal": "SIGKILL"})
    g.procs[0].kill()


def _keep(folder: Path, name: str) -> None:
    """Copy a job's logs and events to $BENCH_VS_KEEP_LOGS, when set, for a post-mortem."""
    keep = os.environ.get("BENCH_VS_KEEP_LOGS")
    if keep:
        import shutil
        shutil.copytree(folder, Path(keep) / f"{name}-{time.time():.0f}",
                        ignore=shutil.ignore_patterns("*.pt", "*.tmp", "checkpoints"))


# -- the baselines' supervisor ---------------------------------------------------------------------
class _Supervisor:
    """Starts worker processes, injects chaos, restarts the failed, stops on the plan's rule."""

    def __init__(self, plan: Plan, mode: str, tmp: Path, lighthouse: str = ""):
        self.plan, self.mode, self.tmp, self.lighthouse = plan, mode, tmp, lighthouse
        self.names = [f"g{i}" for i in range(plan.groups)]
        self.procs: dict[str, subprocess.Popen | None] = {n: None for n in self.names}
        self.incarnations = {n: 0 for n in self.names}
        self.sup_events = tmp / "events-supervisor.jsonl"
        self.rng = random.Random(plan.chaos_seed)
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])), PYTHONUNBUFFERED="1")
        self.store_port = 0
        self.spawned_at: dict[str, float] = {}

    def emit(self, kind: str, **fields) -> None:
        with open(self.sup_events, "a") as f:
            f.write(json.dumps({"ts": time.time(), "kind": kind, "group": "supervisor",
                                "step": -1, **fields}) + "\n")

    def events(self) -> list[dict]:
        return read_jsonl(self.tmp.glob("events-*.jsonl"))

    def spawn(self, name: str) -> None:
        inc = self.incarnations[name]
        spec = {"mode": self.mode, "group": name, "incarnation": inc, "model": self.plan.model,
                "batch": self.plan.batch, "threads": self.plan.threads, "steps": self.plan.steps,
                "dir": str(self.tmp / "run"), "events": str(self.tmp / f"events-{name}.jsonl"),
                "fault": self.plan.faults.get(name, "") if inc == 0 else "",
                "allreduce_timeout": self.plan.ft_value("allreduce_timeout"),
                "lighthouse": self.lighthouse, "rank": self.names.index(name),
                "world": len(self.names), "store_port": self.store_port,
                "ckpt_dir": str(self.tmp), "ckpt_every": self.plan.ckpt_every}
        self.spawned_at[name] = time.time()
        log = open(self.tmp / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "bench.baseline_worker", json.dumps(spec)], cwd=REPO_ROOT,
            env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()

    def kill(self, name: str) -> None:
        p = self.procs[name]
        if p is not None and p.poll() is None:
            p.kill()
        if p is not None:
            p.wait(timeout=10)

    def log_tail(self) -> str:
        return "".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                       for p in sorted(self.tmp.glob("*.log")))

    def run(self) -> JobResult:
        plan, restart_delay = self.plan, self.plan.ft_value("restart_delay")
        hang_kill_after = (self.plan.hang_kill_after if self.plan.hang_kill_after is not None
                           else self.plan.ft_value("heartbeat_timeout"))
        whole_job = self.mode == "ddp"
        if whole_job:
            self.store_port = _free_port()
        t0 = time.time()
        start_at = {n: t0 + plan.start_delays.get(n, 0.0) for n in self.names}
        stopped_since: dict[str, float] = {}
        next_chaos = t0 + self.rng.expovariate(1 / plan.chaos_mtbf) if plan.chaos_mtbf else None
        seen = 0
        try:
            while time.time() - t0 < plan.duration:
                now = time.time()
                for n in self.names:
                    if start_at.get(n) is not None and now >= start_at[n]:
                        start_at[n] = None
                        self.spawn(n)
                events = self.events()
                for e in events[seen:]:  # a worker that stopped itself is hung: kill it
                    if e["kind"] == "failure_injected" and e.get("signal") == "SIGSTOP":
                        stopped_since[e["group"]] = e["ts"]
                seen = len(events)
                for n, since in list(stopped_since.items()):
                    if now - since > hang_kill_after:
                        self.kill(n)
                        del stopped_since[n]
                failed = [n for n, p in self.procs.items()
                          if p is not None and p.poll() is not None]
                if any(self.procs[n].returncode == 0 for n in failed):
                    break  # reached the step cap
                if failed:
                    self.emit("group_exit", target=",".join(failed), ok=False)
                    if whole_job:  # checkpoint-restart: everybody goes down and comes back
                        failed = self.names
                        self.store_port = _free_port()
                    for n in failed:
                        self.kill(n)
                        self.procs[n] = None
                        self.incarnations[n] += 1
                        start_at[n] = now + restart_delay
                if next_chaos is not None and now >= next_chaos:
                    live = [n for n, p in self.procs.items() if p is not None and p.poll() is None]
                    # Like ftlm's launcher: never hit a job with no up-to-date group (one that
                    # has committed since it was last started), e.g. one still starting up.
                    trained = {e["group"] for e in events if e["kind"] == "commit"
                               and e["ts"] > self.spawned_at.get(e["group"], now)}
                    if any(n in trained for n in live) and len(live) > (0 if whole_job else 1):
                        n = self.rng.choice(live)
                        self.emit("failure_injected", target=n, signal="SIGKILL")
                        self.procs[n].kill()
                    next_chaos = time.time() + self.rng.expovariate(1 / plan.chaos_mtbf)
                if plan.stop and plan.stop(events):
                    break
                time.sleep(POLL_S)
        finally:
            wall = time.time() - t0
            for n in self.names:
                p = self.procs[n]
                if p is not None and p.poll() is None:
                    os.kill(p.pid, signal.SIGCONT)
                    p.kill()
                    p.wait(timeout=10)
        _keep(self.tmp, self.mode)
        events = self.events()
        if not any(e["kind"] in ("commit", "failure_injected") for e in events):
            raise RuntimeError(f"{self.mode} job committed no step:\n{self.log_tail()}")
        return JobResult(events, wall)


def run_torchft(plan: Plan) -> JobResult:
    """torchft's lighthouse runs as its own ``torchft_lighthouse`` process (its log goes to a
    file, not the console); the same join and heartbeat timeouts as ftlm's coordinator."""
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    with tempfile.TemporaryDirectory(prefix="ftlm-bench-torchft-") as tmp:
        port = _free_port()
        with open(Path(tmp) / "lighthouse.log", "ab") as log:
            lighthouse = subprocess.Popen(
                [str(binary), "--bind", f"127.0.0.1:{port}", "--min_replicas", "1",
                 "--join_timeout_ms", str(int(1000 * plan.ft_value("join_timeout"))),
                 "--heartbeat_timeout_ms", str(int(1000 * plan.ft_value("heartbeat_timeout")))],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            _wait_listening(port, lighthouse)
            return _Supervisor(plan, "torchft", Path(tmp), f"http://127.0.0.1:{port}").run()
        finally:
            lighthouse.kill()
            lighthouse.wait(timeout=10)


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    import socket
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"torchft_lighthouse exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"torchft_lighthouse did not listen on port {port} within {timeout:.0f} s")


def run_ckpt_restart(plan: Plan) -> JobResult:
    with tempfile.TemporaryDirectory(prefix="ftlm-bench-ckpt-") as tmp:
        return _Supervisor(plan, "ddp", Path(tmp)).run()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
