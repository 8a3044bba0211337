"""SFT's step loss is the token mean of the whole step: the same gradient whatever the gradient
accumulation, and, over groups, the gradient of all their rows as one batch."""

from __future__ import annotations

import pytest
import torch

from ftlm.post import run
from ftlm.train.session import Step


@pytest.fixture
def sft_trainer(post_config, demo_data, tmp_path):
    made = []

    def make(grad_accum: int):
        config = post_config(tmp_path / f"accum{grad_accum}",
                             data={"tokenizer": str(demo_data / "tokenizer.json"), "eval_samples": 0},
                             train={"batch_size": 4, "grad_accum": grad_accum})
        trainer = run._trainer("sft", config)
        made.append(trainer)
        return trainer

    yield make
    for trainer in made:
        trainer.loader.close()
        trainer.session.abort()


def _grads(trainer, rows, units, participants=1):
    for p in trainer.params:
        p.grad = None
    loss = trainer._forward_backward(rows, units, participants)
    return loss, [p.grad.clone() for p in trainer.params]


def test_grad_accum_1_and_4_give_the_same_gradient_the_token_mean(sft_trainer) -> None:
    one, four = sft_trainer(1), sft_trainer(4)
    four.model.load_state_dict(one.model.state_dict())
    rows = one.loader.compute(0, 0, 1, 4)
    counts = [one.objective.units(r[None]) for r in rows]
    assert len(set(counts)) > 1, "rows with different token counts: a mean of means would differ"
    units = one._step_units(Step(0, range(0, 4), range(0, 4), 0.0, participants=1, index=0))
    assert units == sum(counts)
    loss1, g1 = _grads(one, rows, units)
    loss4, g4 = _grads(four, rows, units)
    torch.testing.assert_close(loss1, loss4)
    for a, b in zip(g1, g4):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    # The loss is the sum over every completion token / their count...
    total, count = one.objective.eval_sums(one.model, rows)
    torch.testing.assert_close(loss1.double(), total / count, rtol=1e-5, atol=1e-6)
    # ...which the mean of the four micro-batch means is not.
    with torch.no_grad():
        mean_of_means = sum(one.objective.loss(one.model, r[None]) for r in rows) / 4
    assert abs(float(mean_of_means) - float(loss1)) > 1e-4


def test_two_groups_average_to_the_token_mean_of_all_their_rows(sft_trainer) -> None:
    trainer = sft_trainer(2)
    # The step's units count both groups' rows, read from the loader like the trainer does.
    step = Step(0, range(4, 8), range(4, 8), 0.0, participants=2, index=1)
    parts = [trainer.loader.compute(0, i, 2, 4) for i in range(2)]
    units = trainer._step_units(step)
    assert units == sum(trainer.objective.units(p) for p in parts)
    (la, ga), (lb, gb) = (_grads(trainer, p, units, participants=2) for p in parts)
    together, g = _grads(trainer, torch.cat(parts), units, participants=1)
    torch.testing.assert_close((la + lb) / 2, together)  # what the all-reduce of the loss gives
    for a, b, both in zip(ga, gb, g):
        torch.testing.assert_close((a + b) / 2, both, rtol=1e-4, atol=1e-7)
