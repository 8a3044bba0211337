"""Non-blocking catch-up and failure detection, with real group processes.

The joiner enters the all-reduce at once with zero gradients, pulls the snapshot in the
background and replays the averaged updates it buffered; healthy groups never wait for it.
"""

from __future__ import annotations

import pytest

import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

from ftlm.launch.local import LocalLauncher
from ftlm.observe.events import read_events

sys.path.insert(0, str(Path(__file__).parent))
from test_fault_tolerance import (ALL_IN_FIRST_QUORUM, CATCH_UP_FROM_PEERS, LONG,  # noqa: E402
                                  STARVED_HEARTBEATS_TOLERATED, WAIT_FOR_PEERS, check_invariants,
                                  injected, make_config, recovered, run_job)


def trained_step_seconds(events: list[dict], group: str) -> list[float]:
    """Step times of the steps ``group`` trained: a commit it replayed while catching up (on a
    loaded machine any group may have to) has no step time."""
    return [e["step_seconds"] for e in events
            if e["kind"] == "commit" and e["group"] == group and not e.get("replayed")]


def healthy_gaps(events: list[dict], group: str, start: float, end: float) -> list[float]:
    times = sorted(e["ts"] for e in events if e["kind"] == "commit" and e["group"] == group)
    return [b - a for a, b in zip(times, times[1:]) if start <= a and b <= end]


@pytest.mark.slow  # 47 s; a performance property, measured in bench.serve_impact and bench.ft_vs_torchft
def test_slow_transfer_does_not_slow_the_healthy_group_and_joiner_ends_bitwise_equal(tmp_path,
                                                                                   demo_data):
    # A buffer large enough for the whole slow transfer: one catch-up, many replayed steps.
    # min_replicas=2: both groups train from step 0 and g0 waits for g1's restart, so the slow
    # transfer is the restarted g1's, whatever the machine's speed.
    steps = 300
    summary, events = run_job(tmp_path, demo_data, groups=2, steps=steps,
                              ft={"catchup_max_steps": 2000, "min_replicas": 2, **WAIT_FOR_PEERS},
                              extra_env={"FTLM_FAULT_STEPS": "5", "FTLM_FAULT_SECONDS": "120"},
                              faults={"g1": ["before_allreduce@10+"], "g0": ["slow_serve"]})
    assert injected(events, "g1") == ["before_allreduce"] and injected(events, "g0") == ["slow_serve"]
    rec = recovered(events, "g1")
    assert rec and rec[0]["replayed"] >= 3, rec  # the transfer took several steps
    start = [e for e in events if e["kind"] == "recovery_start" and e["group"] == "g1"
             and e["ts"] < rec[0]["ts"]][-1]
    during = healthy_gaps(events, "g0", start["ts"], rec[0]["ts"])
    before = trained_step_seconds(events, "g0")
    # g0 kept committing at its usual pace while it served the slow transfer.
    assert len(during) >= 3
    assert max(during) < 1.0 + 10 * statistics.median(before), (max(during), statistics.median(before))
    check_invariants(summary, events, 2, steps=steps)


@pytest.mark.slow  # 38 s; overflow and restart of a catch-up are visited thousands of times by tests/sim
def test_buffer_smaller_than_the_lag_restarts_catch_up_and_converges(tmp_path, demo_data):
    # The first (slow) transfer lags by far more steps than the buffer holds; an ordinary one
    # (a fraction of a second) fits, so the second attempt converges.
    summary, events = run_job(tmp_path, demo_data, groups=2, steps=LONG,
                              ft={"catchup_max_steps": 60, **ALL_IN_FIRST_QUORUM},
                              checkpoint=CATCH_UP_FROM_PEERS,
                              extra_env={"FTLM_FAULT_STEPS": "70", "FTLM_FAULT_SECONDS": "300"},
                              faults={"g1": ["before_allreduce@10+"], "g0": ["slow_serve"]})
    assert injected(events, "g1") == ["before_allreduce"] and injected(events, "g0") == ["slow_serve"]
    restarts = [e for e in events if e["kind"] == "recovery_end" and e["group"] == "g1"
                and not e["ok"] and "buffer" in e.get("error", "")]
    assert restarts, "the joiner never dropped its buffer"
    assert recovered(events, "g1")
    check_invariants(summary, events, 2, steps=LONG)


