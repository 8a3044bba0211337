"""Failure injection at named points of the step protocol, for tests and chaos drills.

A group process started with ``FTLM_FAULT=<point>[@<step>]`` kills itself with SIGKILL (or stops
itself with SIGSTOP when the point is prefixed ``hang:``) the first time it reaches that point at
that step (any step when omitted). It writes a ``failure_injected`` event first, so the run can
account for it. Prefixed ``term:``, the process sends itself SIGTERM there and goes on: a stop
request (a preemption notice) landing at that moment in that one rank, which is not a failure and
logs no event (the group's ``member_left`` and ``group_exit`` record the stop). The launcher
passes one entry per incarnation (``faults={"g1": [...]}``); an entry may list several points
separated by commas (``slow_serve,before_commit@12``), each firing once.

``slow_serve`` is not a crash but a slow link: the first time the group serves a chunk of state
it holds the transfer until the group committed ``FTLM_FAULT_STEPS`` more steps (when set; at
most ``FTLM_FAULT_SECONDS``, default 3, otherwise exactly that long), so a recovering peer's pull
spans several steps however fast or loaded the machine is (catch-up tests).
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


@dataclass
class FaultPlan:
    point: str
    step: int | None
    hang: bool = False
    fired: bool = False
    term: bool = False

    @classmethod
    def parse(cls, text: str) -> FaultPlan | None:
        if not text:
            return None
        hang, term = text.startswith("hang:"), text.startswith("term:")
        body = text[5:] if hang or term else text
        point, _, step = body.partition("@")
        if term and point == "slow_serve":
            raise ConfigError(f"FTLM_FAULT={text!r}: slow_serve is a slow link, not a moment to "
                              "stop at; give 'term:' one of the other points")
        if point not in POINTS:
            raise ConfigError(f"FTLM_FAULT={text!r}: unknown point {point!r}; valid: "
                              f"{', '.join(POINTS)} (optionally '@STEP', prefix 'hang:' to SIGSTOP, "
                              "'term:' to send SIGTERM)")
        try:
            return cls(point, int(step) if step else None, hang, term=term)
        except ValueError:
            raise ConfigError(f"FTLM_FAULT={text!r}: step must be an integer") from None

    def maybe_fire(self, point: str, step: int, emit,
                   committed: Callable[[], int] | None = None) -> None:
        """Fire if this is the planned point (and step). ``committed`` returns the group's
        committed step now (``slow_serve`` waits on it)."""
        if self.fired or point != self.point or (self.step is not None and step != self.step):
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


def fault_from_env() -> FaultSchedule | None:
    return FaultSchedule.parse(os.environ.get("FTLM_FAULT", ""))
