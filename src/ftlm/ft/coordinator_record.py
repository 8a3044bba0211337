"""The coordinator's record: what a restarted coordinator must not forget.

The coordinator's state is soft: a restarted coordinator rebuilds the job from the groups'
heartbeats. Five facts are in no heartbeat:

* **Convictions.** How often each group was found corrupt, and so where it is quarantined (rule
  I1): a coordinator restarted after a group's first conviction would let the same faulty device
  be convicted twice more before refusing it.
* **Finished leaves.** Which groups left the job finished, and at which state (``Quorum.
  groups_left``): a group still in the job at the final state waits for the others to finish or
  to come back. After a restart, with the finished groups gone, it would wait for nobody until
  ``ft.quorum_timeout``.
* **Agreements.** At which steps each member's digest agreed with the others' (rule I2): a
  member found corrupt later may hold corrupt bits only from its last agreement on, so the
  states before it are not suspect. Forgotten, every state before the restarted coordinator's
  start would be (it never saw their chains), and a job split at the next check would roll back
  to step 0.
* **Retirements for a state.** Which members were retired because their state was found
  corrupt (or copied from a corrupt one, or suspect), and which checkpoint each must set aside.
  The refusal that tells a member so answers its next message; if the coordinator dies first,
  the member would otherwise take part again in the restarted coordinator's job.
* **Suspect states** (rule I2): which states a member found corrupt may have handed on (a
  checkpoint it wrote), and who is vouched for to claim them. Forgotten, a restarted member that
  loads a checkpoint of the corrupt member's would count as a holder of the job's state, and its
  bits would spread again.

With a record file (``ftlm coordinator --record PATH``; ``ftlm launch local`` and the Slurm layout
pass one in the run directory) each agreement of digests (one line per ``ft.integrity_every``
steps), each retirement for a state (with the conviction when a majority found it), each
finished leave and each change of the suspect states (the whole list, a few entries at most: the
newest line wins) is appended as one JSON line, and a coordinator starting on that file takes
them in again before it serves.

Responsible for: what is kept (``entry_of``), reading the record into a ``Membership``
(``restore``, ``apply_entry``; the protocol simulator replays its coordinator's record the same
way) and appending to it as ``state_agreed``, ``state_mismatch``, ``member_left``,
``member_dead``, ``suspect_states`` and ``suspect_vouched`` events pass (``RecordingEvents``).
Not responsible for:
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

from ftlm.ft.quorum.integrity import count_corrupt, restore_agreed, restore_suspect

if TYPE_CHECKING:
    from ftlm.ft.membership import Membership

log = logging.getLogger("ftlm.coordinator")


def _entry(line: str) -> dict[str, Any]:
    """One record line: an agreement ``{"agreed": step, "replica_ids"}``; a retirement
    ``{"retired", "why", "set_aside"}``, with a conviction's
    ``"group", "host", "step"`` when a majority found it; a conviction alone (records before
    retirements were kept); a finished leave ``{"left": "finished", "group", "step", "chain"}``;
    or the suspect states ``{"suspect": [...]}`` (``integrity.suspect_snapshot``); ``ValueError``
    otherwise."""
    entry = json.loads(line)
    if isinstance(entry, dict) and "suspect" in entry:
        if not isinstance(entry["suspect"], list):
            raise ValueError("suspect states must be a list")
        return entry
    if isinstance(entry, dict) and "agreed" in entry:
        rids = entry.get("replica_ids")
        if (type(entry["agreed"]) is not int or not isinstance(rids, list)
                or not all(isinstance(r, str) and r for r in rids)):
            raise ValueError("an agreement needs an integer step and a list of replica ids")
        return entry
    if isinstance(entry, dict) and "retired" in entry:
        held = entry.get("set_aside")
        if not isinstance(entry["retired"], str) or not entry["retired"] or not isinstance(entry.get("why"), str):
            raise ValueError("a retirement needs a replica id and why")
        if held is not None and not (isinstance(held, list) and len(held) == 2 and isinstance(held[0], int)
                                     and isinstance(held[1], str)):
            raise ValueError("a retirement's set_aside must be null or [step, chain]")
        if "group" not in entry:
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
    """What the record keeps of a coordinator event: an agreement of digests; a member retired
    for its state (found corrupt, a copy of a corrupt one, or holding a suspect state), with the
    conviction when a majority found it (not a copy's); a finished leave (with the state it
    finished at); the suspect states after a change; None for every other event."""
    if kind in ("suspect_states", "suspect_vouched") and isinstance(fields.get("suspect"), list):
        return {"suspect": fields["suspect"]}
    if kind == "state_agreed" and isinstance(fields.get("replica_ids"), list):
        return {"agreed": fields.get("step", -1), "replica_ids": fields["replica_ids"]}
    if kind in ("state_mismatch", "member_dead") and isinstance(fields.get("retired"), str) and fields.get("replica_id"):
        entry = {"retired": fields["replica_id"], "why": fields["retired"], "set_aside": fields.get("set_aside")}
        if kind == "state_mismatch" and fields.get("majority") and not fields.get("copied_from"):
            entry.update(group=fields.get("group", ""), host=fields.get("host", ""), step=fields.get("step", -1))
        return entry
    if kind == "member_left" and fields.get("reason") == "finished" and "chain" in fields:
        return {"left": "finished", "group": fields.get("group", ""), "step": fields.get("step", -1),
                "chain": fields["chain"]}
    return None


def apply_entry(membership: Membership, entry: dict[str, Any]) -> None:
    """Take one record entry (``entry_of``'s) into ``membership``; ``ValueError`` for suspect
    states that are not a ``suspect_snapshot`` (``membership`` left as it was)."""
    if "suspect" in entry:
        restore_suspect(membership.state, entry["suspect"])
    elif "agreed" in entry:
        restore_agreed(membership.integrity, entry["agreed"], entry["replica_ids"])
    elif entry.get("left") == "finished":
        membership.restore_finished(entry["group"], entry["step"], entry["chain"])
    else:
        if "retired" in entry:
            held = entry.get("set_aside")
            membership.restore_retired(entry["retired"], entry["why"], (held[0], held[1]) if held else None)
        if "group" in entry:
            count_corrupt(membership.integrity, entry["group"], entry["host"])


def restore(path: Path, membership: Membership) -> int:
    """Take the record in ``path`` into ``membership``: the convictions are counted again, the
    agreements, retirements, finished leaves and the newest suspect states known again; how many
    lines it took. A missing
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
        convicted += "group" in entry and "host" in entry and entry.get("left") is None
        n += 1
    if convicted:
        where = ", ".join(f"{g} on {h}" for g, h in sorted(membership.integrity.quarantined)) or "none"
        log.warning("restored %d conviction(s) for corruption from %s; quarantined: %s", convicted, path, where)
    return n


class RecordingEvents:
    """The coordinator's event sink, appending each agreement of digests, each retirement for a
    state, each finished leave and each change of the suspect states to ``path`` before passing every event on to
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
                    f"the agreement of step {entry['agreed']}" if "agreed" in entry else
                    f"the finished leave of {entry['group']}" if entry.get("left") else
                    f"the retirement of {entry['retired']}" if "retired" in entry else
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
