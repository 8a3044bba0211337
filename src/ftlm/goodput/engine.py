"""The discrete-event simulation of one job (``JobModel``): a heap of timed events, seeded.

Every replica group (training groups and spares) is a *slot* in one of five states:
``training``, ``starting`` (restarting after a failure), ``recovering`` (catching up from a
peer), ``idle`` (a started spare) and ``preempted`` (spot capacity taken away, not yet
replaced). Failures arrive as a Poisson process over the allocation and strike a uniformly
drawn slot; spot preemptions likewise. Between two events nothing changes, so the clock jumps
from event to event and each interval is accounted at once: work done (job speed while not
stalled), GPU-seconds by state, and lost GPU-seconds by cause.

In ``ft`` mode a failure of a training or recovering group stalls every group for ``stall``
seconds (stalls that overlap merge), and the failed group restarts alone; a rejoin stalls
everyone ``rejoin_stall``. In ``checkpoint_restart`` mode any failure stops the job for
``restart`` seconds and throws away the work since the last checkpoint.

It does not model the protocol (``ftlm.sim`` does), per-step timing, stragglers, correlated
failures (a rack, a switch), failures during a stall being cheaper, or the coordinator.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

from ftlm.errors import ConfigError
from ftlm.goodput.model import JobModel

STATES = ("training", "stalled", "recovering", "starting", "idle", "preempted")
"""GPU-hour states (``stalled``: a training group while the job is stalled or checkpointing)."""
CAUSES = ("startup", "teardown", "stall", "restart", "catch-up", "preemption", "rejoin", "checkpoint",
          "rework", "slow")
"""Why GPU time did not turn into progress (``slow``: fewer groups ran slower than linear)."""

_TRAINING, _STARTING, _RECOVERING, _SPARE, _PREEMPTED = ("training", "starting", "recovering",
                                                         "idle", "preempted")


@dataclass
class SimResult:
    """What one simulated job did."""

    ett: float
    """Work done over wall time (1.0: every group trained all the time)."""
    duration: float
    work: float
    """Full-job seconds of training that counted."""
    failures: int
    preemptions: int
    gpu_hours: dict[str, float]
    """GPU-hours by state (``STATES``) over the whole allocation."""
    lost_gpu_hours: dict[str, float]
    """GPU-hours of the training groups that produced no progress, by cause (``CAUSES``)."""
    timeline: list[tuple[float, float]] = field(default_factory=list)
    """``(t, speed)`` at every change, when recorded."""


@dataclass
class _Slot:
    state: str
    epoch: int = 0
    """Bumped on every failure: a pending event of an older epoch is stale."""
    current_at: float = 0.0
    """A spare: when it holds the job's state (it is promoted only from then on)."""


