"""bench.ft_vs_torchft's repetitions: medians with their spread, and --merge of saved runs."""

from __future__ import annotations

import json

import pytest

from bench import ft_vs_torchft as b


def _rep(date: str, ftlm_kill: float, torchft_kill: float | None, ett: float) -> dict:
    def row(model, signal, system, median, failure, rejoin, doomed=None):
        return {"model": model, "params": 1_310_000, "batch": 8, "at": 8, "signal": signal,
                "system": system, "median": median, "failure": failure, "rejoin": rejoin,
                "doomed": doomed}
    return {"date": date, "command": "python -m bench.ft_vs_torchft --parts 2 3 4",
            "machine": "test box", "parts": [2, 3, 4], "torchft": "torchft 0.2.0",
            "part23": [row("tiny", "kill", "ftlm", 0.30, ftlm_kill, 0.05, 0.25),
                       row("tiny", "kill", "torchft", 0.31, torchft_kill, 0.30, 0.28),
                       row("tiny", "stop", "ftlm", 0.30, 1.2, None),
                       row("tiny", "stop", "torchft", 0.31, 10.2, None)],
            "part4": [{"system": "ftlm", "ett": ett, "steps": 180, "failures": 5,
                       "seconds": 240.0, "mtbf": 30.0, "seed": 1}]}


def test_a_cell_is_the_median_with_its_spread_and_counts_what_was_not_measured():
    assert b.cell([0.5, 0.1, 0.3]) == "0.300 (0.100-0.500)"
    assert b.cell([0.25]) == "0.250"
    assert b.cell([None, 0.2, 0.4]) == "0.300 (0.200-0.400) [1 of 3 n/a]"
    assert b.cell([None, None]) == "n/a"


def test_three_repetitions_render_medians_per_part():
    reps = [_rep("2026-12-04 10:00 UTC", 0.40, 1.0, 0.87),
            _rep("2026-12-04 11:00 UTC", 0.20, None, 0.85),
            _rep("2026-12-04 12:00 UTC", 0.30, 1.2, 0.90)]
    parts = b.render(reps)
    assert sorted(parts) == [2, 3, 4]
    assert ("| tiny | 1.3M | SIGKILL | 0.300 (0.300-0.300) | 0.300 (0.200-0.400) | "
            "0.250 (0.250-0.250) | 0.310 (0.310-0.310) | 1.100 (1.000-1.200) [1 of 3 n/a] | "
            "0.280 (0.280-0.280) |") in parts[2]
    assert "3 repetitions; each cell the median (min-max) over them" in parts[2]
    assert "2026-12-04 10:00 UTC to 2026-12-04 12:00 UTC" in parts[2]
    assert "*Measured*" not in parts[3]  # part 2's runs, named there once
    assert "*Measured*" in b.render([dict(r, parts=[3]) for r in reps])[3]  # alone, it names them
    assert "| ftlm | 0.870 (0.850-0.900) | 180 (180-180) | 5 (5-5) |" in parts[4]


def test_the_doomed_step_runs_from_the_last_commit_to_the_first_healthy_step_failed():
    events = [{"kind": "commit", "group": "g0", "step": 3, "ts": 10.0},
              {"kind": "commit", "group": "g1", "step": 3, "ts": 10.2},
              {"kind": "commit", "group": "g2", "step": 3, "ts": 10.1},
              {"kind": "failure_injected", "group": "g2", "ts": 11.0},
              {"kind": "step_failed", "group": "g2", "ts": 11.0},  # (the victim's own: not counted)
              {"kind": "step_failed", "group": "g1", "ts": 12.5},
              {"kind": "step_failed", "group": "g0", "ts": 12.9}]
    assert b.doomed_step(events, 11.0) == pytest.approx(2.5)
    assert b.doomed_step([e for e in events if e["kind"] != "step_failed"], 11.0) is None


def test_merge_writes_the_section_from_saved_runs(tmp_path, capsys):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps(_rep("2026-12-04 10:00 UTC", 0.4, 1.0, 0.8)) + "\n")
    second.write_text(json.dumps(_rep("2026-12-04 11:00 UTC", 0.2, 1.2, 0.9)) + "\n\n")
    assert b.main(["--merge", str(first), str(second), "--no-write"]) == 0
    out = capsys.readouterr().out
    assert "Merged from 2 repetition(s)" in out
    assert "| tiny | 1.3M | SIGKILL | 0.300 (0.300-0.300) | 0.300 (0.200-0.400) |" in out


def test_merge_refuses_a_file_that_is_not_saved_repetitions(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ett": 1}\n')
    with pytest.raises(SystemExit, match="not a repetition written by --json"):
        b.main(["--merge", str(bad), "--no-write"])
    bad.write_text("not json\n")
    with pytest.raises(SystemExit, match="bad.jsonl:1: not a JSON line"):
        b.main(["--merge", str(bad), "--no-write"])


def test_repeat_must_be_positive():
    with pytest.raises(SystemExit):
        b.main(["--repeat", "0", "--no-write"])
