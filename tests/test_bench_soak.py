"""The soak's section table: one row per layout, counts summed over its runs (the runs themselves
are a benchmark: ``bench.soak``)."""

from __future__ import annotations

from bench.soak import PREEMPT_SUMMED, SUMMED, layout_headers, layout_rows


def _run(seed: int, groups: int, ok: bool = True, distinct: int = 1, **counts) -> dict:
    record = {"seed": seed, "groups": groups, "ranks": 1, "wall_seconds": 60.0 + seed, "ok": ok,
              "reasons": [] if ok else ["1 injected failure(s) never detected"],
              "hashes": f"{distinct} distinct of {groups} for {groups} groups"}
    record.update({k: 0 for k in SUMMED + PREEMPT_SUMMED})
    record.update(counts)
    return record


def test_a_layout_row_sums_its_runs_and_counts_the_passes():
    runs = [_run(0, 3, kills=2, hangs=1, restarts=3, detected=3),
            _run(2, 3, ok=False, distinct=2, kills=1, coordinator_kills=4, detected=4,
                 preemptions=2, preempted_exits=2),
            _run(1, 4, hangs=5, detected=5)]
    head = layout_headers(preempt=True)
    rows = {r[0]: dict(zip(head, r)) for r in layout_rows(runs, preempt=True)}
    three = rows["3x1"]
    assert (three["runs"], three["passed"], three["median wall s"]) == (2, 1, "61")
    assert three["faults"] == 2 + 1 + 1 + 4 + 2  # kills, hangs, coordinator kills, preemptions
    assert (three["group kills"], three["coordinator kills"], three["preemptions"]) == (3, 4, 2)
    assert three["identical final hashes"] == "1 of 2"
    assert rows["4x1"]["group hangs"] == 5 and rows["4x1"]["passed"] == 1
    assert len(head) == len(layout_rows(runs, preempt=True)[0])
    assert "preemptions" not in layout_headers(preempt=False)
    assert len(layout_headers(False)) == len(layout_rows(runs, preempt=False)[0])
