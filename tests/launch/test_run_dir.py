"""The run directory of ``launch local``: one launch at a time (its lock), a record that is never
erased (a launch that starts over moves the earlier one into ``previous/``), a resume point the
groups agree with (a checkpoint they reject is not it), and a stop on request that is not a
failed run.

Most tests drive ``LocalLauncher``'s set-up and end directly; one runs the real command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ftlm.cli import main
from ftlm.config import build_config, save_config
from ftlm.errors import DataError
from ftlm.launch.group_process import GroupProcess
from ftlm.launch.local import LocalLauncher
from ftlm.train.job_token import run_id
from ftlm.train.job_token import run_token as _run_token
from ftlm.launch.run_lock import LOCK_FILE, RunDirInUse, lock_run_dir
from ftlm.observe.events import EventLog, read_events
from ftlm.train.checkpoint import Checkpointer
from ftlm.train.model_file import MODEL_FILE, read_stamp, stamp_metadata
from ftlm.train.optim import build_optimizer
from ftlm.train.run_record import PREVIOUS
from ftlm.train.state import TrainState
from ftlm.train.trainer import build_model

TINY = {"size": "tiny", "vocab_size": 1024, "dim": 64, "n_layers": 2, "n_heads": 4,
        "n_kv_heads": 2, "ffn_dim": 128, "max_seq_len": 64}


def launcher(run_dir: Path, steps: int = 100, **checkpoint) -> LocalLauncher:
    config = build_config({"run": {"dir": str(run_dir)}, "model": TINY, "train": {"steps": steps},
                           "checkpoint": {"every": 0, **checkpoint}})
    return LocalLauncher(config, groups=1, progress=False)


def commits(path: Path, steps: range) -> None:
    with EventLog(path, group="g0") as events:
        events.emit("run_start", step=-1)
        for step in steps:
            events.emit("commit", step=step, samples=[4 * step, 4 * step + 4], tokens=256)


def stamped_model(path: Path, step: int) -> None:
    save_file({"w": torch.zeros(2)}, str(path), metadata=stamp_metadata(step, f"chain{step}"))


def save_checkpoints(run_dir: Path, steps: list[int]) -> Path:
    """Real checkpoints of the tiny model at ``steps``, signed with the run directory's token."""
    cfg = build_config({"model": TINY})
    model = build_model(cfg, torch.device("cpu"))
    state = TrainState(model, build_optimizer(model, cfg.train), 0)
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    ck = Checkpointer(root, every=1, keep=10, async_save=False, key=_run_token(run_dir).encode(),
                      run=run_id(run_dir))
    for step in steps:
        state.step, state.cursor = step, 4 * step
        ck.save(state)
    return root


def flip_a_byte(checkpoint: Path) -> None:
    data = sorted(checkpoint.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


# -- one launch at a time ---------------------------------------------------------------------

def test_a_launch_into_a_run_directory_in_use_is_refused_before_touching_it(tmp_path, capsys):
    """The testers' second launch, 8 s after the first, erased its events.jsonl: now it exits 2
    with one line naming the running launch, and the directory is as it was."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    commits(run_dir / "events.jsonl", range(3))
    before = (run_dir / "events.jsonl").read_bytes()
    config = tmp_path / "tiny.toml"
    save_config(launcher(run_dir).config, config)
    with lock_run_dir(run_dir, argv=["ftlm", "launch", "local", "first.toml", "--groups", "2"]):
        code = main(["launch", "local", str(config), "--groups", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert f"in use by another launch (pid {os.getpid()}, started " in line, line
    assert "ftlm launch local first.toml --groups 2" in line
    assert f"stop it (kill {os.getpid()})" in line and "choose another run directory" in line
    assert (run_dir / "events.jsonl").read_bytes() == before
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE, "events.jsonl"]


def test_the_lock_of_a_killed_launch_is_gone_with_it(tmp_path):
    """flock dies with its process: a SIGKILLed launch leaves no stale lock to clean up."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from ftlm.launch.run_lock import lock_run_dir; "
         "lock = lock_run_dir(Path(sys.argv[1])); print('locked', flush=True); time.sleep(60)",
         str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirInUse, match=f"pid {holder.pid}"):
            lock_run_dir(run_dir)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    with lock_run_dir(run_dir) as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


# -- the record is never erased -----------------------------------------------------------------

def test_a_launch_that_starts_over_moves_the_earlier_record_into_previous(tmp_path, capsys):
    """tiny.toml as shipped saves no checkpoint: a Ctrl-C and a relaunch started at step 0 and
    the first launch's events.jsonl (64 steps) was deleted."""
    la = launcher(tmp_path / "run")
    run_dir = la.run_dir
    (run_dir / "logs").mkdir(parents=True)
    commits(run_dir / "events.jsonl", range(64))
    for name in ("summary.json", "report.md", "loss.png", "prometheus_targets.json", "logs/g0.log"):
        (run_dir / name).write_text(name)
    stamped_model(run_dir / MODEL_FILE, 64)
    (run_dir / "checkpoints").mkdir()
    token = _run_token(run_dir)
    la._prepare_run_dir()
    (previous,) = (run_dir / PREVIOUS).iterdir()
    assert sorted(p.name for p in previous.iterdir()) == sorted(
        ["events.jsonl", "summary.json", "report.md", "loss.png", "prometheus_targets.json",
         "logs", MODEL_FILE])
    assert (previous / "logs" / "g0.log").read_text() == "logs/g0.log"
    assert len([e for e in read_events(previous / "events.jsonl") if e["kind"] == "commit"]) == 64
    assert read_stamp(previous / MODEL_FILE).step == 64
    assert la._resume_step is None
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(
        ["checkpoints", "token", "run-id", "config.toml", "logs", PREVIOUS])
    assert _run_token(run_dir) == token
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "starting over at step 0" in line and "last committed step 63" in line, line
    assert str(previous) in line


