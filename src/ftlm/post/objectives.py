"""The post-training objectives: SFT, DPO and GRPO, as ``Objective`` s of the trainer.

* ``SFT``: next-token cross-entropy on completion tokens only, over packed rows with the
  document mask (``ftlm.post.forward``), mean per completion token of the micro-batch.
* ``DPO``: ``dpo_losses`` on summed completion log-probs of the policy and of a frozen reference
  (computed on the fly, no gradient): the sigmoid loss ``-log sigmoid(beta * h)`` or IPO's
  ``(h - 1 / (2 beta))^2`` on length-normalised log-probs, with
  ``h = (log pi(y_w) - log pi(y_l)) - (log ref(y_w) - log ref(y_l))`` (TRL's formulas),
  plus, with ``nll_coef``, RPO's NLL per chosen token.
* ``GRPO``: per prompt, ``group_size`` completions sampled from the current policy
  (``rollout.sample_groups``: the micro-batch's prompts decoded together) with seeds that
  depend only on ``(run.seed, step, task index, sample)``; reward 1 when the task's checker accepts the answer, else 0; ``group_advantages``;
  ``grpo_loss`` (clipped ratio, k3 KL estimate to the reference, per-sequence token mean, then
  the mean over sequences: DeepSeekMath's form) on log-probs at the sampling temperature, plus,
  with ``nll_coef``, an anchor like DPO's RPO term: the mean NLL per token of the micro-batch's
  verified-correct samples (rejection-sampling fine-tuning on what the policy got right). One
  optimizer step per sampled batch, so the "old" policy is the current one detached (the ratio
  is 1 in value, its gradient is the policy gradient).

Each objective is deterministic given the model state and the rows (and, for GRPO, the step), so
a retried step recomputes the same update. The reference models are frozen copies loaded from
a file: a group that restarts or catches up loads the same file.

Not responsible for: data (``ftlm.post.data``), sampling (``ftlm.post.rollout``), the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ftlm.data.tokenizer import Tokenizer
from ftlm.data.chat import completion_text, prompt_ids
from ftlm.post.forward import completion_logprobs, packed_logits, token_logprobs
from ftlm.post.rollout import sample_groups, sample_seed
from ftlm.tasks import Task, check


# -- SFT ------------------------------------------------------------------------------------------
class SFT:
    """Cross-entropy on completion tokens of packed ``[3, seq_len + 1]`` rows (tokens, mask, docs)."""

    def __init__(self, seq_len: int) -> None:
        self.tokens_per_sample = seq_len

    def _sums(self, model: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, mask, docs = rows[:, 0], rows[:, 1], rows[:, 2]
        logits = packed_logits(model, tokens[:, :-1], docs[:, :-1])
        nll = -token_logprobs(logits, tokens[:, 1:])
        # A target counts when it is a completion token of the same document as its input.
        learn = (mask[:, 1:] > 0) & (docs[:, 1:] == docs[:, :-1])
        m = learn.float()
        return (nll * m).sum(), m.sum()

    def loss(self, model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        total, count = self._sums(model, rows)
        return total / count.clamp(min=1.0)

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
    """

    def __init__(self, reference: nn.Module, seq_len: int, beta: float = 0.1,
                 loss_type: str = "sigmoid", nll_coef: float = 0.0) -> None:
        self.reference = reference.eval().requires_grad_(False)
        self.beta, self.loss_type, self.nll_coef = beta, loss_type, nll_coef
        self.tokens_per_sample = 2 * seq_len

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
        with torch.no_grad():
            ref_chosen, ref_rejected = self.sequence_logps(self.reference, rows)
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


