"""Whose fault a non-finite loss or gradient is: the training, the data, or one group's device.

A group whose loss or gradient is not finite fails the step for every group (its flag travels
with the loss through the all-reduce), so no replica ever applies it. The flag used to be one
number, and every group stopped the job after three such attempts in a row ("lower train.lr"):
one group with a faulty device (silent data corruption is a known failure at scale) ended the
whole job, which fault tolerance exists to prevent. Now the flag is one entry per participant, so
every group sees which participants were non-finite (the *origins*) and on which samples (a
participant's slice is a fixed range of global positions at the step's cursor), and judges:

* every participant non-finite, ``NONFINITE_LIMIT`` attempts in a row: the training diverged
  (``TrainingDiverged``, exit status 2: a restart would diverge again) -- as before, unless
  members are catching up: a lone participant waits for them to train too;
* only some, this group among them, ``NONFINITE_LIMIT`` attempts in a row: this group, or the
  samples of its slice. It stops as a fault (``NonFiniteReplica``, status 1) and is restarted
  on a fresh process (on a cluster, often another node); the others go on without it;
* this group non-finite on samples that another group was non-finite on before: the samples (or
  the state) break training wherever they go, not a device: ``TrainingDiverged``, naming them.
  So samples that break training cost one restart of the first group that met them, and then
  stop the job with the right diagnosis, instead of being taken for a device fault forever.

Responsible for: that judgement, from what every group sees after the all-reduce. Not
responsible for: computing the flags (``ftlm.train.session``), the restart (the launcher).
"""

from __future__ import annotations

from collections import deque

from ftlm.errors import FaultError, FtlmError

__all__ = ["NONFINITE_LIMIT", "NonFiniteJudge", "NonFiniteReplica", "TrainingDiverged"]

NONFINITE_LIMIT = 3
"""Attempts in a row with a non-finite loss or gradient after which training stops (the data and
the state are deterministic, so a retry sees the same numbers)."""

REMEMBERED = 256
"""Sample ranges that were non-finite in other groups, remembered to tell data from a device."""


class TrainingDiverged(FtlmError):
    """The loss or gradient stayed non-finite: training cannot continue from this state."""


class NonFiniteReplica(FaultError):
    """This group's loss or gradient stayed non-finite while its peers' were finite: a faulty
    device (or samples that break training, which the next group to train them tells)."""


class NonFiniteJudge:
    """One group's verdict on the non-finite attempts it took part in (every rank of the group
    sees the same values, so its ranks agree)."""

    def __init__(self, limit: int = NONFINITE_LIMIT) -> None:
        self.limit = limit
        self.in_a_row = 0
        """Attempts in a row this group was an origin in."""
        self._elsewhere: deque[tuple[int, int]] = deque(maxlen=REMEMBERED)

    def committed(self) -> None:
        """A step committed: attempts in a row start again (what broke elsewhere is kept)."""
        self.in_a_row = 0

    def failed(self, step: int, origins: list[int], participants: int, mine: int | None,
               cursor: int, batch_size: int, recovering: int = 0) -> list[tuple[int, int]]:
        """A failed attempt of ``step``: ``origins`` are the participant indices whose loss or
        gradient was not finite (empty: it failed for another reason), ``mine`` this group's
        index (None: not a participant), ``cursor`` the step's first sample position,
        ``recovering`` the quorum's members catching up (no loss of their own yet). Returns the
        origins' sample ranges; raises when this group must stop."""
        if not origins:
            self.in_a_row = 0
            return []
        ranges = [(cursor + i * batch_size, cursor + (i + 1) * batch_size) for i in origins]
        if mine not in origins:
            self.in_a_row = 0
            if mine is not None:  # (a recovering group's cursor is not the step's)
                self._elsewhere.extend(r for r in ranges if r not in self._elsewhere)
            return ranges
        start, stop = cursor + mine * batch_size, cursor + (mine + 1) * batch_size
        seen = [(a, b) for a, b in self._elsewhere if a < stop and start < b]
        if seen:
            raise TrainingDiverged(
                f"the samples at positions [{start}, {stop}) made the loss or gradient non-finite "
                f"here at step {step} after positions {_spans(seen)} did in another group: "
                "the data or the model breaks there, not a device; inspect those samples, lower "
                "train.lr or set train.grad_clip, then resume from a checkpoint")
        self.in_a_row += 1
        if self.in_a_row < self.limit:
            return ranges
        if len(origins) >= participants:
            if recovering:
                # Nothing to compare with yet (a lone participant): a member catching up trains
                # the next attempts too once it holds the state, and tells a device from the run.
                return ranges
            raise TrainingDiverged(
                f"the loss or gradient was not finite in {self.in_a_row} attempts in a row at "
                f"step {step} (no update was applied); lower train.lr, raise "
                "train.warmup_steps or set train.grad_clip, then resume from a checkpoint")
        raise NonFiniteReplica(
            f"this group's loss or gradient was not finite in {self.in_a_row} attempts in a row "
            f"at step {step} (samples at positions [{start}, {stop})) while {participants - len(origins)} "
            f"of its {participants - 1} peers' were finite: a faulty device, or samples that break "
            "training (then the next group to train them stops the job); this group stops so "
            "that the others go on, and restarts")


def _spans(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"[{a}, {b})" for a, b in sorted(set(ranges)))
