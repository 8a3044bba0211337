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

A group found corrupt ``QUARANTINE_AFTER`` times is *quarantined*: a new incarnation of it on
the same host is refused as a convicted one, so launchers give up on it there.

Every function here is pure bookkeeping over ``IntegrityBook``; nothing here retires a member,
logs an event or answers a request (``ftlm.ft.membership`` does, from the ``Verdict``), and the
quorum decision never reads this book: a corrupt member leaves the quorum only by being retired.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

MAX_STATES = 64
"""Most states whose digests are kept at once (older ones are dropped, judged or not)."""
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
    """The newest step whose digests all agreed (-1: none yet)."""


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
            if verdict.agreed:
                book.last_agreed = max(book.last_agreed, verdict.step)
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


def is_quarantined(book: IntegrityBook, group: str, host: str) -> bool:
    """Whether ``group`` was found corrupt ``QUARANTINE_AFTER`` times on ``host``."""
    return bool(host) and (group, host) in book.quarantined


def _count(book: IntegrityBook, report: DigestReport) -> None:
    group = report.group
    book.corrupt_count[group] = book.corrupt_count.get(group, 0) + 1
    if book.corrupt_count[group] >= QUARANTINE_AFTER:
        book.quarantined.add((group, report.host))


def _bound(book: IntegrityBook) -> None:
    for table in (book.expected, book.reports, book.judged, book.reporters):
        while len(table) > MAX_STATES:
            table.pop(next(iter(table)))  # the oldest first (dicts keep insertion order)
