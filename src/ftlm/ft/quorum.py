"""Membership and the per-step quorum decision, as pure functions of the coordinator's state.

Responsible for: which replica groups are alive (heartbeats with the clock passed in), replacing an
old incarnation of a group by a newer one, and deciding when to issue a quorum, who is in it, its
id, who participates and who recovers from whom (DESIGN.md section 6). Every "not yet" comes with a
human-readable reason.

Not responsible for: sockets, threads, timers or the wall clock (``ftlm.ft.coordinator`` feeds
these functions), nor for what members do with the answer (``ftlm.ft.manager``).

Time values (``now``, ``last_seen``, ``asked_at``, ``issued_at``) are seconds on one monotonic clock
chosen by the caller. A replica id is ``"<group>:<incarnation>"``; each group has at most one live
incarnation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ftlm.errors import FtlmError

# Bound on remembered replaced incarnations (enough for thousands of restarts; memory stays small).
_MAX_RETIRED = 4096


class StaleIncarnation(FtlmError):
    """A replica group incarnation was replaced by a newer one; the old process must exit."""


@dataclass
class MemberRequest:
    """One group's request to join the quorum of its next step."""

    replica_id: str
    group: str
    step: int
    last_quorum_id: int
    failed: bool
    meta: dict[str, Any]
    asked_at: float


@dataclass
class Heartbeat:
    """The latest sign of life of one replica."""

    replica_id: str
    group: str
    last_seen: float
    step: int
    quorum_id: int = -1  # the last quorum id the replica knows; raises the state's id after a restart


@dataclass
class QuorumOptions:
    """The knobs of the quorum decision (taken from ``CoordinatorConfig``)."""

    min_replicas: int
    join_timeout: float
    heartbeat_timeout: float
    expected_groups: int = 0  # groups the job is launched with; the first quorum waits for them


