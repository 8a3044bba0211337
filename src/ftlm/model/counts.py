"""Parameter and FLOP counts of the decoder, computed from a ``ModelConfig`` alone.

Responsible for: closed-form counts that the trainer uses for MFU, tokens-per-second-to-FLOPs and
the size table, and the inference FLOPs of a cached pass (``forward_flops``: compute-matched
test-time studies), without building a module. Not responsible for measuring anything; the tests
check these formulas against a real module (``numel``) and against torch's FLOP counter.
"""

from __future__ import annotations

from ftlm.model.config import ModelConfig


def _block_matmul_params(cfg: ModelConfig) -> int:
    """Weights of the matmuls of one block: q, k, v, o projections and the three SwiGLU matrices."""
    q_width = cfg.n_heads * cfg.head_dim
    kv_width = cfg.n_kv_heads * cfg.head_dim
    attention = cfg.dim * q_width + 2 * cfg.dim * kv_width + q_width * cfg.dim
    mlp = 3 * cfg.dim * cfg.ffn_dim
    return attention + mlp


def param_count(cfg: ModelConfig, include_embedding: bool = True) -> int:
    """Number of distinct parameters of ``Transformer(cfg)`` (a tied matrix is counted once).

    ``include_embedding=False`` leaves out the token-embedding table (``vocab_size * dim``), the
    "non-embedding" count of Kaplan et al. (2020). An untied output projection is a matmul weight
    and stays in that count; a tied one *is* the embedding table and so leaves with it.
    """
    per_block = _block_matmul_params(cfg) + 2 * cfg.dim  # + two RMSNorm weights
    embedding = cfg.vocab_size * cfg.dim
    output = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    body = cfg.n_layers * per_block + cfg.dim + output  # + final RMSNorm weight
    return body + embedding if include_embedding else body


def _matmul_params(cfg: ModelConfig) -> int:
    """Weights every token multiplies through: the blocks' matmuls and the output projection
    (``vocab_size * dim``, tied or not: the matmul runs either way). The embedding lookup and the
    RMSNorm weights are not matmuls and are left out."""
    return cfg.n_layers * _block_matmul_params(cfg) + cfg.vocab_size * cfg.dim


def _attention_flops_per_pair(cfg: ModelConfig) -> int:
    """Forward FLOPs of one (query, key) pair over every layer: ``Q K^T`` and ``A V``, each 2
    FLOPs per multiply-add over ``n_heads * head_dim``."""
    return 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token for sequences of ``seq_len`` tokens.

    ``6 * N + 12 * n_layers * n_heads * head_dim * seq_len``, the convention of PaLM (Chowdhery et
    al. 2022, appendix B) also used by Chinchilla-style MFU accounting:

    * ``N`` counts every matmul weight (``_matmul_params``): the blocks' q/k/v/o and SwiGLU
      matrices *and* the output projection. A matmul costs 2 FLOPs per weight per token forward
      and 4 backward (gradients of input and of weight): 6 in all.
    * The attention term counts ``Q K^T`` and ``A V`` (``_attention_flops_per_pair``: forward 4,
      training 12 per layer per ``n_heads * head_dim``) over ``seq_len`` keys. It counts the full
      square, not the causal half, as PaLM does and as torch's FLOP counter does for SDPA.

    Softmax, normalisation, rotary and activation FLOPs are not counted (they are not matmuls and
    are a fraction of a percent at these shapes).
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len} must be a positive number of tokens")
    return float(6 * _matmul_params(cfg) + 3 * _attention_flops_per_pair(cfg) * seq_len)


def forward_flops(cfg: ModelConfig, context: int, generated: int = 0) -> float:
    """Inference FLOPs of one pass with a KV cache: ``context`` tokens read (the prefill), then
    ``generated`` tokens decoded one at a time.

    Each of the ``T = context + generated`` positions goes through the matmuls once (``2 * N``,
    ``N`` as in ``flops_per_token``) and attends to itself and every position before it: position
    ``t`` (from 1) reads ``t`` keys from the cache, ``T (T + 1) / 2`` pairs in all, the causal
    triangle a cached decode computes (training's ``flops_per_token`` counts the full square).
    The last generated token is counted as if it were fed back (one token more than the engine
    runs: the same count for every strategy). A teacher-forced read (a verifier scoring a text) is
    ``forward_flops(cfg, len(tokens))``.
    """
    if context < 0 or generated < 0:
        raise ValueError(f"context={context} and generated={generated} must be >= 0 tokens")
    positions = context + generated
    pairs = positions * (positions + 1) // 2
    return float(2 * _matmul_params(cfg) * positions + _attention_flops_per_pair(cfg) * pairs)


MAX_PARAMETERS = 2 * 10**12
"""Most parameters a model may have (five times the largest dense Llama): a shape beyond it is a
typo (``dim=1000000000``), refused before anything is allocated."""
MAX_LAYERS = 4096
"""Most blocks a model may have (building a module per block is what a typo would cost)."""
MAX_POSITIONS = 1 << 24
"""Longest context (``max_seq_len``): the rotary table holds one row per position."""


def size_problem(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` is too large to build (naming the field and the bound), or None."""
    if cfg.n_layers > MAX_LAYERS:
        return f"n_layers={cfg.n_layers} is above {MAX_LAYERS} layers"
    if cfg.max_seq_len > MAX_POSITIONS:
        return f"max_seq_len={cfg.max_seq_len} is above {MAX_POSITIONS} positions"
    params = param_count(cfg)
    if params > MAX_PARAMETERS:
        return (f"the shape (dim={_short(cfg.dim)}, n_layers={cfg.n_layers}, ffn_dim={_short(cfg.ffn_dim)}, "
                f"vocab_size={_short(cfg.vocab_size)}) has {_short(params)} parameters, above "
                f"{MAX_PARAMETERS:.0e}")
    return None


def _short(n: int) -> str:
    """``n`` for a message: as it is up to 16 digits, else as ``9.99e99`` (a float cannot hold
    every int a config may give: ``vocab_size`` with 200 digits)."""
    text = str(n)
    return text if len(text) <= 16 else f"{text[0]}.{text[1:3]}e{len(text) - 1}"
