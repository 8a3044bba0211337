"""The records of the quorum protocol: what members send, what the coordinator knows and issues.

Responsible for: the shapes of a member's quorum request (``MemberRequest``) and heartbeat
(``Heartbeat``), the decision's knobs (``QuorumOptions``), an issued quorum (``Quorum``, with the
questions a member asks of it and its JSON form), an explicit rollback (``Restore``), everything
the coordinator knows (``CoordinatorState``), the errors a replaced or convicted incarnation gets,
and the bounds on what a member may claim.

Not responsible for: any decision. Who is alive is ``ftlm.ft.quorum.members``; the head is
``head``; the quorum is ``decision``; the look on disk before a rollback is ``reload``; the search
for a member that fails its steps is ``bad_link``. The counts the decisions read are kept by
``index``.

Time values are seconds on one monotonic clock chosen by the caller. A replica id is
``"<group>:<incarnation>"``; each group has at most one live incarnation.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ftlm.errors import FaultError, RetiredError
from ftlm.ft.history import GENESIS, extend_chain
from ftlm.ft.quorum.index import MemberIndex

if TYPE_CHECKING:
    from ftlm.ft.quorum.bad_link import Probe
    from ftlm.ft.quorum.members import Suspicion

MAX_RETIRED = 4096
"""Bound on remembered replaced incarnations and convicted groups (enough for thousands of
restarts; memory stays small)."""
MAX_CLAIM = 2**53
"""Largest step or quorum id a member may claim (beyond it JSON numbers lose precision)."""
MAX_WATCH = 256
"""Most replica ids one quorum request may ask about (``watch``: the joiners a source serves)."""
MAX_HEAD_LOG = 1024
"""Most recent head states the coordinator remembers (``CoordinatorState.head_log``)."""
MISSING_NAMED = 20
"""Most groups a reason names (the rest are counted): reasons stay short at any size."""


def plural(n: int, word: str) -> str:
    """``"1 group"``, ``"2 groups"``: the counts in reasons."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class StaleIncarnation(FaultError):
    """A replica group incarnation was replaced or retired; the old process must exit."""


