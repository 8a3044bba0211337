"""Fault paths of the step protocol that only real processes walk.

The protocol simulation (tests/sim) visits thousands of fault schedules; these tests check that
the processes, signals and timeouts around it agree with it: a rank that hangs while its leader's
heartbeat lives is declared hung by progress, and a job whose every group died resumes from its
newest durable checkpoint through an explicit, logged restore.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ftlm.config import build_config
from ftlm.launch.local import LocalLauncher
from ftlm.observe.events import read_events

sys.path.insert(0, str(Path(__file__).parent))
from test_fault_tolerance import (ALL_IN_FIRST_QUORUM, CATCH_UP_FROM_PEERS, WAIT_FOR_PEERS,  # noqa: E402
                                  injected)


def config(run_dir: Path, data_dir: Path, steps: int, ft: dict | None = None, **sections: dict):
    raw = {
        "run": {"name": "proto", "dir": str(run_dir), "seed": 5},
        "model": {"size": "tiny", "vocab_size": 1024, "dim": 64, "n_layers": 2, "n_heads": 4,
                  "n_kv_heads": 2, "ffn_dim": 128, "max_seq_len": 64},
        "data": {"dir": str(data_dir), "seq_len": 64, "prefetch": 2},
        "train": {"steps": steps, "batch_size": 4, "lr": 3e-3, "warmup_steps": 5, "threads": 1},
        "ft": {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0, "join_timeout": 2.0,
               "allreduce_timeout": 4.0, "progress_timeout": 8.0, "quorum_timeout": 40.0,
               "give_up_seconds": 120.0, "restart_delay": 0.2, "bucket_bytes": 65536, **(ft or {})},
        "observe": {"progress": False},
    }
    for name, body in sections.items():
        raw.setdefault(name, {}).update(body)
    return build_config(raw)


@pytest.mark.slow  # the same fault as tests/launch/test_hsdp.py's slow test; pure tests cover the rule
def test_a_hung_non_leader_rank_is_declared_hung_and_the_healthy_group_goes_on(tmp_path, demo_data):
    """Defect 3: rank 1 of g1 stops inside the commit vote; g1's leader keeps heartbeating while
    it waits for that rank. Before, "1 of 2, not a majority" repeated until the healthy group gave
    up. Now the coordinator declares g1 hung after ft.progress_timeout, g0 trains on, the
    supervisor kills g1 and its new incarnation catches up."""
    cfg = config(tmp_path / "run", demo_data, steps=80, ft=ALL_IN_FIRST_QUORUM,
                 checkpoint=CATCH_UP_FROM_PEERS)
    summary = LocalLauncher(cfg, groups=2, ranks_per_group=2, progress=False,
                            faults={"g1.r1": ["hang:before_commit@8+"]}).run()  # (+: g1 may start late)
    events = read_events(cfg.run.path / "events.jsonl")
    assert injected(events, "g1") == ["before_commit"]
    assert [e["rank"] for e in events if e["kind"] == "failure_injected"] == [1]
    hung = [e for e in events if e["kind"] == "member_dead" and "no progress" in e.get("reason", "")]
    assert hung and hung[0]["target"] == "g1", [e for e in events if e["kind"] == "member_dead"]
    # g0 committed steps while g1 was hung, before g1's next incarnation came back.
    declared = hung[0]["ts"]
    back = min(e["ts"] for e in events if e["kind"] == "recovery_end" and e.get("ok") and e["group"] == "g1")
    assert any(e["kind"] == "commit" and e["group"] == "g0" and declared < e["ts"] < back for e in events)
    assert summary["replicas_identical"] and len(summary["state_hashes"]) == 2, summary["state_hashes"]
    assert summary["data"]["duplicates"] == 0 and summary["data"]["gaps"] == 0, summary["data"]


def test_every_group_dead_resumes_from_the_newest_durable_checkpoint(tmp_path, demo_data):
    """Defect 9: when no live group holds the newest state the job rolls back, explicitly, to the
    newest intact durable checkpoint the restarted groups loaded, with exactly-once data from its
    cursor, instead of refusing to go on. ``min_replicas=2``: both groups train every step from
    the first one, so both hold step 12 when they die there, whatever the machine's speed (a
    group that started late was still recovering, or had not started, at step 12)."""
    cfg = config(tmp_path / "run", demo_data, steps=40, ft={"min_replicas": 2, **WAIT_FOR_PEERS},
                 checkpoint={"every": 5, "keep": 3, "async_save": False})
    summary = LocalLauncher(cfg, groups=2, progress=False,
                            faults={"g0": ["before_commit@12"], "g1": ["before_commit@12"]}).run()
    events = read_events(cfg.run.path / "events.jsonl")
    assert injected(events, "g0") == injected(events, "g1") == ["before_commit"], _timeline(events)
    restores = [e for e in events if e["kind"] == "restore"]
    assert [(r["from_step"], r["to_step"]) for r in restores] == [(12, 10)], _timeline(events)
    assert summary["replicas_identical"] and len(summary["state_hashes"]) == 2, summary["state_hashes"]
    assert summary["data"]["duplicates"] == 0 and summary["data"]["gaps"] == 0, summary["data"]
    assert summary["steps_committed"] == 40


def test_a_live_group_behind_loads_the_newest_checkpoint_before_the_rollback(tmp_path, demo_data):
    """Session 8: g1 restarted behind the job and pulls g0's state over a slow link; g0 writes a
    checkpoint meanwhile and dies while serving. g1, alive but behind, is told that no live group
    holds the newest state, loads that checkpoint, and the job goes on from it: before, the
    rollback went back to g1's older state although a newer checkpoint was on disk."""
    # min_replicas=2: g0 waits for g1's next incarnation instead of racing to the end alone.
    cfg = config(tmp_path / "run", demo_data, steps=40, ft={"min_replicas": 2, **WAIT_FOR_PEERS},
                 checkpoint={"every": 5, "keep": 3, "async_save": False})
    # g0's first serve holds until g0 committed 8 more steps (a checkpoint among them), then it dies.
    summary = LocalLauncher(cfg, groups=2, progress=False,
                            faults={"g0": ["slow_serve,during_serve"], "g1": ["before_commit@2"]},
                            extra_env={"FTLM_FAULT_STEPS": "8", "FTLM_FAULT_SECONDS": "60"}).run()
    events = read_events(cfg.run.path / "events.jsonl")
    assert injected(events, "g1") == ["before_commit"], _timeline(events)
    assert injected(events, "g0") == ["slow_serve", "during_serve"], _timeline(events)
    reloaded = [e for e in events if e["kind"] == "checkpoint_reloaded"]
    assert reloaded and reloaded[0]["group"] == "g1" and reloaded[0]["step"] > reloaded[0]["from_step"], \
        _timeline(events)
    for r in (e for e in events if e["kind"] == "restore"):  # none gives up a checkpoint on disk
        newest = max(e["step"] for e in events if e["kind"] == "checkpoint_saved" and e["ts"] < r["ts"])
        assert r["to_step"] >= newest, _timeline(events)
    assert summary["replicas_identical"] and len(summary["state_hashes"]) == 2, summary["state_hashes"]
    assert summary["data"]["duplicates"] == 0 and summary["data"]["gaps"] == 0, summary["data"]
    assert summary["steps_committed"] == 40


def _timeline(events: list[dict]) -> str:
    """What decided a rollback, for the failure message: who started where, who died and why,
    what each restore chose (seen once under load: (12, 0) before (12, 10), with nothing else
    kept; a live group still at step 0, restarted early and recovering, is one explanation)."""
    kinds = {"group_start", "member_dead", "failure_injected", "restore", "recovery_start",
             "recovery_end", "checkpoint_saved", "checkpoint_rejected", "checkpoint_reloaded", "group_exit"}
    t0 = min((e["ts"] for e in events), default=0.0)
    return "\n".join(
        f"{e['ts'] - t0:8.3f} {e['kind']:<20} {e.get('group')} step={e.get('step')} "
        + " ".join(f"{k}={e[k]}" for k in ("from_step", "to_step", "holders", "reason", "target")
                   if k in e)
        for e in sorted(events, key=lambda e: e["ts"]) if e["kind"] in kinds)
