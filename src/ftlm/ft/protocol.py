"""The internal seam between a training ``Session`` and fault tolerance, and its null object.

``ftlm.train.session.Session`` (with ``ftlm.train.recovery``) is the only caller; users reach fault
tolerance through the session, never through this protocol. The call order:

* ``join(step, chain)`` once, with the committed state (after a resume from a checkpoint);
* per step, ``start_step(step, chain, snapshot)``: join the step's quorum and learn whether this
  group trains data (``participant_index``), recovers (``recovering``) or drains at the job's end
  (``drain``); it raises ``ReloadCheckpoint`` (load a newer durable checkpoint, then ask again),
  ``StopRequested`` (a stop while waiting) or ``TooManyFailures``;
* ``allreduce_start(bucket)`` for each gradient bucket as backward finishes it, then
  ``allreduce([loss, flags])``, which waits for every bucket; ``fail_step(reason)`` when the step
  must not commit (a non-finite loss or gradient); ``commit()``: the vote;
* after a successful vote, ``ask(step + 1, chain)`` requests the next quorum while the update is
  applied (its answer is what the next ``start_step`` returns);
* between the inner steps of a DiLoCo phase (``ft.sync = "diloco"``), and before each block of
  a forward pass and each gradient bucket of a session with ``abandon_doomed_steps``,
  ``step_alive()`` reports progress and says whether the step can still commit (never blocks);
* a recovering group polls ``poll_recovery()`` while its zero contribution waits
  (``allreduce_in_flight``), ``restart_recovery(reason)`` when the snapshot plus its buffer does
  not lead to the head, ``caught_up(step, chain)`` once it holds the head, and ``fire(point)`` at
  named points of the replay (fault injection);
* at the end: ``finish(step, chain, snapshot)`` after the last step (serve late groups, leave), or
  ``leave(reason)`` after a stop; ``holds_head(step, chain)`` after ``finish`` (whether the
  final checkpoint is the job's history); ``head_step()`` before writing the model file;
  ``close()``.

``request_stop`` may come from a signal handler at any time. ``NoFaultTolerance`` answers for a
lone group at no cost, so the single-group path stays as fast as plain PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

SnapshotFn = Callable[[], tuple[dict[str, torch.Tensor], dict[str, Any]]]


@dataclass
class StepPlan:
    """This group's role in one step, decided by the quorum."""

    quorum_id: int
    step: int
    """Step the participants are at; the update of this step is the one being computed."""
    participant_index: int | None
    """Index among the participants (decides the data slice); None while recovering."""
    participants: int
    """Number of groups training data this step (P); gradients are averaged over them."""
    recovering: bool = False
    members: list[str] = field(default_factory=list)
    drain: bool = False
    """The job reached its last step: nothing to train; a recovering group only catches up."""
    quorum: Any = None
    """The issued ``ftlm.ft.quorum.Quorum`` (None without fault tolerance)."""
    waited: float = 0.0
    """Seconds ``start_step`` waited for the quorum answer (after an early ``ask``: only what
    was left of its round trip and of the wait for the other groups)."""
    spare: bool = False
    """This group holds the job's state but trains no data (a hot spare): it contributes zeros to
    the average and applies it on commit, as a participant does."""

    @property
    def participating(self) -> bool:
        return self.participant_index is not None


@dataclass
class Recovered:
    """A peer's replicated state of step ``step``, checksummed and ready to load."""

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    source: str
    seconds: float
    nbytes: int


class StopRequested(Exception):
    """The group was asked to stop (SIGTERM: preemption, node drain) while waiting for a quorum:
    the trainer leaves the job at once instead of after ``ft.quorum_timeout``."""


class ReloadCheckpoint(Exception):
    """No live group holds the job's newest state (step ``head``), and this group is behind it:
    before the coordinator rolls the job back to the newest state a live group holds, the
    trainer loads the newest durable checkpoint if it is newer than its own state, then asks
    again (``start_step`` with the state it holds then)."""

    def __init__(self, head: int, reason: str) -> None:
        super().__init__(reason)
        self.head = head


class FaultTolerance(Protocol):
    def join(self, step: int, chain: str) -> None: ...
    def ask(self, step: int, chain: str) -> bool: ...
    def start_step(self, step: int, chain: str, snapshot: SnapshotFn) -> StepPlan: ...
    def allreduce_start(self, tensors: list[torch.Tensor]) -> None: ...
    def allreduce(self, tensors: list[torch.Tensor]) -> None: ...
    def allreduce_in_flight(self) -> bool: ...
    def fail_step(self, reason: str) -> None: ...
    def step_alive(self) -> bool: ...
    def commit(self) -> bool: ...
    def poll_recovery(self) -> Recovered | None: ...
    def restart_recovery(self, reason: str) -> None: ...
    def caught_up(self, step: int, chain: str) -> None: ...
    def finish(self, step: int, chain: str, snapshot: SnapshotFn) -> None: ...
    def leave(self, reason: str, at: tuple[int, str] | None = None) -> None: ...
    def fire(self, point: str) -> None: ...
    def nonfinite_fault(self, step: int, start: int, stop: int) -> bool: ...
    def request_stop(self) -> None: ...
    def head_step(self) -> int | None: ...
    def holds_head(self, step: int, chain: str) -> bool: ...
    def close(self) -> None: ...


class NoFaultTolerance:
    """A lone replica group: always participant 0 of 1, nothing to average, every step commits."""

    def __init__(self) -> None:
        self._failed = False

    def join(self, step: int, chain: str) -> None:
        return None

    def start_step(self, step: int, chain: str, snapshot: SnapshotFn) -> StepPlan:
        self._failed = False
        return StepPlan(quorum_id=0, step=step, participant_index=0, participants=1)

    def ask(self, step: int, chain: str) -> bool:
        return False

    def allreduce_start(self, tensors: list[torch.Tensor]) -> None:
        return None

    def allreduce(self, tensors: list[torch.Tensor]) -> None:
        return None

    def allreduce_in_flight(self) -> bool:
        return False

    def fail_step(self, reason: str) -> None:
        self._failed = True

    def step_alive(self) -> bool:
        return not self._failed

    def commit(self) -> bool:
        return not self._failed

    def caught_up(self, step: int, chain: str) -> None:
        return None

    def finish(self, step: int, chain: str, snapshot: SnapshotFn) -> None:
        return None

    def request_stop(self) -> None:
        return None

    def leave(self, reason: str, at: tuple[int, str] | None = None) -> None:
        return None

    def poll_recovery(self) -> Recovered | None:
        return None

    def restart_recovery(self, reason: str) -> None:
        return None

    def fire(self, point: str) -> None:
        return None

    def nonfinite_fault(self, step: int, start: int, stop: int) -> bool:
        return False

    def head_step(self) -> int | None:
        """The step of the last quorum this group was in (the job's head as it knows it); a lone
        group is always at its own head (0: never ahead of it)."""
        return 0

    def holds_head(self, step: int, chain: str) -> bool:
        """A lone group has no coordinator to confirm its history by."""
        return False

    def close(self) -> None:
        return None
