"""Structured event log of a run: ``events.jsonl``, one JSON object per line.

This module owns the file format and the writer/reader. It does not interpret events: counting,
stalls, ETT and data accounting live in ``ftlm.observe.summary``.

Every record has ``ts`` (unix seconds, ``time.time()``), ``kind``, ``group`` (the group id of the
emitting process, ``""`` for job-level processes such as the supervisor), ``rank`` and ``step``,
plus the fields of its kind. Several processes (every group, the coordinator, the supervisor)
append to the same file: each line is written with one ``os.write`` on an ``O_APPEND`` descriptor,
so lines never interleave, and nothing is buffered in the process (a kill loses at most the line
being written, never earlier ones). Lines are not fsync'ed: the log is diagnostics, not state.

``step`` is the index of the step the event is about, 0-based; -1 when none applies (coordinator,
supervisor). In particular a ``commit`` event carries the index of the committed step (the value
*before* the group increments its step), so the commits of one group read 0, 1, 2, ...

An event that one process records about another group (``failure_injected`` by the supervisor,
``member_dead`` by the coordinator) names the affected group in ``target`` (a group id or an
incarnation ``<group>:<uuid>``); otherwise the affected group is ``group`` itself.

Kinds used across ftlm and their fields:

* ``run_start`` / ``run_end``: the supervisor at the start and end of the job (``run_end`` has
  ``reason``: ``"completed"``, ``"interrupted"``, ``"failed"``).
* ``group_start`` / ``group_exit``: a group process came up (``incarnation``) / ended cleanly or not
  (``ok``, ``reason``; the supervisor's ``group_exit`` of a failed process has ``code`` and
  ``cause``: ``crash``, ``hung``, ``chaos`` or ``fault`` (injected), ``retired`` (the coordinator
  retired it for failing the steps it took part in)).
* ``quorum``: a group received the quorum for ``step`` (``quorum_id``, ``participants``,
  ``recovering``).
* ``commit``: a group applied step ``step`` (``quorum_id``, ``participants`` (count), ``samples``
  (``[start, end)``, the *global* sample range of the step, which every committing group agrees
  on), ``loss``, ``tokens`` (global tokens of the step), ``lr``, ``step_seconds``, ``chain`` (the
  history chain after the step, ``ftlm.ft.history``), ``parent`` (the chain before it) and
  ``wire_bytes`` (the payload one group put on the wire between groups for the step); under
  DiLoCo also ``inner_steps``, ``fragment``, ``outer_seconds`` and ``staleness``).
* ``step_failed``: a group voted not to commit step ``step`` (``quorum_id``, ``reason``; for a
  non-finite loss or gradient, ``nonfinite_samples``: the ``[start, end)`` sample positions of the
  participants whose loss or gradient was not finite).
* ``failure_injected``: chaos killed, stopped or broke ``target`` (``signal`` or ``how``). Two are
  not failures (``NOT_FAILURES``): ``signal`` ``none`` slowed a link, ``SIGTERM`` preempted the
  group (it must leave and come back, ``group_exit`` with ``preempted``). The network test bed
  (``ftlm.testing.netbed``, ``group`` ``netbed``) adds ``signal`` ``partition`` (packets of
  ``target`` dropped) and the fields ``fault`` (``block``, ``isolate``, ``shape``), ``peer`` and
  ``both_ways`` (a block), ``shape`` (how a link misbehaves), ``flap`` and ``expect`` (what the
  job must make of it: ``detected``, ``tolerated``, ``either``).
* ``network_healed``: the test bed lifted its faults on ``target`` (``*``: every node).
* ``member_dead``: the coordinator declared ``target`` dead (``reason``: missed heartbeats, no
  progress while heartbeating, process exited, replaced by a new incarnation, or retired because
  attempts of ``step - 1`` failed with it and committed without it and ``step`` failed with it
  again: a bad link or device, ``ftlm.ft.quorum.Probe``; then ``host`` names the host its leader
  ran on, where to look for the bad link).
* ``member_left``: ``target`` left the job on purpose (``reason``: finished, stopped; a finished
  leave also has the ``step`` and ``chain`` it finished at).
* ``restore``: an explicit rollback: no live group held the newest committed state, so the job
  continues from ``to_step`` (``from_step``, ``holders``, ``reason``, ``source``). Commits of steps
  ``>= to_step`` made before it are not part of the final history.
* ``recovery_start`` / ``recovery_end``: a (re)started group began / finished catching up from a
  peer (``source``; ``recovery_end`` has ``ok`` and ``seconds``).
* ``checkpoint_saved``: a durable checkpoint of ``step`` became valid (``path``, ``seconds``).
* ``checkpoint_rejected``: a checkpoint failed verification and was skipped (``path``, ``reason``).
* ``checkpoint_failed``: writing a durable checkpoint failed (``error``: a full disk, a lost
  mount); training went on and the newest valid checkpoint stays.
* ``checkpoint_reloaded``: no live group held the job's newest state (``head``), so this group,
  behind it, loaded the newer durable checkpoint of ``step`` (``from_step``, ``seconds``, ``chain``)
  before the coordinator's rollback.
* ``eval``: held-out loss after step ``step`` (``loss``, ``tokens``, ``seconds``).
* ``objective``: what the objective measured in committed step ``step`` on this rank (the means
  over its micro-batches; ``ftlm.train.objective.ReportingObjective``). GRPO: ``reward``,
  ``zero_variance``, ``truncated`` and, with ``ppo_epochs > 1``, ``clipped``.
* ``coordinator_restart``: the coordinator came back and rebuilt its soft state.
* ``coordinator_unreachable``: this group's leader got no answer at all from the coordinator at
  ``address`` while waiting for a quorum (``seconds`` since the unanswered request went out,
  ``reason``); it keeps its state and waits (docs/ft-protocol.md, "When the coordinator is gone").
* ``coordinator_back``: the coordinator at ``address`` answers again after ``seconds`` without
  answering (from the first unanswered request).
* ``spare_promoted``: the coordinator's quorum for ``step`` (``quorum_id``) gave hot spares the
  places of participants of the previous quorum that train no more (``promoted``, ``replaced``:
  group ids; ``seconds``: from when the coordinator first knew one of those gone, a death or a
  leave, to this quorum, else from the previous quorum's issue; ``spares_left``). A ``commit``
  of a spare carries ``spare: true`` (it applied the step's average and trained nothing).
* ``group_lost``: the local launcher stops starting ``target`` (``reason``: it died after every
  other group had finished, or the coordinator retired its last three processes in a row).
* ``state_mismatch``: the digest of ``target``'s replicated state at committed step ``step``
  differs from the majority's (``majority``; "" when no majority holds one state): silent data
  corruption. ``replica_id``, ``host`` (its leader's), ``chain``, ``digest`` (its own),
  ``digests`` (group -> digest of every group that reported that state), ``times`` (how often
  that group was found corrupt) and ``quarantined`` (it is not let back on ``host``). The
  coordinator retired it; it recovers from a majority member when it comes back. With
  ``copied_from`` (and no ``digest``): ``target`` copied its state from that replica before it
  was found corrupt (rule I2), and was retired with it.
* ``state_agreed``: the digests of the replicated state at committed step ``step`` (``chain``)
  of two or more groups (``groups``; ``replica_ids``) agreed (``digest``): the corruption check
  passed. Kept in the coordinator's record: a restarted coordinator knows from which step a
  group found corrupt later may hold corrupt bits.
* ``suspect_states``: ``replica_id`` (of ``target``) was found corrupt at ``step``; the job's
  states of steps ``from_step`` to ``to_step`` may hold its bits (a checkpoint it wrote): only
  the members in ``vouched`` (and their copies) may claim them; ``copied``: replica id -> whom it
  copied from, for each member retired as a copy; ``suspect``: every range of suspect states the
  coordinator holds now (``ftlm.ft.quorum.integrity.suspect_snapshot``, kept in its record).
* ``suspect_vouched``: a quorum issued at ``step`` told members to copy (``sources``: replica id
  -> its source), and who is vouched for to claim suspect states changed (a copy of a vouched
  member is vouched for, a copy of another is not); ``suspect`` as in ``suspect_states``.
* ``integrity_rollback``: the groups at ``step`` hold different states and no majority holds
  one: every one was retired (and whoever copied their states since), and the job continues
  from its newest durable checkpoint at or before ``last_agreed`` (the reporters' last step of
  agreeing digests before ``step``; the states since are suspect, a ``suspect_states`` event
  with an empty ``replica_id``) (``digests``, ``reason``).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from ftlm.errors import DataError

KINDS: tuple[str, ...] = (
    "run_start", "run_end", "group_start", "group_exit", "quorum", "commit", "step_failed",
    "failure_injected", "member_dead", "member_left", "recovery_start", "recovery_end",
    "checkpoint_saved", "checkpoint_rejected", "checkpoint_failed", "checkpoint_reloaded", "coordinator_restart", "restore",
    "eval", "objective", "group_lost", "coordinator_unreachable", "coordinator_back", "state_mismatch", "state_agreed",
    "integrity_rollback", "suspect_states", "suspect_vouched", "network_healed", "spare_promoted",
)
"""Event kinds ftlm emits (documented above); ``emit`` accepts others for forward compatibility."""

NOT_FAILURES = {"none": "slowed", "SIGTERM": "preempted"}
"""``failure_injected`` signals that disturb a group without failing it, and their one word."""

REQUIRED_FIELDS: tuple[str, ...] = ("ts", "kind", "group", "step")
"""Fields every line must carry (docs/design.md, 'events.jsonl')."""

_RESERVED = frozenset(("ts", "kind", "group", "rank", "step"))


def jsonable(value: Any, where: str = "value") -> Any:
    """Return ``value`` as strict JSON data: non-finite floats become ``None`` (strict JSON has no
    NaN, and a diverged loss must not make the line unreadable for jq or dashboards), numpy/torch
    scalars become Python numbers, paths become strings, tuples become lists."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    item = getattr(value, "item", None)  # numpy / torch scalars, 0-d arrays and tensors
    if callable(item):
        try:
            return jsonable(item(), where)
        except (ValueError, RuntimeError):
            pass  # not a scalar; fall through to the error below
    raise TypeError(f"{where} of type {type(value).__name__} cannot be written as JSON; "
                    "pass numbers, strings, lists or dicts")


