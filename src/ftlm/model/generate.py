"""Autoregressive sampling from a ``Transformer``: small pure functions in the gpt-fast style.

Responsible for: turning logits into a next token (``logits_to_probs``, ``sample``), one decode
step (``decode_one_token``) and the decode loop (``generate``) with temperature, top-k, a seeded
generator, an end-of-sequence id and cropping of the context to ``max_seq_len``.

Not responsible for: batching, serving, or a KV cache. Each step re-runs the model on the cropped
context; that keeps the model free of inference state and makes this loop the reference the cached
engine is tested against. For speed, batches, top-p/min-p and stop strings use ``ftlm.infer``
(``Engine``), which is many times faster.
"""

from __future__ import annotations

import torch
from torch import nn


def logits_to_probs(logits: torch.Tensor, temperature: float = 1.0,
                    top_k: int | None = None) -> torch.Tensor:
    """Probabilities ``[..., vocab]`` of ``logits / temperature``, kept to exactly ``top_k`` tokens."""
    logits = logits.float() / max(temperature, 1e-5)
    if top_k is not None and top_k < logits.shape[-1]:
        # Keep exactly k tokens: a threshold at the k-th value would keep every token tied with
        # it. Among tied values the stable sort keeps the lower token ids.
        order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order[..., :top_k], True)
        logits = logits.masked_fill(~keep, float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token id per row of ``logits [..., vocab]``; returns ``LongTensor[...]``.

    ``temperature == 0`` means greedy (argmax) and draws no random number. With a ``generator``
    the probabilities are moved to the generator's device, so a CPU generator gives the same draw
    for a model on any device.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = logits_to_probs(logits, temperature, top_k)
    if generator is not None:
        probs = probs.to(generator.device)
    flat = probs.reshape(-1, probs.shape[-1])
    ids = torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
    return ids.to(logits.device)


def decode_one_token(model: nn.Module, context: torch.Tensor, temperature: float,
                     top_k: int | None, generator: torch.Generator | None) -> torch.Tensor:
    """Sample the token that follows ``context [1, T]``; returns ``LongTensor[1, 1]``."""
    logits = model(context)[:, -1, :]
    return sample(logits, temperature, top_k, generator).view(1, 1)


def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None, eos_id: int | None = None) -> torch.Tensor:
    """Extend ``prompt [1, T]`` by up to ``max_new_tokens`` sampled tokens.

    Returns ``LongTensor[1, T + n]``: the prompt followed by the ``n <= max_new_tokens`` new
    tokens. Generation stops early after emitting ``eos_id`` (which is included). The model sees at
    most its last ``model.cfg.max_seq_len`` tokens. Runs in eval mode under ``torch.no_grad`` and
    restores the model's previous train/eval mode, also on error.
    """
    if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must have shape [1, T] with T >= 1, got {tuple(prompt.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 or None (no top-k filter)")
    max_seq_len = model.cfg.max_seq_len
    was_training = model.training
    model.eval()
    try:
        tokens = prompt
        with torch.no_grad():
            for _ in range(max_new_tokens):
                next_token = decode_one_token(model, tokens[:, -max_seq_len:], temperature, top_k,
                                              generator)
                tokens = torch.cat((tokens, next_token.to(tokens.dtype)), dim=1)
                if eos_id is not None and int(next_token) == eos_id:
                    break
        return tokens
    finally:
        model.train(was_training)
