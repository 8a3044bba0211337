"""Durable checkpoints: atomic marker, rotation, refusal of bad checkpoints, bitwise stop/resume."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ftlm.config import build_config
from ftlm.errors import CheckpointError
from ftlm.ft.transport import state_digest
from ftlm.observe.events import read_events
from ftlm.train.checkpoint import MARKER, Checkpointer, checkpoint_dir, valid_checkpoints
from ftlm.train.optim import apply_update, build_optimizer
from ftlm.train.state import TrainState
from ftlm.train.trainer import Trainer, build_model

# The model of conftest's TINY_MODEL (conftest is not importable under --import-mode=importlib).
TINY = {"size": "tiny", "vocab_size": 1024, "dim": 64, "n_layers": 2, "n_heads": 4,
        "n_kv_heads": 2, "ffn_dim": 128, "max_seq_len": 64}


def _state(seed: int = 0, **model) -> TrainState:
    cfg = build_config({"model": {**TINY, **model}, "run": {"seed": seed}})
    m = build_model(cfg, torch.device("cpu"))
    return TrainState(m, build_optimizer(m, cfg.train), seed)


def _advance(state: TrainState, steps: int = 1, batch: int = 4) -> None:
    """Take real optimizer steps (random gradients) so the moments are not trivially zero."""
    gen = torch.Generator().manual_seed(state.step)
    params = list(state.model.parameters())
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        apply_update(params, state.optimizer, 1e-3, 1.0)
        state.step += 1
        state.cursor += batch


def _digest(state: TrainState) -> str:
    tensors, meta = state.flat()
    return state_digest(tensors, {"step": meta["step"], "cursor": meta["cursor"]})


def _steps_on_disk(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_due_every_n_steps_never_at_zero_and_never_when_disabled(tmp_path: Path) -> None:
    every4 = Checkpointer(tmp_path, every=4, keep=2)
    assert [s for s in range(13) if every4.due(s)] == [4, 8, 12]
    assert not any(Checkpointer(tmp_path, every=0, keep=2).due(s) for s in range(13))


@pytest.mark.parametrize("async_save", [False, True])
def test_save_marks_complete_and_restore_gives_the_same_bits(tmp_path: Path,
                                                             async_save: bool) -> None:
    state = _state()
    _advance(state, 3)
    saved = []
    ck = Checkpointer(tmp_path, every=3, keep=2, async_save=async_save,
                      on_saved=lambda step, path, s: saved.append((step, path)))
    ck.save(state)
    expected = _digest(state)
    _advance(state, 2)  # training continues while (or after) the save is written
    ck.wait()

    path = checkpoint_dir(tmp_path, 3)
    assert saved == [(3, path)]
    marker = json.loads((path / MARKER).read_text())
    assert (marker["step"], marker["cursor"]) == (3, 12)
    assert valid_checkpoints(tmp_path) == [(3, path)]

    fresh = _state(seed=5)
    assert Checkpointer(tmp_path, every=3, keep=2).restore_latest(fresh) == 3
    assert (fresh.step, fresh.cursor, fresh.seed) == (3, 12, 0)
    assert _digest(fresh) == expected


def test_only_the_newest_keep_checkpoints_remain(tmp_path: Path) -> None:
    state = _state()
    ck = Checkpointer(tmp_path, every=1, keep=2, async_save=True)
    for _ in range(5):
        _advance(state)
        ck.save(state)
    ck.wait()
    assert _steps_on_disk(tmp_path) == ["step-00000004", "step-00000005"]
    assert [s for s, _ in valid_checkpoints(tmp_path)] == [4, 5]


def test_directory_without_marker_is_ignored_and_old_dead_saves_are_removed(
        tmp_path: Path) -> None:
    state = _state()
    ck = Checkpointer(tmp_path, every=1, keep=3, async_save=False)
    _advance(state, 4)
    ck.save(state)
    four = _digest(state)
    # A crash mid-save of step 8 leaves its files but no marker; so does an older one at step 2.
    for step in (8, 2):
        shutil.copytree(checkpoint_dir(tmp_path, 4), checkpoint_dir(tmp_path, step))
        (checkpoint_dir(tmp_path, step) / MARKER).unlink()
    assert [s for s, _ in valid_checkpoints(tmp_path)] == [4]

    fresh = _state(seed=1)
    assert ck.restore_latest(fresh) == 4
    assert _digest(fresh) == four

    _advance(state, 2)
    ck.save(state)  # step 6: rotation removes the dead save older than it, keeps step 8's
    assert _steps_on_disk(tmp_path) == ["step-00000004", "step-00000006", "step-00000008"]


def test_restore_with_nothing_saved_returns_none(tmp_path: Path) -> None:
    state = _state()
    before = _digest(state)
    assert Checkpointer(tmp_path / "absent", every=1, keep=1).restore_latest(state) is None
    assert _digest(state) == before


def _saved_at_step_4(root: Path) -> Path:
    state = _state()
    _advance(state, 4)
    Checkpointer(root, every=4, keep=1, async_save=False).save(state)
    return checkpoint_dir(root, 4)


def test_checkpoint_of_another_model_size_is_refused_naming_the_path(tmp_path: Path) -> None:
    path = _saved_at_step_4(tmp_path)
    other = _state(dim=32, ffn_dim=64)
    with pytest.raises(CheckpointError) as err:
        Checkpointer(tmp_path, every=4, keep=1).restore_latest(other)
    msg = str(err.value)
    assert str(path) in msg
    assert "checkpoint.resume=false" in msg  # the way out
    assert "tok_embeddings" in msg  # the root cause: which tensor does not fit
    assert "\n" not in msg  # FtlmError messages are one line (no DCP traceback inside)


def test_damaged_checkpoint_is_refused_naming_the_path(tmp_path: Path) -> None:
    path = _saved_at_step_4(tmp_path)
    data_files = [p for p in path.iterdir() if p.suffix == ".distcp"]
    assert data_files
    for p in data_files:
        p.write_bytes(b"\0garbage" * 16)
    with pytest.raises(CheckpointError) as err:
        Checkpointer(tmp_path, every=4, keep=1).restore_latest(_state())
    assert str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_checkpoint_holding_another_step_than_its_name_is_refused(tmp_path: Path) -> None:
    path = _saved_at_step_4(tmp_path)
    renamed = path.rename(checkpoint_dir(tmp_path, 8))
    with pytest.raises(CheckpointError) as err:
        Checkpointer(tmp_path, every=4, keep=1).restore_latest(_state())
    assert str(renamed) in str(err.value) and "step 4" in str(err.value)


def test_failed_background_write_is_a_checkpoint_error_naming_the_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP reports a failed write as ``CheckpointException`` (a ``BaseException``, not an
    ``Exception``) on the future; ``wait()`` must turn it into a ``CheckpointError`` and leave no
    marker. The future is faked because a real disk failure cannot be provoked portably."""
    failure = CheckpointException("write failed", {0: (OSError("No space left on device"), None)})
    future: Future = Future()
    future.set_exception(failure)
    monkeypatch.setattr(dcp, "async_save", lambda *args, **kwargs: future)
    state = _state()
    _advance(state)
    ck = Checkpointer(tmp_path, every=1, keep=1, async_save=True)
    ck.save(state)
    with pytest.raises(CheckpointError) as err:
        ck.wait()
    assert str(checkpoint_dir(tmp_path, 1)) in str(err.value)
    assert "No space left on device" in str(err.value)
    assert valid_checkpoints(tmp_path) == []


