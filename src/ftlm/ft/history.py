"""The committed history of a replica group as a hash chain.

Every committed step extends the chain with what determines the update of that step: the step
number, the quorum it was committed in and that quorum's participants (the data slices follow from
the participant count and the cursor, which is itself a function of the history). Two groups
holding the same ``(step, chain)`` applied the same updates in the same order, so they hold the
same bits; two groups at the same step with different chains forked and one of them must recover.

The coordinator uses the chain to decide which state is authoritative (``ftlm.ft.quorum``), a
recovering group to check that its replay reached the head (``ftlm.ft.group``), and the run
summary to walk the final history backwards (exactly-once data over what the model really saw).

Pure functions only: no I/O, no clocks.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

GENESIS = hashlib.sha256(b"ftlm/history/v1").hexdigest()
"""The chain of a state no step was committed to (step 0 of a fresh job)."""

_CHAIN = re.compile(r"[0-9a-f]{64}")


def extend_chain(chain: str, step: int, quorum_id: int, participants: Iterable[str]) -> str:
    """The chain after committing ``step`` in quorum ``quorum_id`` with ``participants``."""
    parts = ",".join(sorted(participants))
    return hashlib.sha256(f"{chain}|{step}|{quorum_id}|{parts}".encode()).hexdigest()


def is_chain(value: object) -> bool:
    """Whether ``value`` looks like a chain (64 lowercase hex digits)."""
    return isinstance(value, str) and _CHAIN.fullmatch(value) is not None
