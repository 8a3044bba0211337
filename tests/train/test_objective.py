"""The trainer's seam for other kinds of training: an injected objective and data, init_from."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ftlm.errors import ConfigError, DataError
from ftlm.train.objective import LanguageModeling, TrainData
from ftlm.train.trainer import Trainer


class _Rows:
    """``n`` rows of shape ``[2, L + 1]``: tokens and a 0/1 loss mask (a test double)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, vocab, size=(n, seq_len + 1))
        mask = np.zeros_like(tokens)
        mask[:, seq_len // 2:] = 1  # loss only on the second half ("the completion")
        self.rows = np.stack([tokens, mask], axis=1).astype(np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def samples(self, indices) -> np.ndarray:
        return self.rows[np.asarray(indices, dtype=np.int64)]


class _MaskedLM:
    """Cross-entropy on the masked positions only; records the shapes it was given."""

    def __init__(self, seq_len: int) -> None:
        self.tokens_per_sample = seq_len
        self.shapes: list[tuple[int, ...]] = []

    def _sums(self, model, rows):
        tokens, mask = rows[:, 0], rows[:, 1]
        logits = model(tokens[:, :-1]).float()
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1),
                             reduction="none")
        m = mask[:, 1:].reshape(-1).float()
        return (ce * m).sum(), m.sum()

    def loss(self, model, rows):
        self.shapes.append(tuple(rows.shape))
        total, count = self._sums(model, rows)
        return total / count

    def eval_sums(self, model, rows):
        total, count = self._sums(model, rows)
        return total.double(), count.double()


def test_an_injected_objective_and_data_train_and_evaluate(tiny_config) -> None:
    config = tiny_config(train={"steps": 3, "eval_every": 3, "eval_batches": 1, "grad_accum": 2})
    base = Trainer.for_run(config)  # for the tokenizer; its own data is not used below
    base.loader.close()
    seq_len = config.data.seq_len
    data = TrainData(base.tokenizer, _Rows(64, seq_len, 100, 0), _Rows(16, seq_len, 100, 1))
    objective = _MaskedLM(seq_len)
    config.run.dir = str(config.run.path.parent / "run2")
    summary = Trainer.for_run(config, objective=objective, data=data).train()
    assert summary["steps_committed"] == 3
    b = config.train.batch_size // config.train.grad_accum
    assert objective.shapes and all(s == (b, 2, seq_len + 1) for s in objective.shapes)
    assert summary["data"]["duplicates"] == 0 and summary["data"]["gaps"] == 0


def test_language_modeling_is_the_default_objective(tiny_config) -> None:
    trainer = Trainer.for_run(tiny_config(train={"steps": 1, "eval_every": 0}))
    trainer.loader.close()
    assert isinstance(trainer.objective, LanguageModeling)
    rows = trainer.loader.compute(0, 0, 1, 2)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    with torch.no_grad():
        logits = trainer.model(inputs)
        expected = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        assert torch.equal(trainer.objective.loss(trainer.model, rows), expected)


def test_init_from_starts_from_saved_weights(tiny_config, tmp_path) -> None:
    first = Trainer.for_run(tiny_config(tmp_path / "a", train={"steps": 1, "eval_every": 0}))
    first.train()
    weights = tmp_path / "a" / "model.safetensors"
    second = Trainer.for_run(tiny_config(tmp_path / "b", train={"steps": 1, "eval_every": 0,
                                                         "init_from": str(weights)}))
    second.loader.close()
    for (name, p), q in zip(first.model.named_parameters(), second.model.parameters()):
        assert torch.equal(p, q), name


def test_init_from_errors_name_the_field(tiny_config, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"train\.init_from=.*does not exist"):
        Trainer.for_run(tiny_config(train={"init_from": str(tmp_path / "missing.safetensors")}))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not safetensors")
    with pytest.raises(DataError, match=r"train\.init_from="):
        Trainer.for_run(tiny_config(train={"init_from": str(bad)}))
