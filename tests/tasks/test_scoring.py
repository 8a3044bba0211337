"""pass@k: the unbiased estimator against brute-force enumeration, and the per-family summary."""

from __future__ import annotations

import itertools
import math

import pytest

from ftlm.errors import ConfigError
from ftlm.tasks.scoring import pass_at_k, summarise


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_pass_at_k_equals_the_share_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
            assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_pass_at_1_is_the_share_correct_and_large_n_is_stable():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert 0.0 < pass_at_k(1000, 1, 10) < 1.0


def test_bad_counts_are_refused():
    for n, c, k in ((3, 4, 1), (3, 1, 0), (3, 1, 4)):
        with pytest.raises(ConfigError):
            pass_at_k(n, c, k)


def test_summary_per_family_with_interval():
    out = summarise(["add", "add", "sort", "sort"], [4, 0, 2, 2], n=4, ks=[1, 2])
    assert out["all"]["tasks"] == 4 and out["add"]["tasks"] == 2
    assert out["all"]["pass@1"]["mean"] == pytest.approx(0.5)
    assert out["add"]["pass@1"]["mean"] == pytest.approx(0.5)
    assert out["sort"]["pass@2"]["mean"] == pytest.approx(1 - 1 / 6)
    assert out["all"]["pass@1"]["ci95"] > 0
    with pytest.raises(ConfigError):
        summarise([], [], n=1, ks=[1])
