"""Local launcher and supervisor: a coordinator process plus N replica groups on this machine.

It starts the coordinator as its own process (``ftlm coordinator``, restarted on the same port
when it dies, by a warm standby that takes over at once: ``ftlm.launch.coordinator_process``)
and each group as ``ftlm train`` processes (one per rank) with the environment of docs/design.md,
'Environment'. It restarts a group whose process exits as a new incarnation and reports
the death to the coordinator (``POST /v1/dead``); restarts a group stopped from outside before the
last step (a SIGTERM, as a spot reclaim sends: it left the quorum and exited 0) as a preempted
pod or a requeued Slurm job comes back; kills a group that is hung so that it restarts:
one that never registered within ``ft.startup_timeout``, one whose heartbeat stopped, one the
coordinator declared dead (it made no progress); stops starting a group whose last three processes
the coordinator retired for failing every step they took part in (``RETIRED_IN_A_ROW``: a bad
link or device stays bad, the job goes on without it); stops the launch with the group's own error when
a group cannot start (exit status 2 before registering), crash-loops (``ft.crash_loop_*``), or
groups stop with status 2 twice with the job no further (a diverged loss: restarts repeat it);
optionally injects failures (``ftlm.launch.chaos``) until a group reaches the last step. At the
end it waits until every group has exited with its final state (bounded by ``ft.give_up_seconds``
without progress), restarting groups that die near the end (they recover from a finished group),
and writes ``summary.json`` and ``report.md``. On Ctrl-C or SIGTERM it stops every process it
started and still writes the summary.

It does not train, decide quorums or judge the run (``ftlm.observe.summary.proof_problems`` does).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ftlm import startup_beacon
from ftlm.config import RunConfig, save_config
from ftlm.errors import EXIT_RETIRED, ConfigError, FtlmError
from ftlm.launch.chaos import ALL_RANKS, COORDINATOR, Chaos
from ftlm.launch.console import ConsoleView
from ftlm.launch.coordinator_process import (ERROR_PREFIX, CoordinatorProcess, CoordinatorUnreachable,
                                             error_line)
from ftlm.launch.run_lock import lock_run_dir
from ftlm.observe.events import EventLog, read_events
from ftlm.observe.report import format_summary, write_report
from ftlm.observe.summary import build_summary, proof_problems, write_summary
from ftlm.train.checkpoint_files import valid_checkpoints
from ftlm.train.model_file import MODEL_FILE, read_stamp
from ftlm.train.run_record import resume_step, set_aside

RESULT_PREFIX = "FTLM_RESULT "
TEARDOWN_SECONDS = 10.0
"""How long a group that left the job, every rank of which printed its final result, may take to
exit before it is killed (its result stands): it has nothing left to do, and the other groups
stay at the end of the job only ``ft.quorum_timeout`` for it to come back if it was preempted."""
EXIT_USAGE = 2
"""Exit status of ``ftlm`` after its one-line ``FtlmError`` (bad config, missing data...)."""
RETIRED_IN_A_ROW = 3
"""Processes of one group in a row that the coordinator retired for failing the steps they took
part in (``ftlm.ft.quorum.Probe``) after which the group is not started again: its node's link
(or device) stays bad, and every new process would cost the others a few failed attempts."""


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
    lost: bool = False  # not started again: died when every other group had finished (nobody
    # to recover from), or retired by the coordinator RETIRED_IN_A_ROW times in a row
    retired_in_a_row: int = 0  # its last incarnations' exits that the coordinator asked for
    stopped: bool = False  # a rank was SIGSTOPped by chaos, waiting to be detected and killed
    terminated: bool = False  # chaos sent this incarnation SIGTERM (a preemption: it must leave)
    result: dict = field(default_factory=dict)
    registered: bool = False  # the current incarnation appeared in the coordinator's members
    first_step: int | None = None  # its step when it first appeared there
    progressed: bool = False  # its step changed since: it committed or recovered
    absent_since: float | None = None  # registered, but missing from the members since then
    left_at: float | None = None  # the coordinator reported its leave (finished, preempted)
    killed: bool = False  # SIGKILL sent to this incarnation (it may still be exiting)
    exiting_since: float | None = None  # when the supervisor first saw its final result
    erring_since: float | None = None  # when it first saw every rank's own error line (exiting)
    stuck_exit: bool = False  # killed because it did not exit after printing its result
    cause: str = ""  # why the current incarnation may die: "chaos", "hung", "fault", or ""
    crash_times: list[float] = field(default_factory=list)  # exits without progress
    log_offsets: list[int] = field(default_factory=list)  # where this incarnation's logs begin

    @property
    def replica_id(self) -> str:
        return f"{self.name}:{self.incarnation}"

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL every rank still alive (a stopped process dies too) and reap them, waiting
        ``timeout`` seconds at most: on a starved machine a process with gigabytes to free can
        take longer to exit, and the launcher's loop reaps it once it has (this never raises:
        it raised ``TimeoutExpired`` and took the whole job down, bench.ft_vs_torchft 82M)."""
        self.killed = True
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        late = []
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                late.append(p.pid)
        if late:
            print(f"ftlm: {self.name}: process {', '.join(map(str, late))} still exiting "
                  f"{timeout:g} s after SIGKILL; reaped when it has", file=sys.stderr)

    def log(self, run_dir: Path, rank: int = 0) -> Path:
        return run_dir / "logs" / (f"{self.name}.log" if rank == 0 else f"{self.name}.r{rank}.log")

    def beacon(self, run_dir: Path, rank: int) -> Path:
        """Where ``rank`` of the current incarnation shows it is alive while it starts
        (``ftlm.startup_beacon``)."""
        return run_dir / "logs" / f"{self.name}.r{rank}.beacon"


