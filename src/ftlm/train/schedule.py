"""Learning-rate schedules and the degraded-mode LR policy, as pure functions of the step."""

from __future__ import annotations

import math

LR_POLICIES = ("none", "linear", "sqrt")


def lr_at(step: int, *, lr: float, steps: int, warmup_steps: int, schedule: str,
          min_lr_ratio: float, decay_fraction: float = 0.2) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    Warm-up is linear from lr/warmup to lr; ``cosine`` then decays to ``lr * min_lr_ratio`` at the
    last step; ``wsd`` holds the peak and decays linearly over the final ``decay_fraction`` of the
    steps; ``constant`` holds the peak.
    """
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    floor = lr * min_lr_ratio
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        span = max(1, steps - warmup_steps - 1)
        progress = min(1.0, (step - warmup_steps) / span)
        return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_steps = max(1, round(steps * decay_fraction))
        decay_start = steps - decay_steps
        if step < decay_start:
            return lr
        progress = min(1.0, (step - decay_start + 1) / decay_steps)
        return lr + (floor - lr) * progress
    raise ValueError(f"unknown schedule {schedule!r}")


def degraded_lr_scale(policy: str, participants: int, groups: int) -> float:
    """LR multiplier when only ``participants`` of ``groups`` replica groups take part in a step.

    ``none`` keeps the LR, ``linear`` scales by P/N, ``sqrt`` by sqrt(P/N) (the FT-HSDP paper found
    sqrt best). With every group present the scale is 1 under every policy.
    """
    if groups <= 0 or participants >= groups or policy == "none":
        return 1.0
    ratio = participants / groups
    if policy == "linear":
        return ratio
    if policy == "sqrt":
        return math.sqrt(ratio)
    raise ValueError(f"unknown LR policy {policy!r}; valid: {', '.join(LR_POLICIES)}")
