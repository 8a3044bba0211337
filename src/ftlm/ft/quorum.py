"""Membership, the authoritative committed state, and the per-step quorum decision: pure functions.

Responsible for: which replica groups are alive (heartbeats, progress, explicit leaves and reported
deaths, with the clock passed in), replacing an old incarnation of a group by a newer one, which
committed state is authoritative (the *head*: a step and the hash chain of its history, see
``ftlm.ft.history``), explicit rollbacks when no live group holds the head, and deciding when to
issue a quorum, who is in it, its id, who participates and who recovers from whom (docs/design.md,
'Quorum rules'; docs/ft-protocol.md, 'The rules'). Every "not yet" comes with a human-readable
reason.

Not responsible for: sockets, threads, timers or the wall clock (``ftlm.ft.membership`` wraps these
functions into the coordinator's state machine, ``ftlm.ft.coordinator`` serves it), nor for what
members do with the answer (``ftlm.ft.group``).

The rules that keep replicas identical:

* the head only moves forward by one step, to a chain that extends the head through a quorum issued
  at the head's step; any other claim (a step far ahead, a fork) is *stale*: that member recovers;
* participants of a quorum are exactly the candidates holding the head; everyone else recovers from
  one of them; a quorum is never issued while live groups hold the head but none of them asked;
* when no live group has held the head for ``rollback_grace`` seconds, the job rolls back,
  explicitly (a ``Restore`` the caller logs), to the newest state a live group holds; before that,
  members behind the head are told to load a newer durable checkpoint if they have one
  (``reload_due``), and the rollback waits while they do;
* after a coordinator restart nothing is decided until the members have reported for one
  ``rebuild_grace`` (or every expected group reported).

Time values are seconds on one monotonic clock chosen by the caller. A replica id is
``"<group>:<incarnation>"``; each group has at most one live incarnation.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import heapq
import itertools
import json
import math
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ftlm.errors import FaultError, RetiredError
from ftlm.ft.history import GENESIS, extend_chain

# Bound on remembered replaced incarnations (enough for thousands of restarts; memory stays small).
_MAX_RETIRED = 4096
MAX_CLAIM = 2**53
"""Largest step or quorum id a member may claim (beyond it JSON numbers lose precision)."""
MAX_WATCH = 256
"""Most replica ids one quorum request may ask about (``watch``: the joiners a source serves)."""


class StaleIncarnation(FaultError):
    """A replica group incarnation was replaced or retired; the old process must exit."""


class Convicted(StaleIncarnation, RetiredError):
    """The incarnation was retired for failing the steps it took part in (``convict``); the
    coordinator's 409 answer says so in a field (``"convicted": true``), and the process exits
    with ``ftlm.errors.EXIT_RETIRED``."""


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
    chain: str = GENESIS
    """Hash chain of the group's committed history at ``step``."""
    watch: tuple[str, ...] = ()
    """Replica ids whose membership the group wants to know (the joiners it serves)."""
    disk_checked: int = -1
    """The head step for which the group looked for a newer durable checkpoint (``reload_due``)."""
    disk_round: int = 0
    """Which telling of ``disk_checked`` it looked after (``reload_round``: 0 the first, one more
    each time the coordinator voided its look, see ``_void_stale_looks``)."""


@dataclass
class Heartbeat:
    """The latest sign of life of one replica, with its committed state."""

    replica_id: str
    group: str
    last_seen: float
    step: int
    quorum_id: int = -1  # the last quorum id the replica knows; raises the state's id after a restart
    chain: str = GENESIS
    progress_at: float | None = None
    """When the group last reached a protocol point (None: as ``last_seen``)."""
    known_head: int = 0
    """The highest step the group saw the job reach (its own or a quorum's): lets a restarted
    coordinator notice progress that died with its holders while it was down."""


@dataclass
class QuorumOptions:
    """The knobs of the quorum decision (taken from ``CoordinatorConfig``)."""

    min_replicas: int
    join_timeout: float
    heartbeat_timeout: float
    expected_groups: int = 0  # groups the job is launched with; the first quorum waits for them
    progress_timeout: float = 0.0  # 0: a live heartbeat is enough (no hang detection by progress)
    rebuild_grace: float | None = None  # None: one heartbeat timeout
    rollback_grace: float | None = None  # None: two heartbeat timeouts
    suspect_window: float = 0.0
    """Seconds after a member of the current quorum reports its step failed within which every
    other member must be heard from (a heartbeat or a request), or be declared dead; 0: off (only
    ``heartbeat_timeout`` expires a member). A report alone never expires a member that speaks."""
    probe_after: int = 0
    """Failed attempts of one step by three or more members after which each next attempt leaves
    half the suspects out, to find the one that makes the step fail (``Probe``); 0: never."""

    @property
    def rebuild_seconds(self) -> float:
        return self.heartbeat_timeout if self.rebuild_grace is None else self.rebuild_grace

    @property
    def rollback_seconds(self) -> float:
        return 2 * self.heartbeat_timeout if self.rollback_grace is None else self.rollback_grace

    @property
    def reload_seconds(self) -> float:
        """How long a rollback waits for a member told to load a newer durable checkpoint."""
        return max(self.progress_timeout, self.rollback_seconds)


@dataclass
class Member:
    """One replica group in an issued quorum; ``meta`` is echoed from its request."""

    replica_id: str
    group: str
    step: int
    meta: dict[str, Any] = field(default_factory=dict)
    watch: tuple[str, ...] = ()
    """Replica ids the member asked about (the joiners it serves): its answer says which are members."""


