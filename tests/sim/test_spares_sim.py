"""Hot spares under the protocol simulator (``SimConfig.spares``): spares die, hang and fall behind
(half the faults strike a current spare), participants fail and spares are promoted; every
invariant holds, **spares** among them (docs/ft-protocol.md, 'The simulator'). ``ftlm sim check
--groups 3 --spares 1 --seeds 501`` is the longer run (BENCHMARKS ``sim_check`` shape)."""

from __future__ import annotations

import pytest

from ftlm.sim.check import check, format_report
from ftlm.sim.group import GroupModel
from ftlm.sim.protocol import SimConfig, run

SPARES = SimConfig(groups=4, spares=1, steps=100)
"""Three training places and one spare."""


def test_spares_are_promoted_and_every_invariant_holds() -> None:
    report = check(10, SPARES, jobs=2)
    assert report.ok, format_report(report, SPARES)
    assert report.spare_quorums > 50 and report.promotions > 0, format_report(report, SPARES)
    assert "spares promoted" in format_report(report, SPARES)


def test_two_spares_beside_two_places_hold_every_invariant() -> None:
    config = SimConfig(groups=4, spares=2, steps=80)
    report = check(4, config, jobs=2)
    assert report.ok, format_report(report, config)
    assert report.promotions > 0


def test_a_spare_that_skips_the_average_is_caught_before_it_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: a spare reports every committed step (its ``GroupProtocol`` moves) but never
    applies the average (its state stays): the simulator finds it as a spare or when promoted,
    before a step trains on a stale state."""
    real = GroupModel.outcome

    def forgetful(self: GroupModel, inc, q, ok: bool, why: str = "") -> None:  # type: ignore[no-untyped-def]
        role, before = inc.proto.role, inc.state
        real(self, inc, q, ok, why)
        if role is not None and role.spare:
            inc.state = before

    monkeypatch.setattr(GroupModel, "outcome", forgetful)
    errors = [run(seed, SPARES).error for seed in range(4)]
    assert any("is a spare of quorum" in e or "is a participant of quorum" in e for e in errors), errors


def test_a_job_with_spares_replays_from_the_command_it_prints() -> None:
    from ftlm.sim.check import replay_command
    assert replay_command(7, 100, SPARES) == "ftlm sim check --start 7 --seeds 1 --steps 100 --groups 3 --spares 1"
