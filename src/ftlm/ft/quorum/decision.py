"""The per-step quorum decision: whether to issue a quorum now, who is in it, its id, who
participates and who recovers from whom.

Responsible for: ``compute_quorum`` (docs/ft-protocol.md, 'The rules'), a pure function of the
state, the clock and the options that returns a quorum or a human-readable reason for every "not
yet", and ``_build``, which lays the issued quorum out (members sorted by group, participants the
holders of the head, or as many as there are training places and the rest spares
(``spares.assign_roles``), a source for each recovering member, the id).

Not responsible for: who is alive (``ftlm.ft.quorum.members``: the decision reads the live
members through ``members.live_view`` and the counts of ``index``, never a pass over the members
unless it issues a quorum), moving the head (``head``), whom an attempt of a failing step leaves
out (``bad_link.leave_out``), or recording the issued quorum (``members.commit_quorum``).
"""

from __future__ import annotations

import itertools

from ftlm.ft.quorum.bad_link import leave_out
from ftlm.ft.quorum.integrity import head_suspect, untrusted
from ftlm.ft.quorum.members import live_view
from ftlm.ft.quorum.spares import assign_roles
from ftlm.ft.quorum.types import (
    MISSING_NAMED,
    CoordinatorState,
    Member,
    MemberRequest,
    Quorum,
    QuorumOptions,
    plural,
)


def compute_quorum(now: float, state: CoordinatorState, options: QuorumOptions) -> tuple[Quorum | None, str]:
    """Decide whether to issue a quorum now; never mutates ``state``.

    Returns ``(quorum, reason)``, or ``(None, reason)`` saying what is awaited. The caller records
    an issued quorum with ``commit_quorum``. Needs the head (``advance_head``). Every rule reads
    counts kept by the index, so a request that does not complete a quorum costs the same at any
    number of groups.
    """
    live = live_view(now, state, options)
    index, pending, head = live.index, live.pending, state.head
    if not pending:
        return None, "no member has asked for a quorum"
    if head is None:
        return None, "rebuilding membership: waiting for members to report their committed state"
    if len(pending) < options.min_replicas:
        return None, f"only {plural(len(pending), 'healthy group')} asked, need min_replicas={options.min_replicas}"
    if not index.pending_claims.get(head):
        holders = index.hb_holders.get(head, {})
        if not holders:
            return None, f"no live group holds the newest state (step {head[0]}); waiting for the rollback"
        named = _named([live.heartbeats[r].group for r in itertools.islice(holders, MISSING_NAMED)], len(holders))
        return None, (f"waiting for the holders of step {head[0]} ({named}) to ask; "
                      f"the groups asking must recover from them")
    if head_suspect(state) and all(untrusted(state, r, head) for r, req in pending.items()
                                   if (req.step, req.chain) == head):
        return None, (f"waiting for a holder of step {head[0]} not suspect of a corruption found late "
                      "to ask; the groups asking may hold a corrupt member's bits and must recover")

    prev = state.prev_quorum
    index.track_prev(prev)
    if prev is not None and index.prev_alive and not index.prev_idle:
        # Every live member of the previous quorum asked: the same members step forward together.
        joiners = len(pending) - index.prev_alive
        extra = f" (+{plural(joiners, 'joiner')})" if joiners else ""
        reason = f"fast path: all {plural(index.prev_alive, 'healthy member')} of quorum {prev.quorum_id} asked{extra}"
        return _build(now, state, options, live, reason), reason

    # A live participant of a quorum issued at this very step that has not asked again may have
    # committed it: a quorum without it could commit the same step differently (a fork).
    if state.head_quorums:
        unsettled = index.track_unsettled(live)
        if unsettled:
            named = _named([live.heartbeats[r].group for r in itertools.islice(unsettled, MISSING_NAMED)],
                           len(unsettled))
            return None, (f"waiting for {named}: it took part in step {head[0]} and may "
                          "have committed it (or it hangs: then progress_timeout declares it dead)")

    if prev is not None and _search_waits(live, options, prev):
        named = _named(_prev_not_asking(live), index.prev_idle)
        return None, (f"waiting for {named}: it took part in quorum {prev.quorum_id}, a failed attempt of "
                      f"step {head[0]} that a search for a bad link judges by the next attempt "
                      "(or it hangs: then progress_timeout declares it dead)")

    started = state.round_started
    if started is None:
        started = index.oldest_request()
        assert started is not None
    left = options.join_timeout - (now - started)
    asked, alive = len(index.pending_groups), len(index.hb_groups)
    if prev is None and asked < options.expected_groups and left > 0:
        # The job's first quorum: groups start at slightly different times; give the others a
        # moment so that they all train from step 0 instead of joining as recovering members.
        return None, (f"first quorum: {asked} of {options.expected_groups} expected "
                      f"groups asked; join timeout in {left:.1f} s")
    if asked == alive:
        reason = f"all {plural(alive, 'heartbeating group')} asked"
        return _build(now, state, options, live, reason), reason
    if 2 * asked <= alive:
        return None, f"{asked} of {alive} heartbeating groups asked: not a majority"
    missing = _named(_not_asking(live), alive - asked)
    if left > 0:
        return None, f"waiting for {missing} (asked {asked} of {alive}); join timeout in {left:.1f} s"
    reason = f"join timeout passed: {asked} of {alive} heartbeating groups asked, not {missing}"
    return _build(now, state, options, live, reason), reason


