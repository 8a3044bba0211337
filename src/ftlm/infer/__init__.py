"""Inference: a static-KV-cache engine with continuous batching, sampling, text streaming and
test-time-compute strategies (best-of-N, self-consistency, thinking budgets).

The server lives in ``ftlm.serve``; the CLI (``ftlm generate``, ``ftlm serve``) in
``ftlm.infer.cli``. Imports flow ``infer -> model``; nothing here touches ``torch.distributed``.
"""

from ftlm.infer.engine import Engine, Sequence
from ftlm.infer.sampling import SamplingParams

__all__ = ["Engine", "Sequence", "SamplingParams"]
