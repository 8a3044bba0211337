"""The floor server of ``bench.coordinator_load --floor`` answers what the load generator asks; the
load test pins the coordinator where asked (``--pin``)."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_floor_server_answers_heartbeats_and_a_quorum_of_all_its_groups() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "bench.coordinator_floor", "2"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", proc.stdout.readline()).group(1))
        conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(2)]
        conns[0].request("POST", "/v1/heartbeat", body=b'{"group": "g0"}')
        beat = conns[0].getresponse()
        assert beat.status == 200 and json.loads(beat.read())["dead"] == []
        for step, conn in enumerate(conns):
            conn.request("POST", "/v1/quorum", body=b'{"group": "g%d", "step": %d}' % (step, 4 + step))
        answers = [json.loads(conn.getresponse().read()) for conn in conns]  # issued once both asked
        assert [a["rank"] for a in answers] == [0, 1]
        assert {(a["size"], a["step"], a["quorum_id"], len(a["next_chain"])) for a in answers} == {(2, 5, 1, 64)}
        for conn in conns:
            conn.close()
    finally:
        proc.kill()
        proc.wait(10)


def test_the_load_test_runs_the_coordinator_on_the_cpus_it_is_given(tmp_path) -> None:
    """``bench.coordinator_load --pin``: every thread of the coordinator's process (its event loop
    runs in one it starts) is on the given CPU."""
    import os

    from bench.coordinator_load import CoordinatorUnderTest
    cpus = {min(os.sched_getaffinity(0))}
    coordinator = CoordinatorUnderTest(2, "token-of-the-test", tmp_path / "coordinator.log", cpus=cpus)
    try:
        tasks = [int(t) for t in os.listdir(f"/proc/{coordinator.proc.pid}/task")]
        assert len(tasks) > 1 and all(os.sched_getaffinity(t) == cpus for t in tasks)
    finally:
        coordinator.stop()
