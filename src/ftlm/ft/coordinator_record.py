"""The coordinator's record: what a restarted coordinator must not forget.

The coordinator's state is soft: a restarted coordinator rebuilds the job from the groups'
heartbeats. Three facts are in no heartbeat:

* **Convictions.** How often each group was found corrupt, and so where it is quarantined (rule
  I1): a coordinator restarted after a group's first conviction would let the same faulty device
  be convicted twice more before refusing it.
* **Finished leaves.** Which groups left the job finished, and at which state (``Quorum.
  groups_left``): a group still in the job at the final state waits for the others to finish or
  to come back. After a restart, with the finished groups gone, it would wait for nobody until
  ``ft.quorum_timeout``.
* **Suspect states** (rule I2): which states a member found corrupt may have handed on (a
  checkpoint it wrote), and who is vouched for to claim them. Forgotten, a restarted member that
  loads a checkpoint of the corrupt member's would count as a holder of the job's state, and its
  bits would spread again.

With a record file (``ftlm coordinator --record PATH``; ``ftlm launch local`` and the Slurm layout
pass one in the run directory) each conviction by a majority, each finished leave and each change
of the suspect states (the whole list, a few entries at most: the newest line wins) is appended as
one JSON line, and a coordinator starting on that file takes them in again before it serves.

Responsible for: what is kept (``entry_of``), reading the record into a ``Membership``
(``restore``, ``apply_entry``; the protocol simulator replays its coordinator's record the same
way) and appending to it as ``state_mismatch`` and ``member_left`` events pass
(``RecordingEvents``), ``suspect_states`` and ``suspect_vouched`` too. Not responsible for:
judging digests (``ftlm.ft.quorum.integrity``), refusing a quarantined group or counting the
groups left (``ftlm.ft.membership``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftlm.ft.quorum.integrity import count_corrupt, restore_suspect

if TYPE_CHECKING:
    from ftlm.ft.membership import Membership

log = logging.getLogger("ftlm.coordinator")


def _entry(line: str) -> dict[str, Any]:
    """One record line: a conviction ``{"group", "host", "step"}``, a finished leave
    ``{"left": "finished", "group", "step", "chain"}`` or the suspect states ``{"suspect": [...]}``
    (``integrity.suspect_snapshot``); ``ValueError`` otherwise."""
    entry = json.loads(line)
    if isinstance(entry, dict) and "suspect" in entry:
        if not isinstance(entry["suspect"], list):
            raise ValueError("suspect states must be a list")
        return entry
    if not isinstance(entry, dict) or not isinstance(entry.get("group"), str) or not entry["group"]:
        raise ValueError("no group")
    if entry.get("left") == "finished":
        if not isinstance(entry.get("step"), int) or not isinstance(entry.get("chain"), str):
            raise ValueError("a finished leave needs an integer step and a chain")
    elif not isinstance(entry.get("host"), str):
        raise ValueError("a conviction needs a host")
    return entry


def entry_of(kind: str, fields: dict[str, Any]) -> dict[str, Any] | None:
    """What the record keeps of a coordinator event: a conviction by a majority (not a copy's),
    a finished leave (with the state it finished at), the suspect states after a change; None
    for every other event."""
    if kind in ("suspect_states", "suspect_vouched") and isinstance(fields.get("suspect"), list):
        return {"suspect": fields["suspect"]}
    if kind == "state_mismatch" and fields.get("majority") and not fields.get("copied_from"):
        return {"group": fields.get("group", ""), "host": fields.get("host", ""), "step": fields.get("step", -1)}
    if kind == "member_left" and fields.get("reason") == "finished" and "chain" in fields:
        return {"left": "finished", "group": fields.get("group", ""), "step": fields.get("step", -1),
                "chain": fields["chain"]}
    return None


def apply_entry(membership: Membership, entry: dict[str, Any]) -> None:
    """Take one record entry (``entry_of``'s) into ``membership``; ``ValueError`` for suspect
    states that are not a ``suspect_snapshot`` (``membership`` left as it was)."""
    if "suspect" in entry:
        restore_suspect(membership.state, entry["suspect"])
    elif entry.get("left") == "finished":
        membership.restore_finished(entry["group"], entry["step"], entry["chain"])
    else:
        count_corrupt(membership.integrity, entry["group"], entry["host"])


def restore(path: Path, membership: Membership) -> int:
    """Take the record in ``path`` into ``membership``: the convictions are counted again, the
    finished leaves and the newest suspect states known again; how many lines it took. A missing
    file is an empty record; a line that is none of these (a torn last line, an edit) is skipped
    with a warning naming it."""
    try:
        lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return 0
    n = convicted = 0
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = _entry(line)
            apply_entry(membership, entry)
        except ValueError as e:
            log.warning("%s:%d is not a record of the coordinator's (%s); skipped", path, i, e)
            continue
        convicted += entry.get("left") is None and "suspect" not in entry
        n += 1
    if convicted:
        where = ", ".join(f"{g} on {h}" for g, h in sorted(membership.integrity.quarantined)) or "none"
        log.warning("restored %d conviction(s) for corruption from %s; quarantined: %s", convicted, path, where)
    return n


class RecordingEvents:
    """The coordinator's event sink, appending each conviction by a majority, each finished
    leave and each change of the suspect states to ``path`` before passing every event on to
    ``inner`` (None: nowhere else)."""

    def __init__(self, path: Path, inner: Any = None) -> None:
        self.path = path
        self.inner = inner

    def emit(self, kind: str, **fields: Any) -> None:
        entry = entry_of(kind, fields)
        if entry is not None:
            self._append({"ts": time.time(), **entry})
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
        except OSError as e:  # it still holds for this coordinator's life
            what = ("the suspect states" if "suspect" in entry else
                    f"the finished leave of {entry['group']}" if entry.get("left") else
                    f"the conviction of {entry['group']}")
            log.error("could not record %s in %s: %s (a restarted coordinator will not remember it)",
                      what, self.path, e)


def with_record(path: str, membership: Membership, events: Any) -> Any:
    """``events`` wrapped to append to the record in ``path`` after restoring ``membership``
    from it; ``events`` itself without a path."""
    if not path:
        return events
    restore(Path(path), membership)
    return RecordingEvents(Path(path), events)
