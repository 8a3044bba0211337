"""A 2-node-shaped replica group on one machine: two torchrun agents meeting through one c10d
rendezvous, as the generated Kubernetes Jobs and Slurm scripts start them, under chaos.

g0 is one torchrun with 2 ranks; g1 is two torchrun agents with 1 rank each (``--nnodes=2
--rdzv-backend=c10d``), every rank of one start sharing one ``FTLM_INCARNATION`` as the Slurm
script exports it. A seeded schedule (``FTLM_CHAOS_SEED``) SIGKILLs each of g1's "nodes" and the
whole of g0, one after another. When a g1 node goes, the other goes too (``srun
--kill-on-bad-exit``), and the group starts again (a new rendezvous id and incarnation, what the
watcher's resubmission gives); each victim recovers from the group that kept training, and both
groups end with the same state.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftlm.config import save_config
from ftlm.observe.events import read_events

sys.path.insert(0, str(Path(__file__).parent))
from test_fault_tolerance import make_config  # noqa: E402

TOKEN = "0" * 64


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)  # polling files written by other processes
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _events(path: Path) -> list[dict]:
    return read_events(path) if path.is_file() else []


def _results(logs: list[Path]) -> dict[str, dict]:
    """Rank 0's FTLM_RESULT of each group, from the agents' output."""
    out = {}
    for log in logs:
        for line in log.read_text().splitlines():
            if line.startswith("FTLM_RESULT "):
                result = json.loads(line[len("FTLM_RESULT "):])
                if result.get("rank") == 0:
                    out[log.name.split("-")[0]] = result
    return out


def _step(log: Path, group: str) -> int:
    """The last step a group's rank 0 printed to its console log (0 before the first)."""
    text = log.read_text() if log.is_file() else ""
    return max(map(int, re.findall(rf"\[{group}/0 [^]]*\] info: step (\d+)/", text)), default=0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_node_shaped_group_under_chaos_loses_nodes_and_recovers(tmp_path, demo_data):
    """A seeded schedule of three faults: each node of the 2-node group (its non-leader rank's
    and its leader's) and the whole 2-rank group g0, one after another; each victim restarts,
    recovers from the other group, and the job ends with equal replicas and every step once."""
    steps = 1500
    config = make_config(tmp_path / "run", demo_data, steps=steps)
    path = tmp_path / "config.toml"
    save_config(config, path)
    coordinator_port, rdzv_port = _port(), _port()
    env = {**os.environ, "FTLM_TOKEN": TOKEN, "FTLM_GROUPS": "2", "FTLM_HOST": "127.0.0.1",
           "FTLM_COORDINATOR": f"http://127.0.0.1:{coordinator_port}", "PYTHONUNBUFFERED": "1"}
    train = ["-m", "ftlm.cli", "train", str(path), "--set", "ft.coordinator="]
    run = [sys.executable, "-m", "torch.distributed.run", "--shutdown-timeout=5"]
    procs: dict[str, subprocess.Popen] = {}
    logs: list[Path] = []
    starts = {"g0": 0, "g1": 0}

    def start(name: str, args: list[str], group: str | None) -> None:
        log = tmp_path / f"{name}.log"
        if log not in logs:
            logs.append(log)
        procs[name] = subprocess.Popen(
            args, env=dict(env, FTLM_GROUP_ID=group) if group else env, stdout=open(log, "a"),
            stderr=subprocess.STDOUT, start_new_session=True)  # its own group: kill it whole

    def start_g0() -> None:
        env["FTLM_INCARNATION"] = f"g0.{starts['g0']}"
        start("g0-node0", [*run, "--standalone", "--nnodes=1", "--nproc-per-node=2", *train], "g0")

    def start_g1() -> None:  # two "nodes", one rendezvous per start (the watcher's resubmission)
        n = starts["g1"]
        env["FTLM_INCARNATION"] = f"g1.{n}"
        for name in ("g1-node0", "g1-node1"):
            start(name, [*run, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                         f"--rdzv-endpoint=127.0.0.1:{rdzv_port}", f"--rdzv-id=g1.{n}", *train],
                  "g1")

    def kill(name: str) -> None:
        os.killpg(procs[name].pid, signal.SIGKILL)
        procs[name].wait(timeout=30)

    events = config.run.path / "events.jsonl"
    start("coordinator", [sys.executable, "-m", "ftlm.cli", "coordinator", str(path), "--host",
                          "127.0.0.1", "--port", str(coordinator_port), "--set", "ft.groups=2"], None)
    schedule = ["g1-node1", "g1-node0", "g0-node0"]
    random.Random(int(os.environ.get("FTLM_CHAOS_SEED", "0"))).shuffle(schedule)
    faults: list[tuple[str, float]] = []
    try:
        start_g0()
        start_g1()
        for victim in schedule:
            group = victim[:2]
            other = "g1" if group == "g0" else "g0"
            other_log = tmp_path / f"{other}-node0.log"
            # The console, not the event log (written in batches), says how far a group is.
            target = _step(tmp_path / f"{group}-node0.log", group) + 30
            _wait_for(lambda: _step(tmp_path / f"{group}-node0.log", group) >= target, 300,
                      f"{group} to reach step {target}")
            lost_at = time.time()
            faults.append((group, lost_at))
            kill(victim)  # the node is gone, agent and rank
            if group == "g1":
                kill("g1-node1" if victim == "g1-node0" else "g1-node0")  # srun --kill-on-bad-exit
            before = _step(other_log, other)
            starts[group] += 1
            (start_g1 if group == "g1" else start_g0)()
            _wait_for(lambda: any(e["kind"] == "recovery_end" and e["group"] == group and e["ok"]
                                  and e["ts"] > lost_at for e in _events(events)), 300,
                      f"{group} to recover after losing {victim}")
            assert _step(other_log, other) > before, f"{other} stopped while {group} was down"
        for name in ("g0-node0", "g1-node0", "g1-node1"):
            assert procs[name].wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for name, p in procs.items():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    assert len(faults) == 3
    seen = _events(events)
    results = _results(logs)
    assert results["g0"]["step"] == results["g1"]["step"] == steps
    assert results["g0"]["state_hash"] == results["g1"]["state_hash"], "replicas differ"
    assert {e["step"] for e in seen if e["kind"] == "commit"} == set(range(steps))
