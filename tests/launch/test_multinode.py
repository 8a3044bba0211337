"""A 2-node-shaped replica group on one machine: two torchrun agents meeting through one c10d
rendezvous, as the generated Kubernetes Jobs and Slurm scripts start them, losing a node.

g0 is one torchrun with 2 ranks; g1 is two torchrun agents with 1 rank each (``--nnodes=2
--rdzv-backend=c10d``), every rank of one start sharing one ``FTLM_INCARNATION`` as the Slurm
script exports it. One of g1's "nodes" is SIGKILLed mid-run; as ``srun --kill-on-bad-exit`` does,
the group's other node goes too, and the group starts again (a new rendezvous id and incarnation,
what the watcher's resubmission gives): it recovers from g0, which kept training, and both groups
end with the same state.
"""

from __future__ import annotations

import json
import os
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_node_shaped_group_loses_a_node_and_recovers(tmp_path, demo_data):
    steps = 600
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

    def start(name: str, args: list[str], group: str | None) -> None:
        log = tmp_path / f"{name}.log"
        logs.append(log)
        procs[name] = subprocess.Popen(
            args, env=dict(env, FTLM_GROUP_ID=group) if group else env, stdout=open(log, "a"),
            stderr=subprocess.STDOUT, start_new_session=True)  # its own group: kill it whole

    def node(name: str, start_no: int) -> None:
        env["FTLM_INCARNATION"] = f"g1.{start_no}"
        start(name, [*run, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint=127.0.0.1:{rdzv_port}", f"--rdzv-id=g1.{start_no}", *train],
              "g1")

    events = config.run.path / "events.jsonl"
    start("coordinator", [sys.executable, "-m", "ftlm.cli", "coordinator", str(path), "--host",
                          "127.0.0.1", "--port", str(coordinator_port), "--set", "ft.groups=2"], None)
    try:
        env["FTLM_INCARNATION"] = "g0.0"
        start("g0-node0", [*run, "--standalone", "--nnodes=1", "--nproc-per-node=2", *train], "g0")
        node("g1-node0", 0)
        node("g1-node1", 0)
        # The console, not the event log (written in batches), says how far g1 is.
        _wait_for(lambda: max(map(int, re.findall(r"\[g1/0 [^]]*\] info: step (\d+)/",
                                                  (tmp_path / "g1-node0.log").read_text())),
                              default=0) >= 30, 240, "g1 to reach step 30")
        lost_at = time.time()
        os.killpg(procs["g1-node1"].pid, signal.SIGKILL)  # the node is gone, agent and rank
        procs["g1-node1"].wait(timeout=30)
        os.killpg(procs["g1-node0"].pid, signal.SIGKILL)  # srun --kill-on-bad-exit
        procs["g1-node0"].wait(timeout=30)
        node("g1-node0", 1)  # the group's next start, on two "nodes" again
        node("g1-node1", 1)
        for name in ("g0-node0", "g1-node0", "g1-node1"):
            assert procs[name].wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for name, p in procs.items():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    seen = _events(events)
    assert any(e["kind"] == "recovery_end" and e["group"] == "g1" and e["ts"] > lost_at and e["ok"]
               for e in seen), "g1's new incarnation did not recover from g0"
    while_down = [e for e in seen if e["kind"] == "commit" and e["group"] == "g0" and e["ts"] > lost_at]
    assert while_down, "the healthy group stopped"
    results = _results(logs)
    assert results["g0"]["step"] == results["g1"]["step"] == steps
    assert results["g0"]["state_hash"] == results["g1"]["state_hash"], "replicas differ"
    assert {e["step"] for e in seen if e["kind"] == "commit"} == set(range(steps))
