"""Scoring several samples per task: the unbiased pass@k estimator and per-family summaries.

``pass_at_k(n, c, k) = 1 - C(n - c, k) / C(n, k)``: the probability that at least one of ``k``
samples drawn without replacement from ``n`` samples, ``c`` of them correct, is correct (the
estimator of Chen et al., 2021, "Evaluating Large Language Models Trained on Code"). Averaged
over tasks it estimates pass@k of the model; ``summarise`` adds a normal-approximation 95 %
interval over tasks and a per-family breakdown.

Not responsible for: sampling (``ftlm eval``) or checking one completion (``ftlm.tasks.check``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ftlm.errors import ConfigError


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with ``c`` correct out of ``n`` samples (``1 <= k <= n``)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ConfigError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # 1 - prod_{i = n-c+1}^{n} (1 - k/i), the numerically stable form of the binomial ratio.
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _mean_ci(values: Sequence[float]) -> dict[str, float]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return {"mean": mean, "ci95": float("nan")}
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return {"mean": mean, "ci95": 1.96 * math.sqrt(var / len(values))}


def summarise(families: Sequence[str], correct: Sequence[int], n: int,
              ks: Sequence[int]) -> dict:
    """pass@k for each ``k`` over all tasks and per family: ``{"all": {"pass@k": {mean, ci95}},
    "<family>": ...}``; ``correct[i]`` is the number of correct samples (of ``n``) of task ``i``."""
    if len(families) != len(correct) or not correct:
        raise ConfigError("summarise needs one correct-count per task and at least one task")
    groups = {"all": list(range(len(correct)))}
    for i, family in enumerate(families):
        groups.setdefault(family, []).append(i)
    out = {}
    for name, members in groups.items():
        out[name] = {"tasks": len(members)}
        for k in ks:
            out[name][f"pass@{k}"] = _mean_ci([pass_at_k(n, correct[i], k) for i in members])
    return out
