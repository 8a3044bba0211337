"""The post-training objectives: SFT, DPO and GRPO, as ``Objective`` s of the trainer.

* ``SFT``: next-token cross-entropy on completion tokens only, over packed rows with the
  document mask (``ftlm.post.forward``): the sum over the step's completion tokens divided by
  their count over every micro-batch, rank and group (a ``SummedObjective`` of the trainer);
  ``loss`` alone is the mean per completion token of the rows it is given.
* ``DPO``: ``dpo_losses`` on summed completion log-probs of the policy and of a frozen reference
  (computed on the fly, no gradient, or once at start: ``reference_table``): the sigmoid loss ``-log sigmoid(beta * h)`` or IPO's
  ``(h - 1 / (2 beta))^2`` on length-normalised log-probs, with
  ``h = (log pi(y_w) - log pi(y_l)) - (log ref(y_w) - log ref(y_l))`` (TRL's formulas),
  plus, with ``nll_coef``, RPO's NLL per chosen token.
* ``GRPO``: in ``ftlm.post.grpo`` (re-exported here with ``grpo_loss`` and ``group_advantages``).

Each objective is deterministic given the model state and the rows (and, for GRPO, the step), so
a retried step recomputes the same update. The reference models are frozen copies loaded from
a file: a group that restarts or catches up loads the same file.

Not responsible for: data (``ftlm.post.data``), sampling (``ftlm.post.rollout``), the loop.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ftlm.post.forward import completion_logprobs, packed_logits, token_logprobs
from ftlm.post.grpo import GRPO, group_advantages, grpo_loss

__all__ = ["SFT", "DPO", "dpo_losses", "reference_table", "with_row_index", "GRPO",
           "group_advantages", "grpo_loss"]


# -- SFT ------------------------------------------------------------------------------------------
class SFT:
    """Cross-entropy on completion tokens of packed ``[3, seq_len + 1]`` rows (tokens, mask, docs)."""

    def __init__(self, seq_len: int) -> None:
        self.tokens_per_sample = seq_len

    def _sums(self, model: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, mask, docs = rows[:, 0], rows[:, 1], rows[:, 2]
        logits = packed_logits(model, tokens[:, :-1], docs[:, :-1])
        nll = -token_logprobs(logits, tokens[:, 1:])
        m = self._learn(mask, docs).float()
        return (nll * m).sum(), m.sum()

    @staticmethod
    def _learn(mask: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` bool: a target counts when it is a completion token of the same document
        as its input."""
        return (mask[:, 1:] > 0) & (docs[:, 1:] == docs[:, :-1])

    def loss(self, model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        total, count = self._sums(model, rows)
        return total / count.clamp(min=1.0)

    # A SummedObjective: the trainer divides the sums by the whole step's completion tokens.
    def units(self, rows: torch.Tensor) -> float:
        return float(self._learn(rows[:, 1], rows[:, 2]).sum())

    def loss_sum(self, model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        return self._sums(model, rows)[0]

    def eval_sums(self, model: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total, count = self._sums(model, rows)
        return total.double(), count.double()


# -- DPO ------------------------------------------------------------------------------------------
def dpo_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
               ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float,
               loss_type: str = "sigmoid") -> torch.Tensor:
    """Per-pair DPO losses ``[B]`` from sequence log-probs ``[B]`` (see the module docstring)."""
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * h)
    if loss_type == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    raise ValueError(f"loss_type={loss_type!r} is not sigmoid or ipo")


class DPO:
    """DPO over preference rows ``[4, seq_len + 1]`` (chosen, its mask, rejected, its mask).

    ``nll_coef > 0`` adds RPO's term (Pang et al. 2024, "Iterative Reasoning Preference
    Optimization"): ``nll_coef`` times the mean negative log-likelihood per chosen completion
    token of the micro-batch, as TRL's ``loss_type=["sigmoid", "sft"]`` with
    ``loss_weights=[1, nll_coef]``. Without it DPO may lower the chosen answers' likelihood too
    (it only widens the margin), which on reasoning tasks costs accuracy.

    ``reference_logps`` (``[N, 2]``: chosen, rejected sequence log-probs of the reference, from
    ``reference_table``) replaces the reference model: rows then carry a fifth channel whose
    first entry is the row's index into that table (``with_row_index``), and no reference
    forward runs during training (TRL's ``precompute_ref_log_probs``).
    """

    def __init__(self, reference: nn.Module | None, seq_len: int, beta: float = 0.1,
                 loss_type: str = "sigmoid", nll_coef: float = 0.0,
                 reference_logps: torch.Tensor | None = None) -> None:
        if (reference is None) == (reference_logps is None):
            raise ValueError("DPO needs either a reference model or its precomputed log-probs")
        self.reference = None if reference is None else reference.eval().requires_grad_(False)
        self.reference_logps = reference_logps
        self.beta, self.loss_type, self.nll_coef = beta, loss_type, nll_coef
        self.tokens_per_sample = 2 * seq_len

    def _reference(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's (chosen, rejected) sequence log-probs ``[B]`` of ``rows``."""
        if self.reference_logps is None:
            with torch.no_grad():
                return self.sequence_logps(self.reference, rows)
        table = self.reference_logps[rows[:, 4, 0].cpu()].to(rows.device)
        return table[:, 0], table[:, 1]

    def _logps(self, model: nn.Module, rows: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token log-probs and masks ``[B, T]`` of the chosen and the rejected side."""
        tokens = torch.cat((rows[:, 0], rows[:, 2]))  # one forward for both sides
        mask = torch.cat((rows[:, 1], rows[:, 3]))
        # Rows are right-padded to seq_len + 1: the padding after the last completion token of
        # the micro-batch changes nothing under causal attention, so it is not computed.
        learned = mask.any(dim=0).nonzero()
        width = max(2, int(learned[-1]) + 1) if len(learned) else tokens.shape[1]
        logp, m = completion_logprobs(model, tokens[:, :width], mask[:, :width])
        (chosen, rejected), (mc, mr) = logp.chunk(2), m.chunk(2)
        return chosen, rejected, mc, mr

    def _sequence(self, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        seq = (logp * mask).sum(-1)
        return seq / mask.sum(-1).clamp(min=1.0) if self.loss_type == "ipo" else seq

    def sequence_logps(self, model: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) completion log-probs ``[B]`` (length-normalised for IPO)."""
        chosen, rejected, mc, mr = self._logps(model, rows)
        return self._sequence(chosen, mc), self._sequence(rejected, mr)

    def _terms(self, model: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-pair preference losses ``[B]`` and the mean NLL per chosen token (a scalar)."""
        chosen, rejected, mc, mr = self._logps(model, rows)
        ref_chosen, ref_rejected = self._reference(rows)
        losses = dpo_losses(self._sequence(chosen, mc), self._sequence(rejected, mr),
                            ref_chosen, ref_rejected, self.beta, self.loss_type)
        nll = -(chosen * mc).sum() / mc.sum().clamp(min=1.0)
        return losses, nll

    def losses(self, model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """Per-pair preference losses ``[B]`` (without the NLL term)."""
        return self._terms(model, rows)[0]

    def loss(self, model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        losses, nll = self._terms(model, rows)
        loss = losses.mean()
        return loss + self.nll_coef * nll if self.nll_coef else loss

    def eval_sums(self, model: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of held-out per-pair preference losses (the NLL term left out) and pairs."""
        losses = self.losses(model, rows)
        return losses.sum().double(), torch.tensor(float(len(losses)), dtype=torch.float64)


@torch.no_grad()
def reference_table(reference: nn.Module, rows: torch.Tensor, loss_type: str,
                    batch: int = 32) -> torch.Tensor:
    """``[N, 2]`` float32 (chosen, rejected) sequence log-probs of ``reference`` for preference
    ``rows [N, 4 or 5, T]``, as ``DPO.sequence_logps`` computes them, on the CPU."""
    reference.eval()
    device = next(reference.parameters()).device
    scorer = DPO(reference, rows.shape[-1] - 1, loss_type=loss_type)
    parts = []
    for start in range(0, len(rows), batch):
        chosen, rejected = scorer.sequence_logps(reference, rows[start:start + batch].to(device))
        parts.append(torch.stack((chosen, rejected), dim=1).float().cpu())
    return torch.cat(parts) if parts else torch.zeros((0, 2))


def with_row_index(rows: np.ndarray, first: int = 0) -> np.ndarray:
    """Preference rows ``[N, 4, T]`` with a fifth channel holding ``first + i`` at position 0."""
    index = np.zeros((len(rows), 1, rows.shape[-1]), dtype=rows.dtype)
    index[:, 0, 0] = np.arange(first, first + len(rows))
    return np.concatenate((rows, index), axis=1)
