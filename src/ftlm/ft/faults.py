"""Failure injection at named points of the step protocol, for tests and chaos drills.

A group process started with ``FTLM_FAULT=<point>[@<step>[+]]`` kills itself with SIGKILL (or
stops itself with SIGSTOP when the point is prefixed ``hang:``) the first time it reaches that
point at that step (any step when omitted; with ``+``, at that step or the first time after it:
a group may not reach the point at that very step, as one that started late and was still
recovering then, and a planned fault must fire). It writes a ``failure_injected`` event first, so
the run can account for it. Prefixed ``term:``, the process sends itself SIGTERM there and goes
on: a stop request (a preemption notice) landing at that moment in that one rank, which is not a
failure and logs no event (the group's ``member_left`` and ``group_exit`` record the stop). The
launcher passes one entry per incarnation (``faults={"g1": [...]}``); an entry may list several
points separated by commas (``slow_serve,before_commit@12``), each firing once.

``slow_serve`` is not a crash but a slow link: the first time the group serves a chunk of state
it holds the transfer until the group committed ``FTLM_FAULT_STEPS`` more steps (when set; at
most ``FTLM_FAULT_SECONDS``, default 3, otherwise exactly that long), so a recovering peer's pull
spans several steps however fast or loaded the machine is (catch-up tests).

Three entries are conditions, not moments, and kill nothing: ``nonfinite@STEP`` makes every attempt
of this process from that step on non-finite (its loss and gradient count as NaN: a faulty
device, every step when omitted), and ``nonfinite_sample@POSITION`` every attempt whose slice holds
that global sample position (samples that break training: give it to every group and incarnation).
The trainer asks ``FaultSchedule.nonfinite``; ``ftlm.train.nonfinite`` judges what follows.
``allreduce_fails@STEP`` fails this process's cross-group all-reduce from that step on whenever
it has a peer, as a bad link does: it aborts the process group, so every peer's all-reduce fails
too, and the coordinator must find the group (``ftlm.ft.quorum.Probe``). ``bitflip@STEP`` flips
one bit of one parameter in this process's state when it takes part in step STEP or the first
step after it (``bitflip_moment@STEP``: of an optimizer moment), once: silent data corruption,
which the coordinator must find by its state digest (``ftlm.ft.integrity``) and retire the group.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ftlm.errors import ConfigError

log = logging.getLogger("ftlm.ft.faults")

POINTS = (
    "before_allreduce",    # gradients computed, collective not entered
    "inside_allreduce",    # between two buckets of the collective: peers are mid-operation
    "after_allreduce",     # collective finished, commit not yet decided
    "before_commit",       # vote passed, optimizer step not applied
    "during_receive",      # a recovering group, after its first chunk of state arrived
    "during_serve",        # a source group, while serving a chunk to a recovering group
    "during_replay",       # a recovering group, after replaying its first buffered update
    "slow_serve",          # a source group: the first transfer it serves stalls (not a crash)
)
CONDITIONS = (
    "nonfinite",           # from step STEP on (every step without one), this process's loss is NaN
    "nonfinite_sample",    # a slice holding sample position POSITION gives a NaN loss (required)
    "allreduce_fails",     # from step STEP on, this process's cross-group all-reduce fails (a bad link)
    "bitflip",             # at step STEP (or the first step after it it takes part in), one parameter bit flips
    "bitflip_moment",      # the same, in an optimizer moment
)
BITFLIPS = {"bitflip": "param", "bitflip_moment": "moment"}


@dataclass
class FaultPlan:
    point: str
    step: int | None
    hang: bool = False
    fired: bool = False
    term: bool = False
    or_later: bool = False
    """``@STEP+``: fire at ``step`` or the first time the point is reached at a later step."""

    @classmethod
    def parse(cls, text: str) -> FaultPlan | None:
        if not text:
            return None
        hang, term = text.startswith("hang:"), text.startswith("term:")
        body = text[5:] if hang or term else text
        point, _, step = body.partition("@")
        or_later = step.endswith("+")
        step = step.removesuffix("+")
        if term and point == "slow_serve":
            raise ConfigError(f"FTLM_FAULT={text!r}: slow_serve is a slow link, not a moment to "
                              "stop at; give 'term:' one of the other points")
        if point in CONDITIONS and (hang or term or (point == "nonfinite_sample" and not step)):
            raise ConfigError(f"FTLM_FAULT={text!r}: {point} is a condition, not a moment: no "
                              "'hang:' or 'term:'" + (", and it needs '@POSITION'"
                                                      if point == "nonfinite_sample" else ""))
        if point in CONDITIONS and or_later:
            raise ConfigError(f"FTLM_FAULT={text!r}: {point} is a condition, not a moment: no '+' "
                              "(a condition holds from its step on already)")
        if point not in POINTS + CONDITIONS:
            raise ConfigError(f"FTLM_FAULT={text!r}: unknown point {point!r}; valid: "
                              f"{', '.join(POINTS)} (optionally '@STEP', or '@STEP+' for that step or "
                              "the first one after it; prefix 'hang:' to SIGSTOP, "
                              "'term:' to send SIGTERM), or the conditions nonfinite[@STEP], "
                              "nonfinite_sample@POSITION, allreduce_fails[@STEP], bitflip[@STEP], "
                              "bitflip_moment[@STEP]")
        try:
            if or_later and not step:
                raise ValueError
            return cls(point, int(step) if step else None, hang, term=term, or_later=or_later)
        except ValueError:
            raise ConfigError(f"FTLM_FAULT={text!r}: step must be an integer") from None

    def maybe_fire(self, point: str, step: int, emit,
                   committed: Callable[[], int] | None = None) -> None:
        """Fire if this is the planned point (and step, or a later one with ``or_later``).
        ``committed`` returns the group's committed step now (``slow_serve`` waits on it)."""
        if self.fired or point != self.point:
            return
        if self.step is not None and (step < self.step if self.or_later else step != self.step):
            return
        self.fired = True
        if point == "slow_serve":
            seconds = float(os.environ.get("FTLM_FAULT_SECONDS", "3"))
            steps = int(os.environ.get("FTLM_FAULT_STEPS", "0"))
            emit("failure_injected", step=step, point=point, signal="none", seconds=seconds,
                 steps=steps)
            # Deliberately blocks the serving thread: this *is* the slow link being simulated.
            deadline = time.monotonic() + seconds
            pause = threading.Event()
            while time.monotonic() < deadline:
                if steps and committed is not None and committed() >= step + steps:
                    break
                pause.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            return
        if self.term:
            log.warning("FTLM_FAULT: sending SIGTERM to this process at %s of step %d", point, step)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        emit("failure_injected", step=step, point=point, signal="SIGSTOP" if self.hang else "SIGKILL")
        os.kill(os.getpid(), signal.SIGSTOP if self.hang else signal.SIGKILL)