@dataclass
class Quorum:
    """An issued quorum: who is in it, who trains, who recovers and from whom."""

    quorum_id: int
    step: int  # the head's step; participants hold it
    members: list[Member]  # sorted by group
    participants: list[str]  # replica ids holding the head, sorted by group
    recovering: list[str]  # every other member, sorted by group
    sources: dict[str, str]  # recovering replica id -> participant replica id to pull state from
    issued_at: float
    reason: str = ""
    chain: str = GENESIS  # the head's chain: what participants hold and recovering members reach
    epoch: str = ""  # the issuing coordinator's start nonce: (epoch, id) names a process group
    left_out: tuple[str, ...] = ()
    """The members whose requests this attempt left waiting (a ``Probe``); the coordinator's own
    bookkeeping, not sent to members."""
    derived_ranks: dict[str, int] | None = field(default=None, init=False, repr=False, compare=False)
    derived_slices: dict[str, int] | None = field(default=None, init=False, repr=False, compare=False)
    derived_recovering: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)
    derived_joiners: dict[str, list[str]] | None = field(default=None, init=False, repr=False, compare=False)
    derived_digest: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # (The compiled dataclass leaves fields that ``__init__`` does not take unset.)
        self.derived_ranks = self.derived_slices = self.derived_joiners = None
        self.derived_recovering = None
        self.derived_digest = None

    def participant_index(self, replica_id: str) -> int | None:
        """Position of ``replica_id`` among the participants (its data slice), None if it is not one."""
        return self._slices.get(replica_id)

    def member(self, replica_id: str) -> Member | None:
        rank = self._ranks.get(replica_id)
        return self.members[rank] if rank is not None else None

    def replica_ids(self) -> list[str]:
        return [m.replica_id for m in self.members]

    # -- what a member asks of its quorum; ``ftlm.ft.quorum_answer.MemberQuorum`` answers the same
    # questions from one member's compact answer, so ``GroupProtocol`` takes either.
    @property
    def size(self) -> int:
        """Members (the cross-group process group's world size)."""
        return len(self.members)

    @property
    def participant_count(self) -> int:
        return len(self.participants)

    @property
    def recovering_count(self) -> int:
        return len(self.recovering)

    @property
    def group_count(self) -> int:
        return len({m.group for m in self.members})

    @property
    def store(self) -> str:
        """The rendezvous store of the quorum's process group: the first member's."""
        return str(self.members[0].meta.get("store", "")) if self.members else ""

    def rank(self, replica_id: str) -> int:
        """``replica_id``'s rank in the quorum's process group (its position among the members)."""
        try:
            return self._ranks[replica_id]
        except KeyError:
            raise ValueError(f"{replica_id} is not a member of quorum {self.quorum_id}") from None

    def present(self, replica_id: str) -> bool:
        """Whether ``replica_id`` is a member."""
        return replica_id in self._ranks

    def is_recovering(self, replica_id: str) -> bool:
        return replica_id in self.sources or replica_id in self._recovering

    def source_of(self, replica_id: str) -> str | None:
        """The participant ``replica_id`` pulls the state from (None unless it recovers)."""
        return self.sources.get(replica_id)

    def joiners_of(self, replica_id: str) -> list[Member]:
        """The recovering members that pull the state from ``replica_id``, in member order."""
        return [self.members[self._ranks[j]] for j in self._joiners.get(replica_id, ()) if j in self._ranks]

    @property
    def digest(self) -> str:
        """A digest of who the members are: two quorums with the same members have the same one."""
        return self._digest

    # Derived once, on first use (plain fields, not ``functools.cached_property``: the compiled
    # class has no ``__dict__``, ``ftlm.native``).
    @property
    def _ranks(self) -> dict[str, int]:
        if self.derived_ranks is None:
            self.derived_ranks = {m.replica_id: i for i, m in enumerate(self.members)}
        return self.derived_ranks

    @property
    def _slices(self) -> dict[str, int]:
        if self.derived_slices is None:
            self.derived_slices = {r: i for i, r in enumerate(self.participants)}
        return self.derived_slices

    @property
    def _recovering(self) -> frozenset[str]:
        if self.derived_recovering is None:
            self.derived_recovering = frozenset(self.recovering)
        return self.derived_recovering

    @property
    def _joiners(self) -> dict[str, list[str]]:
        if self.derived_joiners is None:
            out: dict[str, list[str]] = {}
            for joiner, source in self.sources.items():
                out.setdefault(source, []).append(joiner)
            self.derived_joiners = out
        return self.derived_joiners

    @property
    def _digest(self) -> str:
        if self.derived_digest is None:
            self.derived_digest = membership_digest(self.replica_ids())
        return self.derived_digest

    def next_chain(self) -> str:
        """The chain of a participant that commits this quorum's step."""
        return extend_chain(self.chain, self.step, self.quorum_id, self.participants)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (``json.dumps`` it to send)."""
        return {
            "quorum_id": self.quorum_id,
            "step": self.step,
            "chain": self.chain,
            "members": [
                {"replica_id": m.replica_id, "group": m.group, "step": m.step, "meta": m.meta} for m in self.members
            ],
            "participants": list(self.participants),
            "recovering": list(self.recovering),
            "sources": dict(self.sources),
            "issued_at": self.issued_at,
            "reason": self.reason,
            "epoch": self.epoch,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | str | bytes) -> Quorum:
        """Inverse of ``to_json``; also accepts the encoded text. Raises ValueError on a bad shape."""
        d: Any = json.loads(data) if isinstance(data, (str, bytes)) else data
        try:
            return cls(
                quorum_id=int(d["quorum_id"]),
                step=int(d["step"]),
                members=[
                    Member(str(m["replica_id"]), str(m["group"]), int(m["step"]), dict(m.get("meta") or {}))
                    for m in d["members"]
                ],
                participants=[str(r) for r in d["participants"]],
                recovering=[str(r) for r in d["recovering"]],
                sources={str(k): str(v) for k, v in d["sources"].items()},
                issued_at=float(d["issued_at"]),
                reason=str(d.get("reason", "")),
                chain=str(d.get("chain", GENESIS)),
                epoch=str(d.get("epoch", "")),
            )
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a quorum: {e!r} in {str(d)[:200]}") from e


def membership_digest(replica_ids: Iterable[str]) -> str:
    """A short digest of a set of replica ids (order does not matter)."""
    return hashlib.sha256(",".join(sorted(replica_ids)).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Restore:
    """An explicit rollback: no live group held the head, so the job continues from ``to_step``."""

    from_step: int
    to_step: int
    chain: str
    holders: tuple[str, ...]
    reason: str


class _Index:
    """What the decisions need about the members, kept up to date on every change of the tables.

    Per-message work must not grow with the number of groups: claims and groups are
    counted, expiry deadlines and the oldest request sit in heaps (entries that no longer match
    the table are dropped when they reach the top), and the previous quorum's members that are
    alive, and alive without a request, are counted. The decisions use these only when they are
    exact (``_steady``); otherwise they take the plain scan over the tables.

    The two deadline heaps (``seen``: last heartbeat, ``progress``: last protocol progress) hold
    one entry per replica, a lower bound of its time (``seen_low``/``progress_low`` name it): a
    message that moves the time forward changes nothing in the heap, only an entry that reaches
    the top looking overdue is refreshed from the table (a heap push per replica per timeout, not
    two per message). A message that moves a time back (a reported progress age) pushes a lower
    entry; the one it replaces is dropped when it reaches the top.
    """

    ATTRIBUTES: ClassVar[tuple[str, ...]] = (
        "heartbeats", "pending", "hb_claims", "hb_holders", "hb_version", "pending_claims", "hb_groups",
        "pending_groups", "idle", "orphans", "seen", "seen_low", "progress", "progress_low",
        "asked", "seq", "prev", "prev_ids", "prev_alive", "prev_idle", "chains_head",
        "unsettled_key", "in_flight", "unsettled", "head_info")
    """Every attribute ``__init__`` sets, for ``__deepcopy__`` (the compiled class has no ``__dict__``;
    a test checks the list against the interpreted class)."""

    def __init__(self) -> None:
        self.heartbeats: _Table = _Table(self, True)
        self.pending: _Table = _Table(self, False)
        self.hb_claims: Counter[tuple[int, str]] = Counter()
        self.hb_holders: dict[tuple[int, str], dict[str, None]] = {}  # claim -> heartbeating replica ids
        self.hb_version = 0  # moves whenever a replica starts or stops heartbeating
        self.pending_claims: Counter[tuple[int, str]] = Counter()
        self.hb_groups: dict[str, dict[str, None]] = {}  # group -> its replica ids, oldest first
        self.pending_groups: dict[str, dict[str, None]] = {}
        self.idle: dict[str, None] = {}  # heartbeating replicas without a pending request
        self.orphans: set[str] = set()  # pending replicas without a heartbeat (only by direct writes)
        self.seen: list[tuple[float, int, str]] = []  # (at most its last_seen, seq, rid)
        self.seen_low: dict[str, float] = {}  # rid -> the time of its entry in ``seen``
        self.progress: list[tuple[float, int, str]] = []  # (at most its progress time, seq, rid)
        self.progress_low: dict[str, float] = {}  # rid -> the time of its entry in ``progress``
        self.asked: list[tuple[float, int, str, Any]] = []  # (asked_at, seq, rid, request)
        self.seq = itertools.count()
        self.prev: Quorum | None = None  # the quorum the prev_* counts are about
        self.prev_ids: frozenset[str] = frozenset()
        self.prev_alive = 0  # members of ``prev`` that heartbeat
        self.prev_idle = 0  # ... and have no pending request
        self.chains_head: tuple[int, str] | None = None
        # Live members of quorums issued at the head's step that hold the head and have not asked
        # again (they may have committed it), for the head and quorums named by ``unsettled_key``.
        self.unsettled_key: tuple[Any, ...] | None = None
        self.in_flight: frozenset[str] = frozenset()
        self.unsettled: dict[str, None] = {}
        self.head_info: dict[tuple[int, int], tuple[str, frozenset[str]]] = {}  # (qid, n) -> (next chain, ids)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Index:
        new = _Index.__new__(_Index)
        memo[id(self)] = new
        for name in _Index.ATTRIBUTES:
            value = getattr(self, name)
            if name == "seq":
                new.seq = itertools.count(next(self.seq))
            elif name in ("heartbeats", "pending"):
                table = _Table(new, value.is_heartbeats)
                for k, v in value.items():
                    dict.__setitem__(table, k, copy.deepcopy(v, memo))
                setattr(new, name, table)
            else:
                setattr(new, name, copy.deepcopy(value, memo))
        return new

    # -- table changes ---------------------------------------------------------------------------
    def _set_idle(self, rid: str, idle: bool) -> None:
        was = rid in self.idle
        if was == idle:
            return
        if idle:
            self.idle[rid] = None
        else:
            del self.idle[rid]
        if rid in self.prev_ids:
            self.prev_idle += 1 if idle else -1

    def added(self, table: _Table, rid: str, old: Any, new: Any) -> None:
        is_heartbeats = table.is_heartbeats
        claims, groups = (self.hb_claims, self.hb_groups) if is_heartbeats else (
            self.pending_claims, self.pending_groups)
        if old is not None and old.step == new.step and old.chain == new.chain and old.group == new.group:
            # The same claim of the same group (most messages): the counts stand; the replica moves
            # to the end of its group and of its claim's holders, as when it is counted anew.
            members = groups[new.group]
            del members[rid]
            members[rid] = None
            if is_heartbeats:
                holders = self.hb_holders[(new.step, new.chain)]
                del holders[rid]
                holders[rid] = None
        else:
            if old is not None:
                self._uncount(claims, groups, rid, old)
            claims[(new.step, new.chain)] += 1
            groups.setdefault(new.group, {})[rid] = None
            if is_heartbeats:
                if old is not None:
                    self._unhold(rid, old)
                self.hb_holders.setdefault((new.step, new.chain), {})[rid] = None
        if is_heartbeats:
            if old is None:
                self.hb_version += 1
            _lower(self.seen, self.seen_low, rid, new.last_seen, self.seq)
            _lower(self.progress, self.progress_low, rid, _progress_at(new), self.seq)
            if old is None:
                self.orphans.discard(rid)
                self._set_idle(rid, rid not in self.pending)
                if rid in self.prev_ids:
                    self.prev_alive += 1
        else:
            heapq.heappush(self.asked, (new.asked_at, next(self.seq), rid, new))
            if old is None:
                if rid not in self.heartbeats:
                    self.orphans.add(rid)
                self._set_idle(rid, False)
        self._recheck(rid)

    def _recheck(self, rid: str) -> None:
        if self.unsettled_key is None or rid not in self.in_flight:
            return
        hb = self.heartbeats.get(rid)
        if hb is not None and rid in self.idle and (hb.step, hb.chain) == self.unsettled_key[0]:
            self.unsettled[rid] = None
        else:
            self.unsettled.pop(rid, None)

    def removed(self, table: _Table, rid: str, old: Any) -> None:
        if table.is_heartbeats:
            self._uncount(self.hb_claims, self.hb_groups, rid, old)
            self._unhold(rid, old)
            self.hb_version += 1
            self._set_idle(rid, False)
            self.seen_low.pop(rid, None)  # its heap entries are dropped when they reach the top
            self.progress_low.pop(rid, None)
            if rid in self.prev_ids:
                self.prev_alive -= 1
            if rid in self.pending:
                self.orphans.add(rid)
        else:
            self._uncount(self.pending_claims, self.pending_groups, rid, old)
            if self.orphans:
                self.orphans.discard(rid)
            hb = self.heartbeats.get(rid)
            if hb is not None:
                self._set_idle(rid, True)
                # Its progress deadline counts again now that it no longer waits for a quorum.
                _lower(self.progress, self.progress_low, rid, _progress_at(hb), self.seq)
        if self.unsettled_key is not None:
            self._recheck(rid)

    def all_requests_answered(self, rids: list[str]) -> None:
        """``removed`` of every pending request at once, in the order of ``rids`` (the table is
        empty already): the same state as one ``removed`` after another (a test compares)."""
        self.pending_claims.clear()
        self.pending_groups.clear()
        self.asked.clear()
        if self.orphans:
            self.orphans.difference_update(rids)
        heartbeats, idle, prev_ids = self.heartbeats, self.idle, self.prev_ids
        progress, progress_low, seq = self.progress, self.progress_low, self.seq
        for rid in rids:
            hb = heartbeats.get(rid)
            if hb is None:
                continue
            if rid not in idle:
                idle[rid] = None
                if rid in prev_ids:
                    self.prev_idle += 1
            _lower(progress, progress_low, rid, _progress_at(hb), seq)
        if self.unsettled_key is not None:
            for rid in rids:
                self._recheck(rid)

    def _unhold(self, rid: str, old: Any) -> None:
        holders = self.hb_holders.get((old.step, old.chain))
        if holders is not None:
            holders.pop(rid, None)
            if not holders:
                del self.hb_holders[(old.step, old.chain)]

    @staticmethod
    def _uncount(claims: Counter[tuple[int, str]], groups: dict[str, dict[str, None]], rid: str,
                 old: Any) -> None:
        key = (old.step, old.chain)
        claims[key] -= 1
        if claims[key] <= 0:
            del claims[key]
        members = groups.get(old.group)
        if members is not None:
            members.pop(rid, None)
            if not members:
                del groups[old.group]

    # -- queries ---------------------------------------------------------------------------------
    def track_prev(self, prev: Quorum | None) -> None:
        """Count the members of ``prev`` (the state's previous quorum) that are alive and idle."""
        if prev is self.prev:
            return
        self.prev = prev
        self.prev_ids = frozenset(prev.replica_ids()) if prev is not None else frozenset()
        self.prev_alive = sum(1 for r in self.prev_ids if r in self.heartbeats)
        self.prev_idle = sum(1 for r in self.prev_ids if r in self.idle)

    def track_unsettled(self, state: CoordinatorState) -> dict[str, None]:
        """The live, idle holders of the head among the participants of quorums issued at the
        head's step (recounted only when the head or those quorums change)."""
        key = (state.head, tuple(qid for qid, _ in state.head_quorums))
        if key != self.unsettled_key:
            self.unsettled_key = key
            self.in_flight = frozenset().union(*[ids for _, ids in self.head_quorum_info(state)])
            self.unsettled = {}
            for rid in self.in_flight:
                self._recheck(rid)
        return self.unsettled

    def oldest_fresh_violation(self, now: float, timeout: float) -> bool:
        """Whether some heartbeat is ``timeout`` old or older (not fresh) at ``now``."""
        heap, low = self.seen, self.seen_low
        while heap:
            at, _, rid = heap[0]
            if now - at < timeout:
                return False  # the oldest bound is fresh: so is everyone
            if low.get(rid) != at:
                heapq.heappop(heap)  # gone, or a lower entry replaced it
                continue
            last_seen = self.heartbeats[rid].last_seen
            if last_seen <= at:
                return True
            low[rid] = last_seen  # heard from since: refresh the bound
            heapq.heapreplace(heap, (last_seen, next(self.seq), rid))
        return False

    def progress_overdue(self, now: float, timeout: float) -> bool:
        """Whether some replica not waiting for a quorum made no progress for over ``timeout``."""
        heap, low = self.progress, self.progress_low
        if timeout <= 0:
            heap.clear()
            low.clear()
            return False
        while heap:
            at, _, rid = heap[0]
            if now - at <= timeout:
                return False  # the oldest bound is recent enough: so is everyone's progress
            if low.get(rid) != at or rid in self.pending:
                heapq.heappop(heap)  # gone, replaced, or waiting (its entry comes back when it stops)
                if low.get(rid) == at:
                    del low[rid]
                continue
            progress_at = _progress_at(self.heartbeats[rid])
            if progress_at <= at:
                return True
            low[rid] = progress_at  # progress since: refresh the bound
            heapq.heapreplace(heap, (progress_at, next(self.seq), rid))
        return False

    def oldest_request(self) -> float | None:
        heap = self.asked
        while heap:
            asked_at, _, rid, req = heap[0]
            if self.pending.get(rid) is not req:
                heapq.heappop(heap)
                continue
            return asked_at
        return None

    def head_quorum_info(self, state: CoordinatorState) -> list[tuple[str, frozenset[str]]]:
        """(chain a commit reaches, participant ids) of each quorum issued at the head's step."""
        if self.chains_head != state.head:
            self.chains_head = state.head
            self.head_info = {}
        out = []
        assert state.head is not None
        step, chain = state.head
        for qid, parts in state.head_quorums:
            key = (qid, len(parts))
            info = self.head_info.get(key)
            if info is None:
                info = self.head_info[key] = (extend_chain(chain, step, qid, parts), frozenset(parts))
            out.append(info)
        return out


def _lower(heap: list[tuple[float, int, str]], low: dict[str, float], rid: str, at: float,
           seq: Iterator[int]) -> None:
    """Keep a lower bound of ``rid``'s time ``at`` in ``heap`` (one push unless it has one)."""
    bound = low.get(rid)
    if bound is None or at < bound:
        low[rid] = at
        heapq.heappush(heap, (at, next(seq), rid))


def _progress_at(hb: Heartbeat) -> float:
    return hb.progress_at if hb.progress_at is not None else hb.last_seen


class _Table(dict):  # type: ignore[type-arg]
    """``replica id -> Heartbeat`` or ``-> MemberRequest`` that tells its index about every change."""

    def __init__(self, index: _Index, is_heartbeats: bool) -> None:
        super().__init__()
        self.index = index
        self.is_heartbeats = is_heartbeats

    def __reduce__(self) -> Any:
        return dict, (dict(self),)  # a shallow copy or a pickle is a plain dict

    def __deepcopy__(self, memo: dict[int, Any]) -> _Table:
        index = copy.deepcopy(self.index, memo)  # copies both tables, consistent with the copy
        return index.heartbeats if self.is_heartbeats else index.pending

    def __setitem__(self, rid: str, value: Any) -> None:
        old = dict.get(self, rid)
        dict.__setitem__(self, rid, value)
        self.index.added(self, rid, old, value)

    def __delitem__(self, rid: str) -> None:
        old = dict.__getitem__(self, rid)
        dict.__delitem__(self, rid)
        self.index.removed(self, rid, old)

    _MISSING: ClassVar[object] = object()

    def pop(self, rid: str, default: Any = _MISSING) -> Any:
        old = dict.pop(self, rid, _Table._MISSING)
        if old is _Table._MISSING:
            if default is _Table._MISSING:
                raise KeyError(rid)
            return default
        self.index.removed(self, rid, old)
        return old

    def discard_all(self, rids: list[str]) -> None:
        """``pop(rid, None)`` for each of ``rids`` (a quorum's members leave the pending requests);
        when they are all the requests (a steady step), at once."""
        if not self.is_heartbeats and len(rids) == len(self) and dict.keys(self) == set(rids):
            dict.clear(self)
            self.index.all_requests_answered(rids)
            return
        removed, missing = self.index.removed, _Table._MISSING
        for rid in rids:
            old = dict.pop(self, rid, missing)
            if old is not missing:
                removed(self, rid, old)

    def popitem(self) -> tuple[str, Any]:
        rid = next(reversed(self))
        return rid, self.pop(rid)

    def clear(self) -> None:
        for rid in list(self):
            del self[rid]

    def setdefault(self, rid: str, default: Any = None) -> Any:
        if rid not in self:
            self[rid] = default
        return self[rid]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for rid, value in dict(*args, **kwargs).items():
            self[rid] = value

    def __ior__(self, other: Any) -> _Table:  # type: ignore[misc]  # noqa: PYI034
        self.update(other)
        return self


@dataclass
class Suspicion:
    """Members of quorum ``quorum_id`` reported that its step failed (a peer's transport error, a
    timeout), the first at ``opened_at``. Once ``suspect_window`` has passed, the members of that
    quorum not heard from since ``opened_at`` are declared dead: the reports are corroborated by
    the silence of whom they suspect, so a report never expires a member that still speaks."""

    quorum_id: int
    opened_at: float
    reporters: set[str] = field(default_factory=set)


@dataclass
class Probe:
    """Failed attempts of the head's step, and the search for the member that makes them fail.

    A gray failure that ends no process (a bad link, a faulty device) fails every attempt its
    group takes part in with a peer, and every group would give up together
    (``ft.max_consecutive_failures``). If one member does that, it is among the members of every
    failed attempt since it joined: ``suspects`` (an earlier attempt may have failed for another
    reason). After ``QuorumOptions.probe_after`` failed attempts, each next attempt leaves half
    the suspects out, their requests waiting (``_leave_out``); an attempt that fails without them
    clears them of these attempts, one that commits narrows the search to them (the next step's
    attempts, one step behind, they recover), and once one suspect is left, the attempt without it
    that commits accuses it, and a failed attempt of the next step with it convicts it
    (``convict``): it is retired, its process exits and is restarted. More than one member may
    fail the attempts (two bad links at once): a member cleared so is *set aside*, not trusted,
    so every attempt of the search takes only ``clean`` members (of an attempt of the search that
    committed) and suspects, and leaves out everyone else until the search ends (then they take
    part again, and the next search finds the next one). An attempt whose members
    are not all in the next one, each saying it failed, clears no suspect (the one missing or
    silent about it, dead, hung, slow or never told, may be what failed it; the suspects not left
    out yet go first then); with no suspect left, the search goes over everyone once more (a lost
    message may have failed the attempt that would have committed), then the evidence starts over
    (more than one cause), ``MAX_PROBE_ROUNDS``. The group convicted last is left out first and
    alone (a node whose link stays bad is found at once), the others convicted before first into
    the half left out."""

    step: int
    suspects: frozenset[str]  # members of every failed attempt counted here since they joined
    seen: frozenset[str]  # members of any of them
    since: float  # when the first of them was issued
    failed: int = 1  # failed attempts counted here
    rounds: int = 0  # times every suspect was cleared and the search began again over everyone
    tried: frozenset[str] = frozenset()  # left out in this search (first the others)
    accused: str = ""  # an attempt without it committed; ``step`` is the next one, which judges it
    cleared_at: int = -1  # (accused) the step that committed without it
    narrowed: bool = False  # an attempt without the suspects committed; ``step`` is the next one
    waited: int = 0  # (accused) attempts of ``step`` that ended without a verdict
    clean: frozenset[str] = frozenset()  # members of an attempt of this search that committed
    probed: int = 0  # attempts of this round that left someone out and failed (``probe_limit``)
    strict: bool = False  # more than one member may fail the attempts: set the cleared aside
    hits: dict[str, int] = field(default_factory=dict)  # member -> failed attempts it was in here


VERDICT_ATTEMPTS = 3
"""Attempts of an accused member's step that may end without a verdict (a member slow to ask, one
never told) before the accusation is dropped and the search begins again."""

FAILS_ITS_STEPS = "fails the steps it takes part in"
"""Ends the reason a member is retired for by ``convict``: for people reading the logs (the
process is told by the answer's ``convicted`` field, ``Convicted``, and launchers by its exit
status, ``ftlm.errors.EXIT_RETIRED``)."""

MAX_PROBE_ROUNDS = 2
"""Searches over every member (each cleared when an attempt without it failed too: a lost message
may fail the attempt that would have committed) before the evidence starts over, with
``probe_after`` attempts of every member (which count toward each group's own
``max_consecutive_failures``, so that more than one cause ends in the groups giving up)."""


@dataclass
class CoordinatorState:
    """Everything the coordinator knows; soft state, rebuilt from traffic after a restart."""

    heartbeats: dict[str, Heartbeat] = field(default_factory=dict)
    pending: dict[str, MemberRequest] = field(default_factory=dict)
    prev_quorum: Quorum | None = None
    quorum_id: int = 0  # the highest quorum id issued or reported; the next change issues id + 1
    round_started: float | None = None  # when the oldest pending request arrived
    retired: dict[str, float] = field(default_factory=dict)  # replaced or hung replica id -> when
    retired_why: dict[str, str] = field(default_factory=dict)  # convicted (``convict``) -> why
    head: tuple[int, str] | None = None  # (step, chain) of the authoritative committed state
    head_quorums: list[tuple[int, list[str]]] = field(default_factory=list)  # issued at the head step
    head_seen_at: float | None = None  # when a live member last held the head
    started_at: float | None = None  # when this coordinator first heard from anyone
    known_head: int = 0  # the highest step members say the job reached (bounded by MAX_CLAIM)
    finished: bool = False  # holders of the head left the job as finished: never roll back from it
    top: int = 0  # the furthest step the head ever reached here (a rollback target cannot be beyond)
    epoch: str = ""  # this coordinator's start nonce, stamped on every quorum it issues
    suspicion: Suspicion | None = None  # members reported the current quorum's step failed
    reloads: dict[str, float | None] = field(default_factory=dict)
    """While no live member holds the head: members told to load a newer durable checkpoint ->
    when they were first told, or None once they asked again saying they looked (done)."""
    looked_below: dict[str, int] = field(default_factory=dict)
    """Members that looked -> the newest live claim's step when they did (``_void_stale_looks``)."""
    looked_high: int = -1
    """At least the highest of ``looked_below`` (nothing to void while the newest claim is as new)."""
    reload_rounds: dict[str, int] = field(default_factory=dict)
    """Members whose look was voided -> how many times (the ``reload_round`` they are told)."""
    probe: Probe | None = None  # attempts of the head's step by the same members failed
    convicted: dict[str, int] = field(default_factory=dict)
    """Groups convicted of failing the steps they take part in (``convict``) -> how many times;
    the most recent last."""
    searches: tuple[int, int] = (-1, 0)
    """(step, searches of it that ended without a verdict): the next one takes the groups in
    another order (``_shuffle``)."""
    index: _Index = field(default_factory=_Index, compare=False, repr=False)
    """Counts and heaps over ``heartbeats`` and ``pending`` (kept by the tables themselves)."""

    def __post_init__(self) -> None:
        given_hb, given_pending = self.heartbeats, self.pending
        self.heartbeats, self.pending = self.index.heartbeats, self.index.pending
        self.heartbeats.update(given_hb)
        self.pending.update(given_pending)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("heartbeats", "pending") and getattr(self, "index", None) is not None:
            table = getattr(self.index, name)
            if value is not table:  # assigning a table replaces its contents, the index follows
                items = dict(value)
                table.clear()
                table.update(items)
                value = table
        object.__setattr__(self, name, value)

    @property
    def max_step(self) -> int:
        """The job's progress: the head's step (0 before it is known)."""
        return self.head[0] if self.head is not None else 0


def _is_fresh(now: float, state: CoordinatorState, replica_id: str, options: QuorumOptions) -> bool:
    hb = state.heartbeats.get(replica_id)
    return hb is not None and now - hb.last_seen < options.heartbeat_timeout


def _retire(state: CoordinatorState, replica_id: str, now: float, why: str = "") -> None:
    state.heartbeats.pop(replica_id, None)
    state.pending.pop(replica_id, None)
    state.retired[replica_id] = now
    while len(state.retired) > _MAX_RETIRED:
        state.retired.pop(next(iter(state.retired)))  # dicts keep insertion order: oldest first
    if why:
        state.retired_why[replica_id] = why
        while len(state.retired_why) > _MAX_RETIRED:
            state.retired_why.pop(next(iter(state.retired_why)))


def _retire_other_incarnations(state: CoordinatorState, replica_id: str, group: str, now: float) -> list[str]:
    if replica_id in state.retired:
        why = state.retired_why.get(replica_id)
        if why is not None:  # the one reason recorded: a conviction (``remove_member``'s ``why``)
            raise Convicted(f"replica {replica_id} {why}; this process must exit")
        raise StaleIncarnation(f"replica {replica_id} was replaced or declared hung; this process must exit")
    index = state.index
    beating, asking = index.hb_groups.get(group), index.pending_groups.get(group)
    if (not beating or (len(beating) == 1 and replica_id in beating)) and (
            not asking or (len(asking) == 1 and replica_id in asking)):
        return []  # the group's one incarnation (every message of a steady job)
    old = [r for r in beating or () if r != replica_id]
    old += [r for r in asking or () if r != replica_id and r not in old]
    for r in old:
        _retire(state, r, now)
    return old


def _sync_round(state: CoordinatorState) -> None:
    state.round_started = state.index.oldest_request()


def _steady(now: float, state: CoordinatorState, options: QuorumOptions) -> bool:
    """Whether the index answers exactly what a scan of the tables would: every heartbeat is
    fresh, every request has a heartbeat, and each group has one live incarnation."""
    index = state.index
    index.track_prev(state.prev_quorum)
    return (not index.orphans and len(index.hb_groups) == len(state.heartbeats)
            and not index.oldest_fresh_violation(now, options.heartbeat_timeout))


def record_heartbeat(state: CoordinatorState, hb: Heartbeat, request: bool = False) -> list[str]:
    """Record a heartbeat (``request``: the one a quorum request carries); returns the older
    incarnations of its group that it replaced.

    Raises StaleIncarnation if ``hb`` comes from an incarnation that was itself replaced or retired.
    Claims are bounded by the caller's validation (``MAX_CLAIM``); they never move the head here.
    """
    replaced = _retire_other_incarnations(state, hb.replica_id, hb.group, hb.last_seen)
    if hb.progress_at is None:
        hb.progress_at = hb.last_seen
    req = None if request else state.pending.get(hb.replica_id)
    if req is not None and (hb.step, hb.chain) != (req.step, req.chain):
        # While its request waits, a member holds what it asked with (its trainer waits for the
        # answer; one that asked early is applying that very update). A heartbeat sent before the
        # request can arrive after it: it must not take the claim back, which made the head look
        # unheld for a moment (sim seed 14) or undid a reload just reported (seed 1703).
        hb.step, hb.chain = req.step, req.chain
    state.heartbeats[hb.replica_id] = hb
    if state.head is None:
        # While rebuilding, members tell where the ids and the job stood; afterwards a claim above
        # what this coordinator issued is implausible and never stored.
        state.quorum_id = max(state.quorum_id, min(hb.quorum_id, MAX_CLAIM))
        state.known_head = max(state.known_head, min(hb.known_head, MAX_CLAIM))
    if state.started_at is None:
        state.started_at = hb.last_seen
    return replaced


def record_request(state: CoordinatorState, req: MemberRequest) -> list[str]:
    """Record a quorum request (a heartbeat and a sign of progress); returns replaced incarnations.

    A repeated request of the same replica overwrites its earlier one. Raises StaleIncarnation if
    ``req`` comes from an incarnation that was replaced.
    """
    prior = state.heartbeats.get(req.replica_id)
    known_id = max(req.last_quorum_id, prior.quorum_id if prior else -1)
    replaced = record_heartbeat(state, Heartbeat(req.replica_id, req.group, req.asked_at, req.step, known_id,
                                                 req.chain, req.asked_at, prior.known_head if prior else 0),
                                request=True)
    state.pending[req.replica_id] = req
    if (req.disk_checked >= 0 and req.disk_checked == _reload_target(state)
            and req.disk_round == state.reload_rounds.get(req.replica_id, 0)):
        state.reloads[req.replica_id] = None  # it looked for a newer checkpoint (and loaded it, if any)
        state.looked_below[req.replica_id] = newest = _newest_claim(state)
        state.looked_high = max(state.looked_high, newest)
    if state.round_started is None:
        state.round_started = req.asked_at
    if req.failed:
        _suspect(state, req)
    return replaced


def _suspect(state: CoordinatorState, req: MemberRequest) -> None:
    """A member of the current quorum failed its step: open (or join) a suspicion of its peers."""
    prev = state.prev_quorum
    if prev is None or req.last_quorum_id != prev.quorum_id or not prev.present(req.replica_id):
        return  # a failure of an older quorum: a newer one exists already
    s = state.suspicion
    if s is None or s.quorum_id != prev.quorum_id:
        s = state.suspicion = Suspicion(prev.quorum_id, req.asked_at)
    s.reporters.add(req.replica_id)


def _expire_suspected(now: float, state: CoordinatorState, options: QuorumOptions) -> list[tuple[str, str]]:
    """Members of a quorum whose step peers reported failed and that were silent since the first
    report, once ``suspect_window`` passed (a peer's transport error: docs/design.md, 'Failure
    detection')."""
    s = state.suspicion
    if s is None or options.suspect_window <= 0 or now - s.opened_at < options.suspect_window:
        return []
    state.suspicion = None
    prev = state.prev_quorum
    if prev is None or prev.quorum_id != s.quorum_id:
        return []
    gone: list[tuple[str, str]] = []
    for r in prev.replica_ids():
        hb = state.heartbeats.get(r)
        if hb is None or r in s.reporters or hb.last_seen >= s.opened_at:
            continue
        gone.append((r, f"silent for {now - hb.last_seen:.2f} s after {_plural(len(s.reporters), 'peer')} "
                        f"reported the step of quorum {s.quorum_id} failed"))
        del state.heartbeats[r]
        state.pending.pop(r, None)
    return gone


def expire(now: float, state: CoordinatorState, options: QuorumOptions) -> list[tuple[str, str]]:
    """Remove replicas that stopped heartbeating or stopped making progress.

    Returns ``(replica id, reason)`` for each. A replica whose heartbeat lives while it makes no
    progress (a hung rank, a wedged training thread) is retired: its next heartbeat is refused, so
    that the process exits instead of coming back with a state nobody vouches for.
    """
    gone = _expire_suspected(now, state, options)
    if _nobody_due(now, state, options):
        if gone:
            _sync_round(state)
        return gone
    for r, hb in list(state.heartbeats.items()):
        if not _is_fresh(now, state, r, options):
            gone.append((r, "heartbeat timeout"))
            del state.heartbeats[r]
            state.pending.pop(r, None)
        elif (options.progress_timeout > 0 and r not in state.pending
              and now - (hb.progress_at if hb.progress_at is not None else hb.last_seen) > options.progress_timeout):
            idle = now - (hb.progress_at if hb.progress_at is not None else hb.last_seen)
            gone.append((r, f"no progress for {idle:.0f} s (hung rank or training thread)"))
            _retire(state, r, now)
    if gone:
        _sync_round(state)
    return gone


def _nobody_due(now: float, state: CoordinatorState, options: QuorumOptions) -> bool:
    """Whether no heartbeat or progress deadline has passed (then ``expire`` has nothing to do)."""
    index = state.index
    return not (index.oldest_fresh_violation(now, options.heartbeat_timeout)
                or index.progress_overdue(now, options.progress_timeout))


def remove_member(state: CoordinatorState, replica_id: str, now: float, retire: bool = True,
                  finished: bool = False, why: str = "") -> bool:
    """Drop a replica that left or whose process ended; returns whether it was known.

    ``retire`` refuses the incarnation from then on (its process is gone or told to go; ``why``,
    given for a conviction only, is what its refused messages are told, after "replica <id> ", as
    ``Convicted``); ``finished``: it left having completed the job at the head, which is then
    never rolled back.
    """
    known = replica_id in state.heartbeats or replica_id in state.pending
    hb = state.heartbeats.get(replica_id)
    if finished and hb is not None and state.head is not None and (hb.step, hb.chain) == state.head:
        state.finished = True
    state.heartbeats.pop(replica_id, None)
    state.pending.pop(replica_id, None)
    if retire:
        _retire(state, replica_id, now, why)
    _sync_round(state)
    return known


def commit_quorum(state: CoordinatorState, quorum: Quorum) -> None:
    """Record ``quorum`` as issued: its members' requests are answered and a new round begins."""
    _count_attempt(state, quorum)
    state.prev_quorum = quorum
    state.suspicion = None  # a new quorum formed: whoever it left out is no longer waited for
    state.quorum_id = max(state.quorum_id, quorum.quorum_id)
    if state.head is not None and quorum.step == state.head[0]:
        state.head_quorums.append((quorum.quorum_id, list(quorum.participants)))
        del state.head_quorums[:-64]  # retries of one step: only recent ones can still commit
    state.index.pending.discard_all(quorum.replica_ids())  # the same table as ``state.pending``
    _sync_round(state)


def _whole_set(q: Quorum) -> frozenset[str]:
    """The members ``q`` was meant to have: its own, and those it left out."""
    ids = frozenset(q.replica_ids())
    return ids.union(q.left_out) if q.left_out else ids


def _evidence(state: CoordinatorState, whole: frozenset[str]) -> Probe | None:
    """``state.probe`` once the previous quorum's attempt of the head's step is counted, the next
    attempt being meant for ``whole``: failed when one of its members asks again saying so (the
    requests are still pending). None when there is nothing to go on. Never mutates ``state``.

    If one of its members is not in the next attempt (it died, left, hangs or was slow to ask), or
    does not say it failed that attempt (it never got its answer: a lost message), it may be what
    failed it: the failure clears no suspect then (a probe that left the culprit out, failed by a
    peer's hang, would clear the culprit)."""
    prev, probe = state.prev_quorum, state.probe
    if (prev is None or state.head is None
            or (prev.step, prev.chain, prev.epoch) != (state.head[0], state.head[1], state.epoch)):
        return None  # a new step (or a new coordinator): nothing failed yet
    if probe is not None and probe.accused:
        probe = None  # (``convict`` judges the accused; a new search starts afresh)
    if not _reported_failed(state, prev):
        # Nobody says that attempt failed: a member's answer was lost, or the job's end (finished
        # groups answer quorums at the last step while late joiners catch up).
        return probe if probe is not None and probe.step == prev.step else None
    members = frozenset(prev.replica_ids())
    certain = _whole_set(prev) <= whole and _reported_failed(state, prev, every=True)
    if probe is None or probe.step != prev.step:
        again = state.searches[0] == prev.step and state.searches[1] > 0  # (one ended without a verdict)
        return Probe(prev.step, members, members, prev.issued_at, strict=again,
                     hits=dict.fromkeys(members, 1)) if certain else None
    seen = probe.seen | members
    tried = probe.tried.union(probe.suspects.intersection(prev.left_out) if probe.strict else prev.left_out)
    newcomers = members - probe.seen - probe.clean
    if not certain:
        return Probe(prev.step, probe.suspects | newcomers, seen, probe.since, probe.failed + 1,
                     probe.rounds, tried, clean=probe.clean, probed=probe.probed, strict=probe.strict,
                     hits=probe.hits)
    hits = {**probe.hits, **{r: probe.hits.get(r, 0) + 1 for r in members}}
    if prev.left_out and not probe.suspects.issuperset(prev.left_out):
        # Members were set aside: the attempt took only clean ones, suspects and partners, so
        # what failed it is among those not clean (partners too: more than one may be bad).
        suspects = members - probe.clean
    else:  # everyone else took part: the one member that fails every attempt was in each
        suspects = (probe.suspects & members) | newcomers
    probed = probe.probed + bool(prev.left_out)
    if not suspects or probed > probe_limit(len(seen)):
        # No single member was in every failed attempt (or a message was lost), or the round went
        # on too long (the halves and partners kept a bad one each): again, in another order.
        if probe.rounds + 1 >= MAX_PROBE_ROUNDS:
            return None  # start over
        return Probe(prev.step, whole, seen, probe.since, probe.failed + 1, probe.rounds + 1, strict=True,
                     hits=hits)
    return Probe(prev.step, suspects, seen, probe.since, probe.failed + 1, probe.rounds, tried,
                 clean=probe.clean, probed=probed, strict=probe.strict, hits=hits)


def probe_limit(groups: int) -> int:
    """Failed attempts that leave someone out in one round of a search among ``groups``: twice
    what finding one bad group takes (halving, then one to accuse it), and two more."""
    return 2 * math.ceil(math.log2(max(groups, 2))) + 2


def _count_attempt(state: CoordinatorState, quorum: Quorum) -> None:
    """Keep ``state.probe`` as ``quorum`` is issued (``_evidence``); a no-op on a new step with no
    probe, as in a steady job."""
    probe, prev = state.probe, state.prev_quorum
    if probe is not None and probe.step == quorum.step and (prev is None or prev.step != quorum.step):
        return  # the first attempt of the step a probe narrowed the search to, or of an accused's
    if probe is not None and probe.accused:
        if probe.waited + 1 < VERDICT_ATTEMPTS:  # an attempt of the accused's step without a verdict
            state.probe = dataclasses.replace(probe, waited=probe.waited + 1)
            return
        probe = state.probe = None
    if probe is None and (prev is None or prev.step != quorum.step):
        return
    state.probe = _evidence(state, _whole_set(quorum))
    if probe is not None and state.probe is None and probe.step == quorum.step:  # it starts over
        step, ended = state.searches
        state.searches = (quorum.step, ended + 1 if step == quorum.step else 1)


def _leave_out(state: CoordinatorState, options: QuorumOptions, candidates: dict[str, MemberRequest],
               holders: set[str]) -> tuple[tuple[str, ...], str]:
    """The members the next attempt of the head's step leaves out, and why; ((), "") for none.

    Half the suspects (``Probe``), once ``probe_after`` attempts failed: the attempt then tells in
    which half the member that fails them is (``convict`` narrows the search to the half left
    out when it commits), and every member set aside (neither a suspect nor clean: another bad
    one may be among them). Only when at least two take part (one alone tells nothing) and enough
    for ``min_replicas``, and with a holder of the head among them (the others recover from it):
    if the suspect is the only holder, the search ends without a verdict. Where too few would
    take part without those set aside, they take part (as with one bad member). The accused's
    step (its verdict) sets aside the same members. Never mutates ``state``."""
    prev, probe, head = state.prev_quorum, state.probe, state.head
    if options.probe_after <= 0 or prev is None or head is None or len(candidates) < 3 or state.finished:
        return (), ""  # (finished: groups that reached the end drain and leave; nothing to search)
    if probe is not None and probe.accused in state.heartbeats and probe.strict and probe.step == head[0]:
        set_aside = _set_aside(options, probe, candidates, holders)
        if set_aside[0]:
            return set_aside
    if probe is not None and probe.narrowed and probe.step == head[0] and prev.step == head[0] - 1:
        pass  # the first attempt of the step the search was narrowed to
    elif prev.step == head[0]:
        probe = _evidence(state, frozenset(candidates))
    else:
        return (), ""
    if probe is None or probe.failed < options.probe_after or any(
            r not in candidates and r in state.heartbeats for r in probe.suspects):
        return (), ""  # (a live suspect is not asking: an attempt without it and another tells nothing)
    groups = {r: candidates[r].group for r in probe.suspects if r in candidates}
    if not groups:
        return (), ""
    shuffle = _shuffle(state, probe)
    # (Another round: the suspects in the most failed attempts first, the likeliest bad ones.)
    hits = probe.hits if probe.strict else {}
    order = sorted(groups, key=lambda r: (-hits.get(r, 0), r in probe.tried, groups[r] not in state.convicted,
                                          shuffle(groups[r]), r))
    # Half the suspects; the group convicted last alone (its node's link may still be bad; only
    # the last: when every group was convicted once in a long job, each alone would cost an
    # attempt).
    last = next(reversed(state.convicted), None)
    half = 1 if groups[order[0]] == last and order[0] not in probe.tried else (len(order) + 1) // 2
    trusted = [r for r in candidates if r in probe.clean or r in groups]
    # Too few trusted to take part without half the suspects: the fewest of those set aside, as
    # partners (a commit clears them too), before everyone; first those in no failed attempt
    # (a group restarted since), then others in another order each attempt (a fixed order can
    # keep pairing the good ones with bad ones).
    mix = _shuffle(state, probe, probe.failed)
    others = sorted((r for r in candidates if r not in trusted),
                    key=lambda r: (r in probe.seen, mix(candidates[r].group), r))
    pools = [trusted] + [trusted + others[:k] for k in range(1, min(len(others), max(2, options.min_replicas)) + 1)]
    # (The first search of a step sets nobody aside: one bad member is the usual case, and a
    # member set aside waits for the whole search, perhaps past its ``ft.quorum_timeout``.)
    for pool in (pools if probe.strict else []) + [list(candidates)]:  # the set aside take part only where too few would
        most = min(half, len(pool) - 2, len(pool) - options.min_replicas)
        out: list[str] = []
        holding = sum(1 for r in pool if r in holders)  # at least one stays (linear in the suspects)
        for r in order:
            if len(out) >= most:
                break
            if r in holders:
                if holding == 1:
                    continue
                holding -= 1
            out.append(r)
        if out and holding:
            break
    else:
        return (), ""
    named = ", ".join(groups[r] for r in order[:MISSING_NAMED]) + (" ..." if len(order) > MISSING_NAMED else "")
    which = ", ".join(groups[r] for r in out[:MISSING_NAMED]) + (" ..." if len(out) > MISSING_NAMED else "")
    why = (f"probe: {_plural(probe.failed, 'attempt')} of step {probe.step} failed, each with {named}; "
           f"trying without {which} ({'its request waits' if len(out) == 1 else 'their requests wait'}")
    aside = tuple(r for r in candidates if r not in pool)
    if aside:
        why += f"; {_plural(len(aside), 'other')} set aside until the search ends"
    return tuple(out) + aside, why + ")"


def _shuffle(state: CoordinatorState, probe: Probe, attempt: int = -1) -> Callable[[str], Any]:
    """The order in which a search takes groups: by name in the first round of the step's first
    search; then (no single member was in every failed attempt: more than one may fail them)
    another order each round and search (and each ``attempt``, if given), so that the halves
    and partners differ."""
    ended = state.searches[1] if state.searches[0] == probe.step else 0
    if not probe.rounds and not ended:
        return lambda group: group
    salt = f"{probe.rounds}:{ended}:{probe.since!r}:{attempt}:"
    return lambda group: zlib.crc32((salt + group).encode())


def _set_aside(options: QuorumOptions, probe: Probe, candidates: dict[str, MemberRequest],
               holders: set[str]) -> tuple[tuple[str, ...], str]:
    """The accused's step: its verdict is an attempt of the accused and the clean members only
    (one set aside may fail it too); everyone takes part where too few would. Never mutates."""
    aside = tuple(r for r in candidates if r != probe.accused and r not in probe.clean)
    kept = [r for r in candidates if r not in aside]
    if not aside or len(kept) < max(2, options.min_replicas) or not any(r in holders for r in kept):
        return (), ""
    accused = candidates[probe.accused].group if probe.accused in candidates else probe.accused
    return aside, (f"probe: step {probe.cleared_at} committed without {accused}; its verdict sets "
                   f"{_plural(len(aside), 'other')} aside until the search ends")


def convict(state: CoordinatorState) -> tuple[str, str, Probe] | None:
    """The member to retire for failing the steps it takes part in, why, and the probe that found
    it; None otherwise. Call after ``advance_head``; the caller retires the member.

    Two steps: once the head moved past an attempt that left a suspect out, through it, the
    suspect is *accused*: it takes part in the next step again (behind by one, it recovers). If
    an attempt of that step with it and only those who took part in the search fails too, every
    member saying so, it is convicted: failed with it, committed without it, failed with it
    again. If that step commits, it is cleared: whatever failed the attempts passed (a peer's
    hang, a burst of lost messages), and a healthy group is not restarted."""
    prev, probe = state.prev_quorum, state.probe
    if probe is None or prev is None or state.head is None:
        return None
    through = state.head == (prev.step + 1, prev.next_chain()) and prev.step == probe.step
    if through and not any(prev.present(r) for r in probe.suspects) and (probe.accused or probe.narrowed):
        # The step committed without the accused (or the narrowed suspects) again: they were slow
        # to ask (recovering). That tells nothing new; the next step's attempts go on with them,
        # unless they are gone (dead, left, retired): the search ends.
        live = any(r in state.heartbeats for r in probe.suspects)
        state.probe = dataclasses.replace(probe, step=state.head[0], waited=0) if live else None
        return None
    if not probe.accused:
        if (prev.left_out and through
                and not any(r not in prev.left_out and r in state.heartbeats and not prev.present(r)
                            for r in probe.suspects)):
            # The member that failed the attempts was left out of this one (among the suspects:
            # the others left out were set aside), and its members are clean.
            out = [r for r in prev.left_out if r in probe.suspects and r in state.heartbeats]
            clean = probe.clean | frozenset(prev.replica_ids())
            # ``seen``: who took part in the search (the verdict counts only their word: a group
            # that joined since may be the one whose link is bad)
            seen = probe.seen | clean | frozenset(out)
            if len(out) == 1:
                state.probe = Probe(state.head[0], frozenset(out), seen, probe.since, probe.failed,
                                    accused=out[0], cleared_at=prev.step, clean=clean, strict=probe.strict)
            elif out:  # among these: the next step's attempts search them
                state.probe = Probe(state.head[0], frozenset(out), seen, probe.since, probe.failed,
                                    probe.rounds, narrowed=True, clean=clean, probed=probe.probed,
                                    strict=probe.strict)
            else:
                state.probe = None  # (they died meanwhile)
        return None
    accused = probe.accused
    if state.head[0] != probe.step:
        state.probe = None  # the step after committed (or the job went back): no verdict
        return None
    if prev.step != probe.step or not prev.present(accused):
        return None
    if not (frozenset(prev.replica_ids()) - {accused} <= probe.seen and _reported_failed(state, prev, every=True)):
        # Not a verdict: someone else joined (its link may be the bad one), or a member does not
        # say the attempt failed (it never got its answer); the next attempt of the step judges.
        return None
    state.probe = None
    hb = state.heartbeats.get(accused)
    group = hb.group if hb is not None else accused.split(":", 1)[0]
    state.convicted[group] = state.convicted.pop(group, 0) + 1  # (the newest last)
    while len(state.convicted) > _MAX_RETIRED:
        state.convicted.pop(next(iter(state.convicted)))
    return accused, (f"step {probe.cleared_at} failed in {_plural(probe.failed, 'attempt')} with this "
                     f"group taking part and committed without it, and step {probe.step} failed with "
                     f"it again: its link to the others (or its device) {FAILS_ITS_STEPS}"), probe


def _reported_failed(state: CoordinatorState, q: Quorum, every: bool = False) -> bool:
    """Whether a member of ``q`` (``every`` member) asks again saying that ``q``'s attempt failed."""
    pending = state.pending
    for r in q.replica_ids():
        req = pending.get(r)
        said = req is not None and req.failed and req.last_quorum_id == q.quorum_id
        if said != every:  # one silent member decides "every", one saying so decides "any"
            return said
    return every


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _fresh_claims(now: float, state: CoordinatorState, options: QuorumOptions) -> dict[str, tuple[int, str]]:
    return {r: (hb.step, hb.chain) for r, hb in state.heartbeats.items() if _is_fresh(now, state, r, options)}


def _best(claims: dict[str, tuple[int, str]]) -> tuple[int, str]:
    """The newest claimed state: highest step, then most holders, then the smaller chain."""
    holders = Counter(claims.values())
    return max(holders, key=lambda sc: (sc[0], holders[sc], [-ord(c) for c in sc[1]]))


def _rebuilding(now: float, state: CoordinatorState, options: QuorumOptions,
                claims: dict[str, tuple[int, str]]) -> str:
    """Why the head cannot be chosen yet after a (re)start, or "" when it can."""
    # No shortcut for claims that look like a fresh job: a restarted coordinator first hears from
    # whoever heartbeats first, perhaps a new incarnation at step 0 while the job is far ahead.
    groups = {state.heartbeats[r].group for r in claims}
    if options.expected_groups and len(groups) >= options.expected_groups:
        return ""
    left = options.rebuild_seconds - (now - (state.started_at if state.started_at is not None else now))
    if left <= 0:
        return ""
    return (f"rebuilding membership: {_plural(len(groups), 'group')} reported their committed "
            f"state; deciding in {left:.1f} s")


def advance_head(now: float, state: CoordinatorState, options: QuorumOptions) -> tuple[list[Restore], str]:
    """Move the head to what live members hold; returns explicit rollbacks and a "not yet" reason.

    Call after ``expire`` and before ``compute_quorum``. The head is chosen from the members'
    claims when unknown (a fresh or restarted coordinator), advances by one step when a member
    reports a commit of a quorum issued at the head's step, and rolls back (a ``Restore``) when no
    live member has held it for ``rollback_grace``.
    """
    if _steady(now, state, options):
        fast = _advance_head_steady(now, state, options)
        if fast is not None:
            return fast
    claims = _fresh_claims(now, state, options)
    if not claims:
        return [], ""
    if state.head is None:
        why = _rebuilding(now, state, options, claims)
        if why:
            return [], why
        best = _best(claims)
        if best[0] < state.known_head:
            # As for a rollback below: members behind look for a newer durable checkpoint first.
            waiting = _await_reloads(now, state, options, claims, state.known_head)
            if waiting:
                return [], waiting
            best = _best(claims)
        _set_head(state, best, now)
        state.top = max(state.top, state.known_head)
        if best[0] < state.known_head:
            # The job had reached further, but whoever held that died while nobody coordinated.
            holders = tuple(sorted(state.heartbeats[r].group for r, c in claims.items() if c == best))
            return [Restore(state.known_head, best[0], best[1], holders,
                            f"after a coordinator restart no live group holds step {state.known_head}; "
                            f"continuing from step {best[0]} held by {', '.join(holders)}")], ""
        return [], ""
    step, chain = state.head
    valid = {extend_chain(chain, step, qid, parts) for qid, parts in state.head_quorums}
    ahead = [c for c in claims.values() if c[0] == step + 1 and c[1] in valid]
    if ahead:
        state.finished = False
        votes = Counter(ahead)
        _set_head(state, max(votes, key=lambda sc: (votes[sc], sc[1])), now)
        return [], ""
    if state.head in claims.values():
        state.head_seen_at = now
        _end_reloads(state)
        return [], ""
    if state.finished:
        return [], (f"the job finished at step {step} (its groups left); a group joining now has "
                    "nothing to rejoin")
    seen = state.head_seen_at if state.head_seen_at is not None else now
    left = options.rollback_seconds - (now - seen)
    if left > 0:
        return [], (f"no live group holds the newest state (step {step}); rolling back to the "
                    f"newest state a live group holds in {left:.1f} s unless a holder returns")
    waiting = _await_reloads(now, state, options, claims, step)
    if waiting:
        return [], waiting
    # Back to the newest state a live group holds, which may be a state of a branch an earlier
    # rollback abandoned (a durable checkpoint of it), but never beyond where the job ever got:
    # one step past the furthest head, whose commit of a quorum issued there may not have been
    # reported before its holders died (sim seed 3368: refusing it was a livelock). Unless most
    # live groups, two or more, hold that same state: a coordinator restarted after the job got
    # further may have rebuilt from a group that restarted from an older checkpoint, and the
    # groups that restart next load the newest one (seeds 10084, 10124: refusing it was a
    # livelock); one member's word for a state beyond the furthest head is never enough.
    groups: dict[tuple[int, str], set[str]] = {}
    for r, c in claims.items():
        groups.setdefault(c, set()).add(state.heartbeats[r].group)
    live = len({state.heartbeats[r].group for r in claims})
    plausible = {r: c for r, c in claims.items()
                 if c[0] <= max(step, state.top) + 1 or 2 <= len(groups[c]) and 2 * len(groups[c]) > live}
    if not plausible:
        return [], f"no live group holds the newest state (step {step}) or an older one"
    target = _best(plausible)
    holders = tuple(sorted(state.heartbeats[r].group for r, c in plausible.items() if c == target))
    restore = Restore(step, target[0], target[1], holders,
                      f"every group holding step {step} is gone; continuing from step {target[0]} "
                      f"held by {', '.join(holders)}")
    _set_head(state, target, now)
    return [restore], ""


def _await_reloads(now: float, state: CoordinatorState, options: QuorumOptions,
                   claims: dict[str, tuple[int, str]], step: int) -> str:
    """Before a rollback from ``step``: why it must wait, or "" when it may go ahead.

    Every live member behind ``step`` looks for a newer durable checkpoint first: it may be
    about to hold a newer state than anyone does now (the newest checkpoint may even be the
    head). One that joined during the grace, or never asked, is told now (its heartbeat answer or
    request says ``reload``). The rollback waits until each asks again saying it looked
    (``disk_checked``), at most ``reload_seconds`` from when it was told (a hung load is also
    caught by ``progress_timeout``); a look that a departure made stale is done again
    (``_void_stale_looks``).
    """
    _void_stale_looks(now, state)
    for r, c in claims.items():
        if c[0] < step:
            state.reloads.setdefault(r, now)
    loading = sorted(state.heartbeats[r].group for r, told in state.reloads.items()
                     if told is not None and r in claims and now - told < options.reload_seconds)
    if not loading:
        return ""
    return (f"no live group holds the newest state (step {step}); waiting for {', '.join(loading)} "
            "to look for a newer durable checkpoint before rolling back")


def _advance_head_steady(now: float, state: CoordinatorState,
                         options: QuorumOptions) -> tuple[list[Restore], str] | None:
    """``advance_head`` from the index when every member is fresh; None where the scan must decide
    (choosing the head after a restart, a rollback)."""
    index = state.index
    if not state.heartbeats:
        return [], ""
    if state.head is None:
        if options.expected_groups and len(index.hb_groups) >= options.expected_groups:
            return None
        left = options.rebuild_seconds - (now - (state.started_at if state.started_at is not None else now))
        if left <= 0:
            return None
        return [], (f"rebuilding membership: {_plural(len(index.hb_groups), 'group')} reported their "
                    f"committed state; deciding in {left:.1f} s")
    step, _ = state.head
    claims = index.hb_claims
    ahead = {(step + 1, chain) for chain, _ in index.head_quorum_info(state) if claims.get((step + 1, chain))}
    if ahead:
        state.finished = False
        _set_head(state, max(ahead, key=lambda sc: (claims[sc], sc[1])), now)
        return [], ""
    if claims.get(state.head):
        state.head_seen_at = now
        if state.reloads:
            _end_reloads(state)
        return [], ""
    return None


def _set_head(state: CoordinatorState, head: tuple[int, str], now: float) -> None:
    state.head = head
    state.head_quorums = []
    state.head_seen_at = now
    state.top = max(state.top, head[0])
    _end_reloads(state)


def _end_reloads(state: CoordinatorState) -> None:
    """A live member holds the head (again), or a new head was chosen: nobody is to look on disk."""
    state.reloads.clear()
    state.looked_below.clear()
    state.looked_high = -1
    state.reload_rounds.clear()


def reload_due(now: float, state: CoordinatorState, options: QuorumOptions) -> tuple[int, list[MemberRequest]]:
    """The step no live member holds, and the pending requests to answer "load a durable
    checkpoint newer than your state first" (call after ``advance_head``); marks them told.

    While no live member holds the head (its holders died; the rollback grace runs), a member
    behind it may find on disk a checkpoint newer than its own state: written by a holder after
    this member started, or skipped because this member restarted from an older one. Loading it
    before the grace ends keeps the rollback from giving up the steps in between (at best the
    checkpoint is the head, and no rollback happens). A member asks again with ``disk_checked``
    set to the head's step once it looked (with or without a newer checkpoint): it is not told
    again for that head. One whose answer was lost is told again; the rollback waits for a
    member at most ``reload_seconds`` from when it was first told.

    A member that has not asked (starting, lagging, busy) hears it in its heartbeat answers
    (``reload_hint``) and looks before it asks.
    """
    step = _unheld_head(now, state, options)
    if step is None:
        return -1, []
    _void_stale_looks(now, state)
    rounds = state.reload_rounds
    due = [req for req in state.pending.values()
           if req.step < step and (req.disk_checked != step or req.disk_round != rounds.get(req.replica_id, 0))]
    for req in due:
        state.reloads.setdefault(req.replica_id, now)
    return step, due


def reload_hint(now: float, state: CoordinatorState, options: QuorumOptions, replica_id: str) -> int | None:
    """The head's step for ``replica_id``'s heartbeat answer when it should look for a newer
    durable checkpoint before it asks (see ``reload_due``); None otherwise."""
    step = _unheld_head(now, state, options)
    hb = state.heartbeats.get(replica_id)
    if step is None or hb is None or hb.step >= step or state.reloads.get(replica_id, now) is None:
        return None  # held, not behind, or it looked already
    state.reloads.setdefault(replica_id, now)
    return step


def _unheld_head(now: float, state: CoordinatorState, options: QuorumOptions) -> int | None:
    """The head's step once no live member has held it for a quarter of the rollback grace.

    Not at once: a holder's heartbeat sent before its commit can arrive after its request of the
    next step, and make the head look unheld for a moment (sim seed 14), which must not make a
    member drop a pull in progress. Call after ``advance_head`` (which stamps ``head_seen_at``).
    """
    if state.head is None:  # a restarted coordinator waiting for reloads before it rolls back
        return state.known_head if state.reloads else None
    if state.finished or state.head_seen_at is None or now - state.head_seen_at < options.rollback_seconds / 4:
        return None
    return state.head[0]


def _newest_claim(state: CoordinatorState) -> int:
    """The step of the newest state a live member claims (-1 without members)."""
    return max((step for step, _ in state.index.hb_claims), default=-1)


def _void_stale_looks(now: float, state: CoordinatorState) -> None:
    """Members that looked on disk while a live member held a newer state than any live member
    holds now look again: the newer state's holder left or died since, and may have saved it on
    its way out (``checkpoint.on_stop``: the participant 0 of its last step does, before it
    leaves) after they looked (``ftlm sim check --groups 5``, seed 30206: they rolled back to step
    50 with step 51 on disk). Each is told again with its ``reload_round`` one higher; a request
    that says it looked in an earlier round (sent before it heard) does not count."""
    if not state.looked_below:
        return
    newest = _newest_claim(state)
    if newest >= state.looked_high:  # (cheap in the common case: nobody newer left)
        return
    stale = [r for r, below in state.looked_below.items() if below > newest]
    state.looked_high = newest
    for r in stale:
        del state.looked_below[r]
        if state.reloads.get(r, 0.0) is None:
            state.reloads[r] = now
            state.reload_rounds[r] = state.reload_rounds.get(r, 0) + 1


def reload_round(state: CoordinatorState, replica_id: str) -> int:
    """How many times ``replica_id``'s look on disk was voided (its answers' ``reload_round``)."""
    return state.reload_rounds.get(replica_id, 0)


def _reload_target(state: CoordinatorState) -> int:
    """The step members told to reload compare their state with (see ``_unheld_head``)."""
    return state.head[0] if state.head is not None else state.known_head


def classify(state: CoordinatorState, replica_id: str) -> str:
    """``up-to-date`` (holds the head), ``behind`` or ``stale`` (ahead of the head or forked)."""
    hb = state.heartbeats.get(replica_id)
    if hb is None or state.head is None:
        return "unknown"
    if (hb.step, hb.chain) == state.head:
        return "up-to-date"
    return "behind" if hb.step <= state.head[0] else "stale"


def compute_quorum(now: float, state: CoordinatorState, options: QuorumOptions) -> tuple[Quorum | None, str]:
    """Decide whether to issue a quorum now (docs/design.md, 'Quorum rules'); never mutates
    ``state``.

    Returns ``(quorum, reason)``, or ``(None, reason)`` saying what is awaited. The caller records
    an issued quorum with ``commit_quorum``. Needs the head (``advance_head``).
    """
    if _steady(now, state, options):
        fast = _compute_quorum_steady(now, state, options)
        if fast is not None:
            return fast
    candidates = {r: req for r, req in state.pending.items() if _is_fresh(now, state, r, options)}
    if not candidates:
        return None, "no member has asked for a quorum"
    if state.head is None:
        return None, "rebuilding membership: waiting for members to report their committed state"
    head_step = state.head[0]
    alive = {r for r in state.heartbeats if _is_fresh(now, state, r, options)}
    alive_groups = sorted({state.heartbeats[r].group for r in alive})
    asked_groups = sorted({req.group for req in candidates.values()})
    if len(candidates) < options.min_replicas:
        n = _plural(len(candidates), "healthy group")
        return None, f"only {n} asked, need min_replicas={options.min_replicas}"

    up = [r for r, req in candidates.items() if (req.step, req.chain) == state.head]
    if not up:
        holders = sorted(state.heartbeats[r].group for r in alive if classify(state, r) == "up-to-date")
        if holders:
            return None, (f"waiting for the holders of step {head_step} ({', '.join(holders)}) to ask; "
                          f"the groups asking must recover from them")
        return None, f"no live group holds the newest state (step {head_step}); waiting for the rollback"

    prev = state.prev_quorum
    prev_alive = [m.replica_id for m in prev.members if m.replica_id in alive] if prev else []
    if prev is not None and prev_alive and all(r in candidates for r in prev_alive):
        joiners = len(candidates) - len(prev_alive)
        extra = f" (+{_plural(joiners, 'joiner')})" if joiners else ""
        reason = f"fast path: all {_plural(len(prev_alive), 'healthy member')} of quorum {prev.quorum_id} asked{extra}"
        return _build(now, state, options, candidates, up, reason), reason

    # A live participant of a quorum issued at this very step that has not asked again may have
    # committed it: a quorum without it could commit the same step differently (a fork).
    in_flight = {r for _, parts in state.head_quorums for r in parts}
    unsettled = sorted(state.heartbeats[r].group for r in alive
                       if r in in_flight and r not in candidates and classify(state, r) == "up-to-date")
    if unsettled:
        return None, (f"waiting for {', '.join(unsettled)}: it took part in step {head_step} and may "
                      "have committed it (or it hangs: then progress_timeout declares it dead)")

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
        return _build(now, state, options, candidates, up, reason), reason
    if 2 * len(asked_groups) <= len(alive_groups):
        return None, f"{len(asked_groups)} of {len(alive_groups)} heartbeating groups asked: not a majority"
    asked = set(asked_groups)
    missing = ", ".join(g for g in alive_groups if g not in asked)
    if left > 0:
        return None, (
            f"waiting for {missing} (asked {len(asked_groups)} of {len(alive_groups)}); join timeout in {left:.1f} s"
        )
    reason = f"join timeout passed: {len(asked_groups)} of {len(alive_groups)} heartbeating groups asked, not {missing}"
    return _build(now, state, options, candidates, up, reason), reason


MISSING_NAMED = 20
"""Most waited-for groups a reason names (the rest are counted): reasons stay short at any size."""


def _compute_quorum_steady(now: float, state: CoordinatorState,
                           options: QuorumOptions) -> tuple[Quorum | None, str] | None:
    """``compute_quorum`` from the index when every member is fresh (``_steady``): the same rules
    in the same order, without a pass over the members unless a quorum is issued; None where the
    scan must decide (nobody asking holds the head, a quorum at this step is in flight)."""
    index, pending = state.index, state.pending
    if not pending:
        return None, "no member has asked for a quorum"
    if state.head is None:
        return None, "rebuilding membership: waiting for members to report their committed state"
    if len(pending) < options.min_replicas:
        n = _plural(len(pending), "healthy group")
        return None, f"only {n} asked, need min_replicas={options.min_replicas}"
    if not index.pending_claims.get(state.head):
        holders = index.hb_holders.get(state.head, {})
        if not holders:
            return None, f"no live group holds the newest state (step {state.head[0]}); waiting for the rollback"
        named = sorted(state.heartbeats[r].group for r in itertools.islice(holders, MISSING_NAMED))
        more = f" and {len(holders) - len(named)} more" if len(holders) > len(named) else ""
        return None, (f"waiting for the holders of step {state.head[0]} ({', '.join(named)}{more}) to ask; "
                      f"the groups asking must recover from them")
    prev = state.prev_quorum

    def build(reason: str) -> Quorum:
        up = [r for r, req in pending.items() if (req.step, req.chain) == state.head]
        return _build(now, state, options, dict(pending), up, reason)

    if prev is not None and index.prev_alive and not index.prev_idle:
        joiners = len(pending) - index.prev_alive
        extra = f" (+{_plural(joiners, 'joiner')})" if joiners else ""
        reason = (f"fast path: all {_plural(index.prev_alive, 'healthy member')} of quorum "
                  f"{prev.quorum_id} asked{extra}")
        return build(reason), reason
    if state.head_quorums:
        unsettled = index.track_unsettled(state)
        if unsettled:
            named = sorted(state.heartbeats[r].group for r in itertools.islice(unsettled, MISSING_NAMED))
            more = f" and {len(unsettled) - len(named)} more" if len(unsettled) > len(named) else ""
            return None, (f"waiting for {', '.join(named)}{more}: it took part in step {state.head[0]} and may "
                          "have committed it (or it hangs: then progress_timeout declares it dead)")
    started = state.round_started
    if started is None:
        started = index.oldest_request()
        assert started is not None
    left = options.join_timeout - (now - started)
    asked, alive = len(index.pending_groups), len(index.hb_groups)
    if prev is None and asked < options.expected_groups and left > 0:
        return None, (f"first quorum: {asked} of {options.expected_groups} expected "
                      f"groups asked; join timeout in {left:.1f} s")
    if asked == alive:
        reason = f"all {_plural(alive, 'heartbeating group')} asked"
        return build(reason), reason
    if 2 * asked <= alive:
        return None, f"{asked} of {alive} heartbeating groups asked: not a majority"
    # One live incarnation per group: the groups not asking are those of the idle replicas.
    named = sorted(state.heartbeats[r].group for r in itertools.islice(index.idle, MISSING_NAMED))
    missing = ", ".join(named) + (f" and {alive - asked - len(named)} more" if alive - asked > len(named) else "")
    if left > 0:
        return None, f"waiting for {missing} (asked {asked} of {alive}); join timeout in {left:.1f} s"
    reason = f"join timeout passed: {asked} of {alive} heartbeating groups asked, not {missing}"
    return build(reason), reason


def _build(now: float, state: CoordinatorState, options: QuorumOptions, candidates: dict[str, MemberRequest],
           up: Iterable[str], reason: str) -> Quorum:
    assert state.head is not None
    holders = set(up)
    out, why = _leave_out(state, options, candidates, holders)
    if out:
        candidates = {r: req for r, req in candidates.items() if r not in out}
        holders.difference_update(out)
        reason = why
    reqs = sorted(candidates.values(), key=lambda q: (q.group, q.replica_id))
    members = [Member(q.replica_id, q.group, q.step, q.meta, q.watch) for q in reqs]
    participants = [m.replica_id for m in members if m.replica_id in holders]
    recovering = [m.replica_id for m in members if m.replica_id not in holders]
    sources = {r: participants[i % len(participants)] for i, r in enumerate(recovering)}

    base = state.quorum_id
    prev = state.prev_quorum
    # The id stays the same only while the same members step forward together; a retry of a step,
    # a change of membership or a reported failure each get a fresh id (a fresh process group).
    ordinary = (prev is not None and prev.step == state.head[0] - 1
                and set(prev.replica_ids()) == set(candidates))
    failed = any(q.failed for q in reqs)
    quorum_id = base if ordinary and not failed else base + 1
    return Quorum(quorum_id, state.head[0], members, participants, recovering, sources, now, reason,
                  state.head[1], state.epoch, out)


def withdraw_request(state: CoordinatorState, req: MemberRequest) -> bool:
    """Drop ``req`` if it is still its replica's pending request (the asker stopped waiting).

    Returns whether it was dropped. Keeps a quorum from being issued to a member nobody answers.
    """
    if state.pending.get(req.replica_id) is not req:
        return False
    del state.pending[req.replica_id]
    _sync_round(state)
    return True
