"""Reload before rollback: while no live member holds the head, members behind it look for a
newer durable checkpoint first, and the rollback waits for them.

Responsible for: when the head counts as unheld (``reload_due``, ``reload_hint``), whom to tell
to look on disk and in which round (a look that a departure made stale is done again), and why a
rollback must still wait (``await_reloads``).

Not responsible for: the rollback itself or choosing the head (``ftlm.ft.quorum.head``), nor for
loading anything (the members do, ``ftlm.ft.group``).
"""

from __future__ import annotations

from ftlm.ft.quorum.integrity import head_suspect
from ftlm.ft.quorum.types import CoordinatorState, MemberRequest, QuorumOptions


def await_reloads(now: float, state: CoordinatorState, options: QuorumOptions,
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
    if head_suspect(state):
        return ""  # nobody looks on disk: a newer checkpoint may hold a corrupt member's bits
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



def end_reloads(state: CoordinatorState) -> None:
    """A live member holds the head (again), or a new head was chosen: nobody is to look on disk."""
    if not state.reloads:  # nobody was told (every tick of a healthy job): the others are empty too
        return
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
    if step is None or head_suspect(state):
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
    if step is None or hb is None or head_suspect(state) or hb.step >= step or state.reloads.get(replica_id, now) is None:
        return None  # held, not behind, or it looked already
    state.reloads.setdefault(replica_id, now)
    return step


def _unheld_head(now: float, state: CoordinatorState, options: QuorumOptions) -> int | None:
    """The head's step once no live member has held it for a quarter of the rollback grace.

    Not at once: a holder's heartbeat sent before its commit can arrive after its request of the
    next step, and make the head look unheld for a moment, which must not make a
    member drop a pull in progress. Call after ``advance_head`` (which stamps ``head_seen_at``).
    """
    if state.head is None:  # a restarted coordinator waiting for reloads before it rolls back
        return state.known_head if state.reloads else None
    if state.finished or state.head_seen_at is None or now - state.head_seen_at < options.rollback_seconds / 4:
        return None
    return state.head[0]


def newest_claim(state: CoordinatorState) -> int:
    """The step of the newest state a live member claims (-1 without members)."""
    return max((step for step, _ in state.index.hb_claims), default=-1)


def _void_stale_looks(now: float, state: CoordinatorState) -> None:
    """Members that looked on disk while a live member held a newer state than any live member
    holds now look again: the newer state's holder left or died since, and may have saved it on
    its way out (``checkpoint.on_stop``: the participant 0 of its last step does, before it
    leaves) after they looked: a rollback would give up the state it saved. Each is told again with its ``reload_round`` one higher; a request
    that says it looked in an earlier round (sent before it heard) does not count."""
    if not state.looked_below:
        return
    newest = newest_claim(state)
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


def reload_target(state: CoordinatorState) -> int:
    """The step members told to reload compare their state with (see ``_unheld_head``)."""
    return state.head[0] if state.head is not None else state.known_head
