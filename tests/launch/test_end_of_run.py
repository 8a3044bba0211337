"""The ends of a job under faults, with real processes: a group hung while it starts, a group that
comes back after every other group finished and left.

Each ends as a user expects: the launch succeeds, every group holds the job's final state, and
``model.safetensors`` holds the final step.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from ftlm.config import build_config
from ftlm.launch.local import LocalLauncher
from ftlm.observe.events import read_events
from ftlm.train.model_file import read_stamp


def _config(run_dir: Path, data_dir: Path, steps: int, ft: dict | None = None):
    return build_config({
        "run": {"name": "end", "dir": str(run_dir), "seed": 3},
        "model": {"size": "tiny", "vocab_size": 1024, "dim": 64, "n_layers": 2, "n_heads": 4,
                  "n_kv_heads": 2, "ffn_dim": 128, "max_seq_len": 64},
        "data": {"dir": str(data_dir), "seq_len": 64, "prefetch": 2},
        "train": {"steps": steps, "batch_size": 4, "lr": 3e-3, "warmup_steps": 5, "threads": 1},
        "checkpoint": {"every": 0},  # as configs/tiny.toml ships
        "ft": {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0, "join_timeout": 2.0,
               "allreduce_timeout": 5.0, "quorum_timeout": 8.0, "give_up_seconds": 90.0,
               "restart_delay": 0.2, "bucket_bytes": 65536, **(ft or {})},
        "observe": {"progress": False},
    })


def _ended_well(summary: dict, run_dir: Path, groups: int, steps: int) -> None:
    assert summary["problems"] == [], summary["problems"]
    assert summary["replicas_identical"] and len(summary["state_hashes"]) == groups
    assert set(summary["final_steps"].values()) == {steps}, summary["final_steps"]
    assert summary["lost_groups"] == []
    assert read_stamp(run_dir / "model.safetensors").step == steps


def test_a_group_stopped_while_it_starts_is_found_in_seconds(tmp_path, demo_data):
    """A group SIGSTOPped before it registered was found only by ``ft.startup_timeout`` (120 s):
    its start-up beacon stops, and the launcher kills and restarts it within
    ``ft.startup_stall_timeout``. The stop lands at the worst moment: before the group's first
    heartbeat, when nothing else can tell it from a slow start."""
    config = _config(tmp_path / "run", demo_data, steps=60,
                     ft={"startup_timeout": 600.0, "startup_stall_timeout": 4.0})
    launcher = LocalLauncher(config, groups=2, progress=False)
    spawn, stopped = launcher._spawn, threading.Event()

    def spawn_then_stop(g, *args):
        spawn(g, *args)
        if g.name == "g1" and not stopped.is_set():
            stopped.set()
            os.kill(g.procs[0].pid, signal.SIGSTOP)  # the launcher's kill ends it (SIGKILL)
            g.cause = "chaos"

    launcher._spawn = spawn_then_stop
    summary = launcher.run()
    events = read_events(config.run.path / "events.jsonl")
    killed = [e for e in events if e["kind"] == "member_killed" and e["target"] == "g1"]
    assert stopped.is_set() and killed, "the stopped group was never killed"
    assert "start-up stalled" in killed[0]["reason"], killed[0]
    started = min(e["ts"] for e in events if e["kind"] == "run_start")
    # (ft.startup_timeout is 600 s: far from any start on a loaded machine, as the stall's 4 s is not)
    assert killed[0]["ts"] - started < config.ft.startup_timeout / 2, "found by the start-up timeout"
    _ended_well(summary, config.run.path, 2, 60)


def test_a_group_back_after_every_other_group_left_ends_with_the_final_state(tmp_path, demo_data):
    """With ``checkpoint.every = 0`` a group that came back after the others had finished and
    left had nothing to rejoin: it was lost and the launch failed ("no final state from g1"). The
    last step is always made durable: it resumes there, trains nothing, and ends holding the
    job's final state."""
    steps = 30
    config = _config(tmp_path / "run", demo_data, steps=steps)
    config.ft.min_replicas = 1
    launcher = LocalLauncher(config, groups=2, progress=False, start_delays={"g1": 0.0})
    restart_due = launcher._restart_due
    g0 = launcher.groups[0]

    def start_once_g0_has_left(events, config_file, url, now):
        g1 = launcher.groups[1]
        if g1.restart_at is not None and not g0.finished:
            g1.restart_at = now + 0.1  # held back until g0 has finished and exited
        restart_due(events, config_file, url, now)

    launcher._restart_due = start_once_g0_has_left
    summary = launcher.run()
    events = read_events(config.run.path / "events.jsonl")
    assert [e for e in events if e["kind"] == "group_lost"] == []
    g1_start = [e for e in events if e["kind"] == "group_start" and e["group"] == "g1"]
    assert g1_start and g1_start[0]["step"] == steps, "g1 did not resume at the final step"
    _ended_well(summary, config.run.path, 2, steps)
    # g0 waited for the others at the end for its quorum timeout, then left: it did not wait
    # again, nor until the launcher gave up (bounds from the config, not the machine's speed).
    last = max(e["ts"] for e in events if e["kind"] == "commit" and e["group"] == "g0")
    left = min(e["ts"] for e in events if e["kind"] == "member_left" and e.get("target") == "g0"
               and e["ts"] > last)
    assert left - last < 2 * config.ft.quorum_timeout, left - last
    # g0 waited ft.quorum_timeout (8 s) alone at the end: it asked again less and less often
    # while nothing changed (it asked every 0.25 s: about 30 quorum rounds).
    waiting = [e for e in events if e["kind"] == "quorum" and e["step"] == steps
               and e["ts"] < g1_start[0]["ts"]]
    assert 2 <= len(waiting) <= 10, len(waiting)