class _Job:
    """The simulation state of one run; ``run`` drives it."""

    def __init__(self, model: JobModel, seed: int, record: bool) -> None:
        self.m = model
        self.rng = random.Random(seed)
        self.record = record
        self.heap: list[tuple[float, int, str, int, int]] = []
        self.seq = 0
        self.now = 0.0
        n = model.groups
        self.slots = [_Slot(_TRAINING) for _ in range(n)] + [_Slot(_SPARE)
                                                            for _ in range(model.spares)]
        self.stalled_until = model.startup
        self.stall_cause = "startup"
        self.work = 0.0
        self.failures = self.preemptions = 0
        self.gpu_s = dict.fromkeys(STATES, 0.0)
        self.lost_s = dict.fromkeys(CAUSES, 0.0)
        self.timeline: list[tuple[float, float]] = []
        # checkpoint_restart only
        self.cr_state = "running" if model.startup <= 0 else "starting"
        self.since_checkpoint = 0.0
        self.cr_token = 0
        self.tearing_down = False

    # -- the heap
    def push(self, t: float, kind: str, slot: int = -1, epoch: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, slot, epoch))

    def next_gap(self, mtbf: float) -> float:
        return self.rng.expovariate(1.0 / mtbf) if math.isfinite(mtbf) else math.inf

    # -- accounting of [now, t)
    def advance(self, t: float) -> None:
        while self.now < t:
            stalled = self.now < self.stalled_until
            end = min(t, self.stalled_until) if stalled else t
            self._account(end - self.now, stalled)
            self.now = end

    def _account(self, dt: float, stalled: bool) -> None:
        if dt <= 0:
            return
        m, g = self.m, self.m.gpus_per_group
        if m.mode == "checkpoint_restart":
            self._account_cr(dt)
            return
        counts = {s: 0 for s in (_TRAINING, _STARTING, _RECOVERING, _SPARE, _PREEMPTED)}
        for slot in self.slots:
            counts[slot.state] += 1
        p = counts[_TRAINING]  # never above m.groups: a group only trains in a free place
        state = "training" if not stalled else {"startup": "starting", "teardown": "idle"}.get(
            self.stall_cause, "stalled")
        self.gpu_s[state] += p * g * dt
        self.gpu_s["starting"] += counts[_STARTING] * g * dt
        self.gpu_s["recovering"] += counts[_RECOVERING] * g * dt
        self.gpu_s["idle"] += counts[_SPARE] * g * dt
        self.gpu_s["preempted"] += counts[_PREEMPTED] * g * dt
        full = m.groups * g * dt
        if stalled:
            self.lost_s[self.stall_cause] += full
            return
        speed = m.speed(p)
        self.work += speed * dt
        missing = m.groups - p
        lost = full * (1.0 - speed)
        if missing <= 0 or lost <= 0:
            return
        # The loss of the absent groups, by why they are absent; the rest is a slower-than-linear
        # (or faster) speed curve.
        absent = {"restart": counts[_STARTING], "catch-up": counts[_RECOVERING],
                  "preemption": counts[_PREEMPTED]}
        share = missing * g * dt
        total = sum(absent.values()) or 1
        for cause, k in absent.items():
            self.lost_s[cause] += share * k / total
        self.lost_s["slow"] += lost - share  # negative when fewer groups train faster each

    def _account_cr(self, dt: float) -> None:
        g_all = self.m.groups * self.m.gpus_per_group
        self.gpu_s["idle"] += self.m.spares * self.m.gpus_per_group * dt
        if self.cr_state == "running":
            self.gpu_s["training"] += g_all * dt
            self.work += dt
            self.since_checkpoint += dt
        elif self.cr_state == "checkpointing":
            self.gpu_s["stalled"] += g_all * dt
            self.lost_s["checkpoint"] += g_all * dt
        elif self.cr_state == "teardown":
            self.gpu_s["idle"] += g_all * dt
            self.lost_s["teardown"] += g_all * dt
        else:  # starting (launch) or restarting
            self.gpu_s["starting"] += g_all * dt
            self.lost_s["startup" if self.failures == 0 else "restart"] += g_all * dt

    def mark(self) -> None:
        if self.record:
            if self.m.mode == "checkpoint_restart":
                speed = 1.0 if self.cr_state == "running" else 0.0
            else:
                p = sum(1 for s in self.slots if s.state == _TRAINING)
                speed = 0.0 if self.now < self.stalled_until else self.m.speed(p)
            self.timeline.append((self.now, speed))

    def stall(self, seconds: float, cause: str) -> None:
        if seconds > 0 and self.now + seconds > self.stalled_until:
            if self.now >= self.stalled_until:
                self.stall_cause = cause
            self.stalled_until = self.now + seconds
            self.push(self.stalled_until, "stall_end")

    def begin_teardown(self) -> None:
        """The last step is done: the rest of the run is saving and exiting, no progress."""
        self.tearing_down = True
        self.stalled_until, self.stall_cause = self.m.duration, "teardown"
        self.cr_state = "teardown"
        self.cr_token += 1  # no checkpoint or restart after the end

    # -- ft events
    def strike(self) -> int:
        """The slot a failure or preemption hits (-1: none is allocated)."""
        candidates = [i for i, s in enumerate(self.slots) if s.state != _PREEMPTED]
        training = [i for i in candidates if self.slots[i].state == _TRAINING]
        if self.m.protect_last and len(training) == 1:
            candidates.remove(training[0])
        return self.rng.choice(candidates) if candidates else -1

    def ft_failure(self, i: int, preempted: bool, graceful: bool) -> None:
        m, slot = self.m, self.slots[i]
        was = slot.state
        slot.epoch += 1
        if was in (_TRAINING, _RECOVERING):
            if graceful:
                self.stall(m.rejoin_stall, "preemption")
            else:
                self.stall(m.stall, "stall")
        if preempted:
            slot.state = _PREEMPTED
            self.push(self.now + m.spot_replace, "replaced", i, slot.epoch)
        else:
            slot.state = _STARTING
            self.push(self.now + m.restart, "restarted", i, slot.epoch)
        if was in (_TRAINING, _RECOVERING):
            promotion = m.detection if m.promotion is None else m.promotion
            self.promote_spare(delay=m.leave_time if graceful else promotion)

    def promote_spare(self, delay: float) -> None:
        """A current spare (if any) takes the place of a group that just left the training set,
        ``delay`` seconds from now, with no catch-up: it applied every committed step. A spare
        that is not current yet is never promoted (it is, once current: ``spare_current``)."""
        active = sum(1 for s in self.slots if s.state in (_TRAINING, _RECOVERING))
        if active >= self.m.groups:
            return
        for j, s in enumerate(self.slots):
            if s.state == _SPARE and s.current_at <= self.now:
                s.state = _RECOVERING
                self.push(self.now + delay, "caught_up", j, s.epoch)
                return

    def ft_event(self, kind: str, i: int, epoch: int) -> None:
        m = self.m
        slot = self.slots[i]
        if epoch != slot.epoch:
            return
        if kind == "replaced":
            slot.state = _STARTING
            self.push(self.now + m.restart, "restarted", i, slot.epoch)
        elif kind == "restarted":
            active = sum(1 for s in self.slots if s.state in (_TRAINING, _RECOVERING))
            if active < m.groups:
                slot.state = _RECOVERING
                self.push(self.now + m.catchup, "caught_up", i, slot.epoch)
            else:
                slot.state = _SPARE  # it catches up like any joiner before it is current
                slot.current_at = self.now + m.catchup
                self.push(slot.current_at, "spare_current", i, slot.epoch)
        elif kind == "spare_current":
            self.promote_spare(delay=0.0)  # a place left free while no spare was current
        elif kind == "caught_up":
            slot.state = _TRAINING
            self.stall(m.rejoin_stall, "rejoin")

    # -- checkpoint_restart events
    def cr_failure(self) -> None:
        m = self.m
        if self.cr_state in ("running", "checkpointing"):
            self.lost_s["rework"] += self.since_checkpoint * m.groups * m.gpus_per_group
            self.work -= self.since_checkpoint
        self.since_checkpoint = 0.0
        self.cr_state = "restarting"
        self.cr_token += 1
        self.push(self.now + m.restart, "cr_running", epoch=self.cr_token)

    def cr_event(self, kind: str, token: int) -> None:
        if token != self.cr_token:
            return
        self.cr_token += 1
        if kind == "cr_running":
            self.cr_state = "running"
            self.push(self.now + self.m.interval, "cr_checkpoint", epoch=self.cr_token)
        elif kind == "cr_checkpoint":
            self.cr_state = "checkpointing"
            self.push(self.now + self.m.checkpoint_cost, "cr_saved", epoch=self.cr_token)
        elif kind == "cr_saved":
            self.cr_state = "running"
            self.since_checkpoint = 0.0
            self.push(self.now + self.m.interval, "cr_checkpoint", epoch=self.cr_token)

    def run(self) -> SimResult:
        m = self.m
        self.push(m.duration, "end")
        if m.failure_trace:
            for t, slot in m.failure_trace:
                self.push(t, "failure", slot)
        else:
            self.push(self.next_gap(m.job_mtbf), "failure")
        self.push(self.next_gap(m.preemption_mtbf), "preempt")
        if m.mode == "checkpoint_restart":
            self.push(m.startup, "cr_running", epoch=self.cr_token)
        if m.teardown > 0:
            self.push(max(0.0, m.duration - m.teardown), "teardown")
        self.mark()
        while self.heap:
            t, _, kind, slot, epoch = heapq.heappop(self.heap)
            if t > m.duration:
                t, kind = m.duration, "end"
            self.advance(t)
            if kind == "end":
                break
            if kind == "teardown":
                self.begin_teardown()
            elif self.tearing_down and kind in ("failure", "preempt"):
                pass  # the job reached its last step: nothing left to break
            elif kind in ("failure", "preempt"):
                preempt, traced = kind == "preempt", slot >= 0
                if not traced:
                    self.push(t + self.next_gap(m.preemption_mtbf if preempt else m.job_mtbf),
                              kind)
                if preempt:
                    self.preemptions += 1
                else:
                    self.failures += 1
                if m.mode == "checkpoint_restart":
                    self.cr_failure()
                else:
                    i = slot if traced else self.strike()
                    if i >= 0:
                        self.ft_failure(i, preempted=preempt,
                                        graceful=preempt and m.spot_notice >= m.leave_time)
            elif kind.startswith("cr_"):
                self.cr_event(kind, epoch)
            elif kind != "stall_end":
                self.ft_event(kind, slot, epoch)
            self.mark()
        hours = 1.0 / 3600.0
        return SimResult(
            ett=self.work / m.duration, duration=m.duration, work=self.work,
            failures=self.failures, preemptions=self.preemptions,
            gpu_hours={k: v * hours for k, v in self.gpu_s.items()},
            lost_gpu_hours={k: v * hours for k, v in self.lost_s.items() if v},
            timeline=self.timeline)


