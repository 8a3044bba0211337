"""Fixtures shared by the whole test suite.

Keep each fixture small and documented; put fixtures used by one package in its own conftest.
"""

from __future__ import annotations

from pathlib import Path

import pytest

DEMO_SEQ_LEN = 64
DEMO_VOCAB = 1024


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared dataset folder: 1 MB of stdlib text, seq_len 64, vocab 1024 (> 1000 samples).

    Built once per test session (a few seconds). Open it with
    ``PackedDataset(demo_data, seq_len=64)``; its tokenizer is ``demo_data / "tokenizer.json"``.
    Treat it as read-only: other tests share it.
    """
    from ftlm.data.demo import ensure_demo_data

    root = tmp_path_factory.mktemp("demo-data")
    return ensure_demo_data(root, seq_len=DEMO_SEQ_LEN, vocab_size=DEMO_VOCAB,
                            max_bytes=1_000_000, progress=False)