def test_kill_during_replay(tmp_path, demo_data):
    """g1 dies at step 10; its next incarnation pulls g0's state over a slow link (3 steps: a
    backlog of buffered updates) and dies after replaying the first of them; the third catches
    up and every invariant holds. ``min_replicas=2`` makes this happen whatever the machine's
    speed: both groups train from step 0 (a g1 that started late used to recover through step
    10, and no fault fired), and g0 waits for each of g1's restarts instead of racing to the
    end, so the slow pull is the one that replays. The quorum and give-up bounds cover a
    restart on a loaded machine, and the heartbeat timeout a process starved for seconds."""
    steps = 100
    summary, events = run_job(tmp_path, demo_data, groups=2, steps=steps,
                              ft={"catchup_max_steps": 2000, "min_replicas": 2, **WAIT_FOR_PEERS,
                                  **STARVED_HEARTBEATS_TOLERATED},
                              extra_env={"FTLM_FAULT_STEPS": "3", "FTLM_FAULT_SECONDS": "120"},
                              faults={"g1": ["before_allreduce@10+", "during_replay"],
                                      "g0": ["slow_serve"]})
    assert injected(events, "g1") == ["before_allreduce", "during_replay"]
    assert injected(events, "g0") == ["slow_serve"]
    # The second kill came while g1 replayed the slow pull's backlog: after that pull started,
    # before it ended.
    kill = next(e for e in events if e["kind"] == "failure_injected" and e["point"] == "during_replay")
    pull = [e for e in events if e["kind"] == "recovery_start" and e["group"] == "g1"
            and e["ts"] <= kill["ts"]][-1]
    assert not [e for e in events if e["kind"] == "recovery_end" and e["group"] == "g1"
                and pull["ts"] < e["ts"] < kill["ts"]]
    assert recovered(events, "g1")
    check_invariants(summary, events, 2, steps=steps)


@pytest.mark.slow  # 65 s; simultaneous failures are visited thousands of times by tests/sim
def test_two_groups_failing_at_once(tmp_path, demo_data):
    summary, events = run_job(tmp_path, demo_data, groups=3, steps=LONG, ft=ALL_IN_FIRST_QUORUM,
                              checkpoint=CATCH_UP_FROM_PEERS,
                              faults={"g1": ["before_allreduce@10+"], "g2": ["before_allreduce@10+"]})
    assert injected(events, "g1") == injected(events, "g2") == ["before_allreduce"]
    assert recovered(events, "g1") and recovered(events, "g2")
    check_invariants(summary, events, 3, steps=LONG)


@pytest.mark.slow  # 69 s; SIGSTOP then SIGCONT ("hang_resume") is visited thousands of times by tests/sim,
# and test_fault_tolerance.py's test_hung_group_is_detected_killed_and_rejoins runs a hang for real
def test_hung_group_of_three_detected_within_heartbeat_timeout_then_resumed(tmp_path, demo_data):
    """SIGSTOP one group of three: the others commit again within the heartbeat timeout plus a
    step; the hung group, resumed with SIGCONT (not killed), rejoins without corrupting anyone."""
    # (the others may finish before g1 is resumed: they wait for it at the end)
    config = make_config(tmp_path / "run", demo_data, steps=LONG, ft=ALL_IN_FIRST_QUORUM)
    launcher = LocalLauncher(config, groups=3, progress=False, kill_hung=False,
                             faults={"g1": ["hang:before_allreduce@10+"]})
    events_path = config.run.path / "events.jsonl"
    done = threading.Event()

    def resume_after_detection() -> None:
        # Once g1 is declared dead and the others have moved on by some steps, resume it: it is
        # then behind and must catch up. Every wait is bounded (the test's timeout).
        seen = None
        deadline = time.monotonic() + 280
        while time.monotonic() < deadline:
            if done.wait(0.1):
                return
            text = events_path.read_text() if events_path.exists() else ""
            if seen is None and '"member_dead"' in text and '"target":"g1"' in text:
                seen = text.count('"commit"')
            if seen is not None and text.count('"commit"') >= seen + 20:
                os.kill(launcher.groups[1].procs[0].pid, signal.SIGCONT)
                return

    thread = threading.Thread(target=resume_after_detection, daemon=True)
    thread.start()
    summary = launcher.run()
    done.set()
    thread.join(timeout=10)
    events = read_events(events_path)
    assert injected(events, "g1") == ["before_allreduce"]
    hang = next(e["ts"] for e in events if e["kind"] == "failure_injected" and e["group"] == "g1")
    resumed = [e["ts"] for e in events if e["kind"] == "commit" and e["group"] == "g0" and e["ts"] > hang]
    steps = trained_step_seconds(events, "g0")
    assert resumed[0] - hang < config.ft.heartbeat_timeout + 1.0 + 5 * statistics.median(steps)
    assert recovered(events, "g1"), "the resumed group did not catch up"
    assert summary["restarts"]["g1"] == 0  # resumed, not restarted
    check_invariants(summary, events, 3, steps=LONG)
