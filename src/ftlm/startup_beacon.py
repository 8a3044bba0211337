"""A starting process's sign of life, for the supervisor that started it.

A process that hangs while it starts (stopped by a signal, frozen on a dead mount, starved) has
not yet registered with the coordinator, so no heartbeat can tell it apart from one that is only
slow: importing, loading data, joining its group's ranks. The supervisor sets
``FTLM_STARTUP_BEACON`` to a file path per rank; from its first instant the process rewrites that
file from a thread of its own every ``INTERVAL`` seconds with the phase it is in. A beacon that
stops changing means the whole process stopped, in seconds, whatever the phase; a phase that
never ends is left to ``ft.startup_timeout``.

Standard library only: it starts before anything heavy is imported. It decides nothing about the
process (``ftlm.launch.watchdog`` reads the beacons).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

ENV = "FTLM_STARTUP_BEACON"
INTERVAL = 0.5
"""Seconds between two writes of the beacon."""

_phase = "starting"
_started = False
_lock = threading.Lock()


def start() -> None:
    """Start this process's beacon when the supervisor asked for one (once; idempotent)."""
    global _started
    path = os.environ.get(ENV, "")
    with _lock:
        if not path or _started:
            return
        _started = True
    threading.Thread(target=_beat, args=(Path(path),), name="ftlm-startup-beacon", daemon=True).start()


def phase(name: str) -> None:
    """Say which phase of its start-up this process is in (shown when it is declared hung)."""
    global _phase
    _phase = name


def _beat(path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    while True:
        try:
            tmp.write_text(f"{_phase}\n")
            os.replace(tmp, path)
        except OSError:
            pass  # the run directory may be going away at the end: nothing to report to
        time.sleep(INTERVAL)


def read(path: Path, now: float | None = None) -> tuple[float, str] | None:
    """(seconds since the beacon at ``path`` last changed, its phase); None when there is none
    yet. ``now`` is the wall clock (``time.time()``)."""
    try:
        mtime = path.stat().st_mtime
        text = path.read_text().strip()
    except OSError:
        return None
    return (time.time() if now is None else now) - mtime, text or "starting"
