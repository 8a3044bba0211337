"""Silent data corruption: comparing the digests of the replicated state that groups report.

Groups that committed the same state ``(step, chain)`` must hold bitwise-equal parameters and
optimizer state (rule C1). Every ``ft.integrity_every`` steps each participant digests its state
(``ftlm.ft.integrity``) and sends the digest with its next quorum request. ``IntegrityBook``
gathers the digests of each state; once every participant of the quorum issued at that step
that is still a member reported, ``judge`` compares them:

* one digest held by more than half of the reporting groups is the job's state; every group
  with another digest is *corrupt* (a flipped bit in memory, a faulty device): the coordinator
  retires it and it recovers from a majority member when it comes back;
* no majority (two groups that differ, or three that all differ): nobody can be trusted, and
  the job rolls back to its newest durable checkpoint.

A corrupt state may have been handed on before its digest was compared (rule I2): a member
that recovered from the corrupt one holds the same bits, and so does a checkpoint the corrupt one
wrote, which a restarted member loads. The book keeps which member copied from which, at what
step (``copied``), and the steps at which each member's digest agreed with another's;
``tainted`` names every member that copied, directly or through another, from the corrupt one
after its last agreement: they are retired with it. ``suspect_states`` records the job's states
since then in ``CoordinatorState.suspect``: a claim of one of them counts only from a member the
majority vouched for (``untrusted``, read by the head and the quorum decision).

A group found corrupt ``QUARANTINE_AFTER`` times is *quarantined*: a new incarnation of it on
the same host is refused as a convicted one, so launchers give up on it there.

Every function here is bookkeeping over ``IntegrityBook`` and ``CoordinatorState.suspect``;
nothing here retires a member, logs an event or answers a request (``ftlm.ft.membership`` does,
from the ``Verdict``), and the quorum decision never reads the digests: a corrupt member leaves
the quorum only by being retired.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ftlm.ft.quorum.types import CoordinatorState, Heartbeat, SuspectStates

MAX_STATES = 64
"""Most states whose digests are kept at once (older ones are dropped, judged or not)."""
MAX_SUSPECT = 16
"""Most ranges of suspect states kept (``SuspectStates``; the oldest go)."""
MAX_COPIES = 256
"""Most state copies (a recovering member and its source) remembered at once (the oldest go)."""
QUARANTINE_AFTER = 2
"""A group found corrupt this many times is not let back on the same host."""
WHY_CORRUPT = "its replicated state differs from the majority's (silent data corruption)"
"""What a corrupt member's refused messages are told: the process exits as a convicted one."""


@dataclass(frozen=True)
class DigestReport:
    """One group's digest of its state ``(step, chain)``, sent with a quorum request."""

    replica_id: str
    group: str
    host: str
    step: int
    chain: str
    digest: str


@dataclass(frozen=True)
class Verdict:
    """The comparison of one state's digests.

    ``digests``: group -> digest of every group that reported; ``majority``: the digest more than
    half of them hold ("" when none does); ``corrupt``: the reports of the groups to retire (all
    of them without a majority)."""

    step: int
    chain: str
    digests: dict[str, str]
    majority: str
    corrupt: tuple[DigestReport, ...]

    @property
    def agreed(self) -> bool:
        return bool(self.majority) and not self.corrupt


@dataclass
class IntegrityBook:
    """What the coordinator knows about digests: the reports of the states not judged yet, the
    participants expected to report each, the verdicts given, how often each group was found
    corrupt, and the hosts a group is quarantined on."""

    expected: dict[tuple[int, str], frozenset[str]] = field(default_factory=dict)
    """(step, chain) -> the replica ids that took part in the last quorum issued at that state."""
    reports: dict[tuple[int, str], dict[str, DigestReport]] = field(default_factory=dict)
    judged: dict[tuple[int, str], Verdict] = field(default_factory=dict)
    reporters: dict[tuple[int, str], frozenset[str]] = field(default_factory=dict)
    """(step, chain) -> the replica ids whose reports its verdict compared."""
    corrupt_count: dict[str, int] = field(default_factory=dict)
    quarantined: set[tuple[str, str]] = field(default_factory=set)
    """(group, host) pairs never let back."""
    last_agreed: int = -1
    """The newest step whose digests, two or more, all agreed (-1: none yet)."""
    agreed_at: dict[str, list[int]] = field(default_factory=dict)
    """replica id -> the steps at which its digest was the majority's (newest last, a few)."""
    copies: list[tuple[int, str, str]] = field(default_factory=list)
    """(step, source, recovering) of each state copy a quorum ordered, oldest first."""


