"""The Llama-style decoder: ``Transformer`` and its ``TransformerBlock``.

Responsible for: the module tree (token embedding, ``layers`` of self-contained blocks, final
RMSNorm, output projection), the forward pass from token ids to logits, and a deterministic,
device-independent weight initialisation (``Transformer.init_weights``).

Not responsible for: parallelism, activation checkpointing, compilation or mixed precision (those
are applied from outside, block by block, by ``ftlm.train``), the loss, or sampling
(``ftlm.model.generate``). This module imports only torch and never ``torch.distributed``.

Construction on the meta device is supported, as torchtitan does it::

    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")   # or "cuda"; storage is uninitialised here
    model.init_weights(seed)       # parameters and the rotary table are now valid

Initialisation (``init_weights``): every parameter is drawn in float32 from a CPU
``torch.Generator`` seeded with ``seed``, in the fixed order of ``named_parameters()``, and copied
into place, so one seed gives bitwise the same parameters on any device. Standard deviations:
``cfg.init_std`` for the embedding, the q/k/v projections, the MLP input projections ``w1``/``w3``
and an untied ``output``; ``cfg.init_std / sqrt(2 * n_layers)`` for the projections that write
into the residual stream (attention ``wo`` and MLP ``w2``), the GPT-2 scheme that keeps the
residual variance independent of depth; RMSNorm weights are ones.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ftlm.model.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotary frequencies ``[head_dim/2]`` (float64), with Llama 3.x scaling when configured.

    Llama 3.x scaling (``cfg.rope_scaling``) leaves the high frequencies (wavelength below
    ``original / high_freq_factor``) alone, divides the low ones (wavelength above
    ``original / low_freq_factor``) by ``factor``, and blends linearly in between.
    """
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    if not cfg.rope_scaling:
        return inv_freq
    factor = cfg.rope_scaling["factor"]
    low, high = cfg.rope_scaling["low_freq_factor"], cfg.rope_scaling["high_freq_factor"]
    original = cfg.rope_scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    # blend = 1 keeps a frequency (short wavelengths), 0 divides it by factor (long ones).
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def rope_table(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the rotary ``(cos, sin)`` tables: float32, CPU, ``[max_seq_len, head_dim/2]``.

    Computed on the CPU so the table is bitwise the same whatever device the model lives on.
    """
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), rope_inv_freq(cfg))
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[B, T, heads, head_dim]`` by position.

    Uses the "rotate half" pairing: dimension ``i`` is rotated together with ``i + head_dim/2``.
    ``cos``/``sin`` are ``[T, head_dim/2]``.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, head_dim]
        repeats = self.n_heads // self.n_kv_heads
        if repeats > 1:
            # Query head h reads kv head h // repeats. An explicit repeat instead of enable_gqa
            # keeps every SDPA backend (and the FLOP counter) available.
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """One pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    Self-contained (it owns all of its parameters and receives the rotary table as an argument) so
    that FSDP2 and activation checkpointing can wrap each block on its own.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Llama-style decoder mapping token ids ``[B, T]`` to logits ``[B, T, vocab_size]``.

    Built on a real device, the constructor initialises it as ``init_weights(0)`` does, so the
    module is usable at once. Built under ``torch.device("meta")`` it allocates nothing; call
    ``to_empty`` and then ``init_weights(seed)``. With ``cfg.tie_embeddings`` the ``output``
    projection shares its weight Parameter with ``tok_embeddings`` (and keeps sharing it across
    ``to_empty``/``to``).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._tie_weights()
        # Derived from cfg, never trained: non-persistent so checkpoints and state transfers
        # carry only parameters; init_weights recomputes them after to_empty.
        half = cfg.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, half), persistent=False)
        if self.tok_embeddings.weight.device.type != "meta":
            self.init_weights(0)

    def _tie_weights(self) -> None:
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - signature of nn.Module._apply
        # nn.Module._apply (used by to_empty, to, cuda, half) may replace a Parameter by a new
        # object, e.g. when leaving the meta device, which silently unties shared weights.
        result = super()._apply(fn, recurse)
        self._tie_weights()
        return result

    def _init_std(self, name: str) -> float:
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            return self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        return self.cfg.init_std

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Set every parameter and the rotary table from ``seed``; bitwise the same on any device.

        The parameters must be ordinary (unsharded) tensors: initialise before applying FSDP2, or
        load the values of an initialised model into the sharded one.
        """
        generator = torch.Generator(device="cpu").manual_seed(seed)
        for name, param in self.named_parameters():  # tied weights are listed once
            if type(param.data) is not torch.Tensor:
                raise TypeError(
                    f"init_weights cannot fill parameter {name!r} of type "
                    f"{type(param.data).__name__}; "
                    "call init_weights before sharding the model (e.g. before fully_shard)")
            if name.endswith("norm.weight"):
                value = torch.ones(param.shape)
            else:
                value = torch.empty(param.shape).normal_(0.0, self._init_std(name),
                                                         generator=generator)
            param.copy_(value)
        self.init_rope()

    @torch.no_grad()
    def init_rope(self) -> None:
        """Recompute the rotary table from ``cfg`` (after ``to_empty``, when the weights come from
        a file instead of ``init_weights``)."""
        cos, sin = rope_table(self.cfg)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return logits ``[B, T, vocab_size]`` (in the dtype of the output projection)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape [batch, seq], got {tuple(tokens.shape)}")
        seq = tokens.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds model.max_seq_len={self.cfg.max_seq_len}; "
                "crop the input or raise model.max_seq_len")
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))
