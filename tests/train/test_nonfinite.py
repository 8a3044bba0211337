"""A non-finite loss or gradient is a failed step, never an update."""

from __future__ import annotations

import pytest
import torch

from ftlm.observe.events import read_events
from ftlm.train.nonfinite import NONFINITE_LIMIT, TrainingDiverged
from ftlm.train.trainer import Trainer


def test_a_diverging_run_stops_with_a_clear_error_and_applies_nothing_non_finite(tiny_config) -> None:
    config = tiny_config(train={"lr": 1e30, "warmup_steps": 0, "grad_clip": 0.0, "steps": 30})
    trainer = Trainer.for_run(config)
    with pytest.raises(TrainingDiverged, match="not finite in 3 attempts in a row.*lower train.lr"):
        trainer.train()
    # No parameter ever became non-finite: the failed steps applied nothing.
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    events = read_events(config.run.path / "events.jsonl")
    failed = [e for e in events if e["kind"] == "step_failed"]
    assert len(failed) == NONFINITE_LIMIT and all(e["reason"] == "non-finite loss or gradient" for e in failed)
    assert len({e["step"] for e in failed}) == 1  # the same step, retried
    assert not (config.run.path / "model.safetensors").exists()  # no model file from a diverged run


def test_a_single_non_finite_step_is_skipped_and_training_goes_on(tiny_config, monkeypatch) -> None:
    config = tiny_config(train={"steps": 6})
    trainer = Trainer.for_run(config)
    real = trainer._forward_backward
    calls = {"n": 0}

    def once_nan(batch, *step_units):
        loss = real(batch, *step_units)
        calls["n"] += 1
        if calls["n"] == 3:  # the third attempt produces a NaN gradient
            next(trainer.model.parameters()).grad.view(-1)[0] = float("nan")
        return loss

    monkeypatch.setattr(trainer, "_forward_backward", once_nan)
    trainer.train()
    events = read_events(config.run.path / "events.jsonl")
    assert [e["step"] for e in events if e["kind"] == "commit"] == list(range(6))
    assert [e["step"] for e in events if e["kind"] == "step_failed"] == [2]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