def test_the_watchdog_reads_each_ranks_start_up_beacon(tmp_path):
    """A rank whose beacon stopped (or never appeared) for ``ft.startup_stall_timeout`` hangs
    its group's start, named with the phase it stopped in; a rank that keeps it fresh does not,
    however long it takes; once the group made progress, the beacon no longer counts."""
    from ftlm.launch.group_process import GroupProcess
    config = _config(tmp_path / "run", tmp_path, steps=10, ft={"startup_stall_timeout": 5.0})
    launcher = LocalLauncher(config, groups=1, progress=False)
    (launcher.run_dir / "logs").mkdir(parents=True)
    g = GroupProcess("g0", procs=[object(), object()], started=1000.0)
    now = 1000.0 + 60
    assert "rank 0 showed no sign of life for 60 s (while starting the interpreter" in \
        launcher._stalled_start(g, now)
    for rank in (0, 1):
        g.beacon(launcher.run_dir, rank).write_text("loading data\n")
        os.utime(g.beacon(launcher.run_dir, rank), (now - 1, now - 1))
    assert launcher._stalled_start(g, now) == ""
    os.utime(g.beacon(launcher.run_dir, 1), (now - 7, now - 7))
    assert "rank 1 showed no sign of life for 7 s (while loading data" in launcher._stalled_start(g, now)
    launcher.config.ft.startup_stall_timeout = 0.0
    assert launcher._stalled_start(g, now) == ""


@pytest.mark.slow
def test_a_non_leader_rank_stopped_while_it_starts_is_found_in_seconds(tmp_path, demo_data):
    """A non-leader rank hung during start-up took 105 s to find (its leader's store connection
    gave up first): its own beacon stops, whoever leads its group."""
    config = _config(tmp_path / "run", demo_data, steps=40,
                     ft={"startup_timeout": 600.0, "startup_stall_timeout": 4.0})
    launcher = LocalLauncher(config, groups=2, ranks_per_group=2, progress=False)
    spawn, stopped = launcher._spawn, threading.Event()

    def spawn_then_stop(g, *args):
        spawn(g, *args)
        if g.name == "g1" and not stopped.is_set():
            stopped.set()
            os.kill(g.procs[1].pid, signal.SIGSTOP)
            g.cause = "chaos"

    launcher._spawn = spawn_then_stop
    summary = launcher.run()
    events = read_events(config.run.path / "events.jsonl")
    killed = [e for e in events if e["kind"] == "member_killed" and e["target"] == "g1"]
    assert stopped.is_set() and killed and "rank 1 showed no sign of life" in killed[0]["reason"]
    _ended_well(summary, config.run.path, 2, 40)