class LocalLauncher:
    """Runs a fault-tolerant job on this machine; ``run()`` returns the summary.

    ``chaos_coordinator`` puts the coordinator process in the chaos mix (one more target, drawn
    like a group, always SIGKILL); ``chaos_preempt`` makes a third of the groups' failures
    preemptions (SIGTERM, see ``ftlm.launch.chaos``), after which the group must leave and come
    back. ``run()`` raises ``FtlmError`` (after writing the summary) when
    a group cannot start or crash-loops, or the coordinator cannot be (re)started.
    """

    term_grace = 10.0
    """Seconds the group processes get to exit after SIGTERM at the end, before SIGKILL."""
    stopped_by = ""
    """The signal that asked the launch to stop (SIGINT, SIGTERM), once one did."""

    def __init__(self, config: RunConfig, groups: int, chaos_mtbf: float = 0.0,
                 chaos_hang: bool = False, chaos_seed: int = 0, chaos_coordinator: bool = False,
                 chaos_preempt: bool = False, faults: dict[str, list[str]] | None = None,
                 start_delays: dict[str, float] | None = None, ranks_per_group: int = 1,
                 kill_hung: bool = True,
                 extra_env: dict[str, str] | None = None, progress: bool | None = None,
                 command: str = "train", coordinator_standby: bool = True):
        if groups < 1:
            raise ConfigError(f"--groups={groups} must be at least 1")
        if ranks_per_group < 1:
            raise ConfigError(f"--ranks-per-group={ranks_per_group} must be at least 1")
        if chaos_mtbf < 0:
            raise ConfigError(f"--chaos-mtbf={chaos_mtbf} must be >= 0 (0 disables chaos)")
        self.config = config
        self.command = command  # the ftlm subcommand each rank runs: train, sft, dpo, grpo
        self.coordinator_standby = coordinator_standby  # a warm process ready to replace it
        self.n = groups
        self.ranks = ranks_per_group
        self.kill_hung = kill_hung  # off: a hung group stays stopped until someone resumes it
        self.chaos = Chaos(chaos_mtbf, chaos_seed, hang=chaos_hang, coordinator=chaos_coordinator,
                           preempt=chaos_preempt)
        # Named-point failures per group, one entry per incarnation (see ftlm.ft.faults).
        self.faults = faults or {}
        # Groups started this many seconds after the job's first committed step (late joiners).
        self.start_delays = start_delays or {}
        self.extra_env = extra_env or {}
        self.progress = config.observe.progress if progress is None else progress
        self.run_dir = config.run.path
        self.groups = [GroupProcess(f"g{i}") for i in range(groups)]
        self._best_step = 0  # the furthest step the job was seen at (chaos stops at the last one)
        self._healthy: set[str] = set()  # participants of the last quorum seen (chaos spares the last)
        self.token = secrets.token_hex(16)
        self._stop = threading.Event()
        self._coordinator_lock = threading.Lock()
        self.coordinator: CoordinatorProcess | None = None
        self.events: EventLog | None = None
        self.fatal = ""  # why the launch stopped early (a group that cannot start...)
        self.metrics_targets: dict[tuple[str, int], int] = {}
        self._best = (-1, -1)  # high-water mark of the job's progress (see _progress_key)
        self._declared_dead: set[str] = set()  # replica ids the coordinator lists as dead
        self._outages: list[tuple[float, float]] = []  # (from, to): the coordinator was down
        self._down_since: float | None = None  # it is down now, since then
        self._resume_step: int | None = None  # the checkpoint step a relaunch resumes from
        self._usage_exit: tuple[int, str] | None = None  # (job's top step, group): the last status-2 exit
        self._usage_errors: list[tuple[str, str]] = []  # (group, error) of the last distinct ones

    # -- set-up ----------------------------------------------------------------------------------
    def _prepare_run_dir(self) -> Path:
        """Under the run directory's lock (``run``): the job token, the checkpoint step the groups
        will resume from, the earlier record set aside, the config the groups read.

        The token comes first: the groups verify checkpoints under it, and so does the launcher,
        so that the resume point it records is theirs. Nothing is erased
        (``ftlm.train.run_record``): a launch that starts over moves the earlier record into
        ``previous/``; one that resumes (to train more steps, or after the whole job was lost)
        continues ``events.jsonl``, so that the summary proves exactly-once over the whole
        history (``_mark_resume`` marks where it resumes), and moves only what it writes anew."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.token = _run_token(self.run_dir)
        self._resume_step = resume_step(self.config.checkpoint, self.run_dir, self.token.encode())
        moved = set_aside(self.run_dir, self._resume_step,
                          also=("summary.json", "report.md", "logs", "prometheus_targets.json"))
        if moved:
            print(f"ftlm: {moved}", file=sys.stderr)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        self.config.ft.groups = self.n  # the coordinator's first quorum waits for all of them
        config_file = self.run_dir / "config.toml"
        save_config(self.config, config_file)
        return config_file

    def _spawn(self, g: GroupProcess, config_file: Path, url: str) -> None:
        """Start the group's ranks with the torchrun environment, as a new incarnation."""
        g.incarnation = uuid.uuid4().hex[:12]
        master_port = _free_port()
        cmd = [sys.executable, "-m", "ftlm.cli", self.command, str(config_file),
               "--set", "observe.progress=false"]
        g.procs, g.log_offsets, g.cause, g.terminated = [], [], "", False
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
                g.cause = "fault"
            beacon = g.beacon(self.run_dir, rank)
            beacon.unlink(missing_ok=True)  # the last incarnation's
            env[startup_beacon.ENV] = str(beacon)
            log_path = g.log(self.run_dir, rank)
            g.log_offsets.append(log_path.stat().st_size if log_path.is_file() else 0)
            with open(log_path, "ab") as log:
                # A session of its own: a Ctrl-C at the terminal reaches the launcher alone,
                # which stops the groups with SIGTERM, between steps (a SIGINT could land
                # mid-update, and the committed step would not be saved).
                g.procs.append(subprocess.Popen(cmd, env=env, stdout=log, start_new_session=True,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        if self.config.observe.metrics:
            self._write_targets()
        g.started = time.time()
        g.restart_at = None
        g.stopped = g.registered = g.progressed = g.killed = g.stuck_exit = False
        g.first_step = g.absent_since = g.left_at = g.exiting_since = g.erring_since = None

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
        """Run the job; refused (``RunDirInUse``) while another launch holds the run directory,
        which this one holds until it returns, before anything in it is touched."""
        with lock_run_dir(self.run_dir):
            return self._launch()

    def _launch(self) -> dict:
        config_file = self._prepare_run_dir()
        events = self.events = EventLog(self.run_dir / "events.jsonl", group="supervisor")
        self.coordinator = CoordinatorProcess(config_file, _free_port(), self.token,
                                              self.run_dir / "events.jsonl",
                                              self.run_dir / "logs" / "coordinator.log",
                                              tls=self._tls_context(),
                                              standby=self.coordinator_standby)
        self.coordinator.start(self.config.ft.startup_timeout)
        url = self.coordinator.url
        # ranks_per_group: GPU-hours count every rank of a group (ftlm.observe.cost).
        events.emit("run_start", step=-1, groups=self.n, coordinator=url,
                    chaos_mtbf=self.chaos.mtbf, coordinator_pid=self.coordinator.pid,
                    ranks_per_group=self.ranks, resume_from=self._resume_step)
        self._mark_resume(events)
        wall0 = time.time()
        handlers = self._install_signals()
        view = ConsoleView(self.config.train.steps, self.groups, bool(self.progress))
        gap = self.chaos.next_gap()
        next_chaos = None if gap is None else time.time() + gap
        status: dict | None = None
        try:
            late = dict(self.start_delays)  # late joiners: started once training is under way
            for g in self.groups:
                if g.name in late:
                    g.restarts = -1
                else:
                    self._spawn(g, config_file, url)
            last_progress = time.time()
            while not self._stop.is_set() and not all(g.finished or g.lost for g in self.groups):
                now = time.time()
                self._watch_coordinator(events)
                status = self._poll_status()
                if status is not None:
                    self._observe(status, now)
                ending = self._ending(status)  # sticky: polled every round, not only at chaos time
                self._reap(events, now)
                if self.fatal:
                    break
                if status is not None and self.kill_hung:
                    self._watchdog(status, events, now)
                for name, delay in list(late.items()):
                    if self._best[0] > 0:  # the others committed a step: the delay counts from here
                        self.groups[[x.name for x in self.groups].index(name)].restart_at = now + delay
                        del late[name]
                self._restart_due(events, config_file, url, now)
                if self._progress_key(status) > self._best:
                    self._best, last_progress = self._progress_key(status), now
                elif now - last_progress > self.config.ft.give_up_seconds:
                    events.emit("run_end", step=self._best[0], ok=False, reason="no progress")
                    print(f"ftlm: no progress for {self.config.ft.give_up_seconds:.0f} s "
                          "(ft.give_up_seconds); stopping the job", file=sys.stderr)
                    break
                if next_chaos is not None and now >= next_chaos:
                    if ending:
                        next_chaos = None  # a group reached the last step: no more failures
                    else:
                        self._inject(events, status)
                        next_chaos = time.time() + self.chaos.next_gap()
                view.update(status)
                self._stop.wait(0.1)
        finally:
            view.update(status)
            view.close()
            try:
                self._terminate_all()
            finally:
                self._restore_signals(handlers)
                self.coordinator.stop()
        summary = self._finish(events, time.time() - wall0)
        if self.fatal:
            raise FtlmError(self.fatal)
        return summary

    def _tls_context(self):
        """How to verify the coordinator when it serves HTTPS (``ft.tls_cert``): against
        ``ft.tls_ca``, else the system's CAs, as the groups do."""
        ft = self.config.ft
        if not ft.tls_cert:
            return None
        import ssl

        from ftlm.ft.tls import client_context
        return client_context(ft.tls_ca) if ft.tls_ca else ssl.create_default_context()

    def _poll_status(self) -> dict | None:
        try:
            return self.coordinator.status()
        except CoordinatorUnreachable:
            return None  # it is being restarted, or busy: try again on the next tick

    def _progress_key(self, status: dict | None) -> tuple[int, int]:
        """(highest step, groups at it or finished): grows when the job commits a step, a group
        catches up or a group finishes; a group killed and restored again is no progress."""
        steps = [m["step"] for m in (status or {}).get("members", [])]
        done = [g.result.get("step", 0) for g in self.groups if g.finished]
        top = max(steps + done, default=0)
        return top, sum(1 for s in steps + done if s == top)

    def _ending(self, status: dict | None) -> bool:
        """Whether any group reached the last step (chaos stops for good: the job is finishing).

        Sticky: groups that finished leave the coordinator's members before their processes
        exit, so the members alone would say nobody is at the last step any more."""
        steps = [m["step"] for m in (status or {}).get("members", [])]
        head = (status or {}).get("head_step", 0)
        self._best_step = max(self._best_step, max(steps, default=0), head if isinstance(head, int) else 0)
        return any(g.finished for g in self.groups) or self._best_step >= self.config.train.steps

    def _observe(self, status: dict, now: float) -> None:
        """Registration and progress of each group's current incarnation, from the status."""
        members = {m["replica_id"]: m for m in status.get("members", [])}
        self._declared_dead = {d["replica_id"] for d in status.get("dead", [])}
        left = {d["replica_id"] for d in status.get("left", [])}
        for g in self.groups:
            m = members.get(g.replica_id)
            if m is not None:
                if not g.registered:
                    g.registered, g.first_step = True, m["step"]
                elif m["step"] != g.first_step:
                    g.progressed = True
                g.absent_since = None
            elif g.registered and g.absent_since is None and g.running():
                g.absent_since = now
            if g.replica_id in left and g.left_at is None and m is None:
                g.left_at = now

    # -- the coordinator -------------------------------------------------------------------------
    def _watch_coordinator(self, events: EventLog) -> None:
        """Restart the coordinator process on its port when it died (chaos or a crash)."""
        with self._coordinator_lock:
            if self.coordinator.running():
                return
            code = self.coordinator.exit_code()
            down = self._down_since if self._down_since is not None else time.time()
            self._down_since = down
            try:
                self.coordinator.start(self.config.ft.startup_timeout)
            except FtlmError as e:
                self.fatal = str(e)
                return
            self._outages.append((down, time.time()))
            self._down_since = None
            events.emit("coordinator_restart", step=-1, port=self.coordinator.port, code=code,
                        seconds=round(time.time() - down, 3), pid=self.coordinator.pid)

    def restart_coordinator(self) -> None:
        """Kill the coordinator process and start a fresh one on the same port (a coordinator
        failure). The new one holds no state: it rebuilds membership from the next heartbeats and
        continues quorum ids above those the members report. Safe to call from another thread."""
        with self._coordinator_lock:
            self.events.emit("failure_injected", step=-1, target=COORDINATOR, target_rank=0,
                             signal="SIGKILL", pid=self.coordinator.pid)
            down = self._down_since = time.time()
            self.coordinator.kill()
            self.coordinator.start(self.config.ft.startup_timeout)
            self._outages.append((down, time.time()))
            self._down_since = None
            self.events.emit("coordinator_restart", step=-1, port=self.coordinator.port,
                             code=-signal.SIGKILL, seconds=round(time.time() - down, 3),
                             pid=self.coordinator.pid)

    def _up_seconds(self, since: float, now: float) -> float:
        """Seconds of ``[since, now]`` during which the coordinator was up: a group can neither
        register nor heartbeat while it is down, so the watchdog's clocks stop meanwhile."""
        outages = self._outages + ([(self._down_since, now)] if self._down_since is not None else [])
        down = sum(max(0.0, min(b, now) - max(a, since)) for a, b in outages)
        return now - since - down

    # -- groups: exits, hangs, restarts ----------------------------------------------------------
    def _reap(self, events: EventLog, now: float) -> None:
        for g in self.groups:
            if not g.procs or g.finished or g.lost or g.restart_at is not None:
                continue
            codes = [p.poll() for p in g.procs]
            if g.terminated:
                # Preempted: a rank that the SIGTERM ended itself (before the trainer took it
                # over at start-up, or after it gave it back on its way out) stopped as asked.
                codes = [0 if c == -signal.SIGTERM else c for c in codes]
            failed = [c for c in codes if c not in (None, 0)]
            if g.stuck_exit and all(c is not None for c in codes) and self._results(g) is not None:
                failed, codes = [], [0] * len(codes)  # its result stands: only its exit hung
            if not failed:
                if all(c == 0 for c in codes):
                    results = self._results(g)
                    if (results is None and g.terminated) or (
                            results is not None and self._stopped_early(g, results, now)):
                        # Stopped from outside before the end (a SIGTERM: spot reclaim, drain):
                        # it left the quorum and exited 0; it comes back as a new incarnation,
                        # as a preempted pod or a requeued Slurm job does. Not a crash.
                        # (No result: the SIGTERM came during its set-up, before it joined.)
                        events.emit("group_exit", step=-1, target=g.name, ok=True, preempted=True,
                                    incarnation=g.incarnation,
                                    final_step=results["step"] if results is not None else None)
                        g.restart_at = now + self.config.ft.restart_delay
                        continue
                    if results is not None:
                        g.finished, g.result = True, results
                        events.emit("group_exit", step=-1, target=g.name, ok=True,
                                    incarnation=g.incarnation, final_step=results["step"])
                        continue
                    failed = [0]  # exited without a final result: treat as a failure
                else:
                    continue  # ranks still finishing
            # Any rank failing takes the whole group down; the group restarts as a new incarnation.
            g.kill()
            # A group the coordinator declared dead (no progress: a hung rank) may exit on its
            # own when its heartbeat is refused: that is the hang, detected, not a crash. Status 2
            # is the group's own error (its heartbeat stopped first), never a refused heartbeat.
            # Retired by the coordinator (any rank's exit status says so): attempts of a step without
            # it committed where attempts with it failed (a bad link or device, ``ftlm.ft.quorum.Probe``).
            retired = EXIT_RETIRED in failed
            code = EXIT_RETIRED if retired else failed[0]
            hung = g.replica_id in self._declared_dead and code != EXIT_USAGE
            cause = g.cause or ("retired" if retired else "hung" if hung else "crash")
            events.emit("group_exit", step=-1, target=g.name, ok=False, code=code, cause=cause,
                        incarnation=g.incarnation)
            if os.environ.get("FTLM_SUPERVISOR_REPORTS", "1") != "0":  # 0: as on k8s/Slurm (bench.failure_stall)
                self.coordinator.report_dead(g.name, g.incarnation, f"process exited with status {code}")
            g.retired_in_a_row = g.retired_in_a_row + 1 if retired else 0
            if g.retired_in_a_row >= RETIRED_IN_A_ROW:
                # Its node's link (or device) stays bad: the job goes on without it.
                g.lost, g.restart_at = True, None
                reason = (f"the coordinator retired its last {g.retired_in_a_row} processes in a row: "
                          f"{self._why(g)}; not started again (fix its node, then launch again to "
                          "resume with every group)")
                events.emit("group_lost", step=-1, target=g.name, reason=reason)
                print(f"ftlm launch: WARNING: group {g.name} {reason}", file=sys.stderr, flush=True)
                continue
            if cause not in ("chaos", "hung") and not retired:
                self._check_start(g, code, now)
            g.restart_at = now + self.config.ft.restart_delay

    def _stopped_early(self, g: GroupProcess, results: dict, now: float) -> bool:
        """Whether a group that exited 0 with its final result stopped before the job's last step
        on a SIGTERM from outside (to be restarted), rather than at the end of its run (the last
        step, or ``train.max_seconds`` of its own training)."""
        tc = self.config.train
        if self._stop.is_set() or results["step"] >= tc.steps:
            return False
        return not (tc.max_seconds and now - g.started >= tc.max_seconds)

    def _check_start(self, g: GroupProcess, code: int, now: float) -> None:
        """Stop the launch when a group cannot start: the CLI's one-line error (status 2) before
        it registered, or ``ft.crash_loop_restarts`` exits without progress within
        ``ft.crash_loop_seconds``; or when groups stop with that error twice (any groups) and the
        job did not get past the step it was at the first time (the loss stayed non-finite in
        every group: each restart resumes, catches up or trains again up to that step and
        diverges again, which the crash-loop rule counts as progress). Restarting would fail the
        same way forever."""
        ft = self.config.ft
        if code == EXIT_USAGE and not g.registered:
            self.fatal = f"group {g.name} cannot start (exit status {code}): {self._why(g)}"
            return
        if code == EXIT_USAGE:
            top, why = max(self._best[0], self._best_step), self._why(g)
            before, self._usage_exit = self._usage_exit, (top, g.name)
            # An earlier error may say more than the last one: samples that broke training are
            # named by the group that saw them break in another group first, while a group
            # restarted since, alone, can only say its loss diverged.
            earlier = [f"{name}: {line}" for name, line in self._usage_errors if line != why]
            self._usage_errors = [(n, line) for n, line in self._usage_errors if line != why][-2:] + [(g.name, why)]
            if before is not None and top <= before[0]:
                first = "it" if before[1] == g.name else f"group {before[1]}"
                self.fatal = (f"group {g.name} stopped with an error a restart repeats (exit status "
                              f"{code}; {first} did too, and the job is still at step {top}): "
                              f"{why}" + "".join(f"; earlier, group {e}" for e in earlier))
                return
        if g.progressed:
            return
        g.crash_times = [t for t in g.crash_times if now - t <= ft.crash_loop_seconds] + [now]
        if len(g.crash_times) >= ft.crash_loop_restarts:
            self.fatal = (f"group {g.name} is crash-looping: {len(g.crash_times)} exits within "
                          f"{ft.crash_loop_seconds:g} s without committing a step "
                          f"(ft.crash_loop_restarts, ft.crash_loop_seconds); last exit status "
                          f"{code}: {self._why(g)}")

    def _why(self, g: GroupProcess) -> str:
        """The group's own error line from this incarnation's logs (a rank's ``ftlm: error:``
        line first, else rank 0's last line)."""
        for rank, offset in enumerate(g.log_offsets):
            if self._said_error(g, rank):
                return error_line(g.log(self.run_dir, rank), offset)
        line = error_line(g.log(self.run_dir), g.log_offsets[0] if g.log_offsets else 0)
        return line or f"no output; see {g.log(self.run_dir)}"

    def _results(self, g: GroupProcess) -> dict | None:
        """The group's final result: its step and one hash over every rank's state shard."""
        results = [_read_result(g.log(self.run_dir, r)) for r in range(self.ranks)]
        if any(r is None or r.get("incarnation") != g.incarnation for r in results):
            return None
        digest = hashlib.sha256("".join(r["state_hash"] for r in results).encode()).hexdigest()
        return {"state_hash": digest if self.ranks > 1 else results[0]["state_hash"],
                "step": results[0]["step"], "incarnation": g.incarnation,
                "rank_hashes": [r["state_hash"] for r in results]}

    def _watchdog(self, status: dict, events: EventLog, now: float) -> None:
        """Kill hung groups so that they restart. A group is hung when:

        * before it made progress, one of its ranks showed no sign of life (its start-up beacon,
          ``ftlm.startup_beacon``) for ``ft.startup_stall_timeout``: the process was stopped or
          frozen while it started, a leader before it registered or any other rank;
        * it has not registered within ``ft.startup_timeout`` of its start (not counting the time
          the coordinator was down: it cannot register meanwhile): alive, but stuck in a phase;
        * it registered, but has been missing from the coordinator's members for ``grace`` seconds:
          the coordinator dropped it (its heartbeat stopped, or it made no progress for
          ``ft.progress_timeout`` while its heartbeat lived: a hung non-leader rank or a wedged
          training thread), or it never came back to a restarted coordinator;
        * it left the job (finished or preempted: no heartbeat is expected any more) but has not
          exited within ``cluster.grace_seconds``: saving the model, summarizing and stopping its
          servers take longer than a heartbeat timeout for a large model or on a busy machine;
          once every rank printed its final result, though, nothing is left but the exit, which
          gets ``TEARDOWN_SECONDS`` (soak seed 46 with preemptions: a preempted group SIGSTOPped
          on its way out was waited for twice the grace, the others finished meanwhile, and the
          job gave up with a replica short of the last step);
        * any of these, but it printed its final result (it is exiting), and it still has not
          exited ``cluster.grace_seconds`` later (a teardown that hangs): it is killed, and its
          result stands (``_reap``).

        The quorum drops a dead group at once (the healthy groups do not wait); the grace of a few
        heartbeat timeouts lets a process that was only starved of CPU come back and rejoin.
        """
        ft = self.config.ft
        grace = 3 * ft.heartbeat_timeout
        dead = {d["replica_id"]: d for d in status.get("dead", [])}
        for g in self.groups:
            if not g.running() or g.finished or g.restart_at is not None or g.killed:
                continue  # (killed: still exiting; the loop reaps and restarts it)
            reason = "" if g.progressed else self._stalled_start(g, now)
            if reason:
                pass  # stopped while starting: none of the checks below applies
            elif not g.registered:
                if self._up_seconds(g.started, now) > ft.startup_timeout:
                    reason = "start-up timeout"
            elif g.left_at is not None:
                if self._results(g) is not None:  # every rank printed its result: only the exit is left
                    g.exiting_since = g.exiting_since or now
                    if now - g.exiting_since > TEARDOWN_SECONDS:
                        reason, g.stuck_exit = (f"left the job and printed its result but did not exit "
                                                f"within {TEARDOWN_SECONDS:g} s"), True
                elif now - g.left_at > self.config.cluster.grace_seconds:
                    reason = (f"did not exit within cluster.grace_seconds="
                              f"{self.config.cluster.grace_seconds} s of leaving the job")
            elif g.absent_since is not None and self._up_seconds(g.absent_since, now) > grace:
                entry = dead.get(g.replica_id)
                reason = f"declared dead: {entry['reason']}" if entry else "heartbeat lost"
            if reason and not g.stuck_exit and self._printed_error(g):
                # Every rank stopped on an error of its own and is exiting (the heartbeat ended
                # first): let it, so that its exit status says what it was (2: a restart repeats
                # it), within TEARDOWN_SECONDS (on a loaded machine the teardown outlasted the
                # grace).
                g.erring_since = g.erring_since or now
                if now - g.erring_since <= TEARDOWN_SECONDS:
                    continue
            if reason and not g.stuck_exit and self._has_result(g):  # exiting: bounded too (a teardown can hang)
                g.exiting_since = g.exiting_since or now
                if now - g.exiting_since <= self.config.cluster.grace_seconds:
                    continue
                reason, g.stuck_exit = (f"printed its result but did not exit within "
                                        f"cluster.grace_seconds={self.config.cluster.grace_seconds} s"), True
            if reason:
                events.emit("member_killed", step=-1, target=g.name, incarnation=g.incarnation,
                            reason=reason, stopped=g.stopped)
                g.cause = g.cause if g.cause == "chaos" else "hung"
                g.kill()

    def _stalled_start(self, g: GroupProcess, now: float) -> str:
        """Why a group that has not made progress yet is hung in its start-up: a rank whose
        start-up beacon stopped for ``ft.startup_stall_timeout`` (or never appeared: counted
        from the start); "" when every rank shows signs of life."""
        limit = self.config.ft.startup_stall_timeout
        if not limit:
            return ""
        for rank in range(len(g.procs)):
            seen = startup_beacon.read(g.beacon(self.run_dir, rank), now)
            silent, phase = seen if seen is not None else (now - g.started, "starting the interpreter")
            if silent > limit:
                return (f"start-up stalled: rank {rank} showed no sign of life for {silent:.0f} s "
                        f"(while {phase}; ft.startup_stall_timeout={limit:g})")
        return ""

    def _restart_due(self, events: EventLog, config_file: Path, url: str, now: float) -> None:
        for g in self.groups:
            if g.restart_at is None or now < g.restart_at:
                continue
            others = [x for x in self.groups if x is not g]
            if (others and any(x.finished for x in others)
                    and not any(x.running() or x.restart_at is not None for x in others)
                    and not self._final_checkpoint(others)):
                # Every other group finished and left, and the job's final state is not on disk:
                # a new incarnation would have nobody to recover from and would train alone from
                # an older checkpoint. (With the final checkpoint, the last step always made
                # durable, it resumes at the end and finishes at once, as soak seed 46's
                # preempted group could have.)
                g.lost, g.restart_at = True, None
                events.emit("group_lost", step=-1, target=g.name,
                            reason="died after every other group had finished")
                continue
            g.restarts += 1
            self._spawn(g, config_file, url)

    def _final_checkpoint(self, others: list[GroupProcess]) -> bool:
        """Whether a group started now would resume at the job's final state and train nothing:
        the finished groups reached ``train.steps`` (not their ``train.max_seconds``), a complete
        checkpoint of that step is on disk, and ``checkpoint.resume`` is on."""
        ck, final = self.config.checkpoint, self.config.train.steps
        if not ck.resume or not any(x.finished and x.result.get("step") == final for x in others):
            return False
        root = Path(ck.dir) if ck.dir else self.run_dir / "checkpoints"
        return any(step == final for step, _ in valid_checkpoints(root))

    def _printed_error(self, g: GroupProcess) -> bool:
        """Whether every rank of the current incarnation printed the CLI's ``ftlm: error:`` line:
        the group stopped on its own error (every rank raises it) and nothing is left but the
        exits. Not when some rank did not: the others may be stuck on a hung one, which must be
        killed at the grace as before. Reads the end of each log only."""
        return bool(g.log_offsets) and all(self._said_error(g, rank, tail=8192)
                                           for rank in range(len(g.log_offsets)))

    def _said_error(self, g: GroupProcess, rank: int, tail: int | None = None) -> bool:
        """Whether ``rank``'s log holds the CLI's error line since this incarnation began (in
        its last ``tail`` bytes only, when given: it is the last thing a rank prints)."""
        offset = g.log_offsets[rank]
        try:
            with open(g.log(self.run_dir, rank), "rb") as f:
                if tail is not None:
                    offset = max(offset, f.seek(0, os.SEEK_END) - tail)
                f.seek(offset)
                return ERROR_PREFIX.encode() in f.read()
        except OSError:
            return False

    def _has_result(self, g: GroupProcess) -> bool:
        """Whether the group's current incarnation has printed its final result (it is exiting)."""
        result = _read_result(g.log(self.run_dir))
        return bool(result) and result.get("incarnation") == g.incarnation

    # -- chaos -----------------------------------------------------------------------------------
    def _inject(self, events: EventLog, status: dict | None) -> None:
        """Break one process. A group may be hit unless it is the last up-to-date one (a healthy
        participant of the last quorum with no other such group alive): starting and recovering
        groups are fair game, before the first quorum too."""
        last = (status or {}).get("last_quorum") or {}
        if last.get("participants"):
            self._healthy = set(last["participants"])
        # A coordinator that just restarted knows no quorum yet: judge by the last one seen, or
        # the last up-to-date group could be killed while nobody can tell it is the last.
        healthy = self._healthy
        live = [g for g in self.groups if g.running() and not g.stopped and not g.finished
                and g.restart_at is None]
        candidates = [g.name for g in live if g.replica_id not in healthy
                      or any(x.replica_id in healthy for x in live if x is not g)]
        fault = self.chaos.choose(candidates, self.ranks, self.coordinator.running())
        if fault is None:
            return
        if fault.target == COORDINATOR:
            self._down_since = time.time()
            events.emit("failure_injected", step=-1, target=COORDINATOR, target_rank=0,
                        signal=fault.signal, pid=self.coordinator.pid)
            self.coordinator.kill()  # _watch_coordinator restarts it on the next tick
            return
        g = next(x for x in self.groups if x.name == fault.target)
        events.emit("failure_injected", step=-1, target=g.name, target_rank=fault.rank,
                    signal=fault.signal, incarnation=g.incarnation, registered=g.registered)
        if fault.signal == "SIGTERM":  # a preemption, not a failure: the group must leave on its own
            g.terminated = True
            for p in (g.procs if fault.rank == ALL_RANKS else [g.procs[fault.rank]]):
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            return
        g.cause = "chaos"
        if fault.signal == "SIGSTOP":
            g.stopped = True
            os.kill(g.procs[fault.rank].pid, signal.SIGSTOP)
        else:
            g.procs[fault.rank].kill()

    # -- the end ---------------------------------------------------------------------------------
    def _terminate_all(self) -> None:
        procs = [p for g in self.groups for p in g.procs if p.poll() is None]
        for p in procs:
            try:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
            except ProcessLookupError:
                pass
        deadline = time.time() + self.term_grace
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        # Whatever did not stop in time is killed, all at once; on a loaded machine a process
        # with gigabytes to unmap can take a while to exit even then, and waiting on it must not
        # raise past the caller, which still has the coordinator to stop.
        late = [p for p in procs if p.poll() is None]
        for p in late:
            try:
                p.kill()
            except ProcessLookupError:
                pass
        deadline = time.time() + 60
        for p in late:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                print(f"ftlm: process {p.pid} did not exit 60 s after SIGKILL", file=sys.stderr)
        for g in self.groups:
            if g.procs and not g.finished:
                g.result = self._results(g) or {}

    def _install_signals(self):
        """Ctrl-C and SIGTERM stop the launch, which still writes its summary as a stop on
        request (``stopped_by``). Only in the main thread, where Python runs signal handlers."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def stop(signum: int, _frame: object) -> None:
            self.stopped_by = signal.Signals(signum).name
            self._stop.set()
        return signal.signal(signal.SIGINT, stop), signal.signal(signal.SIGTERM, stop)

    @staticmethod
    def _restore_signals(handlers) -> None:
        if handlers:
            signal.signal(signal.SIGINT, handlers[0])
            signal.signal(signal.SIGTERM, handlers[1])

    def _mark_resume(self, events: EventLog) -> None:
        """Before any group starts: the earlier launches' commits from the checkpoint's step on
        are redone by this one, so they leave the history, as in a rollback (a ``restore``)."""
        step = self._resume_step
        if step is None:
            return
        earlier = [e["step"] for e in read_events(self.run_dir / "events.jsonl")
                   if e["kind"] == "commit" and isinstance(e.get("step"), int) and e["step"] >= step]
        if earlier:
            events.emit("restore", step=step, from_step=max(earlier) + 1, to_step=step, chain=None,
                        holders=[], source="checkpoint",
                        reason=f"relaunched: the groups resume from the durable checkpoint of step {step}")

    def _finish(self, events: EventLog, wall: float) -> dict:
        events.emit("run_end", step=-1, wall_seconds=wall)
        hashes = {g.name: g.result["state_hash"] for g in self.groups if g.result.get("state_hash")}
        recorded = read_events(self.run_dir / "events.jsonl")
        if recorded and self._resume_step is not None:  # the record starts with the first launch
            wall = max(wall, time.time() - min(e["ts"] for e in recorded))
        summary = build_summary(recorded, wall_seconds=wall, state_hashes=hashes,
                                config=self.config.to_dict(), groups=[g.name for g in self.groups])
        summary["restarts"] = {g.name: g.restarts for g in self.groups}
        summary["final_steps"] = {g.name: g.result.get("step") for g in self.groups}
        summary["lost_groups"] = [g.name for g in self.groups if g.lost]
        stamp = read_stamp(self.run_dir / MODEL_FILE)
        summary["model"] = {"step": stamp.step, "chain": stamp.chain} if stamp is not None else None
        judged = summary
        if self.stopped_by:  # judged on what it did, not on train.steps
            summary["stopped"] = "on request"
            judged = _as_stopped(summary)
        summary["problems"] = ([self.fatal] if self.fatal else []) + proof_problems(judged)
        write_summary(self.run_dir / "summary.json", summary)
        write_report(self.run_dir, summary, recorded)
        if self.progress is not False:
            print(format_summary(summary))
        return summary


def _run_token(run_dir: Path) -> str:
    """The job token of this run directory, made once and kept (mode 600) in ``run_dir/token``.

    Checkpoint manifests are authenticated with the token: a relaunch into the same run
    directory must use the same one, or it would refuse every checkpoint it wrote before.
    """
    path = run_dir / "token"
    if path.is_file():
        token = path.read_text().strip()
        if len(token) >= 16:
            return token
    token = secrets.token_hex(16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return token


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


def _as_stopped(summary: dict) -> dict:
    """``summary`` as a launch stopped on request is judged: on the steps it committed and the
    groups that left a final state, not on ``train.steps`` nor on groups it stopped before they
    had one (restarting); replicas that differ, samples trained twice or skipped still fail it."""
    config = dict(summary.get("config") or {})
    config["train"] = {k: v for k, v in (config.get("train") or {}).items() if k != "steps"}
    hashes = summary.get("state_hashes") or {}
    return {**summary, "config": config,
            "groups": [g for g in summary.get("groups") or [] if hashes.get(g)]}
