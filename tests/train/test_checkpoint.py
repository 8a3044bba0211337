"""Durable checkpoints: atomic marker, rotation, integrity (manifest, HMAC, restricted unpickling),
fallback to older checkpoints, bitwise stop/resume, and the sharded (2-rank) path."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ftlm.train.checkpoint as checkpoint_module
from ftlm.config import build_config
from ftlm.errors import CheckpointError, ConfigError
from ftlm.ft.transport import state_digest
from ftlm.observe.events import read_events
from ftlm.train.checkpoint import (MANIFEST, MARKER, Checkpointer, RejectedCheckpoint,
                                   UnverifiableCheckpoint, VerifiedReader, checkpoint_dir,
                                   load_verified, read_manifest, valid_checkpoints, verify,
                                   write_manifest)
from ftlm.train.job_token import run_token
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
    """The checkpoint directories under ``root`` (not the lock the final save takes)."""
    return sorted(p.name for p in root.iterdir() if p.name != ".save.lock")


def _flip(file: Path, n: int = 64) -> None:
    """Invert ``n`` bytes in the middle of ``file`` (what the outside testers did)."""
    data = bytearray(file.read_bytes())
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    file.write_bytes(bytes(data))


def _distcp(path: Path) -> list[Path]:
    files = sorted(p for p in path.iterdir() if p.suffix == ".distcp")
    assert files
    return files


def _reseal(path: Path, key: bytes | None = None) -> None:
    """What an attacker with write access and without the token can do: rewrite the manifest."""
    marker = json.loads((path / MARKER).read_text())
    write_manifest(path, marker["step"], marker["cursor"], key)


class _Recorder:
    """``on_rejected`` callback that remembers its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, Path, str]] = []

    def __call__(self, step: int, path: Path, reason: str) -> None:
        self.calls.append((step, path, reason))


def test_due_every_n_steps_never_at_zero_and_never_when_disabled(tmp_path: Path) -> None:
    every4 = Checkpointer(tmp_path, every=4, keep=2)
    assert [s for s in range(13) if every4.due(s)] == [4, 8, 12]
    assert not any(Checkpointer(tmp_path, every=0, keep=2).due(s) for s in range(13))


