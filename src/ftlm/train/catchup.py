"""Buffer of averaged gradients that a recovering group replays once its snapshot arrives.

While a restarted group pulls a peer's state of step ``n`` in the background it keeps taking part in
every all-reduce (with zero gradients) and records what it receives: the averaged gradient of each
committed step with the step's metadata. Replaying these through the same update function as the
peers reproduces their state bit for bit (docs/design.md, 'Joining and catching up'). The buffer is
bounded; when it overflows the group drops it and asks for a fresher snapshot.

Once the snapshot is loaded, the group replays the buffered updates a few at a time, while its
zero contribution to each step's all-reduce waits for the participants' gradients, and keeps
recording the new steps' averages behind them until it reaches the head (``run_from``, ``drop``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class BufferedUpdate:
    step: int
    grads: torch.Tensor
    """All gradients flattened into one CPU vector, in parameter order."""
    lr: float
    samples: int
    """How far the data cursor moved in this step (participants x batch size)."""
    quorum_id: int = 0
    participants: list[str] = field(default_factory=list)
    """The quorum the update was averaged in: replaying it extends the history chain."""


class CatchUpBuffer:
    """Averaged updates keyed by step; a retried step replaces its earlier record."""

    def __init__(self, max_steps: int, max_bytes: int | None = None):
        self.max_steps = max_steps
        self.max_bytes = max_bytes
        self._updates: dict[int, BufferedUpdate] = {}
        self._bytes_bound = False  # ``max_steps`` is what ``max_bytes`` holds (``fit_steps``)

    def fit_steps(self, step_bytes: int) -> int:
        """Bound the buffer by steps of ``step_bytes`` each (the largest of the group's ranks)
        as well: every rank then overflows at the same step, whatever its own shard weighs.
        Returns the steps it holds."""
        if self.max_bytes is not None and self.max_bytes // max(step_bytes, 1) < self.max_steps:
            self.max_steps, self._bytes_bound = self.max_bytes // max(step_bytes, 1), True
        return self.max_steps

    def __len__(self) -> int:
        return len(self._updates)

    @property
    def overflowing(self) -> bool:
        return len(self._updates) > self.max_steps or (
            self.max_bytes is not None and self.nbytes > self.max_bytes)

    def limit(self) -> str:
        """The bound that ``overflowing`` checks, in words (for logs and events)."""
        if self.max_bytes is not None and (self._bytes_bound or self.nbytes > self.max_bytes):
            return f"{self.max_bytes} bytes (ft.catchup_max_bytes)"
        return f"{self.max_steps} steps (ft.catchup_max_steps)"

    @property
    def nbytes(self) -> int:
        return sum(u.grads.numel() * u.grads.element_size() for u in self._updates.values())

    def record(self, step: int, grads: list[torch.Tensor], lr: float, samples: int,
               quorum_id: int = 0, participants: list[str] | None = None) -> None:
        flat = torch.cat([g.detach().reshape(-1).to("cpu", copy=True) for g in grads])
        self._updates[step] = BufferedUpdate(step, flat, lr, samples, quorum_id, list(participants or []))

    def clear(self) -> None:
        self._updates.clear()

    def take_from(self, step: int) -> list[BufferedUpdate] | None:
        """The updates of steps ``step, step+1, ...`` in order, emptying the buffer.

        Returns None when a step in that run is missing (this group failed a step its peers
        committed): the snapshot cannot be brought forward and a fresher one is needed. Whether
        the run reaches the head is checked by ``ftlm.ft.group.check_replay``.
        """
        later = sorted(s for s in self._updates if s >= step)
        if later != list(range(step, step + len(later))):
            self._updates.clear()
            return None
        taken = [self._updates[s] for s in later]
        self._updates.clear()
        return taken


    def run_from(self, step: int) -> list[BufferedUpdate] | None:
        """The updates of steps ``step, step+1, ...`` in order, left in the buffer (a catch-up
        replays them over several steps and drops each once applied, ``drop``).

        Updates before ``step`` are dropped: the state is past them. Returns None when a step in
        the run is missing (as ``take_from``).
        """
        for s in [s for s in self._updates if s < step]:
            del self._updates[s]
        later = sorted(self._updates)
        if later != list(range(step, step + len(later))):
            return None
        return [self._updates[s] for s in later]

    def drop(self, step: int) -> None:
        """Forget the update of ``step`` (it was applied)."""
        self._updates.pop(step, None)


def unflatten_into(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    """Set each parameter's ``.grad`` from its slice of ``flat`` (local shards for DTensors)."""
    offset = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        n = local.numel()
        grad = flat[offset:offset + n].view(local.shape).to(local.device, local.dtype, copy=True)
        if local is not p:
            from torch.distributed.tensor import DTensor
            grad = DTensor.from_local(grad, p.device_mesh, p.placements, shape=p.shape,
                                      stride=p.stride())
        p.grad = grad
        offset += n
