"""The pure parts of bench/convergence.py: the token-matched step count, reading a run's final
held-out loss and update statistics from its events, and the noise verdict. No training runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # bench/ is a top-level package beside src/, not installed
    sys.path.insert(0, str(REPO_ROOT))

from bench.convergence import compare, matched_steps, run_stats

STEP = 3072  # 3 groups x 8 samples x 128 tokens


def test_matched_steps_equal_tokens_when_a_multiple_of_a_full_step() -> None:
    assert matched_steps(150 * STEP, STEP) == 150


def test_matched_steps_within_half_a_step_of_the_tokens() -> None:
    for slices in range(2, 3 * 200):  # a chaos run commits whole slices, at least 2 here
        tokens = slices * STEP // 3
        assert abs(matched_steps(tokens, STEP) * STEP - tokens) <= STEP // 2, slices


def test_matched_steps_is_at_least_one_step() -> None:
    assert matched_steps(STEP // 3, STEP) == 1


def test_matched_steps_rounds_half_up() -> None:
    assert matched_steps(STEP + STEP // 2, STEP) == 2
    assert matched_steps(STEP + STEP // 2 - 1, STEP) == 1


@pytest.mark.parametrize("tokens, step", [(0, STEP), (-5, STEP), (STEP, 0)])
def test_matched_steps_refuses_non_positive_input(tokens: int, step: int) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        matched_steps(tokens, step)


def _commit(group: str, step: int, participants: int, lr: float) -> dict:
    return {"kind": "commit", "group": group, "step": step, "participants": participants,
            "lr": lr, "ts": float(step)}


def _eval(group: str, step: int, loss: float, tokens: int) -> dict:
    return {"kind": "eval", "group": group, "step": step, "loss": loss, "tokens": tokens,
            "ts": float(step) + 0.5}


def test_run_stats_counts_each_step_once_and_reads_the_last_eval() -> None:
    events = [
        *(_commit(g, 0, 3, 0.1) for g in ("g0", "g1", "g2")),
        *(_commit(g, 1, 2, 0.2) for g in ("g0", "g2")),  # g1 down
        _eval("g0", 1, 5.5, 5 * 1024), _eval("g2", 1, 5.5, 5 * 1024),
        *(_commit(g, 2, 3, 0.05) for g in ("g0", "g1", "g2")),
        *(_eval(g, 2, 5.25, 8 * 1024) for g in ("g0", "g1", "g2")),
    ]
    stats = run_stats(events, last_step=2, groups=3)
    assert stats.eval_losses == (5.25, 5.25, 5.25)
    assert stats.eval_tokens == 8 * 1024
    assert stats.updates == 3 and stats.degraded == 1
    assert stats.lr_sum == pytest.approx(0.35)


def test_run_stats_without_a_final_eval_says_so() -> None:
    events = [_commit("g0", 0, 3, 0.1), _eval("g0", 1, 5.5, 3072)]
    with pytest.raises(ValueError, match="no eval event at step 2"):
        run_stats(events, last_step=2, groups=3)


def test_run_stats_refuses_evals_that_disagree_on_tokens() -> None:
    events = [_eval("g0", 2, 5.0, 3072), _eval("g1", 2, 5.0, 2048)]
    with pytest.raises(ValueError, match="disagree on tokens"):
        run_stats(events, last_step=2, groups=3)


def test_compare_within_noise_only_below_two_pooled_std() -> None:
    none = [5.0, 5.1, 4.9]  # std 0.1 in both arms: pooled std 0.1
    near = compare(none, [x + 0.19 for x in none])
    far = compare(none, [x + 0.21 for x in none])
    assert near.pooled_std == pytest.approx(0.1)
    assert near.within_noise and not far.within_noise
    assert far.paired == pytest.approx((0.21, 0.21, 0.21))
