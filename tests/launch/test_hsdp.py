"""HSDP: FSDP2 inside each replica group (2 ranks, gloo), fault tolerance across groups."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ftlm.config import save_config
from ftlm.launch.local import LocalLauncher
from ftlm.observe.events import read_events
from ftlm.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from test_fault_tolerance import (ALL_IN_FIRST_QUORUM, CATCH_UP_FROM_PEERS,  # noqa: E402
                                  STARVED_HEARTBEATS_TOLERATED, WAIT_FOR_PEERS,
                                  check_invariants, commits_while_down, make_config, recovered)


def start_torchrun_like(path: Path, ranks: int) -> list[subprocess.Popen]:
    """Start ``ranks`` processes of ``ftlm train path`` with the torchrun environment (no FT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.pop("FTLM_COORDINATOR", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "ftlm.cli", "train", str(path)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def run_torchrun_like(config, ranks: int, timeout: float = 300) -> None:
    """Run ``ranks`` processes of ``ftlm train`` with the torchrun environment (no FT) to the end."""
    path = config.run.path / "input.toml"
    save_config(config, path)
    procs = start_torchrun_like(path, ranks)
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0, out.decode()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_hsdp_2x2_matches_one_group_of_2_and_a_single_process(tmp_path, demo_data):
    steps, per_group = 30, 8
    hsdp = make_config(tmp_path / "hsdp", demo_data, steps=steps,
                       ft={"min_replicas": 2, **WAIT_FOR_PEERS}, batch_size=per_group)
    summary = LocalLauncher(hsdp, groups=2, ranks_per_group=2, progress=False).run()
    events = read_events(hsdp.run.path / "events.jsonl")
    check_invariants(summary, events, 2, steps=steps)
    # GPU-hours count both ranks of each group (the launcher records the group size).
    assert [e["ranks_per_group"] for e in events if e["kind"] == "run_start"] == [2]
    # The same global batches: one group of 2 ranks, and one process, each taking 2 x 8 samples.
    fsdp = make_config(tmp_path / "fsdp", demo_data, steps=steps, batch_size=2 * per_group)
    run_torchrun_like(fsdp, ranks=2)
    single = make_config(tmp_path / "single", demo_data, steps=steps, batch_size=2 * per_group)
    Trainer.for_run(single).train()
    ref = load_file(single.run.path / "model.safetensors")
    for other in (hsdp, fsdp):
        weights = load_file(other.run.path / "model.safetensors")
        for name in ref:
            torch.testing.assert_close(weights[name], ref[name], rtol=1e-3, atol=1e-4)


def test_hsdp_rank_killed_group_restarts_and_recovers_shard_by_shard(tmp_path, demo_data):
    # g1's restart may come after g0 reached the last step (14 s at a load of 3): g0 then waits
    # for it at the end and serves it (CATCH_UP_FROM_PEERS).
    config = make_config(tmp_path / "run", demo_data, steps=250, ft=ALL_IN_FIRST_QUORUM,
                         checkpoint=CATCH_UP_FROM_PEERS)
    summary = LocalLauncher(config, groups=2, ranks_per_group=2, progress=False,
                            faults={"g1.r1": ["before_allreduce@10+"]}).run()  # (+: g1 may start late)
    events = read_events(config.run.path / "events.jsonl")
    injected = [e for e in events if e["kind"] == "failure_injected"]
    assert [(e["group"], e["rank"], e["point"]) for e in injected] == [("g1", 1, "before_allreduce")]
    rec = recovered(events, "g1")
    assert rec, "the restarted group never caught up"
    assert commits_while_down(events, "g1") > 0, "the healthy group stopped"
    check_invariants(summary, events, 2, steps=250)
    # Every rank's shard equals its peer's: the group hash is over both ranks' hashes.
    assert summary["state_hashes"]["g0"] == summary["state_hashes"]["g1"]


def test_a_stop_request_reaching_one_rank_stops_its_whole_group_gracefully(tmp_path, demo_data):
    """A preemption notice (SIGTERM) reaches the ranks of a group each at its own moment; here
    only one rank gets it, mid-step (after its commit vote): rank 1 of g1's first incarnation,
    then rank 0 of its second. A rank that stopped on its own left the other waiting in a
    collective until the group was killed as hung (the slow Slurm USR2 test's rare hang): each
    time the group must stop as one, leave the quorum, exit 0 and come back as a new
    incarnation. ``min_replicas=2`` keeps g0 waiting for g1, so that its second incarnation
    trains past step 15 too; that incarnation may still be catching up at step 15 on a loaded
    machine, so its stop comes at step 15 or its first commit vote after it (``@15+``)."""
    steps = 40
    config = make_config(tmp_path / "run", demo_data, steps=steps,
                         ft={"min_replicas": 2, **WAIT_FOR_PEERS,
                             **STARVED_HEARTBEATS_TOLERATED})
    summary = LocalLauncher(config, groups=2, ranks_per_group=2, progress=False,
                            faults={"g1.r1": ["term:before_commit@5+"],
                                    "g1": ["", "term:before_commit@15+"]}).run()
    events = read_events(config.run.path / "events.jsonl")
    # A stop request logs no event: the signalled ranks' logs say where each one came.
    logs = "".join(config.run.path.joinpath("logs", name).read_text() for name in ("g1.r1.log", "g1.log"))
    signalled = [int(step) for step in re.findall(r"FTLM_FAULT: sending SIGTERM to this process at "
                                                  r"before_commit of step (\d+)", logs)]
    assert len(signalled) == 2 and signalled[0] == 5 and signalled[1] >= 15, signalled
    exits = [e for e in events if e["kind"] == "group_exit" and e.get("target") == "g1"]
    assert [(e["ok"], e.get("preempted")) for e in exits] == [(True, True)] * 2 + [(True, None)], exits
    assert not [e for e in events if e["kind"] == "member_dead" and e.get("target") == "g1"]
    left = [e for e in events if e["kind"] == "member_left" and e.get("target") == "g1"]
    assert [e["reason"] for e in left] == ["stopped", "stopped", "finished"], left
    # The signalled rank's step (it had voted) and at most one more, on both ranks together.
    for step, stop in zip(signalled, left):
        last = max(e["step"] for e in events if e["kind"] == "commit" and e["group"] == "g1"
                   and e["ts"] <= stop["ts"])
        assert last in (step, step + 1), (step, last)
    assert summary["restarts"]["g1"] == 2
    check_invariants(summary, events, 2, steps=steps)


# Rank 0 in the slow tier: the default tier's stop reaches a non-leader rank here, and rank 0 and
# rank 1 in turn in test_a_stop_request_reaching_one_rank_stops_its_whole_group_gracefully.
@pytest.mark.parametrize("rank", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_without_fault_tolerance_a_sigterm_to_one_rank_stops_both(tmp_path, demo_data, rank):
    """The same for one FSDP group of 2 ranks without fault tolerance (torchrun): the rank that
    gets SIGTERM and its peer finish the same step, save the same model and exit 0."""
    config = make_config(tmp_path / "fsdp", demo_data, steps=100000, batch_size=8)
    path = config.run.path / "input.toml"
    save_config(config, path)
    events_path = config.run.path / "events.jsonl"
    procs = start_torchrun_like(path, ranks=2)
    try:
        for _ in range(2400):  # bounded: 240 s (a start at a load of 10 takes tens of seconds)
            if events_path.is_file() and events_path.read_text().count('"commit"') >= 3:
                break
            assert all(p.poll() is None for p in procs), "a rank exited before training"
            threading.Event().wait(0.1)
        os.kill(procs[rank].pid, signal.SIGTERM)
        outs = [p.communicate(timeout=90)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs[rank][-2000:] + outs[1 - rank][-2000:]
    events = read_events(events_path)
    exits = [e for e in events if e["kind"] == "group_exit"]
    assert exits and exits[-1]["ok"] and exits[-1]["step"] < 100000, exits
    assert (config.run.path / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hung_non_leader_rank_is_detected_by_lack_of_progress_and_its_group_restarts(tmp_path,
                                                                                   demo_data):
    """SIGSTOP rank 1 of g1: rank 0 keeps heartbeating while it waits for rank 1 forever, so only
    the progress timeout can tell; the supervisor must then kill both ranks and restart g1."""
    config = make_config(tmp_path / "run", demo_data, steps=600,
                         ft={"progress_timeout": 10.0, **WAIT_FOR_PEERS}, checkpoint=CATCH_UP_FROM_PEERS)
    launcher = LocalLauncher(config, groups=2, ranks_per_group=2, progress=False)
    events_path = config.run.path / "events.jsonl"
    done = threading.Event()

    def hang_rank_1_of_g1() -> None:
        for _ in range(3000):  # bounded: 300 s
            if done.wait(0.1):
                return
            if events_path.exists() and events_path.read_text().count('"commit"') >= 40:
                os.kill(launcher.groups[1].procs[1].pid, signal.SIGSTOP)
                return

    thread = threading.Thread(target=hang_rank_1_of_g1, daemon=True)
    thread.start()
    summary = launcher.run()
    done.set()
    thread.join(timeout=10)
    events = read_events(events_path)
    dead = [e for e in events if e["kind"] == "member_dead" and e.get("target") == "g1"]
    assert dead and "progress" in dead[0]["reason"], dead
    assert summary["restarts"]["g1"] == 1
    assert recovered(events, "g1"), "the restarted group never caught up"
    check_invariants(summary, events, 2, steps=600)


def test_sharded_checkpoint_save_and_restore_with_2_ranks_is_bitwise(tmp_path, demo_data):
    full = make_config(tmp_path / "full", demo_data, steps=20)
    full.checkpoint.every, full.checkpoint.keep = 10, 3
    run_torchrun_like(full, ranks=2)
    # A second run starts from the step-10 checkpoint of the first, sharded over 2 ranks again.
    resumed = make_config(tmp_path / "resumed", demo_data, steps=20)
    resumed.checkpoint.every, resumed.checkpoint.keep = 10, 3
    (resumed.run.path / "checkpoints").mkdir(parents=True)
    shutil.copytree(full.run.path / "checkpoints" / "step-00000010",
                    resumed.run.path / "checkpoints" / "step-00000010")
    run_torchrun_like(resumed, ranks=2)
    losses = {}
    for name, cfg in (("full", full), ("resumed", resumed)):
        losses[name] = {e["step"]: e["loss"] for e in read_events(cfg.run.path / "events.jsonl")
                        if e["kind"] == "commit"}
    assert sorted(losses["resumed"]) == list(range(10, 20))
    assert all(losses["resumed"][s] == losses["full"][s] for s in range(10, 20))
    a = load_file(full.run.path / "model.safetensors")
    b = load_file(resumed.run.path / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((resumed.run.path / "summary.json").read_text())["steps_committed"] == 10


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_diloco_groups_sharded_with_fsdp2_lose_a_rank_and_recover_the_outer_state(tmp_path, demo_data):
    """HSDP inside DiLoCo workers: 2 groups x 2 ranks (FSDP2 over each group), H=4 inner steps
    per synchronisation; rank 1 of g1 is killed at an outer all-reduce, the group restarts and
    recovers the outer state shard by shard from g0 while g0 trains on alone. About 25 s on an
    idle 2-core box (slow tier: four processes importing torch). The default tier covers DiLoCo
    on one rank (tests/train/test_diloco.py) and HSDP recovery (above)."""
    steps, h = 40, 4
    config = make_config(tmp_path / "run", demo_data, steps=steps,
                         ft={**ALL_IN_FIRST_QUORUM, "sync": "diloco", "diloco_inner_steps": h},
                         checkpoint=CATCH_UP_FROM_PEERS)
    summary = LocalLauncher(config, groups=2, ranks_per_group=2, progress=False,
                            faults={"g1.r1": ["before_allreduce@5+"]}).run()
    events = read_events(config.run.path / "events.jsonl")
    assert [(e["group"], e["rank"]) for e in events if e["kind"] == "failure_injected"] == [("g1", 1)]
    assert recovered(events, "g1"), "the restarted group never caught up"
    assert commits_while_down(events, "g1") > 0, "the healthy group stopped"
    check_invariants(summary, events, 2, steps=steps)
    commits = [e for e in events if e["kind"] == "commit"]
    # Each outer step commits its inner steps' samples: participants x H x batch.
    assert all(e["samples"][1] - e["samples"][0] == e["participants"] * h * 4 for e in commits)
    assert summary["state_hashes"]["g0"] == summary["state_hashes"]["g1"]