@dataclass
class Member:
    """One replica group in an issued quorum; ``meta`` is echoed from its request."""

    replica_id: str
    group: str
    step: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Quorum:
    """An issued quorum: who is in it, who trains, who recovers and from whom."""

    quorum_id: int
    step: int  # the highest step among members; participants are at this step
    members: list[Member]  # sorted by group
    participants: list[str]  # replica ids at ``step``, sorted by group
    recovering: list[str]  # replica ids behind ``step``, sorted by group
    sources: dict[str, str]  # recovering replica id -> participant replica id to pull state from
    issued_at: float
    reason: str = ""

    def participant_index(self, replica_id: str) -> int | None:
        """Position of ``replica_id`` among the participants (its data slice), None if it is not one."""
        try:
            return self.participants.index(replica_id)
        except ValueError:
            return None

    def member(self, replica_id: str) -> Member | None:
        return next((m for m in self.members if m.replica_id == replica_id), None)

    def replica_ids(self) -> list[str]:
        return [m.replica_id for m in self.members]

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (``json.dumps`` it to send)."""
        return {
            "quorum_id": self.quorum_id,
            "step": self.step,
            "members": [
                {"replica_id": m.replica_id, "group": m.group, "step": m.step, "meta": m.meta} for m in self.members
            ],
            "participants": list(self.participants),
            "recovering": list(self.recovering),
            "sources": dict(self.sources),
            "issued_at": self.issued_at,
            "reason": self.reason,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | str | bytes) -> Quorum:
        """Inverse of ``to_json``; also accepts the encoded text. Raises ValueError on a bad shape."""
        if isinstance(data, (str, bytes)):
            data = json.loads(data)
        try:
            return cls(
                quorum_id=int(data["quorum_id"]),
                step=int(data["step"]),
                members=[
                    Member(str(m["replica_id"]), str(m["group"]), int(m["step"]), dict(m.get("meta") or {}))
                    for m in data["members"]
                ],
                participants=[str(r) for r in data["participants"]],
                recovering=[str(r) for r in data["recovering"]],
                sources={str(k): str(v) for k, v in data["sources"].items()},
                issued_at=float(data["issued_at"]),
                reason=str(data.get("reason", "")),
            )
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a quorum: {e!r} in {str(data)[:200]}") from e


@dataclass
class CoordinatorState:
    """Everything the coordinator knows; soft state, rebuilt from traffic after a restart."""

    heartbeats: dict[str, Heartbeat] = field(default_factory=dict)
    pending: dict[str, MemberRequest] = field(default_factory=dict)
    prev_quorum: Quorum | None = None
    quorum_id: int = 0  # the highest quorum id issued or reported; the next change issues id + 1
    round_started: float | None = None  # when the oldest pending request arrived
    retired: dict[str, float] = field(default_factory=dict)  # replaced replica id -> when
    max_step: int = 0  # the highest step any member has reported: the job's progress


def _is_fresh(now: float, state: CoordinatorState, replica_id: str, options: QuorumOptions) -> bool:
    hb = state.heartbeats.get(replica_id)
    return hb is not None and now - hb.last_seen < options.heartbeat_timeout


def _retire_other_incarnations(state: CoordinatorState, replica_id: str, group: str, now: float) -> list[str]:
    if replica_id in state.retired:
        raise StaleIncarnation(
            f"replica {replica_id} was replaced by a newer incarnation of group {group}; this process must exit"
        )
    old = [r for r, hb in state.heartbeats.items() if hb.group == group and r != replica_id]
    old += [r for r, req in state.pending.items() if req.group == group and r != replica_id and r not in old]
    for r in old:
        state.heartbeats.pop(r, None)
        state.pending.pop(r, None)
        state.retired[r] = now
    while len(state.retired) > _MAX_RETIRED:
        state.retired.pop(next(iter(state.retired)))  # dicts keep insertion order: oldest first
    return old


def record_heartbeat(state: CoordinatorState, hb: Heartbeat) -> list[str]:
    """Record a heartbeat; returns the older incarnations of its group that it replaced.

    Raises StaleIncarnation if ``hb`` comes from an incarnation that was itself replaced.
    """
    replaced = _retire_other_incarnations(state, hb.replica_id, hb.group, hb.last_seen)
    state.heartbeats[hb.replica_id] = hb
    state.quorum_id = max(state.quorum_id, hb.quorum_id)
    state.max_step = max(state.max_step, hb.step)
    return replaced


def record_request(state: CoordinatorState, req: MemberRequest) -> list[str]:
    """Record a quorum request (which counts as a heartbeat); returns the incarnations it replaced.

    A repeated request of the same replica overwrites its earlier one. Raises StaleIncarnation if
    ``req`` comes from an incarnation that was replaced.
    """
    prior = state.heartbeats.get(req.replica_id)
    known_id = max(req.last_quorum_id, prior.quorum_id if prior else -1)
    replaced = record_heartbeat(state, Heartbeat(req.replica_id, req.group, req.asked_at, req.step, known_id))
    state.pending[req.replica_id] = req
    if state.round_started is None:
        state.round_started = req.asked_at
    return replaced


def expire(now: float, state: CoordinatorState, options: QuorumOptions) -> list[str]:
    """Remove replicas whose heartbeat is older than ``heartbeat_timeout``; returns their ids."""
    dead = [r for r in state.heartbeats if not _is_fresh(now, state, r, options)]
    for r in dead:
        del state.heartbeats[r]
        state.pending.pop(r, None)
    if dead:
        state.round_started = min((req.asked_at for req in state.pending.values()), default=None)
    return dead


def commit_quorum(state: CoordinatorState, quorum: Quorum) -> None:
    """Record ``quorum`` as issued: its members' requests are answered and a new round begins."""
    state.prev_quorum = quorum
    state.quorum_id = max(state.quorum_id, quorum.quorum_id)
    for r in quorum.replica_ids():
        state.pending.pop(r, None)
    state.round_started = min((req.asked_at for req in state.pending.values()), default=None)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def compute_quorum(now: float, state: CoordinatorState, options: QuorumOptions) -> tuple[Quorum | None, str]:
    """Decide whether to issue a quorum now (DESIGN.md section 6); never mutates ``state``.

    Returns ``(quorum, reason)``, or ``(None, reason)`` saying what is awaited. The caller records
    an issued quorum with ``commit_quorum``.
    """
    candidates = {r: req for r, req in state.pending.items() if _is_fresh(now, state, r, options)}
    if not candidates:
        return None, "no member has asked for a quorum"
    alive_groups = sorted({hb.group for r, hb in state.heartbeats.items() if _is_fresh(now, state, r, options)})
    asked_groups = sorted({req.group for req in candidates.values()})
    if len(candidates) < options.min_replicas:
        n = _plural(len(candidates), "healthy group")
        return None, f"only {n} asked, need min_replicas={options.min_replicas}"

    # Progress must not silently go back: if every holder of the newest state died, the groups
    # left cannot heal from anyone. One step behind is the normal case of a group that committed
    # while the others failed that step; more is lost work that only a durable checkpoint restores.
    newest = max(req.step for req in candidates.values())
    if state.max_step - newest > 1:
        return None, (f"the newest state (step {state.max_step}) is held by no live group; the "
                      f"groups asking are at step {newest}: restore them from a durable checkpoint")

    prev = state.prev_quorum
    prev_alive = [m.replica_id for m in prev.members if _is_fresh(now, state, m.replica_id, options)] if prev else []
    if prev is not None and prev_alive and all(r in candidates for r in prev_alive):
        joiners = len(candidates) - len(prev_alive)
        extra = f" (+{_plural(joiners, 'joiner')})" if joiners else ""
        reason = f"fast path: all {_plural(len(prev_alive), 'healthy member')} of quorum {prev.quorum_id} asked{extra}"
        return _build(now, state, candidates, reason), reason

    started = state.round_started
    if started is None:
        started = min(req.asked_at for req in candidates.values())
    left = options.join_timeout - (now - started)
    if prev is None and len(asked_groups) < options.expected_groups and left > 0:
        # The job's first quorum: groups start at slightly different times; give the others a
        # moment so that they all train from step 0 instead of joining as recovering members.
        return None, (f"first quorum: {len(asked_groups)} of {options.expected_groups} expected "
                      f"groups asked; join timeout in {left:.1f} s")
    if len(asked_groups) == len(alive_groups):
        reason = f"all {_plural(len(alive_groups), 'heartbeating group')} asked"
        return _build(now, state, candidates, reason), reason
    if 2 * len(asked_groups) <= len(alive_groups):
        return None, f"{len(asked_groups)} of {len(alive_groups)} heartbeating groups asked: not a majority"
    missing = ", ".join(g for g in alive_groups if g not in asked_groups)
    if left > 0:
        return None, (
            f"waiting for {missing} (asked {len(asked_groups)} of {len(alive_groups)}); join timeout in {left:.1f} s"
        )
    reason = f"join timeout passed: {len(asked_groups)} of {len(alive_groups)} heartbeating groups asked, not {missing}"
    return _build(now, state, candidates, reason), reason