class Convicted(StaleIncarnation, RetiredError):
    """The incarnation was retired for failing the steps it took part in (``convict``), or for a
    state found or suspected corrupt (``integrity``); the coordinator's 409 answer says so in a
    field (``"convicted": true``), and the process exits with ``ftlm.errors.EXIT_RETIRED``.

    ``suspect_state``: (step, chain) of the state it claimed when that state may hold a corrupt
    member's bits (a checkpoint it loaded, rule I2): it sets that checkpoint aside before it
    exits, so that its next process starts from an older one."""

    def __init__(self, message: str, suspect_state: tuple[int, str] | None = None) -> None:
        super().__init__(message)
        self.suspect_state = suspect_state


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
    integrity: tuple[int, str, str] | None = None
    """``(step, chain, digest)``: the digest of the replicated state it held at that committed
    state (``ftlm.ft.quorum.integrity``), sent every ``ft.integrity_every`` steps."""


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
    max_participants: int = 0
    """Most members that train data in one quorum; the other holders of the head are *spares*
    (``ftlm.ft.quorum.spares``): they follow every step and take a participant's place when one
    is missing. 0: every holder of the head trains (no spares)."""

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
    spares: list[str] = field(default_factory=list)
    """Members holding the head that train no data (beyond ``max_participants``): they enter the
    all-reduce with zeros and apply its average, as a participant does, sorted by group."""
    groups_left: int = 0
    """Groups that left the job finished at this quorum's state (step, chain) and have not come
    back: a group at the last step waits for the job's other groups, but not for these (the
    coordinator sets it as it issues the quorum)."""
    _ranks: dict[str, int] = field(init=False, repr=False, compare=False)
    """replica id -> its position among the members (its rank)."""
    _slices: dict[str, int] = field(init=False, repr=False, compare=False)
    """participant id -> its position among the participants (its data slice)."""
    _recovering: frozenset[str] = field(init=False, repr=False, compare=False)
    _spares: frozenset[str] = field(init=False, repr=False, compare=False)
    _joiners: dict[str, list[str]] = field(init=False, repr=False, compare=False)
    """participant id -> the recovering members that pull the state from it."""

    def __post_init__(self) -> None:
        # Derived once: a quorum's members never change after it is issued, and each member's
        # answer asks these for every member (a scan per question would be quadratic).
        self._ranks = {m.replica_id: i for i, m in enumerate(self.members)}
        self._slices = {r: i for i, r in enumerate(self.participants)}
        self._recovering = frozenset(self.recovering)
        self._spares = frozenset(self.spares)
        self._joiners = {}
        for joiner, source in self.sources.items():
            self._joiners.setdefault(source, []).append(joiner)

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
    def spare_count(self) -> int:
        return len(self.spares)

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

    def is_spare(self, replica_id: str) -> bool:
        """Whether ``replica_id`` holds the head but trains no data in this quorum."""
        return replica_id in self._spares

    def source_of(self, replica_id: str) -> str | None:
        """The participant ``replica_id`` pulls the state from (None unless it recovers)."""
        return self.sources.get(replica_id)

    def joiners_of(self, replica_id: str) -> list[Member]:
        """The recovering members that pull the state from ``replica_id``, in member order."""
        return [self.members[self._ranks[j]] for j in self._joiners.get(replica_id, ()) if j in self._ranks]

    @property
    def digest(self) -> str:
        """A digest of who the members are: two quorums with the same members have the same one."""
        return membership_digest(self._ranks)

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
            "spares": list(self.spares),
            "groups_left": self.groups_left,
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
                spares=[str(r) for r in d.get("spares") or []],
                groups_left=int(d.get("groups_left") or 0),
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


@dataclass
class SuspectStates:
    """States a member found corrupt may have handed on (rule I2): the job's states (``states``,
    step -> chain) from the step after the newest at which its digest agreed with a majority up
    to the commit in flight when it was found. It may have written checkpoints of its corrupt
    bits at any of them, which a restarted member loads. A claim of one of these states counts
    (as a holder of the head, or as the target of a rollback) only from a member ``vouched``
    for: one whose digest the majority that found it corrupt agreed with, or one told to copy
    its state from such a member since (its claims from that copy's step on, less the state it
    held when told: the copy may fail). States of another history (after a rollback) are not
    suspect."""

    states: dict[int, set[str]]
    vouched: dict[str, tuple[int, tuple[int, str] | None]]
    """replica id -> (the first step of the claims it is vouched for, a claim it is not)."""
    unknown: tuple[int, int] = (0, 0)
    """Steps ``[first, end)`` of the suspect ones whose chains the coordinator never saw (they
    came before its start): every state at them is suspect, less ``cleared``."""
    cleared: dict[int, set[str]] = field(default_factory=dict)
    """Chains at ``unknown`` steps that the job committed after the entry was made (another
    history, after a rollback): not suspect."""


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
    suspect: list[SuspectStates] = field(default_factory=list)
    """States a member found corrupt may have handed on: only members vouched for may claim them
    (``integrity.untrusted``, rule I2)."""
    head_log: dict[int, str] = field(default_factory=dict)
    """The head's chain at each of its recent steps (``MAX_HEAD_LOG``): the states a
    ``SuspectStates`` names."""
    first_head: int | None = None
    """The step of the first head this coordinator chose: the chains of the steps before it are
    not in ``head_log`` (``SuspectStates.unknown``)."""
    stranded: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Members to retire now because they hold a suspect state and nobody vouched for holds
    any (``head._roll_back``) -> that state (they set its checkpoint aside)."""
    set_aside: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Retired replica ids told to set their state's checkpoint aside -> that state."""
    index: MemberIndex = field(default_factory=MemberIndex, compare=False, repr=False)
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

