"""A tiny model, tokenizer and running server for the server tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "infer"))

TOKEN = "test-job-token"


def make_tokenizer(tmp: Path):
    from ftlm.data.tokenizer import train_tokenizer
    text = ("the quick brown fox jumps over the lazy dog\n" * 40
            + "What is 12 + 30? <think>2+0=2, 1+3=4</think> Answer: 42\n" * 20)
    (tmp / "corpus.txt").write_text(text)
    return train_tokenizer([tmp / "corpus.txt"], tmp / "tokenizer.json", vocab_size=300)


def start_server(tokenizer, **overrides):
    from infer_helpers import tiny_model

    from ftlm.infer import Engine
    from ftlm.serve import ServeConfig, Server
    model = tiny_model(vocab_size=tokenizer.vocab_size, max_seq_len=64)
    engine_cls = overrides.pop("engine_cls", Engine)
    engine = engine_cls(model, max_batch=overrides.pop("max_batch", 4), eos_id=tokenizer.eos_id,
                        detokenize=tokenizer.decode)
    scorer = overrides.pop("scorer", None)
    config = ServeConfig(port=0, token=overrides.pop("token", TOKEN), model_name="tiny", **overrides)
    server = Server(engine, tokenizer, config, scorer=scorer)
    server.start()
    return server