@pytest.mark.parametrize("async_save", [False, True])
def test_save_writes_manifest_then_marker_and_restore_gives_the_same_bits(
        tmp_path: Path, async_save: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    written = []
    atomic = checkpoint_module._write_atomic
    monkeypatch.setattr(checkpoint_module, "_write_atomic",
                        lambda path, data: (written.append(path.name), atomic(path, data)))
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
    # The state digest first (the manifest lists it), the marker last: valid only once all is on disk.
    assert written == [checkpoint_module.STATE_DIGEST.format(rank=0), MANIFEST, MARKER]
    marker = json.loads((path / MARKER).read_text())
    assert (marker["step"], marker["cursor"]) == (3, 12)
    manifest = json.loads((path / MANIFEST).read_text())
    # The manifest covers every file of the finished save, and nothing else.
    assert sorted(manifest["files"]) == sorted(set(_steps_on_disk(path)) - {MANIFEST, MARKER})
    assert ".metadata" in manifest["files"] and "hmac" not in manifest
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


def _saved_at(root: Path, *steps: int, key: bytes | None = None) -> dict[int, str]:
    """Save one state at each of ``steps``; the digest of each saved state."""
    state = _state()
    ck = Checkpointer(root, every=1, keep=len(steps), async_save=False, key=key)
    digests = {}
    for step in steps:
        _advance(state, step - state.step)
        ck.save(state)
        digests[step] = _digest(state)
    return digests


def test_checkpoint_of_another_model_size_is_refused_naming_the_path(tmp_path: Path) -> None:
    _saved_at(tmp_path, 4)
    other = _state(dim=32, ffn_dim=64)
    with pytest.raises(CheckpointError) as err:
        Checkpointer(tmp_path, every=4, keep=1).restore_latest(other)
    msg = str(err.value)
    assert str(checkpoint_dir(tmp_path, 4)) in msg
    assert "checkpoint.resume=false" in msg  # the way out
    assert "tok_embeddings" in msg  # the root cause: which tensor does not fit
    assert "\n" not in msg  # FtlmError messages are one line (no DCP traceback inside)


# -- integrity: damage is detected before loading, and an older checkpoint is used ---------------

def test_flipped_bytes_in_distcp_fall_back_to_the_previous_checkpoint(tmp_path: Path) -> None:
    digests = _saved_at(tmp_path, 4, 8)
    _flip(_distcp(checkpoint_dir(tmp_path, 8))[0])
    rejected = _Recorder()
    fresh = _state(seed=3)
    assert Checkpointer(tmp_path, every=4, keep=2, on_rejected=rejected).restore_latest(fresh) == 4
    assert _digest(fresh) == digests[4]
    [(step, path, reason)] = rejected.calls
    assert (step, path) == (8, checkpoint_dir(tmp_path, 8))
    assert "__0_0.distcp" in reason and "sha256" in reason and "\n" not in reason
    # Moved aside, kept for inspection: rotation can no longer weigh it against new saves.
    assert _steps_on_disk(tmp_path) == ["rejected-step-00000008", "step-00000004"]


def test_a_checkpoint_suspect_of_a_corrupt_writer_is_set_aside_and_an_older_one_loads(tmp_path: Path) -> None:
    """Rule I2: a group retired because its state may hold a corrupt group's bits moves that
    state's checkpoint aside (matched by step and history), so its next process loads an older
    one; a checkpoint of another history at that step, or a reader that is not the group's
    writer, moves nothing."""
    digests = _saved_at(tmp_path, 4, 8)
    chain = json.loads((checkpoint_dir(tmp_path, 8) / MARKER).read_text())["chain"]
    ck = Checkpointer(tmp_path, every=4, keep=2)
    assert ck.set_aside(8, "f" * 64) is None  # another history's state of step 8
    reader = Checkpointer(tmp_path, every=4, keep=2)
    reader.writer = False
    assert reader.set_aside(8, chain) is None
    moved = ck.set_aside(8, chain)
    assert moved is not None and moved.name == "rejected-step-00000008"
    fresh = _state(seed=3)
    assert Checkpointer(tmp_path, every=4, keep=2).restore_latest(fresh) == 4
    assert _digest(fresh) == digests[4]


def test_a_checkpoint_whose_state_differs_from_its_recorded_digest_falls_back(tmp_path: Path) -> None:
    """Intact files that load another state than the one saved (a corrupt writer's memory, a
    reader's): the state digest recorded at the save tells, the checkpoint is refused naming it,
    and the older one is loaded."""
    digests = _saved_at(tmp_path, 4, 8)
    path = checkpoint_dir(tmp_path, 8)
    recorded = path / checkpoint_module.STATE_DIGEST.format(rank=0)
    assert json.loads(recorded.read_bytes())["step"] == 8
    recorded.write_text(json.dumps({"step": 8, "digest": "0" * 32}))
    checkpoint_module.write_manifest(path, 8, json.loads((path / MANIFEST).read_bytes())["cursor"])  # files verify
    rejected = _Recorder()
    fresh = _state(seed=3)
    assert Checkpointer(tmp_path, every=4, keep=2, on_rejected=rejected).restore_latest(fresh) == 4
    assert _digest(fresh) == digests[4]
    [(step, where, reason)] = rejected.calls
    assert (step, where) == (8, path) and "state digest" in reason
    # Without an older one, the load stops with an error naming it.
    _saved_at(tmp_path / "alone", 8)
    alone = checkpoint_dir(tmp_path / "alone", 8)
    (alone / checkpoint_module.STATE_DIGEST.format(rank=0)).write_text(json.dumps({"step": 8, "digest": "0" * 32}))
    checkpoint_module.write_manifest(alone, 8, json.loads((alone / MANIFEST).read_bytes())["cursor"])
    with pytest.raises(CheckpointError, match="step-00000008.*state digest"):
        Checkpointer(tmp_path / "alone", every=4, keep=2).restore_latest(_state(seed=3))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "missing", "unlisted", "renamed"])
