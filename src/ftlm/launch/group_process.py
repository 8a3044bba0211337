"""One replica group as the local launcher sees it: its current processes (one per rank), its
history, and what its logs say.

Responsible for: the bookkeeping of a group across its incarnations (``GroupProcess``: when it
started, registered, progressed, left, was killed, why it may die), killing and reaping its ranks,
where its logs and start-up beacons lie, and reading its logs: the final ``FTLM_RESULT`` line of
each rank, the CLI's ``ftlm: error:`` line.

Not responsible for: deciding when a group is hung, restarted or lost (``ftlm.launch.local`` and
``ftlm.launch.watchdog`` do), nor starting its processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ftlm.launch.coordinator_process import ERROR_PREFIX, error_line

RESULT_PREFIX = "FTLM_RESULT "
"""The line each rank of a group process prints last: its final step and state hash (JSON)."""


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
        take longer to exit, and the launcher's loop reaps it once it has. It never raises: a
        ``TimeoutExpired`` here would take the whole job down."""
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

    # -- what its logs say about the current incarnation --------------------------------------
    def final_result(self, run_dir: Path, ranks: int) -> dict | None:
        """The current incarnation's final result once every rank printed its own: its step and
        one hash over every rank's state shard; None before."""
        results = [read_result(self.log(run_dir, r)) for r in range(ranks)]
        if any(r is None or r.get("incarnation") != self.incarnation for r in results):
            return None
        digest = hashlib.sha256("".join(r["state_hash"] for r in results).encode()).hexdigest()
        return {"state_hash": digest if ranks > 1 else results[0]["state_hash"],
                "step": results[0]["step"], "incarnation": self.incarnation,
                "rank_hashes": [r["state_hash"] for r in results]}

    def printed_result(self, run_dir: Path) -> bool:
        """Whether rank 0 of the current incarnation printed its final result (it is exiting)."""
        result = read_result(self.log(run_dir))
        return bool(result) and result.get("incarnation") == self.incarnation

    def printed_error(self, run_dir: Path) -> bool:
        """Whether every rank of the current incarnation printed the CLI's ``ftlm: error:`` line:
        the group stopped on its own error (every rank raises it) and nothing is left but the
        exits. Not when some rank did not: the others may be stuck on a hung one, which must be
        killed at the grace as before. Reads the end of each log only."""
        return bool(self.log_offsets) and all(self.said_error(run_dir, rank, tail=8192)
                                              for rank in range(len(self.log_offsets)))

    def said_error(self, run_dir: Path, rank: int, tail: int | None = None) -> bool:
        """Whether ``rank``'s log holds the CLI's error line since this incarnation began (in
        its last ``tail`` bytes only, when given: it is the last thing a rank prints)."""
        offset = self.log_offsets[rank]
        try:
            with open(self.log(run_dir, rank), "rb") as f:
                if tail is not None:
                    offset = max(offset, f.seek(0, os.SEEK_END) - tail)
                f.seek(offset)
                return ERROR_PREFIX.encode() in f.read()
        except OSError:
            return False

    def own_error(self, run_dir: Path) -> str:
        """The group's own error line from this incarnation's logs (a rank's ``ftlm: error:``
        line first, else rank 0's last line)."""
        for rank, offset in enumerate(self.log_offsets):
            if self.said_error(run_dir, rank):
                return error_line(self.log(run_dir, rank), offset)
        line = error_line(self.log(run_dir), self.log_offsets[0] if self.log_offsets else 0)
        return line or f"no output; see {self.log(run_dir)}"


def free_port() -> int:
    """A TCP port free right now on the loopback (for a group's MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_result(log: Path) -> dict | None:
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