def _named(groups: list[str], total: int) -> str:
    """``groups`` (at most ``MISSING_NAMED`` of ``total``) for a reason, sorted, the rest counted."""
    more = f" and {total - len(groups)} more" if total > len(groups) else ""
    return ", ".join(sorted(groups)) + more


def _search_waits(live: CoordinatorState, options: QuorumOptions, prev: Quorum) -> bool:
    """Whether the next attempt of the head's step waits for the live members of ``prev`` that
    have not asked again, some having asked: ``prev`` was an attempt of the head's step (it failed
    for those who asked, or their answer was lost) in a job the search for a bad link may run in
    (``bad_link``). The search judges an attempt by the next one, and an attempt without one of
    its members tells it nothing (that member may be what failed it). A bad link fails some
    members at once and others at their all-reduce timeout, so one attempt's members ask again
    that far apart, longer than ``join_timeout``: without this wait the next attempt goes without
    the slow one every time, recovering members most (participants are waited for already, as
    unsettled), and the search never narrows. Bounded by ``progress_timeout`` (a member stuck
    longer is declared hung), so only where that is set; reads the index's counts only."""
    index = live.index
    assert live.head is not None
    return (options.probe_after > 0 and options.progress_timeout > 0 and index.prev_idle > 0
            and index.prev_alive > index.prev_idle and len(index.hb_groups) >= 3
            and (prev.step, prev.chain, prev.epoch) == (*live.head, live.epoch))


def _prev_not_asking(live: CoordinatorState) -> list[str]:
    """Up to ``MISSING_NAMED`` groups of live members of the previous quorum without a request."""
    index, out = live.index, []
    for r in index.idle:
        if r in index.prev_ids:
            out.append(live.heartbeats[r].group)
            if len(out) == MISSING_NAMED:
                break
    return out


def _not_asking(live: CoordinatorState) -> list[str]:
    """Up to ``MISSING_NAMED`` live groups none of whose replicas asked: the groups of replicas that
    heartbeat without a request (``index.idle``), less those whose other incarnation asked."""
    asking = live.index.pending_groups
    out: dict[str, None] = {}
    for r in live.index.idle:
        group = live.heartbeats[r].group
        if group not in asking:
            out[group] = None
            if len(out) == MISSING_NAMED:
                break
    return list(out)


def _build(now: float, state: CoordinatorState, options: QuorumOptions, live: CoordinatorState,
           reason: str) -> Quorum:
    """The quorum of every live member that asked (less those a search leaves out)."""
    assert state.head is not None
    candidates: dict[str, MemberRequest] = dict(live.pending)
    holders = {r for r, req in candidates.items() if (req.step, req.chain) == state.head}
    if state.suspect:  # a state a corrupt member may have written: held only by the vouched (rule I2)
        holders = {r for r in holders if not untrusted(state, r, state.head)}
    out, why = leave_out(state, options, candidates, holders)
    if out:
        candidates = {r: req for r, req in candidates.items() if r not in out}
        holders.difference_update(out)
        reason = why
    reqs = sorted(candidates.values(), key=lambda q: (q.group, q.replica_id))
    members = [Member(q.replica_id, q.group, q.step, q.meta, q.watch) for q in reqs]
    participants, spares = assign_roles([m.replica_id for m in members if m.replica_id in holders],
                                        state.prev_quorum, options.max_participants)
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
                  state.head[1], state.epoch, out, spares)