# -- GRPO -----------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` within each group (row) of ``rewards [N, G]``; std unbiased."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor,
              advantages: torch.Tensor, mask: torch.Tensor, clip: float,
              kl_coef: float, nll_coef: float = 0.0,
              correct: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO's loss from per-token log-probs ``[N, T]``, advantages ``[N]`` and a mask ``[N, T]``.

    Per token: ``-min(rho * A, clip(rho, 1 - clip, 1 + clip) * A) + kl_coef * k3`` with
    ``rho = exp(logp - old_logp)`` and ``k3 = exp(ref - logp) - (ref - logp) - 1``; averaged over
    each sequence's completion tokens, then over the sequences. With ``nll_coef``, plus
    ``nll_coef`` times the mean of ``-logp`` over the completion tokens of the sequences that
    ``correct [N]`` (bool) marks (0 when none is).
    """
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1.0 - clip, 1.0 + clip) * a)
    diff = ref_logp - logp
    per_token = -surrogate + kl_coef * (torch.exp(diff) - diff - 1.0)
    per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    if not nll_coef:
        return per_seq.mean()
    if correct is None:
        raise ValueError("grpo_loss: nll_coef > 0 needs correct, the [N] mask of rewarded samples")
    anchored = mask * correct.to(mask.dtype)[:, None]
    nll = -(logp * anchored).sum() / anchored.sum().clamp(min=1.0)
    return per_seq.mean() + nll_coef * nll


class GRPO:
    """RL with verifiable rewards over prompt rows ``[1]`` (an index into ``tasks``)."""

    def __init__(self, tasks: Sequence[Task], tokenizer: Tokenizer, reference: nn.Module, *,
                 seq_len: int, seed: int, group_size: int, clip: float, kl_coef: float,
                 max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 nll_coef: float = 0.0, verify: Callable[[Task, str], bool] = check) -> None:
        self.tasks, self.tokenizer = list(tasks), tokenizer
        self.verify = verify
        """Reward 1 when ``verify(task, completion)`` (``check``, or ``check_trace``)."""
        self.reference = reference.eval().requires_grad_(False)
        self.seed, self.group_size = seed, group_size
        self.clip, self.kl_coef, self.nll_coef = clip, kl_coef, nll_coef
        self.max_new_tokens, self.temperature, self.top_k = max_new_tokens, temperature, top_k
        self.tokens_per_sample = group_size * seq_len
        self.clock: Callable[[], int] = lambda: 0
        """The committed step the next update is for (set by the command to the trainer's)."""
        self.last_reward = float("nan")
        """Mean reward of the last micro-batch's samples (for logs)."""
        self._end = tokenizer.token_id("<|end|>")

    def _complete(self, model: nn.Module, task_indices: list[int], n: int, temperature: float,
                  seeds: list[int]) -> list[tuple[list[list[int]], int]]:
        """Per task of ``task_indices``: ``n`` sequences (prompt + completion) and the prompt's
        length, sampled together (``sample_groups``)."""
        prompts = [prompt_ids(self.tokenizer, self.tasks[i].prompt) for i in task_indices]
        groups, _ = sample_groups(model, prompts, n, self.max_new_tokens, self._end,
                                  self.tokenizer.pad_id, temperature, self.top_k, seeds)
        return [([prompt + c for c in completions], len(prompt))
                for prompt, completions in zip(prompts, groups)]

    def samples(self, model: nn.Module, rows: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens ``[B*G, T]``, completion mask ``[B*G, T]`` and rewards ``[B, G]`` of ``rows``."""
        step = self.clock()
        indices = rows[:, 0].tolist()
        groups = self._complete(model, indices, self.group_size, self.temperature,
                                [sample_seed(self.seed, step, index) for index in indices])
        seqs, masks, rewards = [], [], []
        for index, (full, plen) in zip(indices, groups):
            for ids in full:
                seqs.append(ids)
                masks.append([0] * plen + [1] * (len(ids) - plen))
            rewards.append([float(self.verify(self.tasks[index],
                                              completion_text(self.tokenizer, s[plen:])))
                            for s in full])
        width = max(len(s) for s in seqs)
        tokens = torch.full((len(seqs), width), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (s, m) in enumerate(zip(seqs, masks)):
            tokens[i, :len(s)], mask[i, :len(m)] = torch.tensor(s), torch.tensor(m)
        return tokens.to(rows.device), mask.to(rows.device), torch.tensor(rewards)

    def loss(self, model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        tokens, mask, rewards = self.samples(model, rows)
        self.last_reward = float(rewards.mean())
        advantages = group_advantages(rewards).reshape(-1).to(tokens.device)
        # The policy that sampled is softmax(logits / temperature): its log-probs (TRL's choice).
        logp, m = completion_logprobs(model, tokens, mask, self.temperature)
        with torch.no_grad():
            ref_logp, _ = completion_logprobs(self.reference, tokens, mask, self.temperature)
        return grpo_loss(logp, logp.detach(), ref_logp, advantages, m, self.clip, self.kl_coef,
                         self.nll_coef, rewards.reshape(-1).to(tokens.device) > 0)

    def eval_sums(self, model: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out error rate (1 - accuracy) of greedy completions: sum of errors, prompts."""
        indices = rows[:, 0].tolist()
        errors = 0
        for index, (full, plen) in zip(indices, self._complete(model, indices, 1, 0.0,
                                                               [0] * len(indices))):
            errors += 0 if check(self.tasks[index], completion_text(self.tokenizer, full[0][plen:])) else 1
        return (torch.tensor(float(errors), dtype=torch.float64),
                torch.tensor(float(len(rows)), dtype=torch.float64))