def expect(book: IntegrityBook, step: int, chain: str, participants: frozenset[str]) -> None:
    """A quorum was issued at ``(step, chain)`` with these participants: they are the reporters
    of that state's digest (a later quorum at the same state replaces the earlier one's)."""
    key = (step, chain)
    done = book.judged.get(key)
    if done is not None:
        if participants <= book.reporters.get(key, frozenset()):
            return  # the same members again (a retried step): judged already
        # Other incarnations hold that state again (restarted from a checkpoint of it, after a
        # rollback): their digests are compared anew, not with the earlier reporters'.
        del book.judged[key]
    book.expected[key] = participants
    _bound(book)


def copied(book: IntegrityBook, step: int, sources: dict[str, str]) -> None:
    """A new quorum issued at ``step`` told each recovering member (key) to copy its state from a
    participant (value)."""
    book.copies.extend((step, src, dst) for dst, src in sorted(sources.items()))
    del book.copies[:-MAX_COPIES]


def suspect_since(book: IntegrityBook, corrupt: str, step: int) -> int:
    """The first step whose state ``corrupt``, found corrupt at ``step``, may have held corrupt:
    one past the newest step before ``step`` at which its digest agreed with a majority (an
    agreement at a later step, judged first, was with its own copies)."""
    return max((a for a in book.agreed_at.get(corrupt, ()) if a < step), default=-1) + 1


def tainted(book: IntegrityBook, corrupt: str, step: int) -> dict[str, str]:
    """The members that may hold the bits of ``corrupt``, found corrupt at ``step``: every one
    that copied from it from ``suspect_since`` on, and every one that copied from those after
    their copy; replica id -> the replica id it copied from."""
    return _copies_of(book, {corrupt: suspect_since(book, corrupt, step)})


def _copies_of(book: IntegrityBook, since: dict[str, int]) -> dict[str, str]:
    """The members that copied from a holder in ``since`` (holder -> the first step from which
    its copies count), directly or through another; replica id -> whom it copied from."""
    since = dict(since)
    out: dict[str, str] = {}
    for step, src, dst in book.copies:  # oldest first: a copy of a copy comes after the first
        if src in since and step >= since[src] and dst not in since:
            out[dst] = src
            since[dst] = step
    return out


def suspect_states(state: CoordinatorState, book: IntegrityBook, verdict: Verdict,
                   lo: int) -> SuspectStates:
    """A member was found corrupt by ``verdict``, its bits suspect from step ``lo``: the
    job's states from ``lo`` to the commit in flight become suspect (``SuspectStates``), vouched
    for by the live members whose digest agreed with the majority and those that copied from
    them since (``untrusted``)."""
    agreeing = {r for r in state.heartbeats if verdict.step in book.agreed_at.get(r, ())}
    vouched: dict[str, tuple[int, tuple[int, str] | None]] = dict.fromkeys(agreeing, (0, None))
    for rid in _copies_of(book, dict.fromkeys(agreeing, verdict.step)):
        vouched[rid] = (next(s for s, _, dst in reversed(book.copies) if dst == rid), None)
    # (Step 0 is never suspect: every group starts from the same initial state.)
    first = max(lo, 1)
    states = {s: {c} for s, c in state.head_log.items() if s >= first}
    if state.head is not None:  # and what a commit in flight reaches
        for chain, _ in state.index.head_quorum_info(state):
            states.setdefault(state.head[0] + 1, set()).add(chain)
    # The steps before this coordinator's first head: it never saw their chains (it started
    # after them), so every state at them is suspect.
    end = state.first_head if state.first_head is not None else first
    entry = SuspectStates(states, vouched, (first, end) if first < end else (0, 0))
    state.suspect.append(entry)
    del state.suspect[:-MAX_SUSPECT]
    return entry


def _names(entry: SuspectStates, step: int, chain: str) -> bool:
    """Whether ``(step, chain)`` is one of ``entry``'s suspect states."""
    if chain in entry.states.get(step, ()):
        return True
    first, end = entry.unknown
    return first <= step < end and chain not in entry.cleared.get(step, ())


def suspect_bounds(entry: SuspectStates, default: int) -> tuple[int, int]:
    """The first and last step of ``entry``'s suspect states (``default`` for both if none)."""
    steps = list(entry.states) + ([entry.unknown[0], entry.unknown[1] - 1] if entry.unknown[0] < entry.unknown[1] else [])
    return (min(steps), max(steps)) if steps else (default, default)


def committed(state: CoordinatorState, head: tuple[int, str]) -> None:
    """The head moved to ``head`` by a commit of a quorum issued at the step before: a new state
    of the job, not one handed on from before a ``SuspectStates`` was made. At a step whose
    chains the coordinator never saw (``unknown``) it is cleared (after a rollback to before
    them, the job trains those steps again, in another history)."""
    step, chain = head
    for entry in state.suspect:
        first, end = entry.unknown
        if first <= step < end and chain not in entry.states.get(step, ()):
            entry.cleared.setdefault(step, set()).add(chain)


