"""GRPO (RL with verifiable or user rewards) as an ``Objective`` of the trainer.

Per prompt of a micro-batch, ``group_size`` completions are sampled from the current policy
(``rollout.sample_groups``, seeds a pure function of ``(run.seed, step, task index, sample)``),
rewarded (``ftlm.post.rewards``: the task checker, or ``post.reward``'s function) and turned into
group-normalised advantages ``(r - mean) / (std + 1e-4)`` (unbiased std, TRL's ``scale_rewards=
"group"``). Before the loss, optionally:

* ``filter_zero_variance``: groups whose rewards are all equal (advantage 0 for every sample) are
  left out of the loss and of its normaliser (DAPO's dynamic-sampling filter, without resampling);
* ``mask_truncated``: completions cut at ``max_new_tokens`` (no ``<|end|>``) get no loss but stay
  in the sequence count (TRL's ``mask_truncated_completions``).

``grpo_loss`` per token: ``-min(rho * A, clip(rho, 1 - clip, 1 + clip) * A) + kl_coef * k3`` with
``rho = exp(logp - old_logp)`` and ``k3 = exp(ref - logp) - (ref - logp) - 1`` (no reference model
and no KL term when ``kl_coef`` is 0), reduced as TRL's ``loss_type``:

* ``grpo``: each sequence's token mean, then the mean over sequences (DeepSeekMath);
* ``dapo``: the sum over the micro-batch's tokens / its token count (token-level);
* ``dr_grpo``: the sum over tokens / (sequences x ``max_new_tokens``), a constant normaliser.

Optimisation passes (``ppo_epochs`` = TRL's ``num_iterations`` = mu of the GRPO paper): a rollout
is trained in ``ppo_epochs`` consecutive optimizer steps. Its old log-probs are taken once, in the
forward of its first pass (the policy that sampled it); in its later passes the policy has moved,
so the ratio differs from 1 and the clip acts. Every step samples the rows the data loader hands
it (so every prompt is rolled out exactly once, as the exactly-once cursor counts it) and trains,
micro-batch by micro-batch, that fresh rollout together with the rollouts of the same micro-batch
slot of the previous ``ppo_epochs - 1`` committed steps, all reduced as one batch. TRL instead
re-trains one rollout ``mu`` times before sampling again; both give each rollout ``mu`` passes
from the same old log-probs, this one without skipping or repeating data positions.

The window of earlier rollouts is this group's memory, not replicated state: a group that
(re)starts or catches up trains fresh rollouts only until its window refills (the others' steps
are unaffected: the all-reduce averages what each group computed). A retried step recomputes
the same update: its fresh rollout is drawn again from the same seeds and model, and the window
holds only committed steps' rollouts.

Not responsible for: sampling (``ftlm.post.rollout``), rewards (``ftlm.post.rewards``), the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ftlm.data.chat import completion_text, prompt_ids
from ftlm.data.tokenizer import Tokenizer
from ftlm.post.forward import completion_logprobs, sequence_logprobs
from ftlm.post.rewards import Reward, checker_reward
from ftlm.post.rollout import sample_groups, sample_seed
from ftlm.tasks import Task, check

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` within each group (row) of ``rewards [N, G]``; std unbiased."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)


def varied_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: the groups (rows of ``rewards [N, G]``) whose rewards are not all equal."""
    return (rewards != rewards[:, :1]).any(dim=1)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, clip: float,
              kl_coef: float, nll_coef: float = 0.0,
              correct: torch.Tensor | None = None, *, loss_type: str = "grpo",
              max_tokens: int = 0, keep: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO's loss from per-token log-probs ``[N, T]``, advantages ``[N]`` and a mask ``[N, T]``.

    The per-token term and the reduction ``loss_type`` are the module docstring's; ``dr_grpo``
    needs ``max_tokens`` (the completion budget). ``keep [N]`` (bool, default all) leaves
    sequences out of the loss and its normaliser. With ``nll_coef``, plus ``nll_coef`` times the
    mean of ``-logp`` over the completion tokens of the kept sequences that ``correct [N]`` marks
    (0 when none is).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    if keep is not None:
        mask = mask * keep.to(mask.dtype)[:, None]
    sequences = mask.new_tensor(float(mask.shape[0])) if keep is None else keep.sum().to(mask.dtype)
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None]
    per_token = -torch.minimum(ratio * a, ratio.clamp(1.0 - clip, 1.0 + clip) * a)
    if kl_coef:
        if ref_logp is None:
            raise ValueError("grpo_loss: kl_coef > 0 needs ref_logp, the reference's log-probs")
        diff = ref_logp - logp
        per_token = per_token + kl_coef * (torch.exp(diff) - diff - 1.0)
    if loss_type == "grpo":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        loss = per_seq.sum() / sequences.clamp(min=1.0)
    elif loss_type == "dapo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    else:
        if max_tokens < 1:
            raise ValueError("grpo_loss: loss_type='dr_grpo' needs max_tokens >= 1 (the budget)")
        loss = (per_token * mask).sum() / (sequences.clamp(min=1.0) * max_tokens)
    if not nll_coef:
        return loss
    if correct is None:
        raise ValueError("grpo_loss: nll_coef > 0 needs correct, the [N] mask of rewarded samples")
    anchored = mask * correct.to(mask.dtype)[:, None]
    return loss + nll_coef * -(logp * anchored).sum() / anchored.sum().clamp(min=1.0)


