"""The fault matrix's cells and verdicts (the runs themselves are a benchmark: ``bench.fault_matrix``)."""

from __future__ import annotations

import json

from bench.fault_matrix import KINDS, cells, verdict
from ftlm.ft.faults import POINTS, FaultSchedule


def test_every_point_rank_and_kind_is_a_cell_with_valid_plans():
    all_cells = cells()
    names = [c.name for c in all_cells]
    assert len(names) == len(set(names))
    struck = set(POINTS) - {"slow_serve"}  # a slow link, not a moment to strike
    assert {(c.point, c.rank, c.kind) for c in all_cells} == {
        (p, r, k) for p in struck for r in (0, 1) for k in KINDS}
    for cell in all_cells:
        for key, plans in cell.faults.items():
            assert key in ("g0", "g1", "g0.r1", "g1.r1"), key
            for plan in plans:
                FaultSchedule.parse(plan)  # raises on a plan FTLM_FAULT would refuse
        # The planned fault strikes the cell's rank, in the source for during_serve.
        assert cell.target == ("g0" if cell.point == "during_serve" else "g1") + f".r{cell.rank}"


def _run_dir(tmp_path, events, **summary):
    base = {"replicas_identical": True, "state_hashes": {"g0": "a", "g1": "a"},
            "data": {"duplicates": 0, "gaps": 0, "restores": 0}, "steps_committed": 300,
            "problems": [], "crashes": [], "failures_undetected": 0, "failures_unexplained": 0,
            "failures_detected": 1, "restarts": {"g1": 1}}
    (tmp_path / "summary.json").write_text(json.dumps({**base, **summary}))
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return tmp_path


def test_a_cell_passes_only_when_its_fault_fired_and_the_job_is_intact(tmp_path):
    cell = next(c for c in cells() if c.name == "inside_allreduce.r1.kill")
    fired = [{"kind": "failure_injected", "group": "g1", "rank": 1, "step": 10,
              "point": "inside_allreduce"}]
    assert verdict(cell, 0, 50.0, _run_dir(tmp_path, fired), 300)["ok"]
    # The same point in the other rank is not this cell's fault.
    other = [{**fired[0], "rank": 0}]
    record = verdict(cell, 0, 50.0, _run_dir(tmp_path, other), 300)
    assert not record["ok"] and "the planned fault never fired" in record["reasons"]
    record = verdict(cell, 0, 50.0, _run_dir(tmp_path, fired, problems=["2 sample(s) trained twice"]), 300)
    assert not record["ok"] and record["reasons"] == ["2 sample(s) trained twice"]
    record = verdict(cell, None, 900.0, _run_dir(tmp_path, fired, failures_undetected=1), 300)
    assert not record["ok"] and len(record["reasons"]) == 2


def test_a_stop_cell_is_exercised_by_the_group_leaving_preempted(tmp_path):
    cell = next(c for c in cells() if c.name == "before_commit.r1.stop")
    left = [{"kind": "group_exit", "group": "launcher", "rank": 0, "step": -1, "target": "g1",
             "ok": True, "preempted": True}]
    assert verdict(cell, 0, 50.0, _run_dir(tmp_path, left), 300)["ok"]
    assert not verdict(cell, 0, 50.0, _run_dir(tmp_path, []), 300)["ok"]


def test_the_table_has_a_row_per_point_and_rank_and_a_column_per_kind():
    from bench.fault_matrix import matrix

    def record(point, rank, kind, ok=True, step=10, rollbacks=0):
        return {"point": point, "rank": rank, "kind": kind, "target": f"g1.r{rank}",
                "fired_at_step": step, "wall_seconds": 50.4, "restarts": 1,
                "rollbacks": rollbacks, "commit": "abc1234", "ok": ok,
                "reasons": [] if ok else ["2 distinct final hashes"]}
    text = matrix([record("before_commit", 0, "kill"), record("before_commit", 0, "hang"),
                   record("before_commit", 1, "kill", ok=False),
                   record("before_commit", 1, "hang", step=None, rollbacks=1)])
    assert "| point | rank | struck | kill | hang |" in text
    assert ("| before_commit | 0 | g1.r0 | pass (step 10, 50 s, 1 restart(s)) | "
            "pass (step 10, 50 s, 1 restart(s)) |") in text
    assert ("| before_commit | 1 | g1.r1 | FAIL: 2 distinct final hashes | "
            "pass (50 s, 1 restart(s), 1 rollback(s)) |") in text
    assert "Code run: kill: abc1234; hang: abc1234." in text


def test_diloco_cells_run_the_same_job_in_diloco_mode(tmp_path) -> None:
    """``--diloco H`` adds ``ft.sync = "diloco"`` and H inner steps to the cells' config, which
    the trainer's config loader accepts; without it the config is the every-step one."""
    from bench.fault_matrix import diloco_ft
    from bench.soak import Settings, write_config
    from ftlm.config import load_config

    config = load_config(write_config(tmp_path / "d", Settings(steps=200, mtbf=0.0, ft=diloco_ft(4))))
    assert config.ft.sync == "diloco" and config.ft.diloco_inner_steps == 4
    plain = load_config(write_config(tmp_path / "p", Settings(steps=200, mtbf=0.0, ft=diloco_ft(0))))
    assert plain.ft.sync == "every_step"
