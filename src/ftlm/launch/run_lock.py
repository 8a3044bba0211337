"""An exclusive lock on a run directory, held for a whole launch: a second launch into a
directory in use is refused with a message naming the running one, instead of rewriting its record.

The lock is an advisory ``fcntl.flock`` on ``RUN_DIR/.launch.lock``. The kernel drops it when the
holding process ends, however it ends, so a launch that was SIGKILLed leaves no stale lock. The
file's JSON body (pid, host, start time, command) only names the holder for the message; the flock
is the lock, and the file stays in place after release (removing it would let two processes lock
two different files of the same name). The descriptor is not inherited by the processes the
launch starts: the lock ends with the launcher, not with an orphaned group.

Not done here: locking across machines (``flock`` on a network file system may lock only locally),
or stopping the running launch.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path

from ftlm.errors import FtlmError

LOCK_FILE = ".launch.lock"


class RunDirInUse(FtlmError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """A held lock on a run directory; ``release()`` (or leaving the ``with`` block) drops it."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        """Drop the lock (closing the descriptor does it); releasing twice is harmless."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


def lock_run_dir(run_dir: Path, argv: list[str] | None = None) -> RunLock:
    """Lock ``run_dir`` (created if missing) for this process, or raise ``RunDirInUse`` naming the
    process that holds it and what to do. ``argv`` is the command recorded for that message
    (default ``sys.argv``). Never waits."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise RunDirInUse(_in_use_message(run_dir, holder, time.time())) from None
    except BaseException:
        os.close(fd)
        raise
    body = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
            "argv": list(sys.argv if argv is None else argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(body) + "\n").encode(), 0)
    return RunLock(path, fd)


def _read_holder(fd: int) -> dict:
    """The holder's body, or {} when it is unreadable (not written yet: it has just locked)."""
    try:
        holder = json.loads(os.pread(fd, 1 << 16, 0))
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _in_use_message(run_dir: Path, holder: dict, now: float) -> str:
    """One line: who holds ``run_dir`` (pid, host, since when, command) and the two ways out."""
    pid, host, started, argv = (holder.get("pid"), holder.get("host"), holder.get("started"),
                                holder.get("argv"))
    who = f"pid {pid}" if isinstance(pid, int) else "a process that has just started"
    if isinstance(host, str) and host and host != socket.gethostname():
        who += f" on {host}"
    if isinstance(started, (int, float)):
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
        who += f", started {when} ({max(0, round(now - started))} s ago)"
    if isinstance(argv, list) and argv:
        who += f": {shlex.join(str(a) for a in argv)}"
    stop = f"stop it (kill {pid})" if isinstance(pid, int) else "stop it"
    return (f"run directory {run_dir} is in use by another launch ({who}); {stop} first, or "
            f"choose another run directory (--set run.dir=...)")
