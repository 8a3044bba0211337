"""The floor server of ``bench.coordinator_load --floor`` answers what the load generator asks."""

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
