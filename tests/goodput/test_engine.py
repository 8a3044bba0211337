"""The goodput simulator against closed forms, the FT-HSDP paper's two numbers, and its own
bookkeeping (every GPU-hour is in exactly one state)."""

from __future__ import annotations

import math

import pytest

from ftlm.errors import ConfigError
from ftlm.goodput import JobModel, estimate, job_model_from_mtbf, run, young_daly_interval
from ftlm.goodput.analytic import checkpoint_restart_ett, ft_ett_without_stall, paper_ft_ett
from ftlm.goodput.presets import PAPER_ETT, paper_ft, paper_sync

DAY = 86400.0


def _no_stall(**kw) -> JobModel:
    return JobModel(**{"gpus_per_group": 1, "detection": 0.0, "stall": 0.0, **kw})


def test_one_group_exponential_failures_fixed_restart_matches_the_closed_form():
    # One group: the job trains unless it failed within the last `restart` seconds.
    model = job_model_from_mtbf(1000 / 60, groups=1, gpus_per_group=1, detection=0.0, stall=0.0,
                                restart=200.0, duration=20 * DAY)
    analytic = ft_ett_without_stall(model)
    assert analytic == pytest.approx(math.exp(-0.2))
    assert estimate(model, runs=2).ett == pytest.approx(analytic, abs=0.01)


def test_twelve_groups_without_stall_lose_only_the_restarting_groups_share():
    model = job_model_from_mtbf(18.0, groups=12, gpus_per_group=8, detection=0.0, stall=0.0,
                                restart=600.0, state_bytes_per_gpu=1e9, catchup_bandwidth=1e7,
                                duration=30 * DAY)
    assert model.catchup == pytest.approx(100.0)
    assert estimate(model, runs=2).ett == pytest.approx(ft_ett_without_stall(model), abs=0.01)


def test_checkpoint_restart_matches_dalys_expected_segment_time():
    model = job_model_from_mtbf(30.0, groups=4, gpus_per_group=2, mode="checkpoint_restart",
                                restart=300.0, checkpoint_cost=20.0, duration=30 * DAY)
    assert model.interval == pytest.approx(young_daly_interval(20.0, 1800.0))
    assert estimate(model, runs=2).ett == pytest.approx(checkpoint_restart_ett(model), abs=0.01)


def test_young_daly_interval_is_the_default_and_a_given_interval_wins():
    model = paper_sync()
    assert model.interval == pytest.approx(math.sqrt(2 * 30.0 * 18 * 60), rel=1e-9)
    assert model.with_changes(checkpoint_interval=100.0).interval == 100.0


@pytest.mark.parametrize("preset,mode", [(paper_sync, "checkpoint_restart"), (paper_ft, "ft")])
def test_the_papers_two_numbers_are_reproduced_within_three_points(preset, mode):
    model = preset(duration=10 * DAY)
    assert model.groups * model.gpus_per_group == 98_304
    assert model.job_mtbf == pytest.approx(18 * 60)
    assert estimate(model, runs=2).ett == pytest.approx(PAPER_ETT[mode], abs=0.03)


def test_the_papers_linear_estimate_is_its_80_percent():
    assert paper_ft_ett(18 * 60, 180, 600, 12) == pytest.approx(0.80, abs=0.005)


def test_every_gpu_hour_is_in_one_state_and_lost_hours_explain_the_ett():
    model = paper_ft(duration=5 * DAY).with_changes(spares=2, spot_preemptions_per_gpu_hour=1e-5,
                                                    spot_notice=0.0)
    result = run(model, seed=3)
    allocated = model.allocated_gpus * model.duration / 3600
    assert sum(result.gpu_hours.values()) == pytest.approx(allocated, rel=1e-9)
    training = model.groups * model.gpus_per_group * model.duration / 3600
    assert sum(result.lost_gpu_hours.values()) == pytest.approx(training * (1 - result.ett),
                                                                rel=1e-6)
    assert result.preemptions > 0 and result.failures > 0


def test_spares_stalls_and_notice_move_ett_the_right_way():
    base = paper_ft(duration=5 * DAY)
    ett = lambda m: estimate(m, runs=2).ett
    assert ett(base.with_changes(spares=1)) > ett(base) + 0.01
    assert ett(base.with_changes(stall=60.0)) > ett(base) + 0.05
    spot = base.with_changes(spot_preemptions_per_gpu_hour=2e-6, rejoin_stall=5.0)
    assert ett(spot.with_changes(spot_notice=60.0)) > ett(spot.with_changes(spot_notice=0.0))
    assert ett(spot) < ett(base)