def test_damaged_checkpoint_is_rejected_with_a_reason(tmp_path: Path, damage: str) -> None:
    _saved_at(tmp_path, 4)
    path = checkpoint_dir(tmp_path, 4)
    data = _distcp(path)[0]
    if damage == "garbage":
        data.write_bytes(b"\0garbage" * 16)
    elif damage == "truncated":
        data.write_bytes(data.read_bytes()[:-1])
    elif damage == "missing":
        data.unlink()
    elif damage == "unlisted":
        shutil.copy(data, path / "__1_0.distcp")
    else:
        path = path.rename(checkpoint_dir(tmp_path, 8))
    with pytest.raises(RejectedCheckpoint) as err:
        verify(path)
    reason = err.value.reason
    expected = {"garbage": "bytes", "truncated": "bytes", "missing": "missing",
                "unlisted": "__1_0.distcp is not in its manifest", "renamed": "step 4"}[damage]
    assert expected in reason and str(path) in str(err.value)
    rejected = _Recorder()
    state = _state(seed=2)
    before = _digest(state)
    ck = Checkpointer(tmp_path, every=4, keep=1, on_rejected=rejected)
    assert ck.restore_latest(state) is None
    assert [(s, p) for s, p, _ in rejected.calls] == [(int(path.name[5:]), path)]
    assert _digest(state) == before  # nothing of it was loaded


def test_checkpoint_without_manifest_is_refused_saying_how_to_proceed(tmp_path: Path) -> None:
    """An earlier ftlm version's checkpoint (no manifest): neither trusted nor skipped silently."""
    _saved_at(tmp_path, 4, 8)
    (checkpoint_dir(tmp_path, 8) / MANIFEST).unlink()
    state = _state(seed=2)
    with pytest.raises(UnverifiableCheckpoint) as err:
        Checkpointer(tmp_path, every=4, keep=2).restore_latest(state)
    msg = str(err.value)
    assert str(checkpoint_dir(tmp_path, 8)) in msg and MANIFEST in msg
    assert "delete it" in msg and "checkpoint.resume=false" in msg and "\n" not in msg
    assert state.step == 0


# -- integrity: authentication with the job token ------------------------------------------------

def test_manifest_under_another_token_is_refused(tmp_path: Path) -> None:
    _saved_at(tmp_path, 4, key=b"token-a")
    assert "hmac" in json.loads((checkpoint_dir(tmp_path, 4) / MANIFEST).read_text())
    rejected = _Recorder()
    state = _state(seed=2)
    before = _digest(state)
    ck = Checkpointer(tmp_path, every=4, keep=1, key=b"token-b", on_rejected=rejected)
    assert ck.restore_latest(state) is None
    assert _digest(state) == before
    [(step, _, reason)] = rejected.calls
    assert step == 4 and "HMAC" in reason and "another token" in reason


def test_right_token_restores_and_a_resealed_manifest_is_refused(tmp_path: Path) -> None:
    digests = _saved_at(tmp_path, 4, 8, key=b"token-a")
    # Without the token, an attacker can change a file and recompute its hash, not the HMAC.
    _flip(_distcp(checkpoint_dir(tmp_path, 8))[0])
    _reseal(checkpoint_dir(tmp_path, 8))
    rejected = _Recorder()
    state = _state(seed=2)
    ck = Checkpointer(tmp_path, every=4, keep=2, key=b"token-a", on_rejected=rejected)
    assert ck.restore_latest(state) == 4
    assert _digest(state) == digests[4]
    assert [s for s, _, r in rejected.calls if "carries no HMAC" in r] == [8]


def test_checkpoint_without_hmac_is_refused_when_a_token_is_set(tmp_path: Path) -> None:
    _saved_at(tmp_path, 4)
    rejected = _Recorder()
    ck = Checkpointer(tmp_path, every=4, keep=1, key=b"token", on_rejected=rejected)
    assert ck.restore_latest(_state()) is None
    assert "no HMAC" in rejected.calls[0][2]


def test_a_non_ascii_hmac_is_rejected_and_an_older_checkpoint_restored(tmp_path: Path) -> None:
    """A crafted ``hmac`` value (any non-hex text) rejects that checkpoint like any bad HMAC;
    it crashed the resume with hmac.compare_digest's TypeError."""
    digests = _saved_at(tmp_path, 4, 8, key=b"token-a")
    manifest_file = checkpoint_dir(tmp_path, 8) / MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest["hmac"] = "\u00e9" * 64
    manifest_file.write_text(json.dumps(manifest))
    rejected = _Recorder()
    state = _state(seed=2)
    ck = Checkpointer(tmp_path, every=4, keep=2, key=b"token-a", on_rejected=rejected)
    assert ck.restore_latest(state) == 4
    assert _digest(state) == digests[4]
    [(step, _, reason)] = rejected.calls
    assert step == 8 and "HMAC" in reason


