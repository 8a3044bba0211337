"""The head: which committed state is authoritative, how it moves forward, and explicit rollbacks.

Responsible for: choosing the head from the members' claims when it is unknown (a fresh or
restarted coordinator, after one ``rebuild_grace``), moving it forward by one step when a member
reports a commit of a quorum issued at the head's step, rolling back (a ``Restore``) when no live
member has held it for ``rollback_grace``, and naming a member's state relative to it
(``classify``).

Not responsible for: who is alive (``ftlm.ft.quorum.members``; the head reads the live members
through ``members.live_view``), telling members behind the head to look on disk first
(``reload``), or issuing quorums (``decision``).
"""

from __future__ import annotations

from collections import Counter

from ftlm.ft.quorum.integrity import committed, head_suspect, trusted_claims, untrusted
from ftlm.ft.quorum.members import live_view
from ftlm.ft.quorum.reload import await_reloads, end_reloads
from ftlm.ft.quorum.types import MAX_HEAD_LOG, CoordinatorState, QuorumOptions, Restore, plural


def advance_head(now: float, state: CoordinatorState, options: QuorumOptions) -> tuple[list[Restore], str]:
    """Move the head to what live members hold; returns explicit rollbacks and a "not yet" reason.

    Call after ``expire`` and before ``compute_quorum``. The head is chosen from the members'
    claims when unknown (a fresh or restarted coordinator), advances by one step when a member
    reports a commit of a quorum issued at the head's step, and rolls back (a ``Restore``) when no
    live member has held it for ``rollback_grace``. The common cases (the head held, or one step
    further) read the index's counts of claims; only choosing the head and a rollback go over the
    members.
    """
    live = live_view(now, state, options)
    holders = live.index.hb_claims  # (step, chain) -> live members holding it
    if not holders:
        return [], ""
    if state.head is None:
        return _choose_head(now, state, options, live)
    if head_suspect(state):  # a state a corrupt member may have written counts only from the vouched
        holders = trusted_claims(state, live.heartbeats)
    step, _ = state.head
    ahead = {(step + 1, chain) for chain, _ in state.index.head_quorum_info(state) if holders.get((step + 1, chain))}
    if ahead:
        state.finished = False
        _set_head(state, max(ahead, key=lambda sc: (holders[sc], sc[1])), now)
        committed(state, state.head)
        return [], ""
    if holders.get(state.head):
        state.head_seen_at = now
        end_reloads(state)
        return [], ""
    if state.finished:
        return [], (f"the job finished at step {step} (its groups left); a group joining now has "
                    "nothing to rejoin")
    seen = state.head_seen_at if state.head_seen_at is not None else now
    left = options.rollback_seconds - (now - seen)
    if left > 0:
        return [], (f"no live group holds the newest state (step {step}); rolling back to the "
                    f"newest state a live group holds in {left:.1f} s unless a holder returns")
    return _roll_back(now, state, options, live)


def _claims(live: CoordinatorState) -> dict[str, tuple[int, str]]:
    """replica id -> the (step, chain) it holds, for every live member."""
    return {r: (hb.step, hb.chain) for r, hb in live.heartbeats.items()}


def _best(holders: Counter[tuple[int, str]]) -> tuple[int, str]:
    """The newest claimed state: highest step, then most holders, then the smaller chain."""
    return max(holders, key=lambda sc: (sc[0], holders[sc], [-ord(c) for c in sc[1]]))


