"""Log-probabilities of a prompt's own tokens under the model (``echo`` with ``logprobs``).

Responsible for: one causal forward over a prompt, returning for every position ``t >= 1`` the
log-probability of token ``t`` given the tokens before it, and optionally the ``top`` most likely
tokens at that position. This is what a loglikelihood evaluation (lm-eval's ``echo=True,
max_tokens=0``) reads. Position 0 has no context, so it has no log-probability (None, as OpenAI
answers).

Not responsible for: generation or its logprobs (``ftlm.infer.engine`` records those while
sampling), or the response format (``ftlm.serve.protocol``). It does not touch the engine's KV
cache, so it may run beside the engine's own thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ftlm.model.llama import Transformer


@torch.no_grad()
def prompt_logprobs(model: Transformer, prompt: Sequence[int], top: int = 0
                    ) -> tuple[list[float | None], list[list[tuple[int, float]]]]:
    """``(logprobs, alternatives)`` of ``prompt``: ``logprobs[t]`` of token ``t`` given the ones
    before it (None at 0), and per position its ``top`` most likely tokens (id, log-probability),
    most likely first (empty lists when ``top`` is 0; position 0: empty)."""
    device = model.tok_embeddings.weight.device
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    scores = model(tokens)[0, :-1].float().log_softmax(dim=-1)  # row t predicts token t + 1
    target = tokens[0, 1:]
    chosen = scores.gather(-1, target[:, None])[:, 0].tolist()
    alternatives: list[list[tuple[int, float]]] = [[] for _ in prompt]
    if top:
        values, indices = scores.topk(min(top, scores.shape[-1]), dim=-1)
        for t, (row_ids, row_lps) in enumerate(zip(indices.tolist(), values.tolist())):
            alternatives[t + 1] = list(zip(row_ids, row_lps))
    return [None, *chosen], alternatives