def run(model: JobModel, seed: int = 0, record: bool = False) -> SimResult:
    """Simulate one job; ``record`` keeps the speed timeline (for plots)."""
    return _Job(model, seed, record).run()


@dataclass
class Estimate:
    """ETT over several seeded runs of one model."""

    model: JobModel
    results: list[SimResult]

    @property
    def ett(self) -> float:
        """Mean ETT over the runs."""
        return statistics.fmean(r.ett for r in self.results)

    @property
    def ett_std(self) -> float:
        """Standard deviation of one run's ETT (0 with one run)."""
        etts = [r.ett for r in self.results]
        return statistics.stdev(etts) if len(etts) > 1 else 0.0

    def mean(self, attr: str) -> dict[str, float]:
        """Mean over the runs of a per-key dict field (``gpu_hours``, ``lost_gpu_hours``)."""
        keys: dict[str, float] = {}
        for r in self.results:
            for k, v in getattr(r, attr).items():
                keys[k] = keys.get(k, 0.0) + v / len(self.results)
        return keys


def estimate(model: JobModel, runs: int = 8, seed: int = 0) -> Estimate:
    """Simulate ``runs`` seeded jobs of ``model`` (seeds ``seed .. seed + runs - 1``)."""
    if runs < 1:
        raise ConfigError(f"runs={runs} must be at least 1")
    return Estimate(model, [run(model, seed + k) for k in range(runs)])
