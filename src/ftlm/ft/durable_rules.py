"""When a group makes its state durable: the trainer's rules, as pure functions.

The trainer (``ftlm.train.checkpoint``, ``ftlm.train.durability``) applies them to real
checkpoints, and the protocol simulator (``ftlm.sim.durable``) to its model of the disk, so the
two cannot drift apart:

* ``checkpoint_due``: a periodic checkpoint of a step (``checkpoint.every``);
* ``saves_on_stop``: a group stopped by SIGTERM saves its committed step on its way out;
* ``keeps_final_on_disk``: the job's last step is saved once per history: a save finds a
  checkpoint of that step and keeps it, unless the coordinator confirmed this group's state as
  the job's and the one on disk holds another history, which it replaces (rule E1 of
  docs/ft-protocol.md).

Not responsible for: reading or writing checkpoints, locks, or who is the writer (the trainer's
``Checkpointer`` and ``Durability``).
"""

from __future__ import annotations

from collections.abc import Sequence


def checkpoint_due(step: int, every: int) -> bool:
    """Whether ``step`` gets a periodic checkpoint with ``checkpoint.every = every`` (0: none)."""
    return every > 0 and step > 0 and step % every == 0


def saves_on_stop(writer: bool, on_stop: bool, due: bool) -> bool:
    """Whether a group stopping gracefully saves its committed step: it wrote that step's
    checkpoints (``writer``), ``checkpoint.on_stop`` is on, and the step was not saved anyway as a
    periodic checkpoint (``due``)."""
    return writer and on_stop and not due


def keeps_final_on_disk(chains_on_disk: Sequence[str | None], chain: str, job_history: bool) -> bool:
    """Whether a save of the job's last step keeps what is on disk instead of saving: the
    histories (chains) of the valid checkpoints of that step on disk (None: one whose history is
    not recorded), this group's ``chain``, and whether the coordinator confirmed this group's
    state as the job's (``job_history``). Nothing on disk: save. Another history on disk and the
    job's confirmed: replace it (a group that committed the last step alone and left before the
    coordinator heard of it saved a history the job gave up). A checkpoint whose history is
    unknown is never replaced."""
    if not chains_on_disk:
        return False
    replace = job_history and chain not in chains_on_disk and None not in chains_on_disk
    return not replace
