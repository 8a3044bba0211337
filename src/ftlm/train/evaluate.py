"""The eval loss: the objective's mean loss of a group's model on held-out samples.

``Evaluator`` reads a fixed eval set once, ``train.eval_batches`` batches of ``train.batch_size``
samples from the front of the held-out split (``ftlm.data.split``), and ``evaluate()`` returns the
objective's weighted mean over it (for language modelling, the token-weighted mean next-token
cross-entropy; ``ftlm.train.objective``). Inside a group sharded with FSDP2 every rank runs the
forward passes on its share of each batch (a collective: all ranks must call ``evaluate()``
together), and one all-reduce of (loss sum, token count) over the group gives every rank the same
number. Every participating group evaluates the same bits on the same samples, so groups agree too.

Side-effect free by construction: no gradients (``torch.no_grad``), eval mode restored to the
previous mode afterwards, the RNG forked and restored, FSDP2 parameters resharded as a training
step leaves them, and nothing in ``TrainState`` is read or written, so replicas stay bitwise equal.

It does not decide when to evaluate beyond ``due()``, and it does not emit events or metrics: the
trainer does, after a committed step, on participating groups only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ContextManager

import numpy as np
import torch
import torch.distributed as dist

from ftlm.data.loader import SampleSource
from ftlm.errors import ConfigError
from ftlm.train.config import TrainConfig
from ftlm.train.objective import LanguageModeling, Objective


@dataclass(frozen=True)
class EvalResult:
    """One evaluation."""

    loss: float
    """Mean cross-entropy per target token over the whole eval set (all ranks of the group)."""
    eval_tokens: int
    """Target tokens the mean is over."""
    seconds: float
    """Wall time of the evaluation on this rank, collectives included."""


class Evaluator:
    """Held-out loss of ``model`` every ``every`` committed steps and after ``last_step``.

    ``rank`` of ``ranks`` takes rows ``[rank * b/ranks, (rank + 1) * b/ranks)`` of each batch of
    ``b = batch_size`` samples, like a training step, and runs them ``micro_batch`` at a time.
    """

    def __init__(self, model: torch.nn.Module, heldout: SampleSource, *, every: int, batches: int,
                 batch_size: int, micro_batch: int, last_step: int, rank: int = 0, ranks: int = 1,
                 device: torch.device | None = None,
                 autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                 group: dist.ProcessGroup | None = None,
                 objective: Objective | None = None) -> None:
        needed = batches * batch_size
        if needed > len(heldout):
            raise ConfigError(f"train.eval_batches={batches} x train.batch_size={batch_size} = "
                              f"{needed} held-out samples, but data.eval_samples={len(heldout)}; "
                              f"lower train.eval_batches or raise data.eval_samples to {needed}")
        if every < 1 or batches < 1 or micro_batch < 1 or batch_size % ranks:
            raise ValueError(f"bad evaluator: every={every}, batches={batches}, "
                             f"micro_batch={micro_batch}, batch_size={batch_size}, ranks={ranks}")
        self.model = model
        self.every, self.last_step = every, last_step
        self.micro_batch = micro_batch
        self.ranks = ranks
        self.device = device or torch.device("cpu")
        self.autocast = autocast
        self.group = group
        per_rank = batch_size // ranks
        mine = np.concatenate([np.arange(k * batch_size + rank * per_rank,
                                         k * batch_size + (rank + 1) * per_rank)
                               for k in range(batches)])
        # Read once: the eval set is fixed for the run, and a data error surfaces at start-up.
        self.rows = torch.from_numpy(np.asarray(heldout.samples(mine), dtype=np.int64))
        self.objective = objective or LanguageModeling(self.rows.shape[-1] - 1)

    def due(self, step: int) -> bool:
        """Whether the model after ``step`` committed steps is evaluated."""
        return step > 0 and (step % self.every == 0 or step == self.last_step)

    def evaluate(self) -> EvalResult:
        """The group's mean held-out loss; every rank of the group must call it together."""
        t0 = time.perf_counter()
        # Sum and count in float64: the mean must not depend on how many batches there are.
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        was_training = self.model.training
        with torch.random.fork_rng(devices=self._rng_devices()), torch.no_grad():
            self.model.eval()
            try:
                for chunk in self.rows.split(self.micro_batch):
                    chunk = chunk.to(self.device, non_blocking=True)
                    with self.autocast():
                        loss_sum, count = self.objective.eval_sums(self.model, chunk)
                    total[0] += loss_sum.to(total.device)
                    total[1] += count.to(total.device)
            finally:
                self.model.train(was_training)
                _reshard(self.model)
        if self.ranks > 1:
            dist.all_reduce(total, group=self.group)
        loss_sum, tokens = total.tolist()
        return EvalResult(loss=loss_sum / tokens, eval_tokens=int(tokens),
                          seconds=time.perf_counter() - t0)

    def _rng_devices(self) -> list[int]:
        if self.device.type != "cuda":
            return []
        return [self.device.index if self.device.index is not None else torch.cuda.current_device()]


class NoEvaluation:
    """Evaluation turned off (``train.eval_every = 0``): never due."""

    def due(self, step: int) -> bool:
        return False

    def evaluate(self) -> EvalResult:
        raise RuntimeError("evaluation is off (train.eval_every=0); check due() first")


def _reshard(model: torch.nn.Module) -> None:
    """Free FSDP2's unsharded parameters, as the end of a training step does.

    A forward without backward leaves the modules with ``reshard_after_forward=False`` (the last
    block, the root) unsharded; resharding keeps the memory layout of the next step unchanged.
    """
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def build_evaluator(model: torch.nn.Module, heldout: SampleSource, tc: TrainConfig, *,
                    rank: int = 0, ranks: int = 1, device: torch.device | None = None,
                    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                    objective: Objective | None = None) -> Evaluator | NoEvaluation:
    """The trainer's evaluator from ``train.eval_every`` / ``eval_batches``, or ``NoEvaluation``."""
    if not tc.eval_every:
        return NoEvaluation()
    if not len(heldout):
        raise ConfigError(f"train.eval_every={tc.eval_every} needs held-out samples, but "
                          "data.eval_samples=0; set data.eval_samples > 0 or train.eval_every=0")
    return Evaluator(model, heldout, every=tc.eval_every, batches=tc.eval_batches,
                     batch_size=tc.batch_size, micro_batch=tc.batch_size // ranks // tc.grad_accum,
                     last_step=tc.steps, rank=rank, ranks=ranks, device=device, autocast=autocast,
                     objective=objective)
