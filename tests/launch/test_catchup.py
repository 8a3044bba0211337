"""Non-blocking catch-up and failure detection (issue 5), with real group processes.

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
from pathlib import Path

from ftlm.launch.local import LocalLauncher
from ftlm.observe.events import read_events

sys.path.insert(0, str(Path(__file__).parent))
from test_fault_tolerance import (LONG, check_invariants, make_config, recovered,  # noqa: E402
                                  run_job)


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
    summary, events = run_job(tmp_path, demo_data, groups=2, steps=LONG,
                              ft={"catchup_max_steps": 2000},
                              extra_env={"FTLM_FAULT_STEPS": "5", "FTLM_FAULT_SECONDS": "120"},
                              faults={"g1": ["before_allreduce@10"], "g0": ["slow_serve"]})
    rec = recovered(events, "g1")
    assert rec and rec[0]["replayed"] >= 3, rec  # the transfer took several steps
    start = min(e["ts"] for e in events if e["kind"] == "recovery_start" and e["group"] == "g1"
                and e["ts"] > rec[0]["ts"] - 60)
    during = healthy_gaps(events, "g0", start, rec[0]["ts"])
    before = trained_step_seconds(events, "g0")
    # g0 kept committing at its usual pace while it served the slow transfer.
    assert len(during) >= 3
    assert max(during) < 1.0 + 10 * statistics.median(before), (max(during), statistics.median(before))
    check_invariants(summary, events, 2, steps=LONG)


@pytest.mark.slow  # 38 s; overflow and restart of a catch-up are visited thousands of times by tests/sim
def test_buffer_smaller_than_the_lag_restarts_catch_up_and_converges(tmp_path, demo_data):
    # The first (slow) transfer lags by far more steps than the buffer holds; an ordinary one
    # (a fraction of a second) fits, so the second attempt converges.
    summary, events = run_job(tmp_path, demo_data, groups=2, steps=LONG,
                              ft={"catchup_max_steps": 60},
                              extra_env={"FTLM_FAULT_STEPS": "70", "FTLM_FAULT_SECONDS": "300"},
                              faults={"g1": ["before_allreduce@10"], "g0": ["slow_serve"]})
    restarts = [e for e in events if e["kind"] == "recovery_end" and e["group"] == "g1"
                and not e["ok"] and "buffer" in e.get("error", "")]
    assert restarts, "the joiner never dropped its buffer"
    assert recovered(events, "g1")
    check_invariants(summary, events, 2, steps=LONG)


def test_kill_during_replay(tmp_path, demo_data):
    summary, events = run_job(tmp_path, demo_data, groups=2, steps=LONG,
                              ft={"catchup_max_steps": 2000},
                              extra_env={"FTLM_FAULT_STEPS": "3", "FTLM_FAULT_SECONDS": "120"},
                              faults={"g1": ["before_allreduce@10", "during_replay"],
                                      "g0": ["slow_serve"]})
    points = [e["point"] for e in events if e["kind"] == "failure_injected" and e["group"] == "g1"]
    assert points == ["before_allreduce", "during_replay"]
    assert recovered(events, "g1")
    check_invariants(summary, events, 2, steps=LONG)


@pytest.mark.slow  # 65 s; simultaneous failures are visited thousands of times by tests/sim
def test_two_groups_failing_at_once(tmp_path, demo_data):
    summary, events = run_job(tmp_path, demo_data, groups=3, steps=LONG,
                              faults={"g1": ["before_allreduce@10"], "g2": ["before_allreduce@10"]})
    assert recovered(events, "g1") and recovered(events, "g2")
    check_invariants(summary, events, 3, steps=LONG)


@pytest.mark.slow  # 69 s; SIGSTOP then SIGCONT ("hang_resume") is visited thousands of times by tests/sim,
# and test_fault_tolerance.py's test_hung_group_is_detected_killed_and_rejoins runs a hang for real
def test_hung_group_of_three_detected_within_heartbeat_timeout_then_resumed(tmp_path, demo_data):
    """SIGSTOP one group of three: the others commit again within the heartbeat timeout plus a
    step; the hung group, resumed with SIGCONT (not killed), rejoins without corrupting anyone."""
    config = make_config(tmp_path / "run", demo_data, steps=LONG)
    launcher = LocalLauncher(config, groups=3, progress=False, kill_hung=False,
                             faults={"g1": ["hang:before_allreduce@10"]})
    events_path = config.run.path / "events.jsonl"
    done = threading.Event()

    def resume_after_detection() -> None:
        # Once g1 is declared dead and the others have moved on by some steps, resume it: it is
        # then behind and must catch up. Every wait is bounded (120 s in all).
        seen = None
        for _ in range(1200):
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
    hang = next(e["ts"] for e in events if e["kind"] == "failure_injected" and e["group"] == "g1")
    resumed = [e["ts"] for e in events if e["kind"] == "commit" and e["group"] == "g0" and e["ts"] > hang]
    steps = trained_step_seconds(events, "g0")
    assert resumed[0] - hang < config.ft.heartbeat_timeout + 1.0 + 5 * statistics.median(steps)
    assert recovered(events, "g1"), "the resumed group did not catch up"
    assert summary["restarts"]["g1"] == 0  # resumed, not restarted
    check_invariants(summary, events, 3, steps=LONG)