def vouch_copies(state: CoordinatorState, step: int, sources: dict[str, str]) -> bool:
    """A quorum issued at ``step`` told recovering members (keys) to copy from participants
    (values): a copy of a vouched member's state is vouched for (a claim from ``step`` on, but
    not the one it holds now: the copy may fail and leave it with what it held), a copy of
    anyone else's is not. Whether any ``SuspectStates`` changed."""
    changed = False
    for entry in state.suspect:
        for dst, src in sources.items():
            if src in entry.vouched and dst not in entry.vouched:
                hb = state.heartbeats.get(dst)
                entry.vouched[dst] = (step, (hb.step, hb.chain) if hb is not None else None)
                changed = True
            elif src not in entry.vouched and dst in entry.vouched:
                del entry.vouched[dst]
                changed = True
    return changed


def suspect_snapshot(state: CoordinatorState) -> list[dict]:
    """``state.suspect`` as JSON data (the coordinator's record keeps the newest; a restarted
    coordinator takes it in again with ``restore_suspect``)."""
    return [{"states": {str(s): sorted(chains) for s, chains in sorted(e.states.items())},
             "vouched": {rid: [first, list(held) if held is not None else None]
                         for rid, (first, held) in sorted(e.vouched.items())},
             **({"unknown": list(e.unknown),
                 "cleared": {str(s): sorted(chains) for s, chains in sorted(e.cleared.items())}}
                if e.unknown[0] < e.unknown[1] else {})}
            for e in state.suspect]


def restore_suspect(state: CoordinatorState, snapshot: object) -> None:
    """Replace ``state.suspect`` with a ``suspect_snapshot``; ``ValueError`` naming what is
    wrong when ``snapshot`` is not one (and ``state`` is left as it was)."""
    if not isinstance(snapshot, list):
        raise ValueError("suspect states must be a list")
    entries = []
    for e in snapshot:
        if not isinstance(e, dict) or not isinstance(e.get("states"), dict) or not isinstance(e.get("vouched"), dict):
            raise ValueError("a suspect entry needs 'states' and 'vouched' objects")
        states = _chains_of(e["states"], "suspect states")
        unknown = e.get("unknown", [0, 0])
        if not (isinstance(unknown, list) and len(unknown) == 2 and all(type(x) is int and x >= 0 for x in unknown)):
            raise ValueError("suspect 'unknown' must be [first step, end step]")
        cleared = _chains_of(e.get("cleared", {}), "cleared states")
        vouched: dict[str, tuple[int, tuple[int, str] | None]] = {}
        for rid, v in e["vouched"].items():
            ok = (isinstance(v, list) and len(v) == 2 and isinstance(v[0], int)
                  and (v[1] is None or (isinstance(v[1], list) and len(v[1]) == 2
                                        and isinstance(v[1][0], int) and isinstance(v[1][1], str))))
            if not ok:
                raise ValueError(f"vouched {rid!r}: must be [first step, null or [step, chain]]")
            vouched[rid] = (v[0], (v[1][0], v[1][1]) if v[1] is not None else None)
        entries.append(SuspectStates(states, vouched, (unknown[0], unknown[1]), cleared))
    state.suspect[:] = entries[-MAX_SUSPECT:]