def test_the_hmac_covers_the_run_another_runs_checkpoint_is_refused(tmp_path: Path) -> None:
    """Two runs under one token (a shared FTLM_TOKEN, a Slurm folder regenerated for another
    run): a checkpoint of run A, copied into run B's checkpoints, is not B's to resume from."""
    state = _state()
    ck = Checkpointer(tmp_path, every=1, keep=2, async_save=False, key=b"shared", run="run-a")
    _advance(state, 4)
    ck.save(state)
    assert json.loads((checkpoint_dir(tmp_path, 4) / MANIFEST).read_text())["run"] == "run-a"
    rejected = _Recorder()
    other = Checkpointer(tmp_path, every=1, keep=2, key=b"shared", run="run-b",
                         on_rejected=rejected)
    assert other.restore_latest(_state(seed=2)) is None
    [(step, _, reason)] = rejected.calls
    assert step == 4 and "run-a" in reason and "run-b" in reason
    # The run's name cannot be edited into the manifest without the token.
    path = tmp_path / "rejected-step-00000004"
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["run"] = "run-b"
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(RejectedCheckpoint, match="HMAC"):
        read_manifest(path, b"shared", run="run-b")


def test_the_run_dirs_token_file_guards_a_resume_without_ftlm_token(tiny_config, monkeypatch) -> None:
    """A launch signed the checkpoints with the run directory's token; ``ftlm train
    RUN_DIR/config.toml`` run later by hand, without FTLM_TOKEN, reads that file as ``ftlm
    convert`` does: the newest checkpoint, its HMAC removed (rewritten by someone without the
    token), is refused and training resumes from the signed one before it."""
    sections = dict(train={"steps": 8}, checkpoint={"every": 4, "keep": 2})
    config = tiny_config(**sections)
    config.run.path.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("FTLM_TOKEN", run_token(config.run.path))  # what the launcher exports
    clean = Trainer.for_run(config)
    clean.train()
    ckpts = clean.run_dir / "checkpoints"
    _flip(_distcp(checkpoint_dir(ckpts, 8))[0])
    _reseal(checkpoint_dir(ckpts, 8))  # hashes redone, no HMAC: all one can do without the token

    monkeypatch.delenv("FTLM_TOKEN")
    resumed = Trainer.for_run(tiny_config(**sections))
    resumed.train()
    [event] = _rejections(resumed.run_dir)
    assert event["step"] == 8 and "no HMAC" in event["reason"]
    assert resumed.losses == clean.losses[4:]


def test_the_run_token_file_is_private_and_never_made_through_a_symlink(tmp_path: Path, caplog) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    elsewhere = tmp_path / "elsewhere"
    (run_dir / "token").symlink_to(elsewhere)  # dangling: a token made through it lands there
    with pytest.raises(ConfigError, match="symbolic link"):
        run_token(run_dir)
    assert not elsewhere.exists()
    (run_dir / "token").unlink()
    token = run_token(run_dir)
    assert len(token) == 32 and run_token(run_dir) == token
    assert (run_dir / "token").stat().st_mode & 0o777 == 0o600
    (run_dir / "token").chmod(0o644)  # made by hand, or copied without its mode
    with caplog.at_level("WARNING", logger="ftlm.train"):
        assert run_token(run_dir) == token
    assert any("readable by other users" in r.getMessage() and "chmod 600" in r.getMessage()
               for r in caplog.records)


# -- integrity: no code runs from a crafted checkpoint, with or without a token -------------------

class _Payload:
    """A pickled object that runs a shell command when unpickled (creates ``proof``)."""

    def __init__(self, proof: Path):
        self.proof = proof

    def __reduce__(self):
        return os.system, (f"touch {self.proof}",)


def test_the_payload_is_live(tmp_path: Path) -> None:
    """The tests below would fail if a crafted file were unpickled: prove the payload works."""
    pickle.loads(pickle.dumps(_Payload(tmp_path / "proof")))
    assert (tmp_path / "proof").exists()


def test_crafted_metadata_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    digests = _saved_at(tmp_path, 4, 8)
    proof = tmp_path / "pwned"
    path = checkpoint_dir(tmp_path, 8)
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(proof)))
    _reseal(path)  # no token set: the manifest cannot stop this, the unpickler must
    rejected = _Recorder()
    state = _state(seed=2)
    assert Checkpointer(tmp_path, every=4, keep=2, on_rejected=rejected).restore_latest(state) == 4
    assert not proof.exists()
    assert _digest(state) == digests[4]
    [(step, _, reason)] = rejected.calls
    assert step == 8 and "system" in reason and "refused to unpickle" in reason
    # DCP itself, through the reader ftlm plugs in, refuses it as well.
    with pytest.raises((CheckpointError, CheckpointException)) as err:
        dcp.load({"train": state},
                 storage_reader=VerifiedReader(tmp_path / "rejected-step-00000008"))
    assert "refused to unpickle" in str(err.value)
    assert not proof.exists()