@dataclass
class FaultSchedule:
    """The fault points of one process (``FTLM_FAULT``, comma-separated), each firing once."""

    plans: list[FaultPlan]

    @classmethod
    def parse(cls, text: str) -> FaultSchedule | None:
        plans = [plan for part in text.split(",") if (plan := FaultPlan.parse(part.strip()))]
        return cls(plans) if plans else None

    @property
    def points(self) -> frozenset[str]:
        return frozenset(p.point for p in self.plans)

    def maybe_fire(self, point: str, step: int, emit,
                   committed: Callable[[], int] | None = None) -> None:
        for plan in self.plans:
            plan.maybe_fire(point, step, emit, committed)

    def allreduce_fails(self, step: int, emit=None) -> bool:
        """Whether this process's cross-group all-reduce of ``step`` fails here (``CONDITIONS``);
        logged and recorded as an injected failure (``emit``) the first time: the coordinator
        must find its group (``ftlm.ft.quorum.Probe``)."""
        for plan in self.plans:
            if plan.point == "allreduce_fails" and (plan.step is None or step >= plan.step):
                if not plan.fired:
                    plan.fired = True
                    log.warning("FTLM_FAULT: the all-reduce fails from step %d on (a bad link)", step)
                    if emit is not None:
                        emit("failure_injected", step=step, point="allreduce_fails", how="bad_link")
                return True
        return False

    def bitflip(self, step: int, emit=None) -> str | None:
        """What to corrupt in this process's state as it takes part in ``step``: ``"param"`` or
        ``"moment"`` the first time a ``bitflip`` plan's step is reached (``CONDITIONS``), else
        None; recorded as an injected failure (``emit``)."""
        for plan in self.plans:
            if plan.point in BITFLIPS and not plan.fired and (plan.step is None or step >= plan.step):
                plan.fired = True
                which = BITFLIPS[plan.point]
                log.warning("FTLM_FAULT: one bit of a %s flips at step %d (silent data corruption)",
                            "parameter" if which == "param" else "optimizer moment", step)
                if emit is not None:
                    emit("failure_injected", step=step, point=plan.point, how="bitflip")
                return which
        return None

    def nonfinite(self, step: int, start: int, stop: int, emit=None) -> bool:
        """Whether an attempt of ``step`` training sample positions ``[start, stop)`` is made
        non-finite here (``CONDITIONS``); logged the first time, and a faulty device is recorded
        as an injected failure then (``emit``: its group must stop; samples that break training
        are not a failure of the process)."""
        for plan in self.plans:
            if plan.point == "nonfinite" and (plan.step is None or step >= plan.step):
                hit = f"from step {plan.step or 0} on (a faulty device)"
            elif plan.point == "nonfinite_sample" and start <= (plan.step or 0) < stop:
                hit = f"for sample position {plan.step} (samples that break training)"
            else:
                continue
            if not plan.fired:
                plan.fired = True
                log.warning("FTLM_FAULT: the loss of step %d counts as non-finite %s", step, hit)
                if emit is not None and plan.point == "nonfinite":
                    emit("failure_injected", step=step, point="nonfinite", how="nonfinite")
            return True
        return False


def fault_from_env() -> FaultSchedule | None:
    return FaultSchedule.parse(os.environ.get("FTLM_FAULT", ""))
