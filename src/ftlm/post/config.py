"""Settings of post-training (``[post]``): where the data comes from and the objectives' knobs.

One section serves ``ftlm sft``, ``ftlm dpo`` and ``ftlm grpo``; each command reads the fields it
needs. The model to start from is ``train.init_from`` (a ``model.safetensors`` of an earlier run);
the frozen reference of DPO and GRPO is ``post.reference``, by default that same file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ftlm.errors import ConfigError

DPO_LOSSES = ("sigmoid", "ipo")
GRPO_LOSSES = ("grpo", "dapo", "dr_grpo")  # ftlm.post.grpo.LOSS_TYPES
VERIFY = ("answer", "trace")  # the keys of ftlm.tasks.VERIFIERS


def _fail(name: str, value: object, what: str) -> None:
    raise ConfigError(f"post.{name}={value!r} must be {what}")


def _int(name: str, value: object, low: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        _fail(name, value, f"an integer >= {low}")


def _real(name: str, value: object, low: float, high: float = math.inf,
          low_closed: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and math.isfinite(float(value)) and value < high
    ok = ok and (value >= low if low_closed else value > low)
    if not ok:
        bound = f"{'>=' if low_closed else '>'} {low:g}" + ("" if math.isinf(high) else f" and < {high:g}")
        _fail(name, value, f"a finite number {bound}")


@dataclass
class PostConfig:
    """Data and objective settings of SFT, DPO and GRPO."""

    data: str = ""
    """Training file (.jsonl or .parquet): instruction data (SFT), preference pairs (DPO) or a
    task file (GRPO); empty: generated from the task suite (post.families, post.train_tasks)."""
    heldout: str = ""
    """Held-out file of the same kind; empty: the task suite's held-out split (post.heldout_tasks)
    when data is generated, else data.eval_samples rows split off the training file."""
    families: str = "add,mod,sort,count"
    """Comma-separated task families used when data is generated from the task suite."""
    train_tasks: int = 2000
    """Training tasks generated from the task suite (when post.data is empty)."""
    heldout_tasks: int = 200
    """Held-out tasks generated from the suite's test split (when post.heldout is empty)."""
    task_seed: int = 0
    """Seed of the task draw."""
    reference: str = ""
    """Frozen reference model (model.safetensors) of DPO and GRPO; empty: train.init_from."""
    beta: float = 0.1
    """DPO: strength of the implicit KL constraint (the temperature of the preference logits)."""
    dpo_loss: str = "sigmoid"
    """DPO loss: sigmoid (Rafailov et al.) or ipo (Azar et al., length-normalised log-probs)."""
    dpo_nll: float = 0.0
    """DPO: weight of the NLL per chosen token added to the loss (RPO; 0: plain DPO)."""
    dpo_precompute: bool = False
    """DPO: compute the reference's log-probs of every pair once at start and keep no reference
    model during training (less memory, no reference forward per step; the same loss)."""
    group_size: int = 8
    """GRPO: completions sampled per prompt (G)."""
    clip: float = 0.2
    """GRPO: the policy ratio is clipped to [1 - clip, 1 + clip]."""
    kl_coef: float = 0.04
    """GRPO: weight of the per-token KL estimate to the reference (TRL's beta; 0: no KL term and
    no reference model loaded)."""
    grpo_loss: str = "grpo"
    """GRPO loss reduction, as TRL's loss_type: grpo (each sequence's token mean, then the mean
    over sequences), dapo (token mean over the micro-batch; TRL's default), dr_grpo (token sum /
    (sequences x post.max_new_tokens))."""
    ppo_epochs: int = 1
    """GRPO: optimizer steps each rollout is trained in (TRL's num_iterations); its old
    log-probs are taken once, at its first pass, so later passes clip the ratio."""
    filter_zero_variance: bool = False
    """GRPO: leave groups whose samples all got the same reward out of the loss and its
    normaliser (their advantages are all 0)."""
    mask_truncated: bool = False
    """GRPO: completions cut at post.max_new_tokens (no end token) get no loss (TRL's
    mask_truncated_completions)."""
    reward: str = ""
    """GRPO: a reward function 'module:function' importable from PYTHONPATH, called as
    fn(prompts, completions, *, answer, family, key, solution) -> list[float] (one number per
    completion; docs/post-training.md); empty: 1.0 when post.verify's checker accepts, else 0.0."""
    grpo_nll: float = 0.0
    """GRPO: weight of the NLL per token of the verified-correct samples added to the loss (an
    anchor like DPO's RPO term; 0: plain GRPO)."""
    max_new_tokens: int = 160
    """Longest sampled completion (GRPO, preference pairs, evaluation)."""
    temperature: float = 1.0
    """Sampling temperature of GRPO (its log-probs are taken at it) and of preference pairs."""
    top_k: int = 0
    """Keep the k most likely tokens when sampling; 0 keeps all."""
    pair_samples: int = 4
    """Preference pairs: completions sampled per task from the reference model."""
    verify: str = "answer"
    """What a correct sample is (GRPO's reward, preference pairs): answer (the final answer
    checks) or trace (the reasoning must also equal the reference solution's)."""

    def __post_init__(self) -> None:
        for name in ("train_tasks", "heldout_tasks", "task_seed", "top_k"):
            _int(name, getattr(self, name), 0)
        for name in ("group_size", "max_new_tokens", "pair_samples", "ppo_epochs"):
            _int(name, getattr(self, name), 1)
        if self.group_size < 2:
            _fail("group_size", self.group_size, "at least 2 (advantages compare samples of a group)")
        if self.pair_samples < 2:
            _fail("pair_samples", self.pair_samples, "at least 2 (a pair needs two samples)")
        _real("beta", self.beta, 0.0)
        _real("clip", self.clip, 0.0, 1.0)
        _real("kl_coef", self.kl_coef, 0.0, low_closed=True)
        _real("dpo_nll", self.dpo_nll, 0.0, low_closed=True)
        _real("grpo_nll", self.grpo_nll, 0.0, low_closed=True)
        _real("temperature", self.temperature, 0.0)
        if self.verify not in VERIFY:
            _fail("verify", self.verify, f"one of {', '.join(VERIFY)}")
        if self.grpo_loss not in GRPO_LOSSES:
            _fail("grpo_loss", self.grpo_loss, f"one of {', '.join(GRPO_LOSSES)}")
        for name in ("filter_zero_variance", "mask_truncated", "dpo_precompute"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "true or false")
        if not isinstance(self.reward, str) or (self.reward and ":" not in self.reward):
            _fail("reward", self.reward, "'module:function' (or empty for the built-in checker)")
        if self.dpo_loss not in DPO_LOSSES:
            _fail("dpo_loss", self.dpo_loss, f"one of {', '.join(DPO_LOSSES)}")
        if not isinstance(self.families, str) or not self.families.strip():
            _fail("families", self.families, "a comma-separated list of task families")

    @property
    def family_list(self) -> list[str]:
        return [f.strip() for f in self.families.split(",") if f.strip()]