def test_crafted_value_in_distcp_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    """DCP stores non-tensor values as pickles in .distcp files and, by default, loads them with
    ``torch.load(weights_only=False)``: a second way to run code that the loader must close."""
    proof = tmp_path / "pwned"
    path = checkpoint_dir(tmp_path, 1)
    dcp.save({"value": _Payload(proof)}, checkpoint_id=str(path), no_dist=True)
    write_manifest(path, 1, 0)
    assert not proof.exists()
    checkpoint = verify(path)  # intact: it is exactly what was written
    with pytest.raises((CheckpointError, CheckpointException)) as err:
        load_verified(checkpoint, {"value": None})
    assert "not plain data" in str(err.value) and "system" in str(err.value)
    assert not proof.exists()


# -- whole-trainer: fallback with events, from scratch when nothing is intact ---------------------

def _commits(run_dir: Path) -> dict[int, dict]:
    return {e["step"]: e for e in read_events(run_dir / "events.jsonl") if e["kind"] == "commit"}


def _rejections(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir / "events.jsonl") if e["kind"] == "checkpoint_rejected"]


def test_trainer_resumes_from_the_previous_checkpoint_when_the_latest_is_damaged(
        tiny_config) -> None:
    sections = dict(train={"steps": 8}, checkpoint={"every": 4, "keep": 2})
    clean = Trainer.for_run(tiny_config(**sections))
    clean.train()
    ckpts = clean.run_dir / "checkpoints"
    _flip(_distcp(checkpoint_dir(ckpts, 8))[0])

    resumed = Trainer.for_run(tiny_config(**sections))
    summary = resumed.train()
    [event] = _rejections(resumed.run_dir)
    assert event["step"] == 8 and event["path"] == str(checkpoint_dir(ckpts, 8))
    assert "sha256" in event["reason"]
    # Resumed at step 4 and trained 4..7 again: the very losses of the clean run, not garbage.
    assert resumed.losses == clean.losses[4:]
    assert summary["final_loss"] == clean.losses[-1]
    assert _steps_on_disk(ckpts) == ["rejected-step-00000008", "step-00000004", "step-00000008"]
    verify(checkpoint_dir(ckpts, 8))  # saved again, intact


def test_trainer_starts_from_scratch_when_no_checkpoint_is_intact(tiny_config) -> None:
    sections = dict(train={"steps": 8}, checkpoint={"every": 4, "keep": 2})
    first = Trainer.for_run(tiny_config(**sections))
    first.train()
    ckpts = first.run_dir / "checkpoints"
    for step in (4, 8):
        _flip(_distcp(checkpoint_dir(ckpts, step))[0])

    again = Trainer.for_run(tiny_config(**sections))
    again.train()
    assert [e["step"] for e in _rejections(again.run_dir)] == [8, 4]
    assert again.losses == first.losses  # from scratch: the same eight steps again
    # The new saves survive rotation: the rejected ones were moved out of its way.
    assert [s for s, _ in valid_checkpoints(ckpts)] == [4, 8]
    assert sorted(p.name for p in ckpts.glob("rejected-*")) == [
        "rejected-step-00000004", "rejected-step-00000008"]