def _choose_head(now: float, state: CoordinatorState, options: QuorumOptions,
                 live: CoordinatorState) -> tuple[list[Restore], str]:
    """The head of a fresh or restarted coordinator, once the members had time to report."""
    # No shortcut for claims that look like a fresh job: a restarted coordinator first hears from
    # whoever heartbeats first, perhaps a new incarnation at step 0 while the job is far ahead.
    groups = len(live.index.hb_groups)
    if not options.expected_groups or groups < options.expected_groups:
        left = options.rebuild_seconds - (now - (state.started_at if state.started_at is not None else now))
        if left > 0:
            return [], (f"rebuilding membership: {plural(groups, 'group')} reported their committed "
                        f"state; deciding in {left:.1f} s")
    best = _best(live.index.hb_claims)
    if best[0] < state.known_head:
        # As for a rollback: members behind look for a newer durable checkpoint first.
        waiting = await_reloads(now, state, options, _claims(live), state.known_head)
        if waiting:
            return [], waiting
        best = _best(live.index.hb_claims)
    _set_head(state, best, now)
    state.top = max(state.top, state.known_head)
    if best[0] >= state.known_head:
        return [], ""
    # The job had reached further, but whoever held that died while nobody coordinated.
    holders = tuple(sorted(hb.group for hb in live.heartbeats.values() if (hb.step, hb.chain) == best))
    return [Restore(state.known_head, best[0], best[1], holders,
                    f"after a coordinator restart no live group holds step {state.known_head}; "
                    f"continuing from step {best[0]} held by {', '.join(holders)}")], ""


def _roll_back(now: float, state: CoordinatorState, options: QuorumOptions,
               live: CoordinatorState) -> tuple[list[Restore], str]:
    """No live member held the head for ``rollback_grace``: continue from the newest state a live
    group holds, once the members behind looked on disk (``reload.await_reloads``)."""
    assert state.head is not None
    step = state.head[0]
    claims = _claims(live)
    waiting = await_reloads(now, state, options, claims, step)
    if waiting:
        return [], waiting
    if state.suspect:
        trusted = {r: c for r, c in claims.items() if not untrusted(state, r, c)}
        if not trusted:
            # Every live state may hold a corrupt member's bits (checkpoints it wrote): its
            # holders set them aside and start again from older ones (rule I2).
            state.stranded = claims
            return [], (f"no live group holds the newest state (step {step}) or an older one that "
                        "is not suspect of a corruption found late; "
                        f"{plural(len(claims), 'group')} set their checkpoints aside and start again")
        claims = trusted
    # The newest state a live group holds may be of a branch an earlier rollback abandoned (a
    # durable checkpoint of it), but never beyond where the job ever got: one step past the
    # furthest head (a commit of a quorum issued there may not have been reported before its
    # holders died), unless most live groups, two or more, hold that same state (a coordinator
    # restarted after the job got further may have rebuilt from a group restarted from an older
    # checkpoint; the groups that restart next load the newest one). One member's word for a
    # state beyond the furthest head is never enough.
    groups: dict[tuple[int, str], set[str]] = {}
    for r, c in claims.items():
        groups.setdefault(c, set()).add(live.heartbeats[r].group)
    alive = len(live.index.hb_groups)
    plausible = Counter(c for c in claims.values()
                        if c[0] <= max(step, state.top) + 1 or 2 <= len(groups[c]) and 2 * len(groups[c]) > alive)
    if not plausible:
        return [], f"no live group holds the newest state (step {step}) or an older one"
    target = _best(plausible)
    holders = tuple(sorted(groups[target]))
    restore = Restore(step, target[0], target[1], holders,
                      f"every group holding step {step} is gone; continuing from step {target[0]} "
                      f"held by {', '.join(holders)}")
    _set_head(state, target, now)
    return [restore], ""


def _set_head(state: CoordinatorState, head: tuple[int, str], now: float) -> None:
    state.head = head
    if state.first_head is None:
        state.first_head = head[0]
    log = state.head_log
    log.pop(head[0], None)  # (a rollback: the newest states are last)
    log[head[0]] = head[1]
    if len(log) > MAX_HEAD_LOG:
        log.pop(next(iter(log)))
    state.head_quorums = []
    state.head_seen_at = now
    state.top = max(state.top, head[0])
    end_reloads(state)


def classify(state: CoordinatorState, replica_id: str) -> str:
    """``up-to-date`` (holds the head), ``behind`` or ``stale`` (ahead of the head or forked)."""
    hb = state.heartbeats.get(replica_id)
    if hb is None or state.head is None:
        return "unknown"
    if (hb.step, hb.chain) == state.head:
        return "up-to-date"
    return "behind" if hb.step <= state.head[0] else "stale"