class Events(Protocol):
    """What components that record events need; ``EventLog`` and ``NullEvents`` provide it."""

    def emit(self, kind: str, step: int, **fields: Any) -> dict: ...

    def close(self) -> None: ...


def _record(kind: str, step: int, group: str, rank: int, fields: dict[str, Any]) -> dict:
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"event kind {kind!r} must be a non-empty string, e.g. 'commit'")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"event step {step!r} must be an int (use -1 when no step applies)")
    clash = _RESERVED & fields.keys()
    if clash:
        raise ValueError(f"event fields {sorted(clash)} are set by the log itself; rename them")
    record = {"ts": time.time(), "kind": kind, "group": group, "rank": rank, "step": step}
    record.update(jsonable(fields, kind))
    return record


class EventLog:
    """Appends events of one process (``group``, ``rank``) to ``path``; safe across threads and
    across processes that share the file. Close it when the process is done (or use ``with``)."""

    def __init__(self, path: Path, group: str = "", rank: int = 0) -> None:
        self.path = Path(path)
        self.group = str(group)
        self.rank = int(rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def emit(self, kind: str, step: int, **fields: Any) -> dict:
        """Write one event and return the record as written."""
        record = _record(kind, step, self.group, self.rank, fields)
        data = (json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd is None:
                raise ValueError(f"event log {self.path} is closed; emit before close()")
            # One write per line: with O_APPEND the kernel places it at the end of the file
            # atomically, so lines of concurrent processes never interleave. The loop only
            # matters on a short write (disk full), where there is nothing better to do.
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        return record

    def close(self) -> None:
        """Close the file; later ``emit`` calls raise. Closing twice is harmless."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullEvents:
    """An event log that records nothing, for components run without a run directory."""

    def __init__(self, group: str = "", rank: int = 0) -> None:
        self.group = str(group)
        self.rank = int(rank)

    def emit(self, kind: str, step: int, **fields: Any) -> dict:
        """Validate and build the record like ``EventLog.emit``, then drop it."""
        return _record(kind, step, self.group, self.rank, fields)

    def close(self) -> None:
        """Nothing to close."""

    def __enter__(self) -> NullEvents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: Path) -> list[dict]:
    """Read ``events.jsonl`` in file order.

    A last line without its newline that does not parse is dropped: that is a process killed
    mid-write. Anything else that is not a JSON object with ``ts``, ``kind``, ``group`` and
    ``step`` raises ``DataError`` naming the line.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"no event log at {path}; pass a run directory written by ftlm") from None
    lines = raw.split(b"\n")
    truncated_tail = not raw.endswith(b"\n")  # lines[-1] is b"" when the file ends cleanly
    events: list[dict] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if truncated_tail and number == len(lines):
                break
            raise DataError(f"{path}:{number}: not a JSON line ({exc}); the event log is "
                            "corrupt: remove or repair that line") from None
        if not isinstance(event, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got "
                            f"{type(event).__name__}; remove or repair that line")
        missing = [f for f in REQUIRED_FIELDS if f not in event]
        if missing:
            raise DataError(f"{path}:{number}: event lacks {missing}; every line needs "
                            f"{list(REQUIRED_FIELDS)}")
        events.append(event)
    return events
