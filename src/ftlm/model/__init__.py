"""Pure PyTorch model code: the Llama-style decoder, its size table, counts and sampling.

Imports only torch (never ``torch.distributed``); parallelism is applied from outside by
``ftlm.train``. The names below load on first use, so that reading a config (``ftlm.model.config``,
which the coordinator does at start) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {"ModelConfig": "config", "SIZES": "config", "flops_per_token": "counts",
         "forward_flops": "counts", "param_count": "counts", "Transformer": "llama"}
# Sampling lives in ``ftlm.model.generate`` (import ``generate`` from there: the package attribute
# of that name is the submodule once anything imported it).

__all__ = ["ModelConfig", "SIZES", "Transformer", "param_count", "flops_per_token", "forward_flops"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'ftlm.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ftlm.model.{_HOME[name]}"), name)