def _chains_of(data: object, what: str) -> dict[int, set[str]]:
    """``{"step": [chain, ...]}`` as step -> chains; ``ValueError`` naming ``what`` otherwise."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be an object")
    out: dict[int, set[str]] = {}
    for s, chains in data.items():
        if not s.isdigit() or not isinstance(chains, list) or not all(isinstance(c, str) for c in chains):
            raise ValueError(f"{what} {s!r}: a step must map to a list of chains")
        out[int(s)] = set(chains)
    return out


def untrusted(state: CoordinatorState, replica_id: str, claim: tuple[int, str]) -> bool:
    """Whether ``replica_id``'s claim of the state ``claim`` (step, chain) is a state of a
    ``SuspectStates`` that does not vouch for it (it must recover from one that is vouched for)."""
    step, chain = claim
    for entry in state.suspect:
        if _names(entry, step, chain):
            first, held = entry.vouched.get(replica_id, (step + 1, None))
            if step < first or claim == held:
                return True
    return False


def head_suspect(state: CoordinatorState) -> bool:
    """Whether the head is a state of a ``SuspectStates`` (the claims of members at it or
    behind it may be suspect, and nobody is told to load a checkpoint that may hold a corrupt
    member's bits)."""
    if state.head is None:
        return False
    step, chain = state.head
    return any(_names(entry, step, chain) for entry in state.suspect)


def trusted_claims(state: CoordinatorState, heartbeats: dict[str, Heartbeat]) -> Counter[tuple[int, str]]:
    """The claims of ``heartbeats`` less the ``untrusted`` ones: (step, chain) -> how many."""
    return Counter((hb.step, hb.chain) for r, hb in heartbeats.items() if not untrusted(state, r, (hb.step, hb.chain)))


def record(book: IntegrityBook, report: DigestReport, members: set[str] | frozenset[str]) -> list[Verdict]:
    """Add ``report``; returns the verdicts now due (at most one: this state's).

    ``members``: the replica ids alive now. A state is judged once every expected participant
    still a member reported. A report of a state judged already is compared with its verdict:
    a late reporter with another digest is corrupt alone."""
    key = (report.step, report.chain)
    done = book.judged.get(key)
    if done is not None:
        if report.group in done.digests:
            return []
        digests = {**done.digests, report.group: report.digest}
        late = Verdict(report.step, report.chain, digests, done.majority,
                       () if report.digest == done.majority else (report,))
        book.judged[key] = Verdict(done.step, done.chain, digests, done.majority, done.corrupt + late.corrupt)
        book.reporters[key] = book.reporters.get(key, frozenset()) | {report.replica_id}
        if done.majority and not late.corrupt:
            _agreed(book, report.replica_id, report.step)
        if late.corrupt and done.majority:
            _count(book, report)
        return [late] if late.corrupt else []
    book.reports.setdefault(key, {})[report.replica_id] = report
    _bound(book)
    return pending(book, members)


def pending(book: IntegrityBook, members: set[str] | frozenset[str]) -> list[Verdict]:
    """The verdicts due now: states every expected participant still a member has reported
    (call after members die or leave, too)."""
    out = []
    for key, reports in list(book.reports.items()):
        expected = book.expected.get(key)
        if expected is None:
            continue
        if all(rid in reports or rid not in members for rid in expected):
            del book.reports[key]
            verdict = judge(list(reports.values()))
            book.judged[key] = verdict
            book.reporters[key] = frozenset(reports)
            if verdict.agreed and len(reports) > 1:  # (a lone digest vouches for nothing)
                book.last_agreed = max(book.last_agreed, verdict.step)
            agreeing = [rid for rid, r in reports.items() if r.digest == verdict.majority]
            if verdict.majority and len(agreeing) > 1:  # (one digest alone was compared with nothing)
                for rid in agreeing:
                    _agreed(book, rid, verdict.step)
            for r in verdict.corrupt if verdict.majority else ():  # (a split convicts nobody)
                _count(book, r)
            out.append(verdict)
    _bound(book)
    return out


def judge(reports: list[DigestReport]) -> Verdict:
    """Compare the digests of one state: the majority's, and who differs from it."""
    first = reports[0]
    digests = {r.group: r.digest for r in reports}
    counts = Counter(digests.values())
    top, n = counts.most_common(1)[0]
    majority = top if 2 * n > len(digests) else ""
    corrupt = tuple(r for r in reports if r.digest != majority)
    return Verdict(first.step, first.chain, digests, majority, corrupt)


def restore_agreed(book: IntegrityBook, step: int, replica_ids: list[str]) -> None:
    """The digests of ``replica_ids`` agreed at ``step`` before this coordinator started (its
    record): ``suspect_since`` counts from there, as it would have for the coordinator that
    judged them."""
    for rid in replica_ids:
        if step not in book.agreed_at.get(rid, ()):
            _agreed(book, rid, step)
    book.last_agreed = max(book.last_agreed, step)
    _bound(book)


def is_quarantined(book: IntegrityBook, group: str, host: str) -> bool:
    """Whether ``group`` was found corrupt ``QUARANTINE_AFTER`` times on ``host``."""
    return bool(host) and (group, host) in book.quarantined


def _count(book: IntegrityBook, report: DigestReport) -> None:
    count_corrupt(book, report.group, report.host)


def count_corrupt(book: IntegrityBook, group: str, host: str) -> None:
    """``group`` was found corrupt on ``host`` (now, or in a previous coordinator's life: the
    record ``ftlm.ft.coordinator_record`` keeps); quarantined there from ``QUARANTINE_AFTER`` on."""
    book.corrupt_count[group] = book.corrupt_count.get(group, 0) + 1
    if book.corrupt_count[group] >= QUARANTINE_AFTER:
        book.quarantined.add((group, host))


def _agreed(book: IntegrityBook, replica_id: str, step: int) -> None:
    steps = book.agreed_at.setdefault(replica_id, [])
    steps.append(step)
    del steps[:-8]  # (verdicts come at most a few states out of order)


def _bound(book: IntegrityBook) -> None:
    for table in (book.expected, book.reports, book.judged, book.reporters):
        while len(table) > MAX_STATES:
            table.pop(next(iter(table)))  # the oldest first (dicts keep insertion order)
    while len(book.agreed_at) > MAX_COPIES:  # a member forgotten counts as never agreed: more is retired
        book.agreed_at.pop(next(iter(book.agreed_at)))
