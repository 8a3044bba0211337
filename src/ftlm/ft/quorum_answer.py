"""What one member of an issued quorum is told: the compact quorum answer.

The whole quorum, every member with its meta (about 170 bytes each), would be O(groups^2) bytes a
step (330 KB to each of 2,000 members). A member needs only its own part, and that is what it gets:

* the quorum's identity and history: id, epoch, step, the head's chain and the chain a commit
  reaches (``next_chain``: the participants' list stays at the coordinator), the reason;
* sizes: members (the process group's world size), participants (P, the gradient divisor),
  recovering members, spares and groups; the first member's rendezvous store; a digest of the membership
  (``GroupProtocol`` compares it to tell "the same members came back" after a failed step);
* its own place: replica id, rank in the process group, participant index (its data slice), or
  ``spare`` (it holds the head and follows the step with zeros, ``ftlm.ft.quorum.spares``);
* recovering: its source (replica id, group and meta, i.e. the transfer addresses) and the
  participants' list its buffered replay folds into the chain;
* a source: the recovering members that pull from it (with their meta: the recovery request);
* which of the replicas it asked about (``watch``: the joiners it still serves) are members.

Responsible for: building that answer from a ``Quorum`` (``AnswerEncoder``: the part common to all
members is JSON-encoded once per quorum, each member's own few fields are spliced in front), and
``MemberQuorum``, the member's view, which answers the questions ``GroupProtocol`` and the manager
ask of a quorum with the same names as ``Quorum``, for itself.

Not responsible for: deciding the quorum (``ftlm.ft.quorum``), HTTP (``ftlm.ft.coordinator``).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from ftlm.ft.history import is_chain
from ftlm.ft.quorum import Member, Quorum

__all__ = ["AnswerEncoder", "MemberQuorum", "member_json"]


def _member(m: Member) -> dict[str, Any]:
    return {"replica_id": m.replica_id, "group": m.group, "step": m.step, "meta": m.meta}


def shared_fields(q: Quorum) -> dict[str, Any]:
    """The part of the answer every member of ``q`` gets."""
    return {"quorum_id": q.quorum_id, "step": q.step, "chain": q.chain, "next_chain": q.next_chain(),
            "epoch": q.epoch, "issued_at": q.issued_at, "reason": q.reason, "size": q.size,
            "participant_count": q.participant_count, "recovering_count": q.recovering_count,
            "spare_count": q.spare_count, "group_count": q.group_count, "digest": q.digest,
            "store": q.store, "groups_left": q.groups_left}


def own_fields(q: Quorum, replica_id: str) -> dict[str, Any]:
    """The part of the answer only ``replica_id`` gets (a few fields; more for a joiner or source)."""
    fields: dict[str, Any] = {"replica_id": replica_id, "rank": q.rank(replica_id),
                              "participant_index": q.participant_index(replica_id)}
    source = q.source_of(replica_id)
    if source is not None:
        src = q.member(source)
        fields["source"] = _member(src) if src is not None else {"replica_id": source}
    if q.is_recovering(replica_id):
        fields["participant_ids"] = list(q.participants)
    if q.is_spare(replica_id):
        fields["spare"] = True
    joiners = q.joiners_of(replica_id)
    if joiners:
        fields["joiners"] = [_member(m) for m in joiners]
    me = q.member(replica_id)
    if me is not None and me.watch:
        fields["present"] = [r for r in me.watch if q.present(r)]
    return fields


def member_json(q: Quorum, replica_id: str) -> dict[str, Any]:
    """The answer ``replica_id`` gets for ``q``, as a JSON-able dict (tests and the simulator)."""
    return {**own_fields(q, replica_id), **shared_fields(q)}


class AnswerEncoder:
    """Encodes the answers of a quorum's members; the shared part once per quorum.

    A plain participant's own part is three fields (replica id, rank, participant index): it is
    formatted into a byte template, the same bytes ``json.dumps`` gives, without building a dict
    or running the encoder (a step's 2,000 answers are written one after another). A
    member with anything more (recovering, a source, watching) goes through ``own_fields``."""

    def __init__(self) -> None:
        self._quorum: Quorum | None = None
        self._shared = b""
        self._special: frozenset[str] = frozenset()
        self._ids: dict[str, bytes] = {}  # replica id -> its JSON string

    def encode(self, q: Quorum, replica_id: str) -> bytes:
        """``member_json(q, replica_id)`` as JSON bytes."""
        if q is not self._quorum:
            self._start(q)
        if replica_id not in self._special:
            index = q.participant_index(replica_id)
            rid = self._ids.get(replica_id)
            if rid is None:
                rid = self._ids[replica_id] = json.dumps(replica_id).encode()
            return b'{"replica_id": %s, "rank": %d, "participant_index": %s, %s' % (
                rid, q.rank(replica_id), b"null" if index is None else b"%d" % index, self._shared[1:])
        own = json.dumps(own_fields(q, replica_id)).encode()
        return own[:-1] + b", " + self._shared[1:]  # the two objects' keys are disjoint

    def _start(self, q: Quorum) -> None:
        self._quorum, self._shared = q, json.dumps(shared_fields(q)).encode()
        # Whoever own_fields gives more than the three fields: the recovering, their sources,
        # the spares and the members watching others.
        self._special = frozenset(itertools.chain(q.sources, q.sources.values(), q.recovering, q.spares,
                                                  [m.replica_id for m in q.members if m.watch]))
        if len(self._ids) > 2 * len(q.members) + 64:  # members come and go: keep it bounded
            self._ids.clear()


@dataclass
class MemberQuorum:
    """One member's view of an issued quorum (its compact answer); see the module docstring.

    Methods that take a replica id answer for this member itself, its source and its joiners
    (the only members its answer names); asked about another member they raise ValueError, since
    an answer that does not name a member cannot say (``present`` answers for watched ids too).
    """

    replica_id: str
    quorum_id: int
    step: int
    chain: str
    committed_chain: str
    """The chain a participant reaches by committing this step (``next_chain()``)."""
    epoch: str
    issued_at: float
    reason: str
    size: int
    participant_count: int
    recovering_count: int
    group_count: int
    digest: str
    store: str
    own_rank: int
    index: int | None
    """This member's participant index (data slice); None while it recovers."""
    source: Member | None = None
    joiners: list[Member] = field(default_factory=list)
    present_ids: frozenset[str] = frozenset()
    participant_ids: list[str] | None = None
    spare: bool = False
    """This member holds the head but trains no data: it follows the step with zeros."""
    spare_count: int = 0
    groups_left: int = 0
    """Groups that left finished at this state and have not come back (``Quorum.groups_left``)."""

    # -- the questions GroupProtocol and the manager ask (same names as on ``Quorum``) ----------
    def next_chain(self) -> str:
        return self.committed_chain

    def participant_index(self, replica_id: str) -> int | None:
        return self.index if self._mine(replica_id) else None

    def rank(self, replica_id: str) -> int:
        self._mine(replica_id, strict=True)
        return self.own_rank

    def is_recovering(self, replica_id: str) -> bool:
        if replica_id in self._joiner_ids:
            return True
        if self.source is not None and replica_id == self.source.replica_id:
            return False
        self._mine(replica_id, strict=True)
        return self.index is None and not self.spare

    def is_spare(self, replica_id: str) -> bool:
        return self.spare if self._mine(replica_id) else False

    def source_of(self, replica_id: str) -> str | None:
        if replica_id in self._joiner_ids:
            return self.replica_id
        self._mine(replica_id, strict=True)
        return self.source.replica_id if self.source is not None else None

    def joiners_of(self, replica_id: str) -> list[Member]:
        self._mine(replica_id, strict=True)
        return list(self.joiners)

    def present(self, replica_id: str) -> bool:
        return (replica_id == self.replica_id or replica_id in self.present_ids or replica_id in self._joiner_ids
                or (self.source is not None and replica_id == self.source.replica_id))

    def member(self, replica_id: str) -> Member | None:
        if self.source is not None and replica_id == self.source.replica_id:
            return self.source
        return next((m for m in self.joiners if m.replica_id == replica_id), None)

    @property
    def participants(self) -> list[str]:
        """The participants' replica ids: only a recovering member's answer lists them (its replay
        folds them into the chain)."""
        if self.participant_ids is None:
            raise ValueError(f"the answer of quorum {self.quorum_id} to {self.replica_id} does not list the "
                             "participants (only a recovering member's does)")
        return self.participant_ids

    @property
    def _joiner_ids(self) -> set[str]:
        return {m.replica_id for m in self.joiners}

    def _mine(self, replica_id: str, strict: bool = False) -> bool:
        if replica_id == self.replica_id:
            return True
        if strict:
            raise ValueError(f"the answer of quorum {self.quorum_id} to {self.replica_id} knows nothing of "
                             f"{replica_id}")
        return False

    # -- the wire ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The answer as a JSON-able dict (the leader shares it with its group's ranks)."""
        out: dict[str, Any] = {
            "replica_id": self.replica_id, "rank": self.own_rank, "participant_index": self.index,
            "quorum_id": self.quorum_id, "step": self.step, "chain": self.chain,
            "next_chain": self.committed_chain, "epoch": self.epoch, "issued_at": self.issued_at,
            "reason": self.reason, "size": self.size, "participant_count": self.participant_count,
            "recovering_count": self.recovering_count, "spare_count": self.spare_count,
            "group_count": self.group_count, "digest": self.digest, "store": self.store,
            "groups_left": self.groups_left}
        if self.source is not None:
            out["source"] = _member(self.source)
        if self.participant_ids is not None:
            out["participant_ids"] = list(self.participant_ids)
        if self.joiners:
            out["joiners"] = [_member(m) for m in self.joiners]
        if self.present_ids:
            out["present"] = sorted(self.present_ids)
        if self.spare:
            out["spare"] = True
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any] | str | bytes) -> MemberQuorum:
        """Parse an answer (dict or its JSON text). Raises ValueError naming what is wrong."""
        d: Any = data
        try:
            if isinstance(d, (str, bytes)):
                d = json.loads(d)
            index = d["participant_index"]
            chains = (str(d["chain"]), str(d["next_chain"]))
            if not all(is_chain(c) for c in chains):
                raise ValueError("chain and next_chain must be 64 lowercase hex digits")
            participant_ids = d.get("participant_ids")
            q = cls(
                replica_id=str(d["replica_id"]), quorum_id=int(d["quorum_id"]), step=int(d["step"]),
                chain=chains[0], committed_chain=chains[1], epoch=str(d["epoch"]),
                issued_at=float(d["issued_at"]), reason=str(d.get("reason", "")),
                size=int(d["size"]), participant_count=int(d["participant_count"]),
                recovering_count=int(d["recovering_count"]), group_count=int(d["group_count"]),
                digest=str(d["digest"]), store=str(d["store"]), own_rank=int(d["rank"]),
                index=None if index is None else int(index),
                source=_parse_member(d["source"]) if d.get("source") is not None else None,
                joiners=[_parse_member(m) for m in d.get("joiners") or []],
                present_ids=frozenset(str(r) for r in d.get("present") or []),
                participant_ids=[str(r) for r in participant_ids] if participant_ids is not None else None,
                spare=bool(d.get("spare", False)), spare_count=int(d.get("spare_count", 0)),
                groups_left=int(d.get("groups_left", 0)))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a quorum answer: {e!r} in {str(d)[:200]}") from e
        if q.spare and q.index is not None:
            raise ValueError(f"not a quorum answer: a spare with participant index {q.index}")
        if not 0 <= q.own_rank < q.size or (q.index is not None and not 0 <= q.index < q.participant_count):
            raise ValueError(f"not a quorum answer: rank {q.own_rank} of {q.size} or participant index "
                             f"{q.index} of {q.participant_count} out of range")
        return q


def _parse_member(m: Any) -> Member:
    meta = m.get("meta") or {}
    if not isinstance(meta, dict):
        raise ValueError(f"meta of {m.get('replica_id')!r} is not an object")
    return Member(str(m["replica_id"]), str(m.get("group", str(m["replica_id"]).split(":", 1)[0])),
                  int(m.get("step", 0)), meta)