def clipped_fraction(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, clip: float) -> float:
    """Share of the masked tokens whose clipped term is the one taken (no gradient flows there):
    ratio below ``1 - clip`` with a negative advantage, or above ``1 + clip`` with a positive one."""
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None]
    clipped = ((ratio < 1.0 - clip) & (a < 0)) | ((ratio > 1.0 + clip) & (a > 0))
    return float((clipped.float() * mask).sum() / mask.sum().clamp(min=1.0))


@dataclass
class Rollout:
    """One micro-batch's sampled completions and what its later passes need."""

    tokens: torch.Tensor
    """Prompt + completion ``[n, T]``, right-padded."""
    mask: torch.Tensor
    """Float ``[n, T - 1]``: the targets that get a loss (completion tokens, truncation applied)."""
    advantages: torch.Tensor
    """``[n]`` group-normalised advantages."""
    keep: torch.Tensor
    """``[n]`` bool: in the loss (false for zero-variance groups when they are filtered)."""
    correct: torch.Tensor
    """``[n]`` bool: reward > 0 (the NLL anchor's samples)."""
    ref_logp: torch.Tensor | None = None
    """``[n, T - 1]`` the reference's log-probs (None without a KL term)."""
    old_logp: torch.Tensor | None = None
    """``[n, T - 1]`` the sampling policy's log-probs, set by the first pass."""


def _padded(parts: Sequence[torch.Tensor], width: int, value: float) -> torch.Tensor:
    """``parts`` ``[n_i, w_i]`` right-padded with ``value`` to ``width`` and concatenated."""
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=value)
                      for p in parts])


