"""Local launcher and supervisor: a coordinator plus N replica groups as processes on this machine.

It starts the coordinator in-process and each group as ``ftlm train`` in a subprocess with the
environment of DESIGN.md section 10, restarts a group whose process exits as a new incarnation,
kills a group whose heartbeat stopped (a hang) so that it can be restarted, optionally injects
failures (chaos: SIGKILL or SIGSTOP at exponentially distributed times, seeded), and at the end
writes ``summary.json`` and ``report.md``. On Ctrl-C or SIGTERM it stops every process it started
and still writes the summary. It does not train and does not decide quorums.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftlm.config import RunConfig, save_config
from ftlm.errors import ConfigError
from ftlm.ft.coordinator import Coordinator
from ftlm.observe.events import EventLog, read_events
from ftlm.observe.report import format_summary, write_report
from ftlm.observe.summary import build_summary, write_summary

RESULT_PREFIX = "FTLM_RESULT "


class _CoordinatorEvents:
    """Adapts the coordinator's events (about other groups) to the run's event log."""

    def __init__(self, log: EventLog):
        self.log = log

    def emit(self, kind: str, **fields: Any) -> None:
        step = fields.pop("step", -1)
        if "group" in fields:
            fields["target"] = fields.pop("group")
        self.log.emit(kind, step=step if isinstance(step, int) else -1, **fields)


@dataclass
class GroupProcess:
    """One replica group's current processes (one per rank) and its history."""

    name: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    incarnation: str = ""
    started: float = 0.0
    restarts: int = 0
    restart_at: float | None = None
    finished: bool = False
    stopped: bool = False  # SIGSTOPped by chaos, waiting to be detected and killed
    result: dict = field(default_factory=dict)

    @property
    def replica_id(self) -> str:
        return f"{self.name}:{self.incarnation}"

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def kill(self) -> None:
        """SIGKILL every rank still alive (a stopped process dies too) and reap them."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=10)

    def log(self, run_dir: Path, rank: int = 0) -> Path:
        return run_dir / "logs" / (f"{self.name}.log" if rank == 0 else f"{self.name}.r{rank}.log")


class LocalLauncher:
    """Runs a fault-tolerant job on this machine; ``run()`` returns the summary."""

    def __init__(self, config: RunConfig, groups: int, chaos_mtbf: float = 0.0,
                 chaos_hang: bool = False, chaos_seed: int = 0,
                 faults: dict[str, list[str]] | None = None,
                 start_delays: dict[str, float] | None = None, ranks_per_group: int = 1,
                 kill_hung: bool = True,
                 extra_env: dict[str, str] | None = None, progress: bool | None = None):
        if groups < 1:
            raise ConfigError(f"--groups={groups} must be at least 1")
        if ranks_per_group < 1:
            raise ConfigError(f"--ranks-per-group={ranks_per_group} must be at least 1")
        if chaos_mtbf < 0:
            raise ConfigError(f"--chaos-mtbf={chaos_mtbf} must be >= 0 (0 disables chaos)")
        self.config = config
        self.n = groups
        self.ranks = ranks_per_group
        self.kill_hung = kill_hung  # off: a hung group stays stopped until someone resumes it
        self.chaos_mtbf = chaos_mtbf
        self.chaos_hang = chaos_hang
        self.rng = random.Random(chaos_seed)
        # Named-point failures per group, one entry per incarnation (see ftlm.ft.faults).
        self.faults = faults or {}
        # Groups started this many seconds after the job's first committed step (late joiners).
        self.start_delays = start_delays or {}
        self.extra_env = extra_env or {}
        self.progress = config.observe.progress if progress is None else progress
        self.run_dir = config.run.path
        self.groups = [GroupProcess(f"g{i}") for i in range(groups)]
        self.token = secrets.token_hex(16)
        self._stop = threading.Event()
        self.coordinator: Coordinator | None = None
        self.metrics_targets: dict[tuple[str, int], int] = {}

    # -- set-up ----------------------------------------------------------------------------------
    def _prepare_run_dir(self) -> Path:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        # A new job starts a new record; durable checkpoints are kept for resuming.
        for name in ("events.jsonl", "summary.json", "report.md", "prometheus_targets.json"):
            (self.run_dir / name).unlink(missing_ok=True)
        for log in (self.run_dir / "logs").glob("*.log"):
            log.unlink()
        config_file = self.run_dir / "config.toml"
        save_config(self.config, config_file)
        return config_file

    def _spawn(self, g: GroupProcess, config_file: Path, url: str) -> None:
        """Start the group's ranks with the torchrun environment, as a new incarnation."""
        g.incarnation = uuid.uuid4().hex[:12]
        master_port = _free_port()
        cmd = [sys.executable, "-m", "ftlm.cli", "train", str(config_file),
               "--set", "observe.progress=false"]
        g.procs = []
        for rank in range(self.ranks):
            env = dict(os.environ)
            env.update({
                "FTLM_COORDINATOR": url, "FTLM_GROUP_ID": g.name, "FTLM_INCARNATION": g.incarnation,
                "FTLM_TOKEN": self.token, "FTLM_GROUPS": str(self.n),
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.ranks),
                "LOCAL_WORLD_SIZE": str(self.ranks), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port), "PYTHONUNBUFFERED": "1",
            })
            env.update(self.extra_env)
            env.pop("FTLM_FAULT", None)
            if self.config.observe.metrics:
                port = self.config.observe.metrics_port
                env["FTLM_METRICS_PORT"] = str(
                    port + self.groups.index(g) * self.ranks + rank if port else _free_port())
                self.metrics_targets[(g.name, rank)] = int(env["FTLM_METRICS_PORT"])
            # Faults for "g1" go to rank 0 of g1; "g1.r1" names another rank.
            planned = self.faults.get(g.name if rank == 0 else f"{g.name}.r{rank}", [])
            if g.restarts < len(planned) and planned[g.restarts]:
                env["FTLM_FAULT"] = planned[g.restarts]
            with open(g.log(self.run_dir, rank), "ab") as log:
                g.procs.append(subprocess.Popen(cmd, env=env, stdout=log,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        if self.config.observe.metrics:
            self._write_targets()
        g.started = time.time()
        g.restart_at = None
        g.stopped = False

    def _write_targets(self) -> None:
        """Prometheus file_sd targets of every rank's metrics endpoint (rewritten on restarts)."""
        host = self.config.observe.metrics_host
        targets = [{"targets": [f"{host}:{port}"], "labels": {"ftlm_target": f"{g}/{r}"}}
                   for (g, r), port in sorted(self.metrics_targets.items())]
        path = self.run_dir / "prometheus_targets.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(targets, indent=1))
        os.replace(tmp, path)

    # -- the supervisor loop ---------------------------------------------------------------------
    def run(self) -> dict:
        config_file = self._prepare_run_dir()
        events = EventLog(self.run_dir / "events.jsonl", group="supervisor")
        self.config.ft.groups = self.n
        self.coordinator = Coordinator(self.config.ft.coordinator_config(token=self.token),
                                       events=_CoordinatorEvents(events))
        url = self.coordinator.start()
        events.emit("run_start", step=-1, groups=self.n, coordinator=url,
                    chaos_mtbf=self.chaos_mtbf)
        wall0 = time.time()
        handlers = self._install_signals()
        view = _ConsoleView(self.config.train.steps, self.groups, self.progress)
        next_chaos = self._next_chaos_time()
        try:
            late = dict(self.start_delays)  # late joiners: started once training is under way
            for g in self.groups:
                if g.name in late:
                    g.restarts = -1
                else:
                    self._spawn(g, config_file, url)
            last_progress, best_step = time.time(), 0
            while not self._stop.is_set() and not all(g.finished for g in self.groups):
                now = time.time()
                try:
                    status = self.coordinator.status_snapshot()
                except Exception:  # noqa: BLE001 - the coordinator is being restarted
                    self._stop.wait(0.1)
                    continue
                step = max((m["step"] for m in status["members"]), default=0)
                for name, delay in list(late.items()):
                    if best_step > 0:  # the others committed a step: the delay counts from here
                        self.groups[[x.name for x in self.groups].index(name)].restart_at = now + delay
                        del late[name]
                if step > best_step:
                    best_step, last_progress = step, now
                elif now - last_progress > self.config.ft.give_up_seconds:
                    events.emit("run_end", step=best_step, ok=False, reason="no progress")
                    print(f"ftlm: no step committed for {self.config.ft.give_up_seconds:.0f} s "
                          "(ft.give_up_seconds); stopping the job", file=sys.stderr)
                    break
                self._reap(events, now)
                if self.kill_hung:
                    self._kill_hung(status, events)
                ending = any(g.finished for g in self.groups)
                if ending:
                    self._stop_stragglers(status)
                for g in self.groups:
                    if g.restart_at is not None and ending:
                        # The others reached the last step: there is nothing left to rejoin.
                        g.finished, g.restart_at = True, None
                    elif g.restart_at is not None and now >= g.restart_at:
                        g.restarts += 1
                        self._spawn(g, config_file, url)
                if next_chaos is not None and now >= next_chaos and not ending:
                    self._inject(events, status)
                    next_chaos = self._next_chaos_time()
                view.update(status)
                self._stop.wait(0.1)
        finally:
            view.close()
            self._terminate_all()
            self._restore_signals(handlers)
            self.coordinator.stop()
        wall = time.time() - wall0
        return self._finish(events, wall)

    def restart_coordinator(self) -> None:
        """Stop the coordinator and start a fresh one on the same port (a coordinator failure).

        The new one holds no state: it rebuilds membership from the next heartbeats and continues
        quorum ids above those the members report. Safe to call from another thread.
        """
        old = self.coordinator
        port = old.port
        old.stop()
        self.coordinator = Coordinator(
            self.config.ft.coordinator_config(port=port, token=self.token),
            events=old.events)
        self.coordinator.start()
        old.events.log.emit("coordinator_restart", step=-1, port=port)

    def _reap(self, events: EventLog, now: float) -> None:
        for g in self.groups:
            if not g.procs or g.finished or g.restart_at is not None:
                continue
            codes = [p.poll() for p in g.procs]
            failed = [c for c in codes if c not in (None, 0)]
            if not failed:
                if all(c == 0 for c in codes):
                    results = self._results(g)
                    if results is not None:
                        g.finished, g.result = True, results
                        continue
                    failed = [0]  # exited without a final result: treat as a failure
                else:
                    continue  # ranks still finishing
            # Any rank failing takes the whole group down; the group restarts as a new incarnation.
            g.kill()
            self.coordinator.report_dead(g.replica_id)
            events.emit("group_exit", step=-1, target=g.name, ok=False, code=failed[0],
                        incarnation=g.incarnation)
            g.restart_at = now + self.config.ft.restart_delay

    def _results(self, g: GroupProcess) -> dict | None:
        """The group's final result: its step and one hash over every rank's state shard."""
        results = [_read_result(g.log(self.run_dir, r)) for r in range(self.ranks)]
        if any(r is None or r.get("incarnation") != g.incarnation for r in results):
            return None
        digest = hashlib.sha256("".join(r["state_hash"] for r in results).encode()).hexdigest()
        return {"state_hash": digest if self.ranks > 1 else results[0]["state_hash"],
                "step": results[0]["step"], "incarnation": g.incarnation,
                "rank_hashes": [r["state_hash"] for r in results]}

    def _kill_hung(self, status: dict, events: EventLog) -> None:
        """A group whose heartbeat stopped while its process lives is hung: kill it so it restarts.

        The quorum drops it after the heartbeat timeout already (the healthy groups do not wait);
        killing waits a few timeouts more, so that a process that was only starved of CPU for a
        moment can come back and rejoin instead of being restarted.
        """
        grace = 3 * self.config.ft.heartbeat_timeout
        alive = {m["replica_id"] for m in status.get("members", [])
                 if m.get("heartbeat_age_seconds", 0) < self.config.ft.heartbeat_timeout}
        dead = {d["replica_id"] for d in status.get("dead", []) if d["seconds_ago"] >= grace}
        for g in self.groups:
            if (g.running() and g.replica_id in dead and g.replica_id not in alive
                    and not self._has_result(g)):
                events.emit("member_killed", step=-1, target=g.name, reason="heartbeat lost")
                g.kill()

    def _stop_stragglers(self, status: dict) -> None:
        """Once a group has reached the last step, a group that is not an up-to-date participant
        has nobody left to heal from: stop it instead of letting it train alone from scratch."""
        last = status.get("last_quorum") or {}
        participants = set(last.get("participants", []))
        for g in self.groups:
            if g.running() and not g.finished and g.replica_id not in participants:
                g.kill()
                g.finished = True

    def _has_result(self, g: GroupProcess) -> bool:
        """Whether the group's current incarnation has printed its final result (it is exiting)."""
        result = _read_result(g.log(self.run_dir))
        return bool(result) and result.get("incarnation") == g.incarnation

    def _next_chaos_time(self) -> float | None:
        if not self.chaos_mtbf:
            return None
        return time.time() + self.rng.expovariate(1.0 / self.chaos_mtbf)

    def _inject(self, events: EventLog, status: dict) -> None:
        last = status.get("last_quorum") or {}
        healthy = {r for r in last.get("participants", [])}
        live = [g for g in self.groups if g.running() and not g.stopped and not g.finished]
        g = self.rng.choice(live) if live else None
        # Never take down the last up-to-date group: nobody would be left to heal from.
        if g is None or not any(r in healthy for r in (x.replica_id for x in live if x is not g)):
            return
        hang = self.chaos_hang and self.rng.random() < 0.5
        # A hang is injected into the leader, whose heartbeat then stops; a kill hits any rank.
        rank = 0 if hang else self.rng.randrange(self.ranks)
        events.emit("failure_injected", step=-1, target=g.name, target_rank=rank,
                    signal="SIGSTOP" if hang else "SIGKILL", incarnation=g.incarnation)
        if hang:
            g.stopped = True
            os.kill(g.procs[rank].pid, signal.SIGSTOP)
        else:
            g.procs[rank].kill()

    def _terminate_all(self) -> None:
        procs = [p for g in self.groups for p in g.procs if p.poll() is None]
        for p in procs:
            try:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for g in self.groups:
            if g.procs and not g.finished:
                g.result = self._results(g) or {}

    def _install_signals(self):
        if threading.current_thread() is not threading.main_thread():
            return None
        stop = lambda *_: self._stop.set()  # noqa: E731
        return signal.signal(signal.SIGINT, stop), signal.signal(signal.SIGTERM, stop)

    @staticmethod
    def _restore_signals(handlers) -> None:
        if handlers:
            signal.signal(signal.SIGINT, handlers[0])
            signal.signal(signal.SIGTERM, handlers[1])

    # -- the end ---------------------------------------------------------------------------------
    def _finish(self, events: EventLog, wall: float) -> dict:
        events.emit("run_end", step=-1, wall_seconds=wall)
        hashes = {g.name: g.result["state_hash"] for g in self.groups if g.result.get("state_hash")}
        summary = build_summary(read_events(self.run_dir / "events.jsonl"), wall_seconds=wall,
                                state_hashes=hashes, config=self.config.to_dict(),
                                groups=[g.name for g in self.groups])
        summary["restarts"] = {g.name: g.restarts for g in self.groups}
        summary["final_steps"] = {g.name: g.result.get("step") for g in self.groups}
        write_summary(self.run_dir / "summary.json", summary)
        write_report(self.run_dir, summary, read_events(self.run_dir / "events.jsonl"))
        if self.progress is not False:
            print(format_summary(summary))
        return summary


def _free_port() -> int:
    """A TCP port free right now on the loopback (for a group's MASTER_PORT)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_result(log: Path) -> dict | None:
    """The last ``FTLM_RESULT`` line a group printed (its final step and state hash)."""
    if not log.is_file():
        return None
    result = None
    with open(log, "rb") as f:
        for line in f:
            if line.startswith(RESULT_PREFIX.encode()):
                try:
                    result = json.loads(line[len(RESULT_PREFIX):])
                except ValueError:
                    continue
    return result


class _ConsoleView:
    """A progress bar of committed steps and one status word per group."""

    def __init__(self, total: int, groups: list[GroupProcess], enabled: bool):
        self.groups = groups
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, status: dict) -> None:
        if self.bar is None:
            return
        members = {m["group"]: m for m in status["members"]}
        last = status.get("last_quorum") or {}
        participants = {r.split(":")[0] for r in last.get("participants", [])}
        parts = []
        for g in self.groups:
            m = members.get(g.name)
            if g.finished:
                word = "done"
            elif g.stopped:
                word = "hung"
            elif not g.running() or m is None:
                word = "down"
            else:
                word = "train" if g.name in participants else "recover"
            parts.append(f"{g.name}:{word}@{m['step'] if m else '-'}")
        step = max((m["step"] for m in members.values()), default=0)
        self.bar.n = max(self.bar.n, min(step, self.bar.total))  # groups that exit report nothing
        self.bar.set_postfix_str(f"q{status.get('quorum_id', 0)} P={len(participants)} "
                                 + " ".join(parts), refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
