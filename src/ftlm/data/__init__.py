"""Training data: tokenizer, corpus reading, prepare (text -> packed token Parquet), loader.

The loader's names are imported lazily so that light users (``prepare`` worker processes, the
CLI's ``--help``) do not pay for importing torch, which only the loader needs.
"""

from __future__ import annotations

import importlib

from ftlm.data.config import DataConfig
from ftlm.data.corpus import build_demo_corpus, iter_documents
from ftlm.data.demo import ensure_demo_data
from ftlm.data.prepare import prepare
from ftlm.data.tokenizer import SPECIAL_TOKENS, Tokenizer, train_tokenizer

_LAZY = {"PackedDataset", "GlobalOrder", "Loader"}

__all__ = sorted(["DataConfig", "build_demo_corpus", "iter_documents", "ensure_demo_data",
                  "prepare", "SPECIAL_TOKENS", "Tokenizer", "train_tokenizer", *_LAZY])


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module("ftlm.data.loader"), name)
    raise AttributeError(f"module 'ftlm.data' has no attribute {name!r}")