class GRPO:
    """GRPO over prompt rows ``[1]`` (an index into ``tasks``): the module docstring."""

    def __init__(self, tasks: Sequence[Task], tokenizer: Tokenizer, reference: nn.Module | None,
                 *, seq_len: int, seed: int, group_size: int, clip: float, kl_coef: float,
                 max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 nll_coef: float = 0.0, verify: Callable[[Task, str], bool] = check,
                 reward: Reward | None = None, loss_type: str = "grpo", ppo_epochs: int = 1,
                 filter_zero_variance: bool = False, mask_truncated: bool = False) -> None:
        if kl_coef and reference is None:
            raise ValueError("GRPO: kl_coef > 0 needs a reference model")
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"GRPO: loss_type={loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        self.tasks, self.tokenizer = list(tasks), tokenizer
        self.reward: Reward = reward or checker_reward(verify)
        """``reward(tasks, completions)``: one number per completion."""
        self.reference = None if reference is None else reference.eval().requires_grad_(False)
        self.seed, self.group_size = seed, group_size
        self.clip, self.kl_coef, self.nll_coef = clip, kl_coef, nll_coef
        self.max_new_tokens, self.temperature, self.top_k = max_new_tokens, temperature, top_k
        self.loss_type, self.ppo_epochs = loss_type, ppo_epochs
        self.filter_zero_variance, self.mask_truncated = filter_zero_variance, mask_truncated
        self.tokens_per_sample = group_size * seq_len
        self.clock: Callable[[], int] = lambda: 0
        """The committed step the next update is for (set by the command to the trainer's)."""
        self.stats: dict[str, float] = {}
        """The last micro-batch's reward mean, share of zero-variance groups, of truncated
        completions, and of clipped tokens (of the rollouts in their later passes)."""
        self._measured: dict[str, list[float]] = {}
        """Every micro-batch's ``stats`` since the last ``step_stats``."""
        self._end = tokenizer.token_id("<|end|>")
        self._window: dict[int, list[tuple[tuple[int, ...], Rollout]]] = {}

    def step_stats(self) -> dict[str, float]:
        """The means of ``stats`` over the micro-batches since the last call (the trainer writes
        them as the committed step's ``objective`` event); forgets them."""
        measured, self._measured = self._measured, {}
        return {name: sum(values) / len(values) for name, values in measured.items()}

    def _measure(self, **stats: float) -> None:
        self.stats.update(stats)
        for name, value in stats.items():
            self._measured.setdefault(name, []).append(value)

    @property
    def last_reward(self) -> float:
        """Mean reward of the last micro-batch's fresh samples (for logs)."""
        return self.stats.get("reward", float("nan"))

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
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens ``[B*G, T]``, completion mask ``[B*G, T]``, rewards ``[B, G]`` and whether each
        completion was cut by the budget ``[B*G]`` (bool) of ``rows``."""
        step = self.clock()
        indices = rows[:, 0].tolist()
        groups = self._complete(model, indices, self.group_size, self.temperature,
                                [sample_seed(self.seed, step, index) for index in indices])
        seqs, masks, cut, tasks, texts = [], [], [], [], []
        for index, (full, plen) in zip(indices, groups):
            for ids in full:
                seqs.append(ids)
                masks.append([0] * plen + [1] * (len(ids) - plen))
                cut.append(ids[-1] != self._end)
                tasks.append(self.tasks[index])
                texts.append(completion_text(self.tokenizer, ids[plen:]))
        rewards = torch.tensor(self.reward(tasks, texts)).reshape(len(indices), self.group_size)
        width = max(len(s) for s in seqs)
        tokens = torch.full((len(seqs), width), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (s, m) in enumerate(zip(seqs, masks)):
            tokens[i, :len(s)], mask[i, :len(m)] = torch.tensor(s), torch.tensor(m)
        return (tokens.to(rows.device), mask.to(rows.device), rewards,
                torch.tensor(cut, device=rows.device))

    def rollout(self, model: nn.Module, rows: torch.Tensor) -> Rollout:
        """Sample, reward and score ``rows`` (the first pass's inputs; old log-probs unset)."""
        tokens, mask, rewards, cut = self.samples(model, rows)
        device = tokens.device
        varied = varied_groups(rewards)
        keep = (varied if self.filter_zero_variance else torch.ones_like(varied))
        keep = keep.repeat_interleave(self.group_size).to(device)
        target_mask = mask[:, 1:].float()
        if self.mask_truncated:
            target_mask = target_mask * (~cut).float()[:, None]
        ref_logp = None
        if self.kl_coef:
            with torch.no_grad():
                ref_logp, _ = completion_logprobs(self.reference, tokens, mask, self.temperature)
        self._measure(reward=float(rewards.mean()),
                      zero_variance=float(1.0 - varied.float().mean()),
                      truncated=float(cut.float().mean()))
        return Rollout(tokens=tokens, mask=target_mask,
                       advantages=group_advantages(rewards).reshape(-1).to(device), keep=keep,
                       correct=(rewards.reshape(-1) > 0).to(device), ref_logp=ref_logp)

    def _earlier(self, step: int, key: tuple[int, ...]) -> tuple[list[Rollout], int]:
        """The rollouts of this micro-batch slot from the window (committed steps before
        ``step``), and the slot: the position of ``key`` (the rows) among this step's calls."""
        for old in [s for s in self._window if s <= step - self.ppo_epochs or s > step]:
            del self._window[old]  # out of the window, or a step that never committed
        calls = self._window.setdefault(step, [])
        keys = [k for k, _ in calls]
        slot = keys.index(key) if key in keys else len(keys)  # a retried step: the same slot
        earlier = [self._window[s][slot][1] for s in range(step - self.ppo_epochs + 1, step)
                   if s in self._window and len(self._window[s]) > slot]
        return earlier, slot

    def loss(self, model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        step, key = self.clock(), tuple(rows[:, 0].tolist())
        fresh = self.rollout(model, rows)
        earlier, slot = self._earlier(step, key)
        rollouts = [fresh, *earlier]
        width = max(r.tokens.shape[1] for r in rollouts)
        tokens = _padded([r.tokens for r in rollouts], width, self.tokenizer.pad_id)
        mask = _padded([r.mask for r in rollouts], width - 1, 0.0)
        advantages = torch.cat([r.advantages for r in rollouts])
        keep = torch.cat([r.keep for r in rollouts])
        ref_logp = (_padded([r.ref_logp for r in rollouts], width - 1, 0.0)
                    if self.kl_coef else None)
        # The policy that sampled is softmax(logits / temperature): its log-probs (TRL's choice).
        logp = sequence_logprobs(model, tokens, self.temperature)
        # The fresh rollout's first pass: the old policy is the current one, its log-probs
        # taken here, once, for this pass and the later ones.
        fresh.old_logp = logp[:len(fresh.tokens), :fresh.tokens.shape[1] - 1].detach()
        old = _padded([r.old_logp for r in rollouts], width - 1, 0.0)
        self.stats.pop("clipped", None)
        if earlier:
            n = len(fresh.tokens)
            self._measure(clipped=clipped_fraction(
                logp[n:].detach(), old[n:], advantages[n:], mask[n:] * keep[n:, None], self.clip))
        calls = self._window[step]
        calls[slot:slot + 1] = [(key, fresh)]  # a retried step replaces its slot's rollout
        if self.ppo_epochs == 1:
            self._window.clear()  # nothing is trained twice: keep no rollout
        return grpo_loss(logp, old, ref_logp, advantages, mask, self.clip, self.kl_coef,
                         self.nll_coef, torch.cat([r.correct for r in rollouts]),
                         loss_type=self.loss_type, max_tokens=self.max_new_tokens, keep=keep)

    def eval_sums(self, model: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out error rate (1 - accuracy) of greedy completions: sum of errors, prompts."""
        indices = rows[:, 0].tolist()
        errors = 0
        for index, (full, plen) in zip(indices, self._complete(model, indices, 1, 0.0,
                                                               [0] * len(indices))):
            errors += 0 if check(self.tasks[index], completion_text(self.tokenizer, full[0][plen:])) else 1
        return (torch.tensor(float(errors), dtype=torch.float64),
                torch.tensor(float(len(rows)), dtype=torch.float64))
