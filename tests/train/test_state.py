"""TrainState flattening for live recovery, and the catch-up buffer a recovering group replays.

A peer's state arrives as ``flat()`` output (tensors + JSON) and is loaded with ``load_flat``;
afterwards the recovered group must be bitwise the peer and take bitwise the same next steps.
"""

from __future__ import annotations

import json

import pytest
import torch

from ftlm.train.catchup import CatchUpBuffer, unflatten_into
from ftlm.train.trainer import Trainer


def advance(trainer: Trainer) -> bool:
    """One step through the trainer's session, as its loop takes it (``next``, then train and
    commit); True if it committed."""
    return trainer.train_step(next(trainer.session))


@pytest.fixture
def trainers(tiny_config, tmp_path):
    """Two trainers of the same run config in separate run directories; loaders closed after."""
    made: list[Trainer] = []

    def make(name: str) -> Trainer:
        made.append(Trainer.for_run(tiny_config(run_dir=tmp_path / name)))
        return made[-1]

    yield make
    for t in made:
        t.loader.close()
        t.session.events.close()


def _transfer(tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict, dict]:
    """What a live transfer hands over: owned copies of the tensors, the meta through JSON."""
    return {k: v.clone() for k, v in tensors.items()}, json.loads(json.dumps(meta))


def test_flat_is_tensors_plus_json(trainers) -> None:
    a = trainers("a")
    advance(a)
    tensors, meta = a.state.flat()
    assert tensors and all(isinstance(k, str) and torch.is_tensor(v) for k, v in tensors.items())
    assert json.loads(json.dumps(meta)) == meta
    assert (meta["step"], meta["cursor"]) == (1, a.config.train.batch_size)
    # Model weights and both AdamW moments travel; nothing is left out of the hash.
    assert any(k.startswith("model.") for k in tensors)
    assert any("exp_avg_sq" in k for k in tensors)


def test_load_flat_round_trip_gives_equal_hash_and_identical_next_steps(trainers) -> None:
    a, b = trainers("a"), trainers("b")
    for _ in range(3):
        advance(a)
    assert b.state_hash() != a.state_hash()

    b.state.load_flat(*_transfer(*a.state.flat()))

    assert (b.state.step, b.state.cursor, b.state.seed) == (3, 3 * 4, a.state.seed)
    assert b.state_hash() == a.state_hash()
    for _ in range(2):
        advance(a)
        advance(b)
        assert b.losses[-1] == a.losses[-1]  # bitwise: the same update from the same state
        assert b.state_hash() == a.state_hash()
    assert b.state.step == a.state.step == 5


def test_load_flat_does_not_alias_the_source_tensors(trainers) -> None:
    """The loaded state must own its memory: changing the source afterwards must not change it.

    Parameters are copied in, but the optimizer state currently keeps references to the given
    tensors (``Optimizer.load_state_dict`` does not copy same-device tensors), so a caller that
    reuses or mutates its tensors after ``load_flat`` silently changes the loaded replica.
    """
    a, b = trainers("a"), trainers("b")
    advance(a)
    tensors, meta = a.state.flat()
    b.state.load_flat(tensors, meta)
    loaded = b.state_hash()
    advance(a)  # mutates a's parameters and optimizer moments in place
    assert b.state_hash() == loaded


def _grads(*values: float) -> list[torch.Tensor]:
    return [torch.full((2, 3), values[0]), torch.full((4,), values[-1])]


def test_catchup_returns_contiguous_updates_in_order_and_empties() -> None:
    buf = CatchUpBuffer(max_steps=8)
    for step in (7, 5, 6):
        buf.record(step, _grads(step), lr=0.1 * step, samples=8)
    updates = buf.take_from(5)
    assert [u.step for u in updates] == [5, 6, 7]
    assert [u.lr for u in updates] == pytest.approx([0.5, 0.6, 0.7])
    assert all(u.samples == 8 and u.grads.shape == (10,) for u in updates)
    assert torch.equal(updates[1].grads, torch.full((10,), 6.0))
    assert len(buf) == 0


def test_catchup_drops_steps_older_than_the_snapshot() -> None:
    buf = CatchUpBuffer(max_steps=8)
    for step in (3, 4, 5):
        buf.record(step, _grads(step), lr=0.1, samples=4)
    assert [u.step for u in buf.take_from(4)] == [4, 5]
    assert buf.take_from(4) == []


@pytest.mark.parametrize("recorded", [(5, 7), (6, 7)])
def test_catchup_gap_gives_none_and_clears(recorded: tuple[int, ...]) -> None:
    buf = CatchUpBuffer(max_steps=8)
    for step in recorded:
        buf.record(step, _grads(step), lr=0.1, samples=4)
    assert buf.take_from(5) is None
    assert len(buf) == 0


def test_catchup_retried_step_replaces_earlier_record() -> None:
    buf = CatchUpBuffer(max_steps=8)
    buf.record(5, _grads(1.0), lr=0.1, samples=4)
    buf.record(5, _grads(2.0), lr=0.2, samples=8)
    assert len(buf) == 1
    (update,) = buf.take_from(5)
    assert torch.equal(update.grads, torch.full((10,), 2.0))
    assert (update.lr, update.samples) == (0.2, 8)


def test_catchup_copies_gradients_and_counts_bytes() -> None:
    buf = CatchUpBuffer(max_steps=8)
    grads = _grads(1.0)
    buf.record(1, grads, lr=0.1, samples=4)
    grads[0].fill_(99.0)  # the live .grad buffers are reused by the next step
    assert buf.nbytes == 10 * 4
    assert torch.equal(buf.take_from(1)[0].grads, torch.ones(10))


def test_catchup_overflow_flag() -> None:
    buf = CatchUpBuffer(max_steps=2)
    buf.record(0, _grads(0.0), lr=0.1, samples=4)
    buf.record(1, _grads(0.0), lr=0.1, samples=4)
    assert not buf.overflowing
    buf.record(2, _grads(0.0), lr=0.1, samples=4)
    assert buf.overflowing
    buf.clear()
    assert not buf.overflowing and len(buf) == 0


def test_unflatten_into_sets_each_parameter_gradient() -> None:
    params = [torch.zeros(2, 3, requires_grad=True), torch.zeros(4, requires_grad=True)]
    unflatten_into(torch.arange(10, dtype=torch.float32), params)
    assert torch.equal(params[0].grad, torch.arange(6, dtype=torch.float32).view(2, 3))
    assert torch.equal(params[1].grad, torch.arange(6, 10, dtype=torch.float32))
