"""Who is alive: heartbeats, quorum requests, departures and expiry, applied to ``CoordinatorState``.

Responsible for: recording a member's heartbeat and quorum request (replacing an older
incarnation of its group, refusing a replaced or convicted one), expiring members that stopped
heartbeating or making progress, declaring dead the members of a failed step that stayed silent
(``Suspicion``), dropping a member that left or whose process ended, and recording an issued
quorum (its members' requests answered).

Not responsible for: which state is authoritative (``ftlm.ft.quorum.head``), whether a quorum is
due (``decision``), or the search for a member that fails its steps (``bad_link``, which
``commit_quorum`` and ``record_request`` feed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ftlm.ft.quorum.bad_link import count_attempt
from ftlm.ft.quorum.index import MemberIndex
from ftlm.ft.quorum.reload import newest_claim, reload_target
from ftlm.ft.quorum.types import (
    MAX_CLAIM,
    MAX_RETIRED,
    Convicted,
    CoordinatorState,
    Heartbeat,
    MemberRequest,
    Quorum,
    QuorumOptions,
    StaleIncarnation,
    plural,
)


@dataclass
class Suspicion:
    """Members of quorum ``quorum_id`` reported that its step failed (a peer's transport error, a
    timeout), the first at ``opened_at``. Once ``suspect_window`` has passed, the members of that
    quorum not heard from since ``opened_at`` are declared dead: the reports are corroborated by
    the silence of whom they suspect, so a report never expires a member that still speaks."""

    quorum_id: int
    opened_at: float
    reporters: set[str] = field(default_factory=set)


def _is_fresh(now: float, state: CoordinatorState, replica_id: str, options: QuorumOptions) -> bool:
    hb = state.heartbeats.get(replica_id)
    return hb is not None and now - hb.last_seen < options.heartbeat_timeout


def _retire(state: CoordinatorState, replica_id: str, now: float, why: str = "") -> None:
    state.heartbeats.pop(replica_id, None)
    state.pending.pop(replica_id, None)
    state.retired[replica_id] = now
    while len(state.retired) > MAX_RETIRED:
        state.retired.pop(next(iter(state.retired)))  # dicts keep insertion order: oldest first
    if why:
        state.retired_why[replica_id] = why
        while len(state.retired_why) > MAX_RETIRED:
            state.retired_why.pop(next(iter(state.retired_why)))
    while len(state.set_aside) > MAX_RETIRED:
        state.set_aside.pop(next(iter(state.set_aside)))


def _retire_other_incarnations(state: CoordinatorState, replica_id: str, group: str, now: float) -> list[str]:
    if replica_id in state.retired:
        why = state.retired_why.get(replica_id)
        if why is not None:  # the one reason recorded: a conviction (``remove_member``'s ``why``)
            raise Convicted(f"replica {replica_id} {why}; this process must exit",
                            state.set_aside.get(replica_id))
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


def live_view(now: float, state: CoordinatorState, options: QuorumOptions) -> CoordinatorState:
    """The state whose tables hold exactly the live members at ``now``: every heartbeat fresh,
    every request from a replica that heartbeats. That is ``state`` itself whenever ``expire``
    ran at ``now`` (the coordinator always does: two checks of the index, no pass over the
    members); otherwise (a caller that did not expire, tables written directly) a copy holding
    only those, with an index of its own. The decisions read members only through it, so they
    are written once; they write to ``state``, never to the view."""
    index = state.index
    if not index.orphans and not index.oldest_fresh_violation(now, options.heartbeat_timeout):
        return state
    fresh = {r: hb for r, hb in state.heartbeats.items() if _is_fresh(now, state, r, options)}
    return dataclasses.replace(state, heartbeats=fresh, index=MemberIndex(),
                               pending={r: req for r, req in state.pending.items() if r in fresh})


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
        # request can arrive after it: it must not take the claim back (the head would look
        # unheld for a moment, or a reload just reported would be undone).
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
    if (req.disk_checked >= 0 and req.disk_checked == reload_target(state)
            and req.disk_round == state.reload_rounds.get(req.replica_id, 0)):
        state.reloads[req.replica_id] = None  # it looked for a newer checkpoint (and loaded it, if any)
        state.looked_below[req.replica_id] = newest = newest_claim(state)
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
        gone.append((r, f"silent for {now - hb.last_seen:.2f} s after {plural(len(s.reporters), 'peer')} "
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
    count_attempt(state, quorum)
    state.prev_quorum = quorum
    state.suspicion = None  # a new quorum formed: whoever it left out is no longer waited for
    state.quorum_id = max(state.quorum_id, quorum.quorum_id)
    if state.head is not None and quorum.step == state.head[0]:
        state.head_quorums.append((quorum.quorum_id, list(quorum.participants)))
        del state.head_quorums[:-64]  # retries of one step: only recent ones can still commit
    state.index.pending.discard_all(quorum.replica_ids())  # the same table as ``state.pending``
    _sync_round(state)


def withdraw_request(state: CoordinatorState, req: MemberRequest) -> bool:
    """Drop ``req`` if it is still its replica's pending request (the asker stopped waiting).

    Returns whether it was dropped. Keeps a quorum from being issued to a member nobody answers.
    """
    if state.pending.get(req.replica_id) is not req:
        return False
    del state.pending[req.replica_id]
    _sync_round(state)
    return True
