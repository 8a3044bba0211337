"""Hot spares: which holders of the head train data and which stand by.

A job launched with spare groups (``ft.spares``) has more groups than training places
(``QuorumOptions.max_participants``). Every member that holds the head is current: it took part
in the last committed step's all-reduce (with zeros) and applied its average, so it could train
the next step at once. ``assign_roles`` gives the training places to the holders of the head,
those that trained in the previous quorum first; the holders beyond them are *spares*. A spare
takes part in the step's all-reduce with zero gradients and no samples, and applies the average
on commit: its state stays bitwise the participants', so the quorum after a participant fails
*promotes* it (it trains the free place) with no catch-up. A repaired group recovers from a
participant like any joiner and, once it holds the head, finds the places taken: it becomes a
spare.

Only a member that asked with the head is ever given a place: a spare that died, hangs (has not
asked) or fell behind (asks with an older state) is never promoted; it recovers, or its place
goes to another holder.

Responsible for: the roles (``assign_roles``), telling promotions apart (``promoted``) and the
record of one (``promotion_fields``: the coordinator's ``spare_promoted`` event).
Not responsible for: who is a member, the head, or the quorum's id (``decision._build`` calls
``assign_roles`` with the holders it found); the all-reduce's divisor is the participant count,
which the members read from their answer (``ftlm.ft.quorum_answer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ftlm.ft.quorum.types import Quorum


def assign_roles(holders: Sequence[str], prev: Quorum | None,
                 max_participants: int) -> tuple[list[str], list[str]]:
    """``(participants, spares)`` among ``holders`` (the asking members that hold the head, in
    member order); both lists keep that order.

    With ``max_participants`` 0, or no more holders than places, every holder trains. Otherwise
    the holders that trained in ``prev`` keep their places (no role changes while nothing
    failed), the free places go to the other holders in member order (promotions), and the rest
    are spares.
    """
    if max_participants <= 0 or len(holders) <= max_participants:
        return list(holders), []
    trained = frozenset(prev.participants) if prev is not None else frozenset()
    chosen = [r for r in holders if r in trained][:max_participants]
    free = max_participants - len(chosen)
    if free:
        taken = set(chosen)
        chosen.extend([r for r in holders if r not in taken][:free])
    keep = frozenset(chosen)
    return [r for r in holders if r in keep], [r for r in holders if r not in keep]


def promoted(quorum: Quorum, prev: Quorum | None) -> list[str]:
    """The participants of ``quorum`` that were spares of ``prev`` (its previous quorum)."""
    if prev is None or not prev.spares:
        return []
    return [r for r in quorum.participants if prev.is_spare(r)]


def promotion_fields(now: float, quorum: Quorum, prev: Quorum,
                     gone: list[tuple[float, str]]) -> dict[str, Any] | None:
    """The ``spare_promoted`` event of ``quorum`` (None when it promoted no spare of ``prev``):
    who was promoted, whose places they took (``prev``'s participants that train no more) and
    ``seconds`` from when the coordinator first knew one of those was gone (``gone``: (time,
    replica id) of deaths and leaves) to now, or from ``prev``'s issue when it knew of none (the
    place was freed by a member that asked behind the head)."""
    up = promoted(quorum, prev)
    if not up:
        return None
    replaced = [r for r in prev.participants if quorum.participant_index(r) is None]
    lost = frozenset(replaced)
    since = min((t for t, rid in gone if rid in lost and t >= prev.issued_at), default=prev.issued_at)
    return {"step": quorum.step, "quorum_id": quorum.quorum_id, "promoted": [r.partition(":")[0] for r in up],
            "replaced": [r.partition(":")[0] for r in replaced],
            "seconds": round(max(0.0, now - since), 4), "spares_left": quorum.spare_count}


def spare_groups(quorum: Quorum | None) -> list[str]:
    """The groups of ``quorum``'s spares (for the status page and metrics)."""
    if quorum is None:
        return []
    return [m.group for m in quorum.members if quorum.is_spare(m.replica_id)]

