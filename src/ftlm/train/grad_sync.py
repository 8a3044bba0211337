"""The cross-group gradient average of one step, overlapped with the backward pass.

``bucket_plan`` cuts the parameters into buckets of at most ``ft.bucket_bytes``, in reverse
registration order (roughly the order backward produces their gradients), as DDP does. The plan
depends on the model alone, so every group issues the same buckets in the same order, whether
it trains (its buckets start from backward hooks as they fill) or contributes zeros while it
recovers (all buckets start after an empty backward).

``GradientSync`` owns the per-parameter hooks. Armed for the last micro-batch of a step, each
``post_accumulate_grad`` hook counts its parameter in; a bucket whose gradients are all final is
started through ``FaultTolerance.allreduce_start`` once every bucket before it has been, so the
order never depends on timing. ``finish`` starts what is left (parameters without a gradient
contribute zeros) and the caller's ``allreduce`` of the loss waits for all of it.

Not here: deciding whether the step commits (``ftlm.ft``), clipping and the optimizer
(``ftlm.train.optim``). Groups sharded with FSDP2 do not use hooks: their gradients are final
only after FSDP's reduce-scatter, so they start every bucket after the backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def bucket_plan(sizes: list[tuple[int, torch.dtype]], bucket_bytes: int) -> list[list[int]]:
    """Indices of parameters (given as ``(bytes, dtype)``) per bucket, last parameter first."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i in reversed(range(len(sizes))):
        nbytes, dt = sizes[i]
        if not buckets or dt != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, dt
        buckets[-1].append(i)
        size += nbytes
    return buckets


class StepDoomed(Exception):
    """Raised from inside the forward or backward pass of a step that can no longer commit (a
    peer's process ended, or the coordinator reported a member of the step's quorum dead), when
    the session was made with ``abandon_doomed_steps=True``: the rest of the pass would be
    thrown away, so it is skipped. The loop catches it and calls ``session.commit`` as usual
    (with any loss: the step fails, and the next one redoes its samples)."""


class GradientSync:
    """Start each bucket's all-reduce as soon as backward finished its gradients."""

    def __init__(self, params: list[torch.Tensor], bucket_bytes: int,
                 start: Callable[[list[torch.Tensor]], None],
                 local: Callable[[torch.Tensor], torch.Tensor], hooks: bool) -> None:
        self.params = params
        self.start = start
        self.local = local
        # Whether the step can still commit, asked as each bucket is ready (None: never asked);
        # raising ``StepDoomed`` when it cannot ends the backward pass there.
        self.doomed: Callable[[], None] | None = None
        self.plan = bucket_plan([(local(p).numel() * local(p).element_size(), p.dtype)
                                 for p in params], bucket_bytes)
        self._bucket_of = {i: b for b, idx in enumerate(self.plan) for i in idx}
        self._missing = [len(idx) for idx in self.plan]
        self._next = 0  # the next bucket to start, in plan order
        self.armed = False
        self.handles = []
        if hooks:
            for i, p in enumerate(params):
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook(i)))

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def on_grad(_: torch.Tensor) -> None:
            if not self.armed:
                return
            b = self._bucket_of[i]
            self._missing[b] -= 1
            if self._next < len(self.plan) and self._missing[self._next] == 0:
                if self.doomed is not None:
                    self.doomed()  # (raises when the step can no longer commit)
                while self._next < len(self.plan) and self._missing[self._next] == 0:
                    self._start(self._next)
        return on_grad

    def _start(self, b: int) -> None:
        self._next = b + 1
        grads = []
        for i in self.plan[b]:
            p = self.params[i]
            if p.grad is None:  # unused in this step's graph: contributes zeros
                p.grad = torch.zeros_like(p)
            grads.append(self.local(p.grad))
        self.start(grads)

    def begin(self) -> None:
        """A new step: nothing started yet."""
        self._missing = [len(idx) for idx in self.plan]
        self._next = 0
        self.armed = False

    def finish(self) -> list[torch.Tensor]:
        """Start the buckets not started yet; return every parameter's local gradient."""
        self.armed = False
        while self._next < len(self.plan):
            self._start(self._next)
        return [self.local(p.grad) for p in self.params]

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
