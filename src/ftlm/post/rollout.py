"""Sampling completions of one prompt inside training: ``sample_group``, ``rollout``, seeds.

``sample_groups`` draws ``n`` completions of each of several prompts: with the KV-cache engine
(``ftlm.infer.Engine``, every sample of every prompt in one continuous batch of up to
``MAX_BATCH`` slots, so a step of GRPO decodes its whole micro-batch together instead of one
prompt's group at a time) when the model is a plain ``Transformer``, else (a model sharded by
FSDP2 inside a group) with ``rollout``, one prompt at a time, which re-runs the model on the whole
context each step and needs no inference state. ``sample_group`` is the one-prompt case. Every
draw comes from a CPU ``torch.Generator`` seeded by ``sample_seed`` from ``(run seed, step, task
index, sample)``: a retried step, or another replica computing the same step, samples exactly
the same completions (the same rows give the same batch; which other prompts share the batch
can change a logit by float rounding, not the seed of a draw).

Not responsible for: rewards (``ftlm.tasks.check``) or losses (``ftlm.post.objectives``).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
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

    A model sharded over the ranks of a group (FSDP2) runs collectives in every forward pass, and
    each rank samples its own prompts, which end after different numbers of tokens: a rank that
    is done keeps running the model with its peers (its output unused, no draw taken) until every
    rank is, so that all of them run the same number of passes.
    """
    max_len = model.cfg.max_seq_len if hasattr(model, "cfg") else len(prompt) + max_new_tokens
    steps = min(max_new_tokens, max_len - len(prompt))
    if steps < 1:
        raise ValueError(f"prompt of {len(prompt)} tokens leaves no room under max_seq_len={max_len}")
    tokens = torch.tensor([prompt] * n, dtype=torch.long, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    sharded = not _engine_ready(model) and dist.is_available() and dist.is_initialized() \
        and dist.get_world_size() > 1
    taken = 0
    while True:
        finished = taken >= steps or bool(done.all())
        if (_all_ranks(finished, tokens.device) if sharded else finished):
            break
        logits = model(tokens)[:, -1, :]
        if finished:
            continue  # a pass for the peers' collectives
        nxt = sample(logits, temperature, top_k or None, generator).to(tokens.device)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        tokens = torch.cat((tokens, nxt[:, None]), dim=1)
        done |= nxt == end_id
        taken += 1
    out = []
    for row in tokens[:, len(prompt):].tolist():
        out.append(row[:row.index(end_id) + 1] if end_id in row else row)
    return out


def _all_ranks(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank of this process group (a collective)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _engine_ready(model: nn.Module) -> bool:
    """Whether the KV-cache engine can run ``model``: a plain Transformer with local weights."""
    from torch.distributed.tensor import DTensor
    return isinstance(model, Transformer) and not any(
        isinstance(p, DTensor) for p in model.parameters())


MAX_BATCH = 256
"""Most samples the engine decodes at once in ``sample_groups`` (more wait for a free slot)."""


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
    tokens, logprobs = sample_groups(model, [prompt], n, max_new_tokens, end_id, pad_id,
                                     temperature, top_k, [seed])
    return tokens[0], None if logprobs is None else logprobs[0]


@torch.no_grad()
def sample_groups(model: nn.Module, prompts: list[list[int]], n: int, max_new_tokens: int,
                  end_id: int, pad_id: int, temperature: float, top_k: int, seeds: list[int]
                  ) -> tuple[list[list[list[int]]], list[list[list[float]]] | None]:
    """``n`` completions of each of ``prompts`` (``[prompt][sample] -> tokens``) and, from the
    engine, their sampler log-probs (``None`` from ``rollout``), as ``sample_group`` per prompt:
    sample ``j`` of prompt ``i`` draws from ``sample_seed(seeds[i], j)``."""
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    if not _engine_ready(model):
        device = next(model.parameters()).device
        groups = [rollout(model, prompt, n, max_new_tokens, end_id, pad_id, temperature, top_k,
                          torch.Generator(device="cpu").manual_seed(sample_seed(seed)), device)
                  for prompt, seed in zip(prompts, seeds)]
        return groups, None
    from ftlm.infer import Engine, SamplingParams
    limit = model.cfg.max_seq_len
    budgets = [min(max_new_tokens, limit - len(p)) for p in prompts]
    for prompt, budget in zip(prompts, budgets):
        if budget < 1:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room under "
                             f"max_seq_len={limit}")
    training = model.training
    try:
        engine = Engine(model, max_batch=min(MAX_BATCH, n * len(prompts)),
                        max_seq_len=min(limit, max(len(p) + b + 1
                                                   for p, b in zip(prompts, budgets))))
        params = [SamplingParams(max_new_tokens=budget, temperature=temperature, top_k=top_k,
                                 stop_ids=(end_id,), seed=sample_seed(seed, j))
                  for seed, budget in zip(seeds, budgets) for j in range(n)]
        seqs = engine.generate([p for p in prompts for _ in range(n)], params)
    finally:
        model.train(training)
    # The engine leaves the stop token out; the policy must learn to stop, so it is a target.
    tokens = [list(s.tokens) + [end_id] * (s.finish_reason == "stop") for s in seqs]
    logprobs = [list(s.logprobs) for s in seqs]
    return ([tokens[i:i + n] for i in range(0, len(seqs), n)],
            [logprobs[i:i + n] for i in range(0, len(seqs), n)])
