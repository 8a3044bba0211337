"""The coordinator's record of the groups it found corrupt, kept across its restarts.

The coordinator's state is soft: a restarted coordinator rebuilds the job from the groups'
heartbeats. How often each group was found corrupt, and so where it is quarantined (rule I1), is
not in any heartbeat: a coordinator restarted after a group's first conviction would let the
same faulty device be convicted twice more before refusing it. With a record file
(``ftlm coordinator --record PATH``; ``ftlm launch local`` and the Slurm layout pass one in the
run directory) each conviction by a majority is appended as one JSON line, and a coordinator
starting on that file counts them again before it serves.

Responsible for: reading the record into an ``IntegrityBook`` (``restore``) and appending to it
as ``state_mismatch`` events pass (``RecordingEvents``). Not responsible for: judging digests
(``ftlm.ft.quorum.integrity``) or refusing a quarantined group (``ftlm.ft.membership``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ftlm.ft.quorum.integrity import IntegrityBook, count_corrupt

log = logging.getLogger("ftlm.coordinator")


def restore(path: Path, book: IntegrityBook) -> int:
    """Count the convictions recorded in ``path`` into ``book``; how many. A missing file is an
    empty record; a line that is not a conviction (a torn last line, an edit) is skipped with a
    warning naming it."""
    try:
        lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return 0
    n = 0
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            group, host = entry["group"], entry["host"]
            if not isinstance(group, str) or not isinstance(host, str) or not group:
                raise TypeError("group and host must be strings")
        except (ValueError, KeyError, TypeError) as e:
            log.warning("%s:%d is not a conviction record (%s); skipped", path, i, e)
            continue
        count_corrupt(book, group, host)
        n += 1
    if n:
        where = ", ".join(f"{g} on {h}" for g, h in sorted(book.quarantined)) or "none"
        log.warning("restored %d conviction(s) for corruption from %s; quarantined: %s", n, path, where)
    return n


class RecordingEvents:
    """The coordinator's event sink, appending each conviction by a majority to ``path`` before
    passing every event on to ``inner`` (None: nowhere else)."""

    def __init__(self, path: Path, inner: Any = None) -> None:
        self.path = path
        self.inner = inner

    def emit(self, kind: str, **fields: Any) -> None:
        if kind == "state_mismatch" and fields.get("majority") and not fields.get("copied_from"):
            self._append({"ts": time.time(), "group": fields.get("group", ""),
                          "host": fields.get("host", ""), "step": fields.get("step", -1)})
        if self.inner is not None:
            self.inner.emit(kind, **fields)

    def _append(self, entry: dict[str, Any]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, (json.dumps(entry) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:  # the conviction still holds for this coordinator's life
            log.error("could not record the conviction of %s in %s: %s (a restarted coordinator "
                      "will not remember it)", entry["group"], self.path, e)


def with_record(path: str, book: IntegrityBook, events: Any) -> Any:
    """``events`` wrapped to record convictions in ``path`` after restoring ``book`` from it;
    ``events`` itself without a path."""
    if not path:
        return events
    restore(Path(path), book)
    return RecordingEvents(Path(path), events)
