"""What the local supervisor shows on the console while a job runs.

On a terminal: a progress bar of committed steps with one status word per group, redrawn in
place. Anywhere else (a log file, CI, a pipe): a plain status line every few seconds, so a log
does not fill with carriage-return frames. It reads the coordinator's status and the supervisor's
view of its processes; it decides nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

PLAIN_INTERVAL_SECONDS = 5.0
"""Seconds between two status lines when the console is not a terminal."""


class ConsoleView:
    """Progress of a job: ``update(status)`` on every supervisor tick, ``close()`` at the end."""

    def __init__(self, total: int, groups: list, enabled: bool, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 interval: float = PLAIN_INTERVAL_SECONDS):
        self.total = total
        self.groups = groups
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.interval = interval
        self.enabled = enabled
        self.step = 0
        self.bar = None
        self._next_line = clock()
        self._last_line = ""
        if enabled and _is_terminal(self.stream):
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=self.stream)

    def update(self, status: dict | None) -> None:
        if not self.enabled:
            return
        status = status or {}
        members = {m["group"]: m for m in status.get("members", [])}
        last = status.get("last_quorum") or {}
        participants = {r.split(":")[0] for r in last.get("participants", [])}
        steps = [m["step"] for m in members.values()]
        # A group that finished has left the coordinator: its result holds its last step.
        steps += [g.result.get("step", 0) for g in self.groups if g.finished and g.result]
        self.step = max([self.step, *[min(s, self.total) for s in steps]])
        parts = []
        for g in self.groups:
            m = members.get(g.name)
            if g.finished:
                word, at = "done", g.result.get("step", "-")
            elif g.stopped:
                word, at = "hung", m["step"] if m else "-"
            elif not g.running() or m is None:
                word, at = ("start" if g.running() else "down"), "-"
            else:
                word, at = ("train" if g.name in participants else "recover"), m["step"]
            parts.append(f"{g.name}:{word}@{at}")
        line = f"q{status.get('quorum_id', 0)} P={len(participants)} " + " ".join(parts)
        if self.bar is not None:
            self.bar.n = self.step
            self.bar.set_postfix_str(line, refresh=False)
            self.bar.refresh()
            return
        self._last_line = line
        now = self.clock()
        if now >= self._next_line:
            self._next_line = now + self.interval
            self._write(line)

    def _write(self, line: str) -> None:
        self.stream.write(f"step {self.step}/{self.total} {line}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.n = self.step
            self.bar.refresh()
            self.bar.close()
        elif self.enabled and self._last_line:
            self._write(self._last_line)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
