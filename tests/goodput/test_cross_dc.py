"""``ftlm simulate --cross-dc``: the step, traffic and failure cost of each synchronisation mode
with the groups spread over regions (``ftlm.goodput.cross_dc``), against closed forms."""

from __future__ import annotations

import pytest

from ftlm.errors import ConfigError
from ftlm.goodput.cross_dc import CrossDC, allreduce_seconds, failure_stall, project, step_and_sync


def test_a_ring_between_regions_sends_2_r_minus_1_over_r_of_the_payload() -> None:
    assert allreduce_seconds(1e9, 2, 8.0, 0.0) == pytest.approx(1.0)  # 1 GB over 8 Gbit/s, half twice
    assert allreduce_seconds(1e9, 4, 8.0, 0.05) == pytest.approx(1.5 + 6 * 0.05)
    assert allreduce_seconds(1e9, 1, 8.0, 0.05) == 0.0


def test_each_mode_pays_its_traffic_as_the_module_says() -> None:
    job = CrossDC(params=1e9, rtt=0.0)
    t = job.compute_seconds
    step, sync, nbytes, per = step_and_sync(job, "every_step", 2, 1.0)
    assert (nbytes, per) == (2e9, 1) and sync == pytest.approx(16.0)
    assert step == pytest.approx(t + sync - 2 * t / 3)  # overlapped with the backward pass
    step, sync, nbytes, per = step_and_sync(job, "diloco", 2, 1.0)
    assert (nbytes, per) == (4e9, 100) and step == pytest.approx(t + sync / 100)
    step, sync, nbytes, per = step_and_sync(job, "streaming", 2, 1.0)
    assert (nbytes, per) == (0.25e9, 25) and step == pytest.approx(t + (sync - t) / 25)
    fast = step_and_sync(job, "every_step", 2, 1e9)[0]
    assert fast == pytest.approx(t, rel=1e-3)  # an infinitely fast link: compute alone


def test_a_failure_costs_diloco_half_a_phase_of_everyone() -> None:
    """As the runtime does it: the protocol step fails for all, every group redoes its phase."""
    job = CrossDC(params=1e9, rtt=0.0)
    step, sync, _, per = step_and_sync(job, "every_step", 2, 10.0)
    assert failure_stall(job, "every_step", step, sync, per) == pytest.approx(job.stall_beyond_step + step)
    step, sync, _, per = step_and_sync(job, "diloco", 2, 10.0)
    redone = sync * sync / (per * step)
    assert failure_stall(job, "diloco", step, sync, per) == pytest.approx(job.stall_beyond_step + 50 * step + redone)
    step, sync, _, per = step_and_sync(job, "streaming", 2, 10.0)
    assert per == 25 and failure_stall(job, "streaming", step, sync, per) > job.stall_beyond_step + 12.5 * step


def test_on_slow_links_streaming_beats_diloco_beats_every_step() -> None:
    rows = {r.mode: r for r in project(CrossDC(), 2, 1.0, runs=2)}
    assert rows["streaming"].days_to_target < rows["diloco"].days_to_target < rows["every_step"].days_to_target
    assert all(0 < r.ett <= 1 for r in rows.values())


def test_bad_settings_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="multiple of fragments"):
        CrossDC(inner_steps=10, fragments=4)
    with pytest.raises(ConfigError, match="mfu"):
        CrossDC(mfu=1.5)
    with pytest.raises(ConfigError, match="regions=1"):
        project(CrossDC(), 1, 10.0)


def test_the_command_prints_the_table_with_its_assumptions(capsys) -> None:
    from ftlm.cli import main
    assert main(["simulate", "--cross-dc", "--regions", "2", "--gbits", "10", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert "70B parameters" in out and out.count("| 2 | 10 |") == 3
    assert main(["simulate", "--cross-dc", "--regions", "two"]) != 0
    assert "--regions='two': give comma-separated numbers" in capsys.readouterr().err