def test_trainer_authenticates_checkpoints_with_the_job_token(
        tiny_config, monkeypatch: pytest.MonkeyPatch) -> None:
    sections = dict(train={"steps": 4}, checkpoint={"every": 4})
    monkeypatch.setenv("FTLM_TOKEN", "job-1")
    first = Trainer.for_run(tiny_config(**sections))
    first.train()
    path = checkpoint_dir(first.run_dir / "checkpoints", 4)
    assert "hmac" in json.loads((path / MANIFEST).read_text())
    monkeypatch.setenv("FTLM_TOKEN", "job-2")
    other = Trainer.for_run(tiny_config(**sections))
    other.train()
    [event] = _rejections(other.run_dir)
    assert event["step"] == 4 and "HMAC" in event["reason"]
    assert other.losses == first.losses  # nothing loaded: trained from scratch


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
    assert not (checkpoint_dir(tmp_path, 1) / MANIFEST).exists()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_periodic_save_is_recorded_and_training_goes_on(
        make_tiny_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool) -> None:
    """A full disk at step 4's save: the error is logged and recorded (``checkpoint_failed``),
    training goes on, step 8 saves again, and resuming finds step 8 (a group stopped for it
    would restart, catch up and fail the same way at its next save). The write is faked: a real
    full disk cannot be provoked portably."""
    config = make_tiny_config(tmp_path / "run", train={"steps": 10, "warmup_steps": 3},
                              checkpoint={"every": 4, "keep": 3, "async_save": async_save})
    name = "async_save" if async_save else "save"
    real = getattr(dcp, name)

    def flaky(state_dict, checkpoint_id, **kwargs):
        if checkpoint_id.endswith("step-00000004"):
            if not async_save:
                raise OSError(28, "No space left on device")
            failed: Future = Future()
            failed.set_exception(CheckpointException("write failed", {0: (OSError("No space left on device"), None)}))
            return failed
        return real(state_dict, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(dcp, name, flaky)
    trainer = Trainer.for_run(config)
    trainer.train()
    assert trainer.state.step == 10
    events = read_events(trainer.run_dir / "events.jsonl")
    [failed] = [e for e in events if e["kind"] == "checkpoint_failed"]
    assert "step-00000004" in failed["error"] and "No space left on device" in failed["error"]
    assert [e["step"] for e in events if e["kind"] == "checkpoint_saved"] == [8, 10]
    assert [step for step, _ in valid_checkpoints(trainer.run_dir / "checkpoints")] == [8, 10]


# -- whole-trainer stop / resume ---------------------------------------------------------------

def _stopped_after(trainer: Trainer, step: int) -> Trainer:
    """``trainer`` with a stop request (the SIGTERM handler) right after its ``step``-th commit."""
    step_once = trainer.train_step

    def step_then_stop(this) -> bool:
        ok = step_once(this)
        if trainer.state.step == step:
            trainer.request_stop()
        return ok

    trainer.train_step = step_then_stop
    return trainer


def _stop_then_resume(make_config, run_dir: Path, sections: dict, after: int) -> tuple[Trainer, list[str], Trainer]:
    """A run stopped after step ``after`` (as a preempted job), the checkpoints it left, and a new
    ``Trainer`` on its run directory that will resume it (not trained yet)."""
    stopped = _stopped_after(Trainer.for_run(make_config(run_dir, **sections)), after)
    stopped.train()
    return stopped, _steps_on_disk(stopped.run_dir / "checkpoints"), Trainer.for_run(make_config(run_dir, **sections))


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
    a = Trainer.for_run(make_tiny_config(root / "a", **sections))
    a.train()

    b, at_stop, resumed = _stop_then_resume(make_tiny_config, root / "b", sections, 8)
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
    assert _rejections(b.run_dir) == []


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


def test_a_stop_between_checkpoints_saves_the_committed_step_and_resumes_from_it(
        make_tiny_config, tmp_path: Path) -> None:
    """Stopped after step 6 with checkpoints every 4: the stop saves step 6 on the way out
    (``checkpoint.on_stop``), so the resumed run redoes nothing and ends bitwise where an
    uninterrupted run does; with ``on_stop`` off it resumes from step 4 and redoes 2 steps."""
    sections = dict(train={"steps": 10, "warmup_steps": 3},
                    checkpoint={"every": 4, "keep": 3, "async_save": True})
    straight = Trainer.for_run(make_tiny_config(tmp_path / "a", **sections))
    straight.train()

    stopped, at_stop, resumed = _stop_then_resume(make_tiny_config, tmp_path / "b", sections, 6)
    assert stopped.state.step == 6
    assert at_stop == ["step-00000004", "step-00000006"]
    summary = resumed.train()
    assert resumed.losses == straight.losses[6:]
    assert resumed.state_hash() == straight.state_hash()
    assert summary["data"]["restores"] == 0 and summary["steps_committed"] == 10

    off = dict(sections, checkpoint={**sections["checkpoint"], "on_stop": False})
    _, at_stop, resumed = _stop_then_resume(make_tiny_config, tmp_path / "c", off, 6)
    assert at_stop == ["step-00000004"]
    resumed.train()
    assert resumed.losses == straight.losses[4:]


def test_ctrl_c_saves_nothing_on_the_way_out(make_tiny_config, tmp_path: Path) -> None:
    """Ctrl-C can land in the middle of an update, so unlike a stop request it saves nothing:
    a resume starts from the last periodic checkpoint."""
    config = make_tiny_config(tmp_path / "run", train={"steps": 10, "warmup_steps": 3},
                              checkpoint={"every": 4, "keep": 2})
    trainer = Trainer.for_run(config)
    step_once = trainer.train_step

    def step_then_interrupt(step) -> bool:
        ok = step_once(step)
        if trainer.state.step == 6:
            raise KeyboardInterrupt
        return ok

    trainer.train_step = step_then_interrupt
    trainer.train()
    assert trainer.state.step == 6
    assert _steps_on_disk(trainer.run_dir / "checkpoints") == ["step-00000004"]


def test_a_stop_whose_checkpoint_fails_still_stops_cleanly(make_tiny_config, tmp_path: Path,
                                                          monkeypatch) -> None:
    """A save that fails on the way out (a full disk) is logged; the stop itself goes on and
    the newest valid checkpoint stays the one before."""
    config = make_tiny_config(tmp_path / "run", train={"steps": 10, "warmup_steps": 3},
                              checkpoint={"every": 4, "keep": 2, "async_save": False})
    trainer = _stopped_after(Trainer.for_run(config), 6)
    real_save = trainer.checkpointer.save

    def save(state) -> None:
        if state.step == 6:
            raise CheckpointError("writing checkpoint step-00000006 failed: No space left on device")
        real_save(state)

    monkeypatch.setattr(trainer.checkpointer, "save", save)
    trainer.train()
    assert trainer.state.step == 6
    assert _steps_on_disk(trainer.run_dir / "checkpoints") == ["step-00000004"]


def test_resume_false_ignores_existing_checkpoints(tiny_config, tmp_path: Path) -> None:
    first = Trainer.for_run(tiny_config(train={"steps": 4}, checkpoint={"every": 4}))
    first.train()
    assert valid_checkpoints(first.run_dir / "checkpoints")[-1][0] == 4
    again = Trainer.for_run(tiny_config(train={"steps": 4}, checkpoint={"every": 4, "resume": False}))
    again.train()
    assert again.losses == first.losses  # trained from scratch: the same four steps again


def test_a_group_started_after_the_job_finished_resumes_at_its_end_and_trains_nothing(tiny_config) -> None:
    """What ``launch local`` counts on when it restarts a group that died after every other group
    finished (the final step is always made durable): it resumes there, trains no step, and
    ends with the finished job's exact state."""
    finished = Trainer.for_run(tiny_config(train={"steps": 5}, checkpoint={"every": 2}))
    finished.train()
    assert valid_checkpoints(finished.run_dir / "checkpoints")[-1][0] == 5  # not a due step: final
    late = Trainer.for_run(tiny_config(train={"steps": 5}, checkpoint={"every": 2}))
    late.train()
    assert late.losses == [] and late.state.step == 5 and late.state_hash() == finished.state_hash()
    for t in (finished, late):
        t.loader.close()


# -- sharded: FSDP2 over 2 ranks (gloo), each rank hashing its share ----------------------------

_RANK_SCRIPT = r"""
import json, sys, time
from pathlib import Path
import torch, torch.distributed as dist
dist.init_process_group("gloo")
from ftlm.config import build_config
from ftlm.ft.transport import state_digest
from ftlm.train.checkpoint import Checkpointer, checkpoint_dir
from ftlm.train.optim import apply_update, build_optimizer
from ftlm.train.parallelize import group_mesh, parallelize
from ftlm.train.state import TrainState
from ftlm.train.trainer import build_model

root, out, model = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
rank = dist.get_rank()
mesh = group_mesh(torch.device("cpu"))
pg = dist.new_group(backend="gloo")
rejected = []

def sharded_state(seed):
    cfg = build_config({"model": model, "run": {"seed": seed}})
    m = build_model(cfg, torch.device("cpu"))
    parallelize(m, mesh, activation_checkpointing=False, compile=False)
    return TrainState(m, build_optimizer(m, cfg.train), seed, mesh=mesh)

def checkpointer():
    return Checkpointer(root, every=1, keep=3, async_save=True, process_group=pg,
                        writer=rank == 0, key=b"job",
                        on_rejected=lambda step, path, reason: rejected.append([step, reason]))

def digest(state):
    tensors, meta = state.flat()
    return state_digest(tensors, {"step": meta["step"], "cursor": meta["cursor"]})

state, ck, saved = sharded_state(0), checkpointer(), {}
params = list(state.model.parameters())
for _ in range(2):
    for p in params:
        p.grad = p.detach() * 0.01 + 0.001
    apply_update(params, state.optimizer, 1e-3, 1.0)
    state.step += 1
    state.cursor += 4
    if rank == 0:  # rank 1 writes into the directory first: the writer's clearing must not lose it
        time.sleep(0.5)
    ck.save(state)
    saved[state.step] = digest(state)
ck.wait()
dist.barrier(group=pg)
files = sorted(json.loads((checkpoint_dir(root, 2) / "MANIFEST.json").read_text())["files"])
if rank == 0:  # damage the file that only rank 1 hashes
    data = bytearray((checkpoint_dir(root, 2) / "__1_0.distcp").read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    (checkpoint_dir(root, 2) / "__1_0.distcp").write_bytes(bytes(data))
dist.barrier(group=pg)
fresh = sharded_state(1)
step = checkpointer().restore_latest(fresh)
out.write_text(json.dumps({"saved": saved[1], "step": step, "restored": digest(fresh),
                           "rejected": rejected, "files": files}))
dist.barrier(group=pg)
dist.destroy_process_group()
"""


def _run_ranks(tmp_path: Path, root: Path, ranks: int = 2) -> list[dict]:
    """Run ``_RANK_SCRIPT`` as the ``ranks`` ranks of one group (torchrun environment)."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, outs = [], []
    for rank in range(ranks):
        out = tmp_path / f"rank-{rank}.json"
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(root), str(out), json.dumps(TINY)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outs.append(out)
    try:
        for p in procs:
            log, _ = p.communicate(timeout=180)
            assert p.returncode == 0, log.decode()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(o.read_text()) for o in outs]


def test_sharded_checkpoint_damaged_in_one_ranks_share_falls_back_on_every_rank(
        tmp_path: Path) -> None:
    """2 ranks, FSDP2 (DTensor shards), async saves with a token. Rank 1 alone hashes
    ``__1_0.distcp``; damage there must make *both* ranks skip step 2 and load step 1. Rank 1
    reaches each save first: its digest file must survive the writer's clearing of the
    directory (it did not, and rank 0 then waited in DCP's collectives for ~100 s)."""
    root = tmp_path / "ckpt"
    ranks = _run_ranks(tmp_path, root)
    for r in ranks:
        assert r["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "state-digest-r0.json",
                              "state-digest-r1.json"]
        assert r["step"] == 1
        assert r["restored"] == r["saved"]  # this rank's shard of step 1, bit for bit
        assert [step for step, _ in r["rejected"]] == [2]
    assert "__1_0.distcp" in ranks[1]["rejected"][0][1]
    assert "another rank" in ranks[0]["rejected"][0][1]
    assert (root / "rejected-step-00000002").is_dir()
    assert [s for s, _ in valid_checkpoints(root)] == [1]


def test_the_final_step_is_saved_once_and_the_jobs_history_replaces_a_given_up_one(tmp_path) -> None:
    """Two histories reach the last step: a group committed it alone and left before the
    coordinator heard of it (its checkpoint lands first); the others redid that step in another
    quorum. A second save of the step keeps what is on disk, unless its caller's history is
    the job's (``job_history``: the coordinator's last quorum confirmed it): then the given-up
    history's checkpoint is replaced, and a group restarted afterwards resumes the job's state."""
    given_up, job = _state(seed=1), _state(seed=2)
    for st, chain in ((given_up, "a" * 64), (job, "b" * 64)):
        _advance(st, steps=3)
        st.chain = chain
    ck = Checkpointer(tmp_path, every=0, keep=2)
    assert ck.save_once(given_up)
    assert not ck.save_once(job)  # unconfirmed: the checkpoint on disk stays
    assert not ck.save_once(given_up, job_history=True)  # the same history: nothing to do
    assert ck.save_once(job, job_history=True)
    assert not ck.save_once(job, job_history=True)
    assert not ck.save_once(given_up)  # a late given-up save never replaces the job's
    resumed = _state(seed=3)
    assert ck.restore_latest(resumed) == 3
    assert resumed.chain == job.chain and _digest(resumed) == _digest(job)
