"""The search for a member that fails the steps it takes part in (a bad link, a faulty device):
suspicion, probe, conviction.

Responsible for: counting the failed attempts of the head's step by the same members
(``Probe``), leaving half the suspects out of the next attempt to find the one that makes them
fail (``leave_out``), and the two-step verdict (accused when an attempt without it commits,
convicted when the next step fails with it again: ``convict``). Every function but
``count_attempt`` and ``convict`` is pure.

Not responsible for: retiring the convicted member (``ftlm.ft.membership`` does, through
``members.remove_member``), whether a quorum is due (``decision``, which asks ``leave_out`` whom an
attempt leaves out), nor for members that die or go silent (``members.expire``, ``Suspicion``).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftlm.ft.quorum.types import (
    MAX_RETIRED,
    MISSING_NAMED,
    CoordinatorState,
    MemberRequest,
    Quorum,
    QuorumOptions,
    plural,
)


@dataclass
class Probe:
    """Failed attempts of the head's step, and the search for the member that makes them fail.

    A gray failure that ends no process (a bad link, a faulty device) fails every attempt its
    group takes part in with a peer, and every group would give up together
    (``ft.max_consecutive_failures``). If one member does that, it is among the members of every
    failed attempt since it joined: ``suspects`` (an earlier attempt may have failed for another
    reason). After ``QuorumOptions.probe_after`` failed attempts, each next attempt leaves half
    the suspects out, their requests waiting (``leave_out``); an attempt that fails without them
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


def count_attempt(state: CoordinatorState, quorum: Quorum) -> None:
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


def leave_out(state: CoordinatorState, options: QuorumOptions, candidates: dict[str, MemberRequest],
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
    why = (f"probe: {plural(probe.failed, 'attempt')} of step {probe.step} failed, each with {named}; "
           f"trying without {which} ({'its request waits' if len(out) == 1 else 'their requests wait'}")
    aside = tuple(r for r in candidates if r not in pool)
    if aside:
        why += f"; {plural(len(aside), 'other')} set aside until the search ends"
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
                   f"{plural(len(aside), 'other')} aside until the search ends")


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
    while len(state.convicted) > MAX_RETIRED:
        state.convicted.pop(next(iter(state.convicted)))
    return accused, (f"step {probe.cleared_at} failed in {plural(probe.failed, 'attempt')} with this "
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

