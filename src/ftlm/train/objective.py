"""What a training step optimises, and the data it reads: the seam between the trainer and a task.

The trainer owns the fault-tolerant loop (quorum, all-reduce, vote, commit, catch-up, checkpoints)
and is the same for every kind of training. What differs between pretraining, SFT, DPO and RL is
two things, injected here:

* an ``Objective``: the mean loss of a micro-batch of rows (``loss``) and the held-out sums
  (``eval_sums``), plus how many tokens a row accounts for; a ``SummedObjective`` also gives sums
  and counts, so that a step's loss is the mean over every token of the step (SFT) rather than a
  mean of micro-batch means;
* a ``TrainData``: the tokenizer and the training / held-out ``SampleSource`` whose rows the loader
  hands out by global position (the exactly-once cursor of docs/design.md, 'Data exactly once', does
  not care what a row holds, as long as it is a fixed-shape int64 array).

A row is an int64 array of fixed shape per data set: ``[seq_len + 1]`` tokens for language
modelling; an objective that needs more per row (a loss mask, document ids, a chosen and a rejected
sequence) stacks them in extra leading dimensions, e.g. ``[3, seq_len + 1]``. The trainer slices rows
across ranks and micro-batches along dimension 0 only.

Not here: the optimizer, the LR schedule, fault tolerance (``ftlm.train.session``, ``ftlm.ft``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from ftlm.data.loader import SampleSource
from ftlm.data.tokenizer import Tokenizer


class Objective(Protocol):
    """The loss a step optimises over a batch of rows."""

    tokens_per_sample: int
    """Tokens one row accounts for in ``tokens_committed`` and throughput."""

    def loss(self, model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """Mean loss of the micro-batch ``rows`` (on the model's device), differentiable.

        Called under the trainer's autocast; every rank of a group calls it on its own rows, and
        the result must be deterministic given the model state and the rows (a replica anywhere
        must compute the same update).
        """
        ...

    def eval_sums(self, model: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss sum, count)`` of held-out ``rows`` as float64 scalars; the mean is sum / count."""
        ...


@runtime_checkable
class SummedObjective(Protocol):
    """An objective whose step loss is a sum over units (e.g. completion tokens) divided by the
    units of the whole step, every micro-batch, rank and group included: the token mean of the
    step, not a mean of micro-batch means. The trainer counts the step's units from every
    participant's rows (a pure function of the data cursor, so no exchange is needed) and scales
    each micro-batch's ``loss_sum`` so that the gradient averages over ranks and groups give it."""

    def units(self, rows: torch.Tensor) -> float:
        """The units (e.g. tokens with a loss) in ``rows`` (on the CPU, as the loader gives them)."""
        ...

    def loss_sum(self, model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """The sum of the loss over the units of ``rows``, differentiable."""
        ...


@runtime_checkable
class ReportingObjective(Protocol):
    """An objective that measures what it saw in a step (GRPO: its rollouts' mean reward, the
    share of groups whose rewards were all equal, of truncated completions, of clipped tokens).
    After each committed step the trainer takes ``step_stats`` and writes it as that step's
    ``objective`` event; a failed step's are dropped (``step_failed``): a retried step measures
    its rows again."""

    def step_stats(self) -> dict[str, float]:
        """The means over this rank's micro-batches since the last call, then forgets them."""
        ...


@dataclass
class TrainData:
    """The tokenizer and the rows a run trains on and evaluates on."""

    tokenizer: Tokenizer
    train: SampleSource
    heldout: SampleSource


def logits_of(output: object) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, or its ``logits`` (a Hugging Face
    ``CausalLMOutput``, or a dict holding them)."""
    if torch.is_tensor(output):
        return output
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if not torch.is_tensor(logits):
        raise TypeError(f"the model returned a {type(output).__name__} without logits: language "
                        "modelling needs a forward(tokens) that returns logits [batch, seq, vocab] "
                        "or an output with a .logits field")
    return logits


class LanguageModeling:
    """Next-token cross-entropy over ``[seq_len + 1]`` token rows (pretraining)."""

    def __init__(self, seq_len: int) -> None:
        self.tokens_per_sample = seq_len

    def loss(self, model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        inputs, targets = rows[:, :-1], rows[:, 1:]
        logits = logits_of(model(inputs))
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))

    def eval_sums(self, model: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = rows[:, :-1], rows[:, 1:]
        logits = logits_of(model(inputs))
        total = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                                reduction="sum").double()
        return total, torch.tensor(float(targets.numel()), dtype=torch.float64)
