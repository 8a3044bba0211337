"""The coordinator's protocol core: membership, the authoritative committed state and the per-step
quorum decision, as functions of ``CoordinatorState`` with the clock passed in (docs/design.md,
'Quorum rules'; docs/ft-protocol.md, 'The rules', whose rule table names the function that applies
each rule). Every "not yet" comes with a human-readable reason.

One module per concept: ``types`` (the records), ``index`` (the counts the decisions read),
``members`` (who is alive), ``head`` (the authoritative state and rollbacks), ``decision`` (the
quorum), ``reload`` (the look on disk before a rollback), ``bad_link`` (the search for a member
that fails its steps), ``spares`` (which holders of the head train and which stand by). This package re-exports what the rest of ``ftlm`` uses.

Not responsible for: sockets, threads, timers or the wall clock (``ftlm.ft.membership`` drives
these functions as the coordinator's state machine, ``ftlm.ft.coordinator`` serves it), nor for
what members do with the answer (``ftlm.ft.group``).
"""

from ftlm.ft.quorum.bad_link import FAILS_ITS_STEPS, Probe, convict
from ftlm.ft.quorum.decision import compute_quorum
from ftlm.ft.quorum.head import advance_head
from ftlm.ft.quorum.members import (
    commit_quorum,
    expire,
    record_heartbeat,
    record_request,
    remove_member,
    withdraw_request,
)
from ftlm.ft.quorum.reload import reload_due, reload_hint, reload_round
# (Imported here, if not used here, so that the compiled package registers it: a compiled
# package's submodule is found only once the package itself imported it.)
from ftlm.ft.quorum import integrity  # noqa: F401
from ftlm.ft.quorum.spares import assign_roles, promoted, promotion_fields, spare_groups
from ftlm.ft.quorum.types import (
    MAX_CLAIM,
    MAX_WATCH,
    Convicted,
    CoordinatorState,
    Heartbeat,
    Member,
    MemberRequest,
    Quorum,
    QuorumOptions,
    Restore,
    StaleIncarnation,
)

__all__ = [
    "FAILS_ITS_STEPS", "MAX_CLAIM", "MAX_WATCH", "Convicted", "CoordinatorState", "Heartbeat", "Member",
    "MemberRequest", "Probe", "Quorum", "QuorumOptions", "Restore", "StaleIncarnation", "advance_head",
    "commit_quorum", "compute_quorum", "convict", "expire", "record_heartbeat", "record_request", "reload_due", "reload_hint", "reload_round", "remove_member",
    "withdraw_request", "assign_roles", "promoted", "promotion_fields", "spare_groups",
]
