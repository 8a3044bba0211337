"""Fixtures of the inference tests (helpers live in infer_helpers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from infer_helpers import tiny_model

from ftlm.model import Transformer

# One intra-op thread: these models are tiny, and on a shared, loaded machine two OpenMP threads
# meet at a barrier in every operator (measured: a beam-search test took 32 s with two threads
# at load 10, 0.8 s with one).
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_model()