def test_the_same_seed_gives_the_same_run():
    model = paper_ft(duration=DAY)
    assert run(model, seed=7).ett == run(model, seed=7).ett != run(model, seed=8).ett


@pytest.mark.parametrize("changes,match", [
    ({"groups": 0}, "groups=0"),
    ({"stall": 10.0, "detection": 60.0}, "stall=10 is shorter than detection=60"),
    ({"mode": "sync"}, "mode='sync'"),
    ({"gpu_mtbf_hours": float("nan")}, "gpu_mtbf_hours=nan"),
    ({"restart": -1.0}, "restart=-1"),
    ({"speed_by_participants": (0.5, 1.0)}, "one per participant count"),
    ({"mode": "checkpoint_restart", "checkpoint_cost": 0.0}, "Young/Daly"),
])
def test_bad_job_models_are_one_line_config_errors(changes, match):
    with pytest.raises(ConfigError, match=match):
        paper_ft().with_changes(**changes)


def test_unknown_field_names_the_valid_ones():
    with pytest.raises(ConfigError, match="unknown job model field.*valid: groups"):
        paper_ft().with_changes(group=3)


def test_protect_last_never_strikes_the_only_training_group():
    model = job_model_from_mtbf(1.0, groups=1, gpus_per_group=1, detection=0.0, stall=0.0,
                                restart=30.0, startup=60.0, duration=DAY, protect_last=True)
    result = run(model, seed=1)
    assert result.failures > 1000  # chaos fired, and found no target
    assert result.ett == pytest.approx(1 - 60.0 / DAY)


def test_start_up_teardown_and_a_replayed_failure_cost_exactly_their_seconds():
    model = _no_stall(groups=2, gpu_mtbf_hours=1e12, restart=50.0, startup=60.0, teardown=40.0,
                      duration=1000.0, failure_trace=((100.0, 1), (990.0, 0)))
    result = run(model)
    assert result.failures == 1  # the second one falls in the teardown: nothing left to break
    assert result.ett == pytest.approx(1 - (60 + 40 + 50 / 2) / 1000)
    assert result.lost_gpu_hours["teardown"] == pytest.approx(2 * 40 / 3600)


@pytest.mark.parametrize("changes,match", [
    ({"failure_trace": ((10.0, 5),)}, "group index in"),
    ({"failure_trace": ((-1.0, 0),)}, "time in"),
    ({"startup": 600.0, "teardown": 500.0, "duration": 1000.0}, "leave no time to train"),
])
def test_bad_traces_and_phases_are_config_errors(changes, match):
    with pytest.raises(ConfigError, match=match):
        _no_stall(groups=2).with_changes(**changes)


def test_a_current_spare_takes_a_failed_place_without_catch_up_and_a_stale_one_does_not():
    """One failure of a training group at t=100 of 1000 s, with a long catch-up (300 s): a current
    spare trains in its place after ``promotion`` seconds, so only the stall is lost; the failed
    group comes back as the spare after its restart and catch-up. With a second failure at t=110
    (the promoted spare's place), no spare is current (the first group is still restarting):
    that place stays empty until the repaired group is current, which costs the job the time a
    group without spares would lose."""
    base = _no_stall(groups=2, duration=1000.0, restart=50.0, catchup_extra=300.0,
                     failure_trace=((100.0, 0),))
    without = run(base).ett
    spare = run(base.with_changes(spares=1, promotion=1.0)).ett
    assert without == pytest.approx(1 - (50 + 300) / 2 / 1000, abs=1e-9)
    assert spare == pytest.approx(1 - 1.0 / 2 / 1000, abs=1e-9)
    # The spare (slot 2) is promoted at 101; the place it took fails at 110; slot 0 restarts at
    # 150, catches up until 450 as a spare, then trains: the place was empty 110..450.
    twice = run(base.with_changes(spares=1, promotion=1.0,
                                  failure_trace=((100.0, 0), (110.0, 2)))).ett
    assert twice == pytest.approx(1 - (1.0 + 340.0) / 2 / 1000, abs=1e-9)
