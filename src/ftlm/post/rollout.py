"""Sampling completions of one prompt inside training: ``sample_group``, ``rollout``, seeds.

``sample_group`` draws ``n`` completions of one prompt: with the KV-cache engine
(``ftlm.infer.Engine``, one batch of exactly the ``n`` samples of this prompt, so what else the
micro-batch holds cannot change them) when the model is a plain ``Transformer``, else (a model
sharded by FSDP2 inside a group) with ``rollout``, which re-runs the model on the whole context
each step and needs no inference state. Every draw comes from a CPU ``torch.Generator`` seeded by
``sample_seed`` from ``(run seed, step, task index, sample)``: a retried step, or another replica
computing the same step, samples exactly the same completions.

Not responsible for: rewards (``ftlm.tasks.check``) or losses (``ftlm.post.objectives``).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from ftlm.model.generate import sample
from ftlm.model.llama import Transformer


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


def _engine_ready(model: nn.Module) -> bool:
    """Whether the KV-cache engine can run ``model``: a plain Transformer with local weights."""
    from torch.distributed.tensor import DTensor
    return isinstance(model, Transformer) and not any(
        isinstance(p, DTensor) for p in model.parameters())


@torch.no_grad()
def sample_group(model: nn.Module, prompt: list[int], n: int, max_new_tokens: int, end_id: int,
                 pad_id: int, temperature: float, top_k: int, seed: int
                 ) -> tuple[list[list[int]], list[list[float]] | None]:
    """``n`` completions of ``prompt`` (each ends with ``end_id`` unless cut by a budget) and,
    from the engine, the sampler's log-probability of each completion token (temperature 1;
    ``None`` from ``rollout``).

    Sample ``j`` draws from a generator seeded by ``sample_seed(seed, j)``; ``temperature == 0``
    is greedy. The model's training/eval mode is left as it was.
    """
    if not _engine_ready(model):
        generator = torch.Generator(device="cpu").manual_seed(sample_seed(seed))
        device = next(model.parameters()).device
        return rollout(model, prompt, n, max_new_tokens, end_id, pad_id, temperature, top_k,
                       generator, device), None
    from ftlm.infer import Engine, SamplingParams
    budget = min(max_new_tokens, model.cfg.max_seq_len - len(prompt))
    if budget < 1:
        raise ValueError(f"prompt of {len(prompt)} tokens leaves no room under "
                         f"max_seq_len={model.cfg.max_seq_len}")
    training = model.training
    try:
        engine = Engine(model, max_batch=n, max_seq_len=min(model.cfg.max_seq_len,
                                                            len(prompt) + budget + 1))
        params = [SamplingParams(max_new_tokens=budget, temperature=temperature, top_k=top_k,
                                 stop_ids=(end_id,), seed=sample_seed(seed, j))
                  for j in range(n)]
        seqs = engine.generate([prompt] * n, params)
    finally:
        model.train(training)
    # The engine leaves the stop token out; the policy must learn to stop, so it is a target.
    ended = [s.finish_reason == "stop" for s in seqs]
    tokens = [list(s.tokens) + [end_id] * e for s, e in zip(seqs, ended)]
    logprobs = [list(s.logprobs) for s in seqs]
    return tokens, logprobs
