"""Training: the public API (``Session``, ``Step``, ``StepDoomed``) and the trainer built on it.

``from ftlm.train import Session`` loads the session on first use, so that importing a section's
config (``ftlm.train.config``) does not load torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Session", "Step", "StepDoomed"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from ftlm.train import session
        return getattr(session, name)
    raise AttributeError(f"module 'ftlm.train' has no attribute {name!r}")
