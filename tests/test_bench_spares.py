"""``bench.spares``: the stall-per-failure parts read from events, and the summary over
repetitions (intervals over independent chaos seeds)."""

from bench.spares import over_reps, stall_parts


def _run(spares: int, stalls: list[float], step: float, measured: float) -> dict:
    return {"spares": spares, "step": step, "stalls": stalls,
            "median_stall": sorted(stalls)[len(stalls) // 2], "measured": measured, "ett": measured}


def test_over_reps_gives_each_side_an_interval_over_repetitions():
    runs = [_run(0, [0.2, 0.3, 0.4], 0.4, 0.90), _run(1, [0.1, 0.5, 0.6], 0.5, 0.97),
            _run(0, [0.4, 0.4, 0.8], 0.4, 0.92), _run(1, [0.1, 0.2, 0.3], 0.5, 0.96)]
    text = over_reps(runs)
    rows = [line for line in text.splitlines() if line.startswith("| 0 ") or line.startswith("| 1 ")]
    assert len(rows) == 2
    # spares 0: per-repetition medians 0.3/0.4 and 0.4/0.4 steps -> 0.75 and 1.0, mean 0.875
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[:3] == ["0", "2", "6"]
    assert cells[3].startswith("0.88 ± ")
    # all six failures of spares 0 in steps: 0.5 0.75 1.0 1.0 1.0 2.0 -> median 1.0, five of six <= 1
    assert cells[4] == "1.00" and cells[5] == "5 of 6"
    assert over_reps(runs[:2]).count("\n") == 1  # one repetition a side: headers only


def test_stall_parts_split_a_kill_into_doomed_step_detection_and_restart():
    events = [
        {"ts": 10.0, "kind": "commit", "group": "g0"},
        {"ts": 10.1, "kind": "commit", "group": "g1"},
        {"ts": 10.3, "kind": "failure_injected", "group": "supervisor", "signal": "SIGKILL", "target": "g1"},
        {"ts": 10.4, "kind": "step_failed", "group": "g0"},
        {"ts": 10.5, "kind": "quorum", "group": "coordinator"},
        {"ts": 11.0, "kind": "commit", "group": "g0"},
    ]
    (doomed, detection, restart), = stall_parts(events, step=0.4)
    assert round(doomed, 6) == 0.4  # g0's last commit (10.0) to its failure (10.4); g1's is the dead one's
    assert round(detection, 6) == 0.1 and round(restart, 6) == 0.1
