"""A coordinator process stopped (SIGSTOP) and resumed (SIGCONT) tells its own stall from the
groups': it heard nothing because it was not running, so nobody is declared dead on resumption."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftlm.ft.client import CoordinatorClient, Heartbeater
from ftlm.ft.history import GENESIS

HB_TIMEOUT = 0.5
HB_INTERVAL = 0.05
PAUSE = 3 * HB_TIMEOUT


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP/SIGCONT")
def test_a_coordinator_resumed_after_sigstop_declares_no_group_dead(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftlm.cli", "coordinator", "--port", "0", "--events", str(events),
         "--set", f"ft.heartbeat_timeout={HB_TIMEOUT}", "--set", f"ft.heartbeat_interval={HB_INTERVAL}",
         "--set", "ft.groups=2"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "FTLM_TOKEN": ""})
    beaters: list[Heartbeater] = []
    try:
        assert select.select([proc.stdout], [], [], 60)[0], "no URL printed"
        url = proc.stdout.readline().split("listening on ", 1)[1].split()[0]
        for g in ("g0", "g1"):
            client = CoordinatorClient(url, g, "a", timeout=2.0)
            beater = Heartbeater(client, HB_INTERVAL, lambda: (0, 0, GENESIS, 0.0))
            beater.beat()
            beater.start()
            beaters.append(beater)
        time.sleep(4 * HB_INTERVAL)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(PAUSE)
        proc.send_signal(signal.SIGCONT)
        time.sleep(2 * HB_TIMEOUT)  # a heartbeat timeout from the resumption has passed: they spoke
        status = beaters[0].client.status()
        logged = [json.loads(line) for line in events.read_text().splitlines()]
        dead = [(e["replica_id"], e["reason"]) for e in logged if e["kind"] == "member_dead"]
        assert dead == [], dead
        stalls = [e["seconds"] for e in logged if e["kind"] == "coordinator_stalled"]
        assert stalls and max(stalls) >= PAUSE * 0.9, logged  # it knew it had stopped
        assert sorted(m["replica_id"] for m in status["members"]) == ["g0:a", "g1:a"], status
    finally:
        for beater in beaters:
            beater.stop()
            beater.client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        proc.stdout.close()
