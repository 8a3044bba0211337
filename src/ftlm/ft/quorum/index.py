"""Counts and heaps over the coordinator's two tables (heartbeats, pending requests), kept up to
date by the tables themselves on every change.

Responsible for: what the decisions read about the members without a pass over them: how many
live members hold each claim, which groups heartbeat and which ask, who heartbeats without
asking, the oldest request, whether a heartbeat or progress deadline passed, and how many
members of the previous quorum are alive and idle. A heartbeat or a request costs the same at
2,000 groups as at 200 (``tests/ft/test_quorum.py``).

Not responsible for: deciding anything (``ftlm.ft.quorum.decision``, ``head``, ``members`` read
these counts), nor for freshness: every heartbeat in the table counts; ``decision.live_view``
says when that is exactly the live members.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ftlm.ft.history import extend_chain

if TYPE_CHECKING:
    from ftlm.ft.quorum.types import CoordinatorState, Heartbeat, Quorum


@dataclass(eq=False, repr=False)
class MemberIndex:
    """What the decisions need about the members, kept up to date on every change of the tables.

    Per-message work must not grow with the number of groups: claims and groups are
    counted, expiry deadlines and the oldest request sit in heaps (entries that no longer match
    the table are dropped when they reach the top), and the previous quorum's members that are
    alive, and alive without a request, are counted. The decisions use these only when they are
    exact (``ftlm.ft.quorum.decision.live_view``); otherwise the decision reads a fresh index of the live
    members only.

    The two deadline heaps (``seen``: last heartbeat, ``progress``: last protocol progress) hold
    one entry per replica, a lower bound of its time (``seen_low``/``progress_low`` name it): a
    message that moves the time forward changes nothing in the heap, only an entry that reaches
    the top looking overdue is refreshed from the table (a heap push per replica per timeout, not
    two per message). A message that moves a time back (a reported progress age) pushes a lower
    entry; the one it replaces is dropped when it reaches the top.
    """

    heartbeats: MemberTable = field(init=False)
    pending: MemberTable = field(init=False)
    hb_claims: Counter[tuple[int, str]] = field(default_factory=Counter)
    hb_version: int = 0
    """Moves whenever a replica starts or stops heartbeating (``Membership`` keys a cache on it)."""
    hb_holders: dict[tuple[int, str], dict[str, None]] = field(default_factory=dict)
    """claim -> the heartbeating replica ids holding it."""
    pending_claims: Counter[tuple[int, str]] = field(default_factory=Counter)
    hb_groups: dict[str, dict[str, None]] = field(default_factory=dict)  # group -> its replica ids, oldest first
    pending_groups: dict[str, dict[str, None]] = field(default_factory=dict)
    idle: dict[str, None] = field(default_factory=dict)  # heartbeating replicas without a pending request
    orphans: set[str] = field(default_factory=set)  # pending replicas without a heartbeat (only by direct writes)
    seen: list[tuple[float, int, str]] = field(default_factory=list)  # (at most its last_seen, seq, rid)
    seen_low: dict[str, float] = field(default_factory=dict)  # rid -> the time of its entry in ``seen``
    progress: list[tuple[float, int, str]] = field(default_factory=list)  # (at most its progress time, seq, rid)
    progress_low: dict[str, float] = field(default_factory=dict)  # rid -> the time of its entry in ``progress``
    asked: list[tuple[float, int, str, Any]] = field(default_factory=list)  # (asked_at, seq, rid, request)
    seq: Iterator[int] = field(default_factory=itertools.count)
    prev: Quorum | None = None  # the quorum the prev_* counts are about
    prev_ids: frozenset[str] = frozenset()
    prev_alive: int = 0  # members of ``prev`` that heartbeat
    prev_idle: int = 0  # ... and have no pending request
    chains_head: tuple[int, str] | None = None
    unsettled_key: tuple[Any, ...] | None = None
    """The head and the ids of the quorums issued at its step that ``unsettled`` is about."""
    in_flight: frozenset[str] = frozenset()
    unsettled: dict[str, None] = field(default_factory=dict)
    """Live members of quorums issued at the head's step that hold the head and have not asked
    again (they may have committed it)."""
    head_info: dict[tuple[int, int], tuple[str, frozenset[str]]] = field(default_factory=dict)
    """(quorum id, participants) -> (the chain its commit reaches, its participant ids)."""

    def __post_init__(self) -> None:
        self.heartbeats = MemberTable(self, True)
        self.pending = MemberTable(self, False)

    def __deepcopy__(self, memo: dict[int, Any]) -> MemberIndex:
        new = MemberIndex.__new__(MemberIndex)
        memo[id(self)] = new
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, MemberTable):  # a copy of the table tells the copy of the index
                table = MemberTable(new, value.is_heartbeats)
                for k, v in value.items():
                    dict.__setitem__(table, k, copy.deepcopy(v, memo))
                value = table
            elif f.name == "seq":
                value = itertools.count(next(self.seq))
            else:
                value = copy.deepcopy(value, memo)
            setattr(new, f.name, value)
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

    def added(self, table: MemberTable, rid: str, old: Any, new: Any) -> None:
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
            _lower(self.progress, self.progress_low, rid, progress_at(new), self.seq)
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

    def removed(self, table: MemberTable, rid: str, old: Any) -> None:
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
                _lower(self.progress, self.progress_low, rid, progress_at(hb), self.seq)
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
            _lower(progress, progress_low, rid, progress_at(hb), seq)
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
            latest = progress_at(self.heartbeats[rid])
            if latest <= at:
                return True
            low[rid] = latest  # progress since: refresh the bound
            heapq.heapreplace(heap, (latest, next(self.seq), rid))
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


def progress_at(hb: Heartbeat) -> float:
    return hb.progress_at if hb.progress_at is not None else hb.last_seen


class MemberTable(dict):  # type: ignore[type-arg]
    """``replica id -> Heartbeat`` or ``-> MemberRequest`` that tells its index about every change."""

    def __init__(self, index: MemberIndex, is_heartbeats: bool) -> None:
        super().__init__()
        self.index = index
        self.is_heartbeats = is_heartbeats

    def __reduce__(self) -> Any:
        return dict, (dict(self),)  # a shallow copy or a pickle is a plain dict

    def __deepcopy__(self, memo: dict[int, Any]) -> MemberTable:
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
        old = dict.pop(self, rid, MemberTable._MISSING)
        if old is MemberTable._MISSING:
            if default is MemberTable._MISSING:
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
        removed, missing = self.index.removed, MemberTable._MISSING
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

    def __ior__(self, other: Any) -> MemberTable:  # type: ignore[misc]  # noqa: PYI034
        self.update(other)
        return self

