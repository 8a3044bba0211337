"""Fixtures of the inference tests (helpers live in infer_helpers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from infer_helpers import tiny_model

from ftlm.model import Transformer


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_model()