# -- whole-trainer stop / resume ---------------------------------------------------------------

def _commits(run_dir: Path) -> dict[int, dict]:
    return {e["step"]: e for e in read_events(run_dir / "events.jsonl") if e["kind"] == "commit"}


@pytest.fixture(scope="module")
def stop_resume(make_tiny_config, tmp_path_factory):
    """Run A trains 12 steps straight; run B is stopped after step 8 and resumed by a new Trainer.

    Both use ``train.steps=12`` (the LR schedule depends on it). B is stopped the way a
    preempted job is: ``request_stop()`` (the SIGTERM handler) is called right after the 8th
    commit, so ``train()`` finishes that step, waits for the in-flight async checkpoint of step 8
    and writes its summary, exactly as in production. A fresh ``Trainer`` on B's run directory
    then resumes from ``step-00000008`` and trains steps 8..11.
    Returns (A, B, resumed trainer, resumed summary, B's checkpoints at the stop).
    """
    root = tmp_path_factory.mktemp("stop-resume")
    sections = dict(train={"steps": 12, "warmup_steps": 3},
                    checkpoint={"every": 4, "keep": 2, "async_save": True})
    a = Trainer(make_tiny_config(root / "a", **sections))
    a.train()

    b = Trainer(make_tiny_config(root / "b", **sections))
    step_once = b.step

    def step_then_stop_after_8() -> None:
        step_once()
        if b.state.step == 8:
            b.request_stop()

    b.step = step_then_stop_after_8
    b.train()
    at_stop = _steps_on_disk(b.run_dir / "checkpoints")

    resumed = Trainer(make_tiny_config(root / "b", **sections))
    return a, b, resumed, resumed.train(), at_stop


def test_stop_and_resume_is_bitwise_identical_to_an_uninterrupted_run(stop_resume) -> None:
    a, b, resumed, summary, at_stop = stop_resume
    assert b.state.step == 8
    assert at_stop == ["step-00000004", "step-00000008"]

    a_commits, b_commits = _commits(a.run_dir), _commits(b.run_dir)
    assert sorted(b_commits) == list(range(12))
    for step in range(12):
        assert b_commits[step]["samples"] == a_commits[step]["samples"]
        assert b_commits[step]["loss"] == a_commits[step]["loss"], f"step {step}"
    assert resumed.losses == a.losses[8:]
    assert resumed.state_hash() == a.state_hash()
    assert _steps_on_disk(b.run_dir / "checkpoints") == ["step-00000008", "step-00000012"]


def test_summary_after_resume_covers_the_whole_run(stop_resume) -> None:
    """The resumed run's summary.json accounts for all 12 steps, and its ETT stays <= ~1.

    ETT = tokens_committed / (wall_seconds * steady rate). The tokens are those of every commit
    in events.jsonl (steps 0..11), so wall_seconds must span the run too (not only the 4 steps
    of the resumed process), and the downtime between stop and resume is not a steady window.
    """
    a, _, _, summary, _ = stop_resume
    assert summary["steps_committed"] == 12
    assert summary["tokens_committed"] == a.config.train.steps * 4 * 64
    assert summary["data"]["duplicates"] == summary["data"]["gaps"] == 0
    assert summary["final_loss"] == a.losses[-1]
    assert 0 < summary["ett"] <= 1.5, summary["ett"]


def test_resume_false_ignores_existing_checkpoints(tiny_config, tmp_path: Path) -> None:
    first = Trainer(tiny_config(train={"steps": 4}, checkpoint={"every": 4}))
    first.train()
    assert valid_checkpoints(first.run_dir / "checkpoints")[-1][0] == 4
    again = Trainer(tiny_config(train={"steps": 4}, checkpoint={"every": 4, "resume": False}))
    again.train()
    assert again.losses == first.losses  # trained from scratch: the same four steps again
