"""LR schedules (warm-up, cosine, wsd, constant) and the degraded-mode LR scale, as pure functions."""

from __future__ import annotations

import math

import pytest

from ftlm.train.schedule import degraded_lr_scale, lr_at

LR = 1e-3
STEPS = 100
WARMUP = 10
RATIO = 0.1


def _lrs(schedule: str, warmup: int = WARMUP, steps: int = STEPS, **kw) -> list[float]:
    return [lr_at(s, lr=LR, steps=steps, warmup_steps=warmup, schedule=schedule,
                  min_lr_ratio=RATIO, **kw) for s in range(steps)]


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_warmup_is_linear_up_to_the_peak(schedule: str) -> None:
    lrs = _lrs(schedule)
    assert lrs[:WARMUP] == pytest.approx([LR * (s + 1) / WARMUP for s in range(WARMUP)])
    assert lrs[WARMUP - 1] == pytest.approx(LR)
    increments = [b - a for a, b in zip(lrs[:WARMUP], lrs[1:WARMUP])]
    assert increments == pytest.approx([LR / WARMUP] * (WARMUP - 1))


def test_cosine_starts_at_peak_decays_monotonically_and_ends_at_min_lr() -> None:
    lrs = _lrs("cosine")
    after = lrs[WARMUP:]
    assert after[0] == pytest.approx(LR)
    assert all(b <= a for a, b in zip(after, after[1:]))
    assert lrs[-1] == pytest.approx(LR * RATIO)
    # Half-way through the decay the cosine is at the mid-point between peak and floor
    # (steps=31, warm-up 10: the decay spans steps 10..30, so step 20 is its middle).
    mid = lr_at(20, lr=LR, steps=31, warmup_steps=10, schedule="cosine", min_lr_ratio=RATIO)
    assert mid == pytest.approx(LR * (1 + RATIO) / 2)
    # Past the last step (e.g. steps raised on resume) it stays at the floor, never climbs back.
    assert lr_at(STEPS + 50, lr=LR, steps=STEPS, warmup_steps=WARMUP, schedule="cosine",
                 min_lr_ratio=RATIO) == pytest.approx(LR * RATIO)


def test_cosine_without_warmup_starts_at_peak() -> None:
    lrs = _lrs("cosine", warmup=0)
    assert lrs[0] == pytest.approx(LR)
    assert lrs[-1] == pytest.approx(LR * RATIO)


def test_wsd_holds_the_peak_then_decays_linearly_to_min_lr() -> None:
    lrs = _lrs("wsd", decay_fraction=0.2)
    decay_start = STEPS - 20
    assert lrs[WARMUP:decay_start] == pytest.approx([LR] * (decay_start - WARMUP))
    decay = lrs[decay_start:]
    assert all(b < a for a, b in zip(decay, decay[1:]))
    steps_down = [a - b for a, b in zip(decay, decay[1:])]
    assert steps_down == pytest.approx([steps_down[0]] * len(steps_down))
    assert lrs[-1] == pytest.approx(LR * RATIO)


def test_constant_holds_the_peak_after_warmup() -> None:
    assert _lrs("constant")[WARMUP:] == pytest.approx([LR] * (STEPS - WARMUP))


def test_unknown_schedule_is_refused() -> None:
    with pytest.raises(ValueError, match="linear"):
        lr_at(50, lr=LR, steps=STEPS, warmup_steps=WARMUP, schedule="linear", min_lr_ratio=RATIO)


@pytest.mark.parametrize("policy, expected", [
    ("none", 1.0), ("linear", 2 / 3), ("sqrt", math.sqrt(2 / 3))])
def test_degraded_scale_with_two_of_three_groups(policy: str, expected: float) -> None:
    assert degraded_lr_scale(policy, 2, 3) == pytest.approx(expected)


@pytest.mark.parametrize("policy", ["none", "linear", "sqrt"])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_degraded_scale_is_one_with_every_group_present(policy: str, n: int) -> None:
    assert degraded_lr_scale(policy, n, n) == 1.0


def test_degraded_scale_with_unknown_group_count_is_one() -> None:
    # groups=0 means "not configured" (a lone trainer): no scaling.
    assert degraded_lr_scale("sqrt", 1, 0) == 1.0


def test_degraded_scale_refuses_unknown_policy() -> None:
    with pytest.raises(ValueError, match="cube"):
        degraded_lr_scale("cube", 1, 2)
