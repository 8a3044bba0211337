"""Settings of the training loop and of durable checkpoints, the run's identity (``[run]``), and
``TrainerConfig``: the sections a ``Trainer`` reads. The composition root (``ftlm.config``)
builds that from the whole run configuration, so training never imports the launchers' settings
(``[cluster]``) or the commands' (``[post]``, ``[cost]``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftlm.data.config import DataConfig
from ftlm.errors import ConfigError
from ftlm.ft.config import FTConfig
from ftlm.model.config import ModelConfig
from ftlm.observe.config import ObserveConfig

SCHEDULES = ("cosine", "wsd", "constant")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")


def is_finite_number(value: object) -> bool:
    """Whether ``value`` is an int or float (not a bool) that is finite as a float."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond the float range
        return False


def _count(name: str, value: object, *, positive: bool) -> None:
    """An integer field of ``[train]``: > 0 or >= 0."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not (ok and (value > 0 if positive else value >= 0)):
        raise ConfigError(f"train.{name}={value!r} must be an integer {'> 0' if positive else '>= 0'}")


def _real(name: str, value: object, low: float, high: float = math.inf, *,
          low_closed: bool = False, high_closed: bool = False, note: str = "") -> None:
    """A float field of ``[train]``: finite and inside the interval ``low .. high``.

    Infinity and NaN are refused everywhere: no field of the training loop means anything
    with them (an infinite learning rate trains to NaN, a NaN range check passes silently).
    """
    ok = is_finite_number(value)
    ok = ok and (low <= value if low_closed else low < value)
    ok = ok and (value <= high if high_closed else value < high)
    if ok:
        return
    if math.isinf(high):
        bound = f"{'>=' if low_closed else '>'} {low:g}"
    else:
        bound = f"in {'[' if low_closed else '('}{low:g}, {high:g}{']' if high_closed else ')'}"
    raise ConfigError(f"train.{name}={value!r} must be a finite number {bound}{note}")


@dataclass
class TrainConfig:
    """The optimisation loop of one replica group."""

    steps: int = 200
    """Number of optimizer steps of the whole run (the LR schedule spans them)."""
    batch_size: int = 8
    """Samples each participating group trains per step; the global batch is participants x this."""
    grad_accum: int = 1
    """Micro-batches per step; batch_size must be divisible by it."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    warmup_steps: int = 20
    """Linear warm-up length in steps."""
    schedule: str = "cosine"
    """Decay after warm-up: cosine, wsd (warmup-stable-decay) or constant."""
    decay_fraction: float = 0.2
    """Fraction of the steps spent decaying at the end of a wsd schedule."""
    weight_decay: float = 0.1
    """Decoupled AdamW weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda."""
    dtype: str = "auto"
    """Autocast dtype: auto (bfloat16 on CUDA, float32 on CPU), float32 or bfloat16 (also on CPU:
    matmuls in bf16, weights and optimizer state in float32)."""
    compile: bool = False
    """Compile the model with torch.compile."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass to save memory."""
    max_seconds: float = 0.0
    """Stop after this many seconds of training even if steps remain; 0 means no limit."""
    threads: int = 0
    """torch intra-op threads; 0 keeps torch's default."""
    eval_every: int = 50
    """Held-out loss every this many committed steps and after the last one; 0 turns it off."""
    eval_batches: int = 4
    """Batches of batch_size held-out samples per evaluation; at most data.eval_samples samples."""
    init_from: str = ""
    """model.safetensors to start from instead of a random initialisation (e.g. a pretrained
    model for post-training); empty: random initialisation from run.seed."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum"):
            _count(name, getattr(self, name), positive=True)
        for name in ("warmup_steps", "threads"):
            _count(name, getattr(self, name), positive=False)
        _real("lr", self.lr, 0)
        _real("min_lr_ratio", self.min_lr_ratio, 0, 1, low_closed=True, high_closed=True)
        _real("decay_fraction", self.decay_fraction, 0, 1, high_closed=True)
        _real("weight_decay", self.weight_decay, 0, low_closed=True)
        _real("beta1", self.beta1, 0, 1, low_closed=True)
        _real("beta2", self.beta2, 0, 1, low_closed=True)
        _real("eps", self.eps, 0)
        _real("grad_clip", self.grad_clip, 0, low_closed=True, note=" (0 disables clipping)")
        _real("max_seconds", self.max_seconds, 0, low_closed=True, note=" (0 means no limit)")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"train.batch_size={self.batch_size} must be divisible by "
                              f"train.grad_accum={self.grad_accum}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"train.schedule={self.schedule!r}; valid: {', '.join(SCHEDULES)}")
        if self.device not in DEVICES:
            raise ConfigError(f"train.device={self.device!r}; valid: {', '.join(DEVICES)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"train.dtype={self.dtype!r}; valid: {', '.join(DTYPES)}")
        for name in ("compile", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"train.{name}={getattr(self, name)!r} must be true or false")
        for name in ("eval_every", "eval_batches"):
            _count(name, getattr(self, name), positive=False)
        if not isinstance(self.init_from, str):
            raise ConfigError(f"train.init_from={self.init_from!r} must be a path (a string)")
        if self.eval_every and not self.eval_batches:
            raise ConfigError(f"train.eval_batches=0 with train.eval_every={self.eval_every}: "
                              "set eval_batches >= 1, or eval_every=0 to turn evaluation off")


@dataclass
class CheckpointConfig:
    """Durable checkpoints for whole-job restarts (live recovery needs none)."""

    every: int = 0
    """Save every this many committed steps; 0: no periodic checkpoints. The last step is always
    saved (``Durability.save_final``)."""
    keep: int = 2
    """Number of most recent valid checkpoints kept on disk."""
    dir: str = ""
    """Checkpoint directory; empty means ``<run dir>/checkpoints``."""
    async_save: bool = True
    """Write in the background after a synchronous copy of the state."""
    resume: bool = True
    """Resume from the latest valid checkpoint in ``dir`` when one exists."""
    on_stop: bool = True
    """When training stops before its last step (SIGTERM, ``train.max_seconds``; not Ctrl-C,
    which may land mid-update), the group that wrote the last step's checkpoints (its first
    participant) saves the committed state on its way out, unless that step is on disk already:
    a job preempted or stopped as a whole resumes where it stopped, not up to ``every`` steps
    earlier. Synchronous, before the group leaves: the other groups wait for it (they hold the
    same state; at most ``ft.join_timeout`` when they are a majority without it), and it must
    fit in the platform's grace period and in ``ft.progress_timeout`` (a save cut short is
    never valid; the job then resumes from the one before). Needs ``every`` > 0."""

    def __post_init__(self) -> None:
        for name in ("every", "keep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"checkpoint.{name}={value!r} must be an integer >= 0")
        if self.keep < 1:
            raise ConfigError(f"checkpoint.keep={self.keep} must be at least 1")


@dataclass
class RunSection:
    """Identity and location of a run."""

    name: str = "run"
    """Name of the run; the run directory defaults to ``runs/<name>``."""
    dir: str = ""
    """Run directory; empty means ``runs/<name>``."""
    seed: int = 0
    """Seed of the model initialisation and of the data order."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(f"run.name={self.name!r} must be a non-empty name without '/'")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"run.seed={self.seed!r} must be a non-negative integer")

    @property
    def path(self) -> Path:
        return Path(self.dir) if self.dir else Path("runs") / self.name


@dataclass(frozen=True)
class TrainerConfig:
    """What one ``Trainer`` is configured with (``RunConfig.trainer_config()`` builds it)."""

    run: RunSection
    """Name, directory and seed of the run."""
    model: ModelConfig
    """Shape of the model."""
    data: DataConfig
    """Prepared data, sequence length and held-out split."""
    train: TrainConfig
    """The training loop: steps, batch, optimizer, device."""
    checkpoint: CheckpointConfig
    """Durable checkpoints."""
    ft: FTConfig
    """Gradient buckets, catch-up buffer budgets, the degraded learning-rate policy, the token."""
    observe: ObserveConfig
    """Progress output and metrics."""
    resolved: dict[str, Any] = field(default_factory=dict)
    """The whole resolved run configuration as plain data: written to the run's config.toml and
    summary.json as the record of what ran."""