def _build(now: float, state: CoordinatorState, candidates: dict[str, MemberRequest], reason: str) -> Quorum:
    reqs = sorted(candidates.values(), key=lambda q: (q.group, q.replica_id))
    members = [Member(q.replica_id, q.group, q.step, q.meta) for q in reqs]
    top = max(m.step for m in members)
    participants = [m.replica_id for m in members if m.step == top]
    recovering = [m.replica_id for m in members if m.step != top]
    sources = {r: participants[i % len(participants)] for i, r in enumerate(recovering)}

    base = max([state.quorum_id] + [q.last_quorum_id for q in reqs])
    prev = state.prev_quorum
    changed = prev is None or set(prev.replica_ids()) != set(candidates)
    failed = any(q.failed for q in reqs)
    quorum_id = base + 1 if changed or failed else base
    return Quorum(quorum_id, top, members, participants, recovering, sources, now, reason)


def withdraw_request(state: CoordinatorState, req: MemberRequest) -> bool:
    """Drop ``req`` if it is still its replica's pending request (the asker stopped waiting).

    Returns whether it was dropped. Keeps a quorum from being issued to a member nobody answers.
    """
    if state.pending.get(req.replica_id) is not req:
        return False
    del state.pending[req.replica_id]
    state.round_started = min((r.asked_at for r in state.pending.values()), default=None)
    return True
