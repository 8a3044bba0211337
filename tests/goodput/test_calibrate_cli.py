"""Calibration from a run directory, and the ``ftlm simulate`` command end to end."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from ftlm.cli import main
from ftlm.errors import DataError
from ftlm.goodput.calibrate import calibrate
from ftlm.observe.summary import build_summary, write_summary

T0 = 1000.0
DT = 0.1
TOKENS_PER_GROUP = 8 * 128


def _event(ts: float, kind: str, group: str = "", step: int = -1, **fields) -> dict:
    return {"ts": round(ts, 6), "kind": kind, "group": group, "rank": 0, "step": step, **fields}


def _chaos_run(run_dir: Path) -> None:
    """4 groups commit every 0.1 s from t=1002 (2 s start-up) for 300 steps; g1 is killed at
    t=1012.02, declared dead 1.0 s later, the others wait 1.5 s; g1 begins recovering 5.0 s after
    the kill and commits again 1.0 s after that."""
    groups = ["g0", "g1", "g2", "g3"]
    events = [_event(T0, "run_start", "supervisor", groups=4, chaos_mtbf=30.0)]
    kill, ts, cursor = T0 + 12.02, T0 + 2.0, 0
    events += [_event(kill, "failure_injected", "supervisor", target="g1", how="SIGKILL"),
               _event(kill + 1.0, "member_dead", "coordinator", target="g1:abc"),
               _event(kill + 5.0, "recovery_start", "g1", source="g0"),
               _event(kill + 5.5, "recovery_end", "g1", source="g0", ok=True, seconds=0.5)]
    for step in range(300):
        if step:
            ts += 1.5 if ts < kill < ts + 1.5 else DT
        up = [g for g in groups if g != "g1" or not kill < ts < kill + 6.0]
        n = len(up)
        for g in up:
            events.append(_event(ts, "commit", g, step, quorum_id=1, participants=n,
                                 samples=[cursor, cursor + 8 * n], loss=3.0,
                                 tokens=TOKENS_PER_GROUP * n, lr=1e-3, step_seconds=DT))
        cursor += 8 * n
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    summary = build_summary(events, wall_seconds=ts - T0, state_hashes={g: "a" * 64 for g in groups},
                            config={}, groups=groups)
    write_summary(run_dir / "summary.json", summary)


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def test_calibration_measures_start_up_detection_stall_restart_and_catch_up(tmp_path):
    _chaos_run(tmp_path / "run")
    cal = calibrate(tmp_path / "run")
    assert cal.groups == 4 and cal.failures == 1
    assert cal.startup == pytest.approx(2.0 - DT, abs=1e-6)  # the first commit's step began a step earlier
    assert cal.detection == pytest.approx(1.0, abs=1e-6)
    assert cal.restart == pytest.approx(5.0, abs=1e-6)
    assert cal.catchup == pytest.approx(1.0, abs=0.11)
    assert cal.stall == pytest.approx(1.4, abs=1e-3)  # the 1.5 s gap minus one 0.1 s step
    assert cal.speed_by_participants[3] == 1.0
    assert cal.speed_by_participants[2] == pytest.approx(0.75, abs=1e-6)  # 3 of 4, same step time
    model = cal.local_model()
    assert model.groups == 4 and model.duration == pytest.approx(cal.duration)


def test_simulate_calibrate_projects_ftlm_with_the_measured_stall(tmp_path):
    _chaos_run(tmp_path / "run")
    code, out, err = _run(["simulate", "--calibrate", str(tmp_path / "run"), "--preset", "ftlm",
                           "--days", "1", "--runs", "2", "--json", str(tmp_path / "out.json")])
    assert code == 0, err
    assert "calibration from" in out and "simulated" in out
    result = json.loads((tmp_path / "out.json").read_text())
    assert 0.0 < result["ett"] <= 1.0
    # stall at scale: the measured stall plus one 20 s step redone
    assert result["model"]["stall"] == pytest.approx(21.4, abs=1e-3)


def test_simulate_writes_plots_and_sweeps(tmp_path):
    code, out, err = _run(["simulate", "--days", "0.05", "--runs", "1", "--sweep", "spares",
                           "--plots", str(tmp_path / "plots")])
    assert code == 0, err
    assert (tmp_path / "plots" / "timeline.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "sweep_spares.png").stat().st_size > 1000
    assert "ETT vs spare groups" in out


def test_simulate_spot_vs_on_demand_reports_the_saving(tmp_path):
    code, out, err = _run(["simulate", "--days", "0.5", "--runs", "1", "--on-demand-price", "4",
                           "--spot-price", "1.5", "--preemptions-per-gpu-hour", "1e-6"])
    assert code == 0, err
    assert "spot saves" in out and "on-demand:" in out


@pytest.mark.parametrize("argv,message", [
    (["--runs", "0"], "--runs=0 must be at least 1"),
    (["--sweep", "nope"], "--sweep nope: unknown"),
    (["--groups", "0"], "groups=0 must be an integer >= 1"),
    (["--stall", "nan"], "stall=nan is out of range"),
    (["--spot-price", "1"], "needs both --on-demand-price and --spot-price"),
    (["--days", "-1"], "--days=-1.0 must be a number > 0"),
])
def test_bad_options_are_one_line_errors(argv, message):
    code, _, err = _run(["simulate", *argv])
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_calibrating_a_directory_without_a_run_is_a_one_line_error(tmp_path):
    code, _, err = _run(["simulate", "--calibrate", str(tmp_path)])
    assert code == 2 and "summary.json not found" in err
    with pytest.raises(DataError, match="not valid JSON"):
        (tmp_path / "summary.json").write_text("{")
        (tmp_path / "events.jsonl").write_text("")
        calibrate(tmp_path)


def test_a_failure_with_no_death_of_its_own_is_not_given_the_next_ones(tmp_path):
    """g1's restarted process is killed again 3 s after the first kill, before it joined (no
    member_dead of its own), and once more 20 s later (declared dead 0.2 s after): detection is
    the mean of the two real ones, not stretched by the next failure's death."""
    _chaos_run(tmp_path / "run")
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    kill = T0 + 12.02
    events += [_event(kill + 3.0, "failure_injected", "supervisor", target="g1", how="SIGKILL"),
               _event(kill + 23.0, "failure_injected", "supervisor", target="g1", how="SIGKILL"),
               _event(kill + 23.2, "member_dead", "coordinator", target="g1:def")]
    events.sort(key=lambda e: e["ts"])
    (tmp_path / "run" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    cal = calibrate(tmp_path / "run")
    assert cal.failures == 3 and cal.samples["detection"] == 2
    assert cal.detection == pytest.approx((1.0 + 0.2) / 2, abs=1e-6)


def test_calibration_replays_the_runs_own_failures(tmp_path):
    _chaos_run(tmp_path / "run")
    cal = calibrate(tmp_path / "run")
    assert cal.failure_trace == ((pytest.approx(12.02), 1),)
    assert cal.teardown == pytest.approx(0.0, abs=1e-6)  # the record ends at the last commit
    replay = cal.replay_model()
    assert replay.failure_trace == cal.failure_trace and replay.protect_last


def _spare_run(run_dir: Path) -> None:
    """3 training places and a spare: g0 starts as the spare (it asked last), g2 is killed at
    t=1012.02 and g0 promoted 0.3 s later; g2 restarts 5 s after the kill and is the spare then."""
    groups = ["g0", "g1", "g2", "g3"]
    events = [_event(T0, "run_start", "supervisor", groups=4, spares=1, chaos_mtbf=30.0)]
    kill, ts = T0 + 12.02, T0 + 2.0
    events += [_event(kill, "failure_injected", "supervisor", target="g2", how="SIGKILL"),
               _event(kill + 0.1, "member_dead", "coordinator", target="g2:abc"),
               _event(kill + 0.3, "spare_promoted", "coordinator", promoted=["g0"],
                      replaced=["g2"], seconds=0.2),
               _event(kill + 5.0, "recovery_start", "g2", source="g1")]
    for step in range(300):
        if step:
            ts += 0.5 if ts < kill < ts + 0.5 else DT
        trainers = ["g1", "g2", "g3"] if ts < kill else ["g0", "g1", "g3"]
        spare = "g0" if ts < kill else ("g2" if ts > kill + 5.5 else None)
        for g in trainers:
            events.append(_event(ts, "commit", g, step, quorum_id=1, participants=3,
                                 samples=[0, 24], loss=3.0, tokens=TOKENS_PER_GROUP * 3, lr=1e-3,
                                 step_seconds=DT))
        if spare:
            events.append(_event(ts, "commit", spare, step, quorum_id=1, participants=3, spare=True,
                                 samples=[0, 24], loss=3.0, tokens=TOKENS_PER_GROUP * 3, lr=1e-3,
                                 step_seconds=DT))
    events.sort(key=lambda e: e["ts"])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    summary = build_summary(events, wall_seconds=ts - T0, state_hashes={g: "a" * 64 for g in groups},
                            config={}, groups=groups)
    write_summary(run_dir / "summary.json", summary)


def test_calibration_of_a_run_with_a_spare_counts_places_and_numbers_the_spare_last(tmp_path):
    """The simulator's slots are the training places, then the spares: g0 began as the spare, so
    it is the last slot, and the failure trace names g2 by its slot. The promotion is timed from
    the kill (0.3 s), not from the death's detection (0.2 s)."""
    _spare_run(tmp_path / "run")
    cal = calibrate(tmp_path / "run")
    assert cal.groups == 3 and cal.spares == 1
    assert cal.promotion == pytest.approx(0.3, abs=1e-6)
    assert cal.failure_trace == ((pytest.approx(12.02), 1),)  # slots: g1, g2, g3, then g0
    model = cal.replay_model()
    assert model.spares == 1 and model.promotion == pytest.approx(0.3, abs=1e-6)
    code, out, _ = _run(["simulate", "--calibrate", str(tmp_path / "run"), "--days", "0.01",
                         "--runs", "1"])
    assert code == 0 and "3 groups (+1 spare; promotion 0.30 s after a failure)" in out
