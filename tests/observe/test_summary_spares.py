"""``summary.json``'s ``spares`` field (``ftlm.observe.summary.spare_figures``) from a record."""

from __future__ import annotations

from ftlm.observe.summary import spare_figures


def event(ts: float, kind: str, group: str = "", **fields: object) -> dict:
    return {"ts": ts, "kind": kind, "group": group, "rank": 0, "step": fields.pop("step", -1), **fields}


def test_a_job_without_spares_has_no_spares_field() -> None:
    assert spare_figures([event(0.0, "run_start", "supervisor", groups=3),
                          event(1.0, "commit", "g0", step=0, participants=3)]) is None


def test_promotions_are_timed_from_the_failure_of_the_group_they_replaced() -> None:
    events = [
        event(0.0, "run_start", "supervisor", groups=3, spares=1),
        event(1.0, "commit", "g3", step=0, participants=3, spare=True),
        event(5.0, "failure_injected", "g1", signal="SIGKILL"),
        event(5.2, "failure_injected", "g0", signal="none"),  # a slowed link fails nobody
        event(5.6, "spare_promoted", "coordinator", step=9, promoted=["g3"], replaced=["g1"], seconds=0.1),
        # g2 fell behind (no failure event): the coordinator's own seconds are kept.
        event(9.0, "spare_promoted", "coordinator", step=20, promoted=["g1"], replaced=["g2"], seconds=0.7),
    ]
    assert spare_figures(events) == {"configured": 1, "promotions": 2,
                                     "failure_to_promotion_seconds": [0.6, 0.7], "spare_commits": 1}
