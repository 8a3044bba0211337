"""Sampling completions of one prompt inside training: ``rollout`` and its seeds.

``rollout`` draws ``n`` completions of one prompt in one batch, re-running the model on the whole
context each step (no KV cache: the model stays free of inference state and the trainer's FSDP2
wrapping works unchanged; ``ftlm.infer`` is the fast engine for serving). Every draw comes from a
CPU ``torch.Generator``, so equal logits give equal samples on any device, and ``sample_seed``
derives that generator's seed from ``(run seed, step, task index)``: a retried step, or another
replica computing the same step, samples exactly the same completions.

Not responsible for: rewards (``ftlm.tasks.check``) or losses (``ftlm.post.objectives``).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from ftlm.model.generate import sample


def sample_seed(*parts: int | str) -> int:
    """A 63-bit seed that is a pure function of ``parts`` (e.g. run seed, step, task index)."""
    digest = hashlib.sha256(":".join(["ftlm.post", *map(str, parts)]).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@torch.no_grad()
def rollout(model: nn.Module, prompt: list[int], n: int, max_new_tokens: int, end_id: int,
            pad_id: int, temperature: float = 1.0, top_k: int = 0,
            generator: torch.Generator | None = None, device: torch.device | None = None
            ) -> list[list[int]]:
    """``n`` completions of ``prompt``, each ending with ``end_id`` unless cut by a budget.

    ``temperature == 0`` is greedy. The budget is ``max_new_tokens`` and the model's
    ``max_seq_len``. Sequences that ended keep receiving ``pad_id`` (not returned).
    """
    max_len = model.cfg.max_seq_len if hasattr(model, "cfg") else len(prompt) + max_new_tokens
    steps = min(max_new_tokens, max_len - len(prompt))
    if steps < 1:
        raise ValueError(f"prompt of {len(prompt)} tokens leaves no room under max_seq_len={max_len}")
    tokens = torch.tensor([prompt] * n, dtype=torch.long, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    for _ in range(steps):
        logits = model(tokens)[:, -1, :]
        nxt = sample(logits, temperature, top_k or None, generator).to(tokens.device)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        tokens = torch.cat((tokens, nxt[:, None]), dim=1)
        done |= nxt == end_id
        if bool(done.all()):
            break
    out = []
    for row in tokens[:, len(prompt):].tolist():
        out.append(row[:row.index(end_id) + 1] if end_id in row else row)
    return out
