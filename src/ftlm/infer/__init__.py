"""Inference: a static-KV-cache engine with continuous batching, sampling, text streaming and
test-time-compute strategies (best-of-N, self-consistency, thinking budgets).

The server lives in ``ftlm.serve``; the CLI (``ftlm generate``, ``ftlm serve``) in
``ftlm.infer_cli``. Imports flow ``infer -> model``; nothing here touches ``torch.distributed``.
``Engine``, ``Sequence`` and ``SamplingParams`` are imported on first use, so that the CLI can
register its commands without importing torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "SamplingParams", "Sequence"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "Sequence"):
        from ftlm.infer import engine
        return getattr(engine, name)
    if name == "SamplingParams":
        from ftlm.infer.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'ftlm.infer' has no attribute {name!r}")
