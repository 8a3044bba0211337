"""Fixtures of the post-training tests: the demo tokenizer, a small model, a post-training config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftlm.data.tokenizer import Tokenizer
from ftlm.model import Transformer
from ftlm.model.config import ModelConfig

SEQ_LEN = 96
"""Row length of the post-training tests: the mod and count tasks fit (about 60 tokens)."""

POST_MODEL = {"size": "tiny", "vocab_size": 1024, "dim": 32, "n_layers": 2, "n_heads": 4,
              "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 128}
"""A ~70k-parameter model over the demo tokenizer (1024 tokens)."""


@pytest.fixture(scope="session")
def tokenizer(demo_data: Path) -> Tokenizer:
    return Tokenizer.load(demo_data / "tokenizer.json")


@pytest.fixture
def model() -> Transformer:
    torch.manual_seed(0)
    m = Transformer(ModelConfig(**POST_MODEL))
    m.init_weights(1)
    return m


@pytest.fixture
def post_config(tmp_path: Path, make_tiny_config):
    """``post_config(**sections)``: a one-group config for post-training on the task suite."""

    def make(run_dir: Path | None = None, **sections: dict):
        merged = {"model": dict(POST_MODEL), "data": {"seq_len": SEQ_LEN, "eval_samples": 4},
                  "train": {"steps": 2, "batch_size": 2, "eval_every": 0, "warmup_steps": 1},
                  "post": {"families": "mod,count", "train_tasks": 24, "heldout_tasks": 4,
                           "max_new_tokens": 12, "group_size": 2, "pair_samples": 2}}
        for name, body in sections.items():
            merged.setdefault(name, {}).update(body)
        return make_tiny_config(run_dir or tmp_path / "run", **merged)

    return make


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the models are tiny and the test machine is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
