"""Fixtures of the server tests: a tokenizer and a server on 127.0.0.1 port 0 per module."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from serve_helpers import make_tokenizer, start_server


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def server(tokenizer):
    s = start_server(tokenizer, max_queue=16, max_n=4, default_max_tokens=16)
    yield s
    s.stop()
