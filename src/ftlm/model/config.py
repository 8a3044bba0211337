"""Model hyper-parameters and the table of named sizes.

A ``ModelConfig`` names a size from ``SIZES``; any field left as ``None`` is filled from that row,
so ``--set model.size=small`` is enough and ``--set model.dim=96`` overrides one value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ftlm.errors import ConfigError

# One row per named size. Parameter counts are those of ``param_count`` with the listed vocab.
SIZES: dict[str, dict] = {
    "tiny": dict(vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384,
                 max_seq_len=512, tie_embeddings=True),
    "small": dict(vocab_size=8192, dim=384, n_layers=8, n_heads=6, n_kv_heads=2, ffn_dim=1024,
                  max_seq_len=1024, tie_embeddings=True),
    "125m": dict(vocab_size=32768, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048,
                 max_seq_len=2048, tie_embeddings=True),
    "1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
               max_seq_len=4096, tie_embeddings=True),
    "8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
               max_seq_len=8192, tie_embeddings=False),
}


_INT_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")


def _finite(value: object) -> bool:
    # Infinity and NaN mean nothing for a norm epsilon, an init scale or a rotary base.
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


@dataclass
class ModelConfig:
    """Shape of the Llama-style decoder."""

    size: str = "tiny"
    """Named size from ``SIZES``; fields left unset take that row's values."""
    vocab_size: int | None = None
    """Number of token ids; must be at least the tokenizer's vocabulary size."""
    dim: int | None = None
    """Width of the residual stream."""
    n_layers: int | None = None
    """Number of transformer blocks."""
    n_heads: int | None = None
    """Number of query heads; ``dim`` must be divisible by it."""
    n_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); divides ``n_heads``."""
    ffn_dim: int | None = None
    """Hidden width of the SwiGLU MLP."""
    max_seq_len: int | None = None
    """Longest sequence the rotary table is built for."""
    tie_embeddings: bool | None = None
    """Share the token embedding with the output projection."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of linear and embedding weights."""

    def __post_init__(self) -> None:
        if not isinstance(self.size, str) or self.size not in SIZES:
            raise ConfigError(
                f"model.size={self.size!r} is not a known size; valid: {', '.join(SIZES)}")
        for key, value in SIZES[self.size].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{name}={value!r} must be a positive integer")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"model.tie_embeddings={self.tie_embeddings!r} must be true or false")
        for name, low in (("norm_eps", 0.0), ("init_std", 0.0), ("rope_theta", 1.0)):
            value = getattr(self, name)
            if not (_finite(value) and value > low):
                what = "positive number (> 0)" if low == 0 else f"number > {low:g}"
                raise ConfigError(f"model.{name}={value!r} must be a finite {what}")
        if self.dim % self.n_heads:
            raise ConfigError(
                f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} must be divisible by "
                              f"model.n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(f"head dimension dim/n_heads={self.dim // self.n_heads} must be even "
                              "for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads
