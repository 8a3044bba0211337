"""Chaos: which process the local supervisor breaks next, how, and when (seeded).

Responsible for: the draws of the failure schedule: exponentially distributed times between
failures, the target (a replica group, or the coordinator when it is in the mix), the rank of a
multi-rank group and the signal (SIGKILL, SIGSTOP for a hang, SIGTERM for a preemption). The same
seed gives the same draws.

Not responsible for: which groups may be hit right now (the supervisor passes the candidates:
never the last up-to-date group, nothing once a group reached the last step), sending the signal,
or recording it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

COORDINATOR = "coordinator"
"""The target name of the coordinator process."""
ALL_RANKS = -1
"""``Fault.rank`` of a preemption that reaches every rank of the group."""


@dataclass(frozen=True)
class Fault:
    """One failure to inject."""

    target: str
    """A group name, or ``COORDINATOR``."""
    rank: int
    """Rank of the group to signal (0 for the coordinator); ``ALL_RANKS`` for every rank."""
    signal: str
    """``SIGKILL`` (a crash), ``SIGSTOP`` (a hang) or ``SIGTERM`` (a preemption notice)."""


class Chaos:
    """The seeded failure schedule of one job.

    ``hang``: half the failures of groups are SIGSTOPs, on any rank (a hung non-leader rank keeps
    its group's heartbeat alive: only the progress timeout catches it). ``coordinator``: the
    coordinator is one more target, drawn like a group (SIGKILL only: it holds only soft state).
    ``preempt``: a third of the failures of groups are SIGTERMs instead, a spot reclaim or a
    preemption at any moment (start-up, recovery, the end of the run included): to every rank of
    the group at once as platforms send it, or, one time in three, to one rank alone (the ranks
    of a real group get it each at its own moment; one rank is the extreme of that). The group
    must leave gracefully and come back; it is not a failure. Without ``preempt`` the draws are
    those of earlier versions (same seed, same schedule).

    ``regular``: a failure every ``mtbf`` seconds exactly instead of exponential gaps (two runs
    compared side by side then see failures at the same times). ``participants_only``: only
    groups that trained in the last quorum are hit, never a spare or a group still starting or
    recovering (the supervisor filters its candidates by it), so that a job with spares and one
    without see the same number of training failures.
    """

    def __init__(self, mtbf: float, seed: int, hang: bool = False, coordinator: bool = False,
                 preempt: bool = False, regular: bool = False, participants_only: bool = False):
        self.mtbf = mtbf
        self.hang = hang
        self.coordinator = coordinator
        self.preempt = preempt
        self.regular = regular
        self.participants_only = participants_only
        self.rng = random.Random(seed)

    def next_gap(self) -> float | None:
        """Seconds until the next failure; None when chaos is off."""
        if self.mtbf <= 0:
            return None
        return self.mtbf if self.regular else self.rng.expovariate(1.0 / self.mtbf)

    def choose(self, groups: list[str], ranks: int, coordinator_up: bool) -> Fault | None:
        """The next failure among ``groups`` (and the coordinator when it is in the mix and up);
        None when there is no target."""
        targets = list(groups) + ([COORDINATOR] if self.coordinator and coordinator_up else [])
        if not targets:
            return None
        target = self.rng.choice(targets)
        if target == COORDINATOR:
            return Fault(COORDINATOR, 0, "SIGKILL")
        if self.preempt and self.rng.random() < 1 / 3:
            alone = ranks > 1 and self.rng.random() < 1 / 3
            return Fault(target, self.rng.randrange(ranks) if alone else ALL_RANKS, "SIGTERM")
        hang = self.hang and self.rng.random() < 0.5
        return Fault(target, self.rng.randrange(ranks), "SIGSTOP" if hang else "SIGKILL")