def test_a_relaunch_resuming_behind_the_model_file_sets_the_newer_model_aside(tmp_path, capsys):
    """Resuming from step 4 while model.safetensors holds step 6 is a rollback: the newer
    weights are kept in previous/, the record goes on in events.jsonl."""
    la = launcher(tmp_path / "run", every=2)
    run_dir = la.run_dir
    save_checkpoints(run_dir, [4])
    commits(run_dir / "events.jsonl", range(6))
    stamped_model(run_dir / MODEL_FILE, 6)
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "g0.log").write_text("first launch")
    la._prepare_run_dir()
    assert la._resume_step == 4
    assert len([e for e in read_events(run_dir / "events.jsonl") if e["kind"] == "commit"]) == 6
    assert not (run_dir / MODEL_FILE).exists()
    (previous,) = (run_dir / PREVIOUS).iterdir()
    assert read_stamp(previous / MODEL_FILE).step == 6
    assert (previous / "logs" / "g0.log").read_text() == "first launch"
    line = capsys.readouterr().err
    assert "rolled back to step 4" in line, line


def test_the_resume_point_is_the_newest_checkpoint_the_groups_accept(tmp_path):
    """With the newest checkpoint's data byte-flipped the groups resumed at the older one, but
    run_start and the restore event named the damaged one."""
    la = launcher(tmp_path / "run", every=2)
    root = save_checkpoints(la.run_dir, [2, 4])
    flip_a_byte(root / "step-00000004")
    commits(la.run_dir / "events.jsonl", range(5))
    la._prepare_run_dir()
    assert la._resume_step == 2
    with EventLog(la.run_dir / "events.jsonl", group="supervisor") as events:
        la._mark_resume(events)
    (restore,) = [e for e in read_events(la.run_dir / "events.jsonl") if e["kind"] == "restore"]
    assert (restore["to_step"], restore["from_step"]) == (2, 5)
    assert (root / "step-00000004").is_dir()  # the groups move it aside, and say so


# -- a stop on request ----------------------------------------------------------------------------

def _ended(la: LocalLauncher, hashes: list[str]) -> dict:
    """``la``'s end after 58 of its steps, its groups' final states hashing to ``hashes``."""
    la.groups = [GroupProcess(f"g{i}", result={"state_hash": h}) for i, h in enumerate(hashes)]
    la.run_dir.mkdir(parents=True, exist_ok=True)
    commits(la.run_dir / "events.jsonl", range(58))
    with EventLog(la.run_dir / "events.jsonl", group="supervisor") as events:
        return la._finish(events, 1.0)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_launch_stopped_on_request_passes_on_what_it_committed(tmp_path, signum):
    la = launcher(tmp_path / "run", steps=200)
    handlers = la._install_signals()
    try:
        os.kill(os.getpid(), signum)
        assert la._stop.wait(10)
    finally:
        la._restore_signals(handlers)
    summary = _ended(la, ["same", "same"])
    assert summary["stopped"] == "on request"
    assert summary["problems"] == []
    assert json.loads((la.run_dir / "summary.json").read_text())["stopped"] == "on request"


def test_a_launch_stopped_on_request_still_fails_on_replicas_that_differ(tmp_path):
    la = launcher(tmp_path / "run", steps=200)
    la.stopped_by = "SIGTERM"
    assert [p.split(":")[0] for p in _ended(la, ["one", "two"])["problems"]] == ["replicas differ"]


def test_a_launch_that_ended_on_its_own_short_of_its_steps_fails(tmp_path):
    summary = _ended(launcher(tmp_path / "run", steps=200), ["same", "same"])
    assert "stopped" not in summary
    assert summary["problems"] == ["only 58 of 200 steps committed"]


def test_the_command_refuses_a_second_launch_and_exits_0_when_stopped(tmp_path, make_tiny_config):
    """The real thing: a second ``launch local`` on the running one's directory exits 2 and
    names it; SIGTERM then stops the first, which exits 0 with its record whole."""
    run_dir = tmp_path / "run"
    config = tmp_path / "tiny.toml"
    save_config(make_tiny_config(run_dir, train={"steps": 100_000},
                                 ft={"heartbeat_interval": 0.1, "join_timeout": 1.0}), config)
    cmd = [sys.executable, "-m", "ftlm.cli", "launch", "local", str(config), "--groups", "1"]
    # Each launch in a session of its own: whatever a failed test leaves is killed with it.
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    second = None
    try:
        deadline = time.monotonic() + 120
        while not any(e["kind"] == "commit" for e in _events(run_dir)):
            assert first.poll() is None, first.stderr.read()
            assert time.monotonic() < deadline, "no step committed within 120 s"
            time.sleep(0.2)
        second = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)
        _, second_err = second.communicate(timeout=60)
        assert second.returncode == 2, second_err
        assert f"in use by another launch (pid {first.pid}," in second_err
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        for launch in (first, second):
            if launch is not None:
                try:
                    os.killpg(launch.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                launch.wait(timeout=30)
    assert first.returncode == 0, err
    assert "stopped on request after" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] == "on request" and summary["problems"] == [], summary
    events = read_events(run_dir / "events.jsonl")
    assert [e["kind"] for e in events if e["kind"] in ("run_start", "run_end")] == ["run_start", "run_end"]
    assert not (run_dir / PREVIOUS).exists()


def _events(run_dir: Path) -> list[dict]:
    try:
        return read_events(run_dir / "events.jsonl")
    except DataError:  # not written yet
        return []
