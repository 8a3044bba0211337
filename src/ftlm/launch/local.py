"""Local launcher and supervisor: a coordinator process plus N replica groups on this machine.

It starts the coordinator as its own process (``ftlm coordinator``, restarted when it dies, by a
warm standby that takes over at once, on the same port unless that was taken meanwhile:
``ftlm.launch.coordinator_process``; its URL is kept in ``coordinator.url`` in the run directory,
which the groups read again whenever they reconnect, ``FTLM_COORDINATOR_FILE``)
and each group as ``ftlm train`` processes (one per rank), or ``ftlm run SCRIPT`` processes for
a user's own training script (``script``), with the environment of docs/design.md,
'Environment'. It restarts a group whose process exits as a new incarnation and reports the
death to the coordinator (``POST /v1/dead``); restarts a group stopped from outside before the
last step (a SIGTERM, as a spot reclaim sends: it left the quorum and exited 0) as a preempted
pod or a requeued Slurm job comes back; has hung groups killed so that they restart
(``ftlm.launch.watchdog``); stops starting a group whose last three processes the coordinator
retired for failing every step they took part in (``RETIRED_IN_A_ROW``: a bad link or device
stays bad, the job goes on without it); stops the launch with the group's own error when a group
cannot start (exit status 2 before registering), crash-loops (``ft.crash_loop_*``), or groups
stop with status 2 twice with the job no further (a diverged loss: restarts repeat it);
optionally injects failures (``ftlm.launch.chaos_injection``) until a group reaches the last
step. At the end it waits until every group has exited with its final state (bounded by
``ft.give_up_seconds`` without progress), restarting groups that die near the end (they recover
from a finished group), and writes ``summary.json`` and ``report.md`` (``ftlm.launch.run_end``).
On Ctrl-C or SIGTERM it stops every process it started and still writes the summary.

It does not train, decide quorums or judge the run (``ftlm.observe.summary.proof_problems`` does).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Protocol

from ftlm import startup_beacon
from ftlm.config import RunConfig, save_config
from ftlm.errors import EXIT_RETIRED, ConfigError, FtlmError
from ftlm.ft.coordinator_address import ADDRESS_FILE_ENV
from ftlm.launch.chaos import COORDINATOR, Chaos
from ftlm.launch.chaos_injection import ChaosInjection
from ftlm.launch.console import ConsoleView
from ftlm.launch.coordinator_process import CoordinatorProcess, CoordinatorUnreachable
from ftlm.launch.group_process import GroupProcess, free_port
from ftlm.launch.run_end import RunEnd
from ftlm.launch.run_lock import lock_run_dir
from ftlm.launch.watchdog import Watchdog
from ftlm.observe.events import EventLog
from ftlm.train.checkpoint_files import valid_checkpoints
from ftlm.train.job_token import run_id, run_token
from ftlm.train.run_record import resume_step, set_aside

EXIT_USAGE = 2
"""Exit status of ``ftlm`` after its one-line ``FtlmError`` (bad config, missing data...)."""
RETIRED_IN_A_ROW = 3
"""Processes of one group in a row that the coordinator retired for failing the steps they took
part in (``ftlm.ft.quorum.Probe``) after which the group is not started again: its node's link
(or device) stays bad, and every new process would cost the others a few failed attempts."""


class Place(Protocol):
    """Where a process of the job runs when not on the loopback (``LocalLauncher(places=...)``;
    ``ftlm.testing.netbed.Node`` is one): the address it binds and others reach it at (a
    group's ``FTLM_HOST``, the coordinator's ``--host``), and the prefix its command is started
    with (``ip netns exec NS``, which execs the command: the PID stays the process's own)."""

    host: str
    prefix: list[str]


class LocalLauncher(Watchdog, ChaosInjection, RunEnd):
    """Runs a fault-tolerant job on this machine; ``run()`` returns the summary.

    ``chaos_coordinator`` puts the coordinator process in the chaos mix (one more target, drawn
    like a group, always SIGKILL); ``chaos_preempt`` makes a third of the groups' failures
    preemptions (SIGTERM, see ``ftlm.launch.chaos``), after which the group must leave and come
    back. ``script`` (with ``script_args``): every rank runs ``ftlm run SCRIPT ARGS``, a user's
    own loop (``ftlm.train.Session``), instead of ``ftlm COMMAND CONFIG``; its checks are the same.
    ``places`` runs the coordinator (key ``coordinator``), a group (``g0``...) or one rank of a
    group (``g0.r1``: a node of its own) at an address of its own behind a command prefix
    (``Place``: a network namespace of ``ftlm.testing.netbed``); the others stay on the loopback.
    ``run()`` raises ``FtlmError`` (after writing the summary) when a group cannot start or
    crash-loops, or the coordinator cannot be (re)started.

    Its parts live in modules of their own: the hang checks (``ftlm.launch.watchdog``), chaos
    injection (``ftlm.launch.chaos_injection``), the end of the run (``ftlm.launch.run_end``); a
    group's bookkeeping is ``ftlm.launch.group_process``.
    """

    stopped_by = ""
    """The signal that asked the launch to stop (SIGINT, SIGTERM), once one did."""

    def __init__(self, config: RunConfig, groups: int, chaos_mtbf: float = 0.0,
                 chaos_hang: bool = False, chaos_seed: int = 0, chaos_coordinator: bool = False,
                 chaos_preempt: bool = False, faults: dict[str, list[str]] | None = None,
                 start_delays: dict[str, float] | None = None, ranks_per_group: int = 1,
                 kill_hung: bool = True,
                 extra_env: dict[str, str] | None = None, progress: bool | None = None,
                 command: str = "train", coordinator_standby: bool = True,
                 script: str | Path | None = None, script_args: list[str] | None = None,
                 places: dict[str, Place] | None = None, spares: int = 0):
        if groups < 1:
            raise ConfigError(f"--groups={groups} must be at least 1")
        if spares < 0:
            raise ConfigError(f"--spares={spares} must be >= 0 (0: every group trains)")
        if ranks_per_group < 1:
            raise ConfigError(f"--ranks-per-group={ranks_per_group} must be at least 1")
        if chaos_mtbf < 0:
            raise ConfigError(f"--chaos-mtbf={chaos_mtbf} must be >= 0 (0 disables chaos)")
        if script is not None and not Path(script).is_file():
            raise ConfigError(f"script {script} does not exist or is not a file; give the path of "
                              "a Python training script, e.g. -- my_train.py")
        if script is not None and command != "train":
            raise ConfigError(f"a script replaces the ftlm command each rank runs; give either "
                              f"the script {script} or the command {command!r}, not both")
        self.config = config
        self.command = command  # the ftlm subcommand each rank runs: train, sft, dpo, grpo
        # A user's training script each rank runs instead (``ftlm run SCRIPT ARGS``).
        self.script = None if script is None else Path(script)
        self.script_args = list(script_args or [])
        self.coordinator_standby = coordinator_standby  # a warm process ready to replace it
        self.n = groups  # groups that train (the N of the degraded-mode LR)
        self.spares = spares  # hot spare groups started beside them (``ft.spares``)
        self.ranks = ranks_per_group
        # Where the coordinator, a group ("g0") or a rank of one ("g0.r1") runs when not on the
        # loopback: the address it binds and tells others, and its commands' prefix.
        self.places = dict(places or {})
        known = {COORDINATOR} | {f"g{i}" for i in range(groups)}
        known |= {f"g{i}.r{r}" for i in range(groups) for r in range(1, ranks_per_group)}
        unknown = set(self.places) - known
        if unknown:
            raise ConfigError(f"places names {sorted(unknown)}: give the coordinator "
                              f"('{COORDINATOR}'), groups g0..g{groups - 1} or their ranks "
                              f"above 0 (g0.r1: a node of its own)")
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
        self.groups = [GroupProcess(f"g{i}") for i in range(groups + spares)]
        self._best_step = 0  # the furthest step the job was seen at (chaos stops at the last one)
        self._healthy: set[str] = set()  # participants of the last quorum seen (chaos spares the last)
        self.token = secrets.token_hex(16)
        self._stop = threading.Event()
        self._wake = threading.Event()  # a rank exited, or a stop: the supervisor's round is due now
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
        # The run directory's own token (made once, kept): a relaunch must sign and verify the
        # checkpoints with the one that wrote them.
        self.token = run_token(self.run_dir)
        self._resume_step = resume_step(self.config.checkpoint, self.run_dir, self.token.encode(),
                                        run_id(self.run_dir))
        moved = set_aside(self.run_dir, self._resume_step,
                          also=("summary.json", "report.md", "logs", "prometheus_targets.json"))
        if moved:
            print(f"ftlm: {moved}", file=sys.stderr)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        self.config.ft.groups = self.n  # the coordinator's first quorum waits for all of them
        self.config.ft.spares = self.spares
        config_file = self.run_dir / "config.toml"
        save_config(self.config, config_file)
        return config_file

    def _spawn(self, g: GroupProcess, config_file: Path, url: str) -> None:
        """Start the group's ranks with the torchrun environment, as a new incarnation."""
        g.incarnation = uuid.uuid4().hex[:12]
        master_port = free_port()
        place = self.places.get(g.name)  # rank 0's, and every rank's without one of its own
        if self.script is not None:
            cmd = [sys.executable, "-m", "ftlm.cli", "run", str(self.script), *self.script_args]
        else:
            cmd = [sys.executable, "-m", "ftlm.cli", self.command, str(config_file),
                   "--set", "observe.progress=false"]
        g.procs, g.log_offsets, g.cause, g.terminated = [], [], "", False
        for rank in range(self.ranks):
            at = self.places.get(f"{g.name}.r{rank}", place)
            env = dict(os.environ)
            env.update({
                "FTLM_COORDINATOR": url, ADDRESS_FILE_ENV: str(self._address_file().absolute()),
                "FTLM_GROUP_ID": g.name, "FTLM_INCARNATION": g.incarnation,
                "FTLM_TOKEN": self.token, "FTLM_GROUPS": str(self.n),
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.ranks),
                "LOCAL_WORLD_SIZE": str(self.ranks), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port), "PYTHONUNBUFFERED": "1",
                # What a script's ``ftlm.train.Session`` reads: the resolved run config (the
                # launcher judges the run against it) and where the job's record goes.
                "FTLM_CONFIG": str(config_file.absolute()), "FTLM_RUN_DIR": str(self.run_dir.absolute()),
            })
            if at is not None:
                env["FTLM_HOST"] = at.host
            if place is not None:  # the group's store is on rank 0's node
                env["MASTER_ADDR"] = place.host
            env.update(self.extra_env)
            env.pop("FTLM_FAULT", None)
            if self.config.observe.metrics:
                port = self.config.observe.metrics_port
                env["FTLM_METRICS_PORT"] = str(
                    port + self.groups.index(g) * self.ranks + rank if port else free_port())
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
                proc = subprocess.Popen([*(at.prefix if at else []), *cmd], env=env,
                                        stdout=log, start_new_session=True,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            g.procs.append(proc)
            # The death of a rank is reported at once, not at the next 0.1 s round: the healthy
            # groups' next quorum waits for that report (or for the heartbeat timeout).
            threading.Thread(target=self._wake_on_exit, args=(proc,), daemon=True,
                             name=f"ftlm-exit-{g.name}.{rank}").start()
        if self.config.observe.metrics:
            self._write_targets()
        g.started = time.time()
        g.restart_at = None
        g.stopped = g.registered = g.progressed = g.killed = g.stuck_exit = False
        g.first_step = g.absent_since = g.left_at = g.exiting_since = g.erring_since = None

    def _wake_on_exit(self, proc: subprocess.Popen) -> None:
        proc.wait()
        self._wake.set()

    def _address_file(self) -> Path:
        """Where the coordinator's current URL is kept for the groups (``FTLM_COORDINATOR_FILE``)."""
        return self.run_dir / "coordinator.url"

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
        at = self.places.get(COORDINATOR)
        self.coordinator = CoordinatorProcess(config_file, free_port(), self.token,
                                              self.run_dir / "events.jsonl",
                                              self.run_dir / "logs" / "coordinator.log",
                                              tls=self._tls_context(),
                                              standby=self.coordinator_standby,
                                              address_file=self._address_file(),
                                              **({"host": at.host, "prefix": at.prefix} if at else {}))
        self.coordinator.start(self.config.ft.startup_timeout)
        url = self.coordinator.url
        # ranks_per_group: GPU-hours count every rank of a group (ftlm.observe.cost).
        events.emit("run_start", step=-1, groups=self.n, spares=self.spares, coordinator=url,
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
                # Its URL now: a group started after a move goes there at once.
                self._restart_due(events, config_file, self.coordinator.url, now)
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
                self._wake.wait(0.1)
                self._wake.clear()
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

    def restart_coordinator(self, port: int | None = None) -> None:
        """Kill the coordinator process and start a fresh one on the same port, or on ``port``
        (a coordinator failure; a move, which the groups follow through the address file). The
        new one holds no state: it rebuilds membership from the next heartbeats and continues
        quorum ids above those the members report. Safe to call from another thread."""
        with self._coordinator_lock:
            self.events.emit("failure_injected", step=-1, target=COORDINATOR, target_rank=0,
                             signal="SIGKILL", pid=self.coordinator.pid)
            down = self._down_since = time.time()
            self.coordinator.kill()
            self.coordinator.start(self.config.ft.startup_timeout, port=port)
            self._outages.append((down, time.time()))
            self._down_since = None
            self.events.emit("coordinator_restart", step=-1, port=self.coordinator.port,
                             code=-signal.SIGKILL, seconds=round(time.time() - down, 3),
                             pid=self.coordinator.pid)

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
            if g.stuck_exit and all(c is not None for c in codes) and g.final_result(self.run_dir, self.ranks) is not None:
                failed, codes = [], [0] * len(codes)  # its result stands: only its exit hung
            if not failed:
                if all(c == 0 for c in codes):
                    results = g.final_result(self.run_dir, self.ranks)
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
                          f"{g.own_error(self.run_dir)}; not started again (fix its node, then launch again to "
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
            self.fatal = f"group {g.name} cannot start (exit status {code}): {g.own_error(self.run_dir)}"
            return
        if code == EXIT_USAGE:
            top, why = max(self._best[0], self._best_step), g.own_error(self.run_dir)
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
                          f"{code}: {g.own_error(self.run_dir)}")

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

    # -- Ctrl-C and SIGTERM ------------------------------------------------------------------------
    def _install_signals(self):
        """Ctrl-C and SIGTERM stop the launch, which still writes its summary as a stop on
        request (``stopped_by``). Only in the main thread, where Python runs signal handlers."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def stop(signum: int, _frame: object) -> None:
            self.stopped_by = signal.Signals(signum).name
            self._stop.set()
            self._wake.set()
        return signal.signal(signal.SIGINT, stop), signal.signal(signal.SIGTERM, stop)

    @staticmethod
    def _restore_signals(handlers) -> None:
        if handlers:
            signal.signal(signal.SIGINT, handlers[0])
            signal.signal(signal.SIGTERM, handlers[1])
