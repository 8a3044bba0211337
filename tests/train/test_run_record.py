"""The record of a run directory is moved aside, never erased (``ftlm.train.run_record``), and
``ftlm train`` alone does so at a fresh start instead of appending a new run to the old record."""

from __future__ import annotations

import json
import shutil

import pytest

from ftlm.cli import main
from ftlm.config import save_config
from ftlm.observe.events import EventLog, read_events
from ftlm.train.run_record import PREVIOUS, archive, last_committed_step, set_aside


def test_archive_moves_what_exists_into_a_new_folder_each_time(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "summary.json").write_text("{}")
    first = archive(tmp_path, ("events.jsonl", "summary.json", "logs"), now=0.0)
    assert first == tmp_path / PREVIOUS / "19700101T000000Z"
    assert [p.name for p in first.iterdir()] == ["summary.json"]  # an empty logs/ is no record
    (tmp_path / "summary.json").write_text("{}")
    assert archive(tmp_path, ("summary.json",), now=0.0).name == "19700101T000000Z-2"
    assert archive(tmp_path, ("summary.json",), now=0.0) is None


def test_starting_over_leaves_checkpoints_token_and_config_in_place(tmp_path):
    for name in ("token", "config.toml", "checkpoints/step-00000002/COMPLETE", "events.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x\n" if name != "events.jsonl" else "")
    line = set_aside(tmp_path, resume_step=None)
    assert "starting over at step 0" in line and "no committed step" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "config.toml", PREVIOUS, "token"]
    assert set_aside(tmp_path, resume_step=None) is None  # nothing left to move


def test_last_committed_step_survives_a_torn_last_line(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path, group="g0") as events:
        for step in range(3):
            events.emit("commit", step=step)
    with open(path, "ab") as f:
        f.write(b'{"ts": 1, "kind": "commit", "st')
    assert last_committed_step(path) == 2
    assert last_committed_step(tmp_path / "missing.jsonl") is None


def test_standalone_train_starting_over_moves_the_earlier_run_aside(tmp_path, make_tiny_config,
                                                                  monkeypatch, capsys):
    """Without a checkpoint, a second ``ftlm train`` into the same directory appended its run to
    the first one's events.jsonl (every sample then counted twice) and replaced its model."""
    monkeypatch.delenv("FTLM_COORDINATOR", raising=False)
    monkeypatch.delenv("FTLM_TOKEN", raising=False)
    run_dir = tmp_path / "run"
    config = tmp_path / "tiny.toml"
    save_config(make_tiny_config(run_dir, train={"steps": 3}), config)
    assert main(["train", str(config)]) == 0
    first = read_events(run_dir / "events.jsonl")
    shutil.rmtree(run_dir / "checkpoints")  # as after a Ctrl-C before any checkpoint
    assert main(["train", str(config)]) == 0
    assert "starting over at step 0" in capsys.readouterr().err
    (previous,) = (run_dir / PREVIOUS).iterdir()
    assert read_events(previous / "events.jsonl") == first
    assert json.loads((previous / "summary.json").read_text())["steps_committed"] == 3
    again = read_events(run_dir / "events.jsonl")
    assert [e["step"] for e in again if e["kind"] == "commit"] == [0, 1, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["data"]["duplicates"] == 0, summary["data"]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
