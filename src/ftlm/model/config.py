"""Model hyper-parameters and the table of named sizes.

A ``ModelConfig`` names a size from ``SIZES``; any field left as ``None`` is filled from that row,
so ``--set model.size=small`` is enough and ``--set model.dim=96`` overrides one value.

Rotary positions: ``rope_theta`` is the base of the frequencies and ``rope_scaling`` the Llama 3.x
frequency rescaling (``factor``, ``low_freq_factor``, ``high_freq_factor``,
``original_max_position_embeddings``; an empty table means none). The ``1b`` and ``8b`` rows use
Llama 3.2 1B's and Llama 3.1 8B's values (theta 500000, factor 32 and 8), so real Llama 3.x weights
load with the positions they were trained with; the smaller rows keep theta 10000 and no scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ftlm.errors import ConfigError

# Llama 3.x rope scaling (HF ``rope_scaling`` with ``rope_type = "llama3"``), less the type.
_LLAMA3_SCALING = dict(low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)

# One row per named size. Parameter counts are those of ``param_count`` with the listed vocab.
SIZES: dict[str, dict] = {
    "tiny": dict(vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384,
                 max_seq_len=512, tie_embeddings=True, rope_theta=10000.0, rope_scaling={}),
    "small": dict(vocab_size=8192, dim=384, n_layers=8, n_heads=6, n_kv_heads=2, ffn_dim=1024,
                  max_seq_len=1024, tie_embeddings=True, rope_theta=10000.0, rope_scaling={}),
    "125m": dict(vocab_size=32768, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048,
                 max_seq_len=2048, tie_embeddings=True, rope_theta=10000.0, rope_scaling={}),
    "1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
               max_seq_len=4096, tie_embeddings=True, rope_theta=500000.0,
               rope_scaling=dict(factor=32.0, **_LLAMA3_SCALING)),
    "8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
               max_seq_len=8192, tie_embeddings=False, rope_theta=500000.0,
               rope_scaling=dict(factor=8.0, **_LLAMA3_SCALING)),
}


_INT_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")
ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")


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
    rope_theta: float | None = None
    """Base of the rotary position embedding frequencies (10000; Llama 3.x: 500000)."""
    rope_scaling: dict[str, float] | None = None
    """Llama 3.x rope scaling: a table of the ``ROPE_SCALING_KEYS``, or empty for none."""
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
        self.rope_scaling = _check_rope_scaling(self.rope_scaling)
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
        """Width of one attention head."""
        return self.dim // self.n_heads


def _check_rope_scaling(value: object) -> dict[str, float]:
    """Validated ``rope_scaling``: ``{}`` or every key of ``ROPE_SCALING_KEYS`` with a sane value.

    Accepts a table (TOML) or ``key=value`` strings (``--set model.rope_scaling=factor=8,...``).
    """
    if isinstance(value, list):  # from --set: "key=value" items
        pairs = {}
        for item in value:
            key, sep, text = str(item).partition("=")
            try:
                pairs[key.strip()] = float(text) if sep else None
            except ValueError:
                pairs[key.strip()] = text
        value = pairs
    if not isinstance(value, dict):
        raise ConfigError(f"model.rope_scaling={value!r} must be a table of "
                          f"{', '.join(ROPE_SCALING_KEYS)} (or empty for no scaling)")
    if not value:
        return {}
    unknown = sorted(set(value) - set(ROPE_SCALING_KEYS))
    missing = [k for k in ROPE_SCALING_KEYS if k not in value]
    if unknown or missing:
        raise ConfigError(f"model.rope_scaling: unknown keys {unknown}, missing keys {missing}; "
                          f"it needs exactly {', '.join(ROPE_SCALING_KEYS)} (or is empty)")
    for key in ROPE_SCALING_KEYS:
        if not (_finite(value[key]) and value[key] > 0):
            raise ConfigError(f"model.rope_scaling.{key}={value[key]!r} must be a finite "
                              "positive number")
    if value["factor"] < 1:
        raise ConfigError(f"model.rope_scaling.factor={value['factor']!r} must be >= 1")
    if value["high_freq_factor"] <= value["low_freq_factor"]:
        raise ConfigError(f"model.rope_scaling.high_freq_factor={value['high_freq_factor']!r} "
                          f"must exceed low_freq_factor={value['low_freq_factor']!r}")
    original = value["original_max_position_embeddings"]
    if float(original) != int(original):
        raise ConfigError(f"model.rope_scaling.original_max_position_embeddings={original!r} "
                          "must be a whole number")
    scaling = {k: float(value[k]) for k in ROPE_SCALING_KEYS[:3]}
    scaling["original_max_position_embeddings"] = int(original)
    return scaling
