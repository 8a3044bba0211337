"""A seeded simulation of the coordinator's lease election (``ftlm.launch.lease``), run on the
real ``LeaseElector`` against ``ftlm.testing.kube_api.KubeState``.

Each coordinator process is a thread that runs only when the scheduler hands it the turn, so one
seed is one schedule, replayed exactly. Time is simulated; each process reads it on its own clock
(an offset and a rate within ``MAX_RATE_SKEW`` of the true one). What a schedule draws:

* every API request takes time before the server applies it and again before the answer
  arrives (a heavy tail past the client's timeout: the client gives up, and the write may still
  be applied later, or never);
* a process may freeze at any point where it waits (SIGSTOP, a paused VM, a lost node that comes
  back) for up to three lease durations, crash there, or stop gracefully (releasing the lease);
  a crashed or fenced process restarts later under the same identity (a container restart);
* the API server is down for spans;
* a holder answers the groups at random moments, each after ``hold()`` (the coordinator's fence).

The property: answers ordered by time never go back to an earlier holding (``term``): once a
process has answered under a newer acquisition, no older holder answers again. ``run`` returns
what a seed did (answers, terms, fences, the longest time nobody held the lease while the API
and some process were up).

Not responsible for: the coordinator itself or HTTP (``test_lease.py`` beside it runs real
processes). Here under ``tests/`` and not in ``ftlm.testing``: it drives ``ftlm.launch``, which only
the command line may import.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ftlm.testing.kube_api import KubeState

MAX_RATE_SKEW = 0.02
"""How much faster or slower than true time a process's clock may run."""
_HANDOFF_TIMEOUT = 30.0


class _Stopped(BaseException):
    """Ends a process's thread (a crash, a fence, the end of the simulation)."""


@dataclass
class SimResult:
    seed: int
    answers: list[tuple[float, int, str]] = field(default_factory=list)  # (time, term, identity)
    terms: list[tuple[float, str]] = field(default_factory=list)  # (time acquired, identity)
    fences: int = 0
    crashes: int = 0
    releases: int = 0
    violations: list[str] = field(default_factory=list)

    def check(self) -> None:
        """Record every answer given under an older term after a newer term had answered."""
        newest, since = -1, 0.0
        for t, term, who in sorted(self.answers):
            if term < newest:
                self.violations.append(f"seed {self.seed}: {who} answered under term {term} at "
                                       f"{t:.3f} s after term {newest} answered at {since:.3f} s")
            elif term > newest:
                newest, since = term, t


class Simulation:
    def __init__(self, seed: int, processes: int = 2, timing: Any = None, horizon: float = 300.0,
                 freeze_p: float = 0.02, crash_p: float = 0.005, release_p: float = 0.003,
                 outage_every: float = 60.0, late_write_p: float = 0.5) -> None:
        from ftlm.launch.lease import LeaseTiming
        self.rng = random.Random(seed)
        self.timing = timing or LeaseTiming()
        self.horizon, self.freeze_p, self.crash_p, self.release_p = horizon, freeze_p, crash_p, release_p
        self.outage_every, self.late_write_p = outage_every, late_write_p
        self.state = KubeState()
        self.result = SimResult(seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._back = threading.Semaphore(0)
        self._names = [f"coordinator-{i}" for i in range(processes)]
        self._actors: list[_Actor] = []

    # ------------------------------------------------------------------------------ scheduling

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), fn))

    def run(self) -> SimResult:
        for name in self._names:
            self.at(self.rng.uniform(0, 2), lambda n=name: self._spawn(n))
        if self.outage_every:
            self.at(self.rng.expovariate(1 / self.outage_every), self._outage)
        try:
            while self._queue and self._queue[0][0] <= self.horizon:
                t, _, fn = heapq.heappop(self._queue)
                self.now = t
                fn()
        finally:
            for actor in self._actors:
                actor.stop()
        self.result.check()
        return self.result

    def _outage(self) -> None:
        self.state.failing = True
        self.at(self.now + self.rng.uniform(0.5, 3 * self.timing.duration), self._outage_ends)

    def _outage_ends(self) -> None:
        self.state.failing = False
        self.at(self.now + self.rng.expovariate(1 / self.outage_every), self._outage)

    def _spawn(self, identity: str) -> None:
        actor = _Actor(self, identity)
        self._actors.append(actor)
        actor.resume()

    def restart_later(self, identity: str) -> None:
        self.at(self.now + self.rng.uniform(0.1, 2 * self.timing.duration), lambda: self._spawn(identity))

    def latency(self) -> float:
        r = self.rng.random()
        if r < 0.9:
            return self.rng.uniform(0.001, 0.05)
        if r < 0.99:
            return self.rng.uniform(0.05, 1.0)
        return self.rng.uniform(1.0, 2 * self.timing.deadline)  # past the client's timeout


class _Actor:
    """One coordinator process: its life runs in a thread, one step at a time."""

    def __init__(self, sim: Simulation, identity: str) -> None:
        from ftlm.launch.lease import LeaseElector
        self.sim, self.identity = sim, identity
        rng = sim.rng
        self.offset, self.rate = rng.uniform(-1e4, 1e4), 1 + rng.uniform(-MAX_RATE_SKEW, MAX_RATE_SKEW)
        self._go = threading.Semaphore(0)
        self._stopping = False
        self.elector = LeaseElector(_SimApi(self), "default", "job-coordinator", identity, sim.timing,
                                    clock=lambda: self.offset + sim.now * self.rate, on_lost=self._fenced)
        self._thread = threading.Thread(target=self._main, daemon=True, name=f"sim-{identity}")
        self._started = False

    # --------------------------------------------------------------------- scheduler's thread

    def resume(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()
        self._go.release()
        if not self.sim._back.acquire(timeout=_HANDOFF_TIMEOUT):
            raise RuntimeError(f"{self.identity} did not hand the turn back")

    def stop(self) -> None:
        if self._started and self._thread.is_alive():
            self._stopping = True
            self._go.release()
            self._thread.join(_HANDOFF_TIMEOUT)

    # ----------------------------------------------------------------------- its own thread

    def wait_until(self, t: float, may_freeze: bool = True) -> None:
        """Give the turn back until simulated time ``t`` (later when frozen); maybe crash there."""
        sim = self.sim
        if may_freeze and sim.rng.random() < sim.freeze_p:
            t += sim.rng.uniform(0, 3 * sim.timing.duration)
        crash = may_freeze and sim.rng.random() < sim.crash_p
        sim.at(t, self.resume)
        sim._back.release()
        self._go.acquire()
        if self._stopping:
            raise _Stopped
        if crash:
            sim.result.crashes += 1
            sim.restart_later(self.identity)
            raise _Stopped

    def _main(self) -> None:
        self._go.acquire()
        try:
            if not self._stopping:
                self._life()
        except _Stopped:
            pass
        finally:
            self.sim._back.release()

    def _fenced(self, reason: str) -> None:
        self.sim.result.fences += 1
        self.sim.restart_later(self.identity)
        raise _Stopped

    def _life(self) -> None:
        from ftlm.launch.lease import KubeApiError
        sim, e, timing = self.sim, self.elector, self.sim.timing
        while True:  # a standby
            try:
                if e.try_acquire_or_renew():
                    break
            except KubeApiError:
                pass
            self.wait_until(sim.now + timing.retry / self.rate)
        term = len(sim.result.terms)
        sim.result.terms.append((sim.now, self.identity))
        next_renew = sim.now + timing.retry / self.rate
        while True:  # the holder: answers between renewals
            self.wait_until(sim.now + sim.rng.expovariate(5.0))
            if sim.now >= next_renew:
                try:
                    e.try_acquire_or_renew()
                except KubeApiError:
                    pass
                next_renew = sim.now + timing.retry / self.rate
            e.hold()
            sim.result.answers.append((sim.now, term, self.identity))
            if sim.rng.random() < sim.release_p:
                e.release()
                sim.result.releases += 1
                sim.restart_later(self.identity)
                return


class _SimApi:
    """``KubeApi.call`` with simulated time on both sides of the server's moment."""

    def __init__(self, actor: _Actor) -> None:
        self.actor = actor

    def call(self, method: str, path: str, body: dict[str, Any] | None = None,
             content_type: str = "application/json", timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        from ftlm.launch.lease import REQUEST_TIMEOUT, KubeApiError
        sim, actor = self.actor.sim, self.actor
        timeout = (timeout or REQUEST_TIMEOUT) / actor.rate  # the client's timeout runs on its clock
        sent, there, back = sim.now, sim.latency(), sim.latency()
        box: dict[str, tuple[int, dict[str, Any]]] = {}
        sent_body = copy.deepcopy(body)
        if there <= timeout or sim.rng.random() < sim.late_write_p:
            sim.at(sent + there, lambda: box.update(answer=sim.state.handle(method, path, sent_body)))
        if there + back > timeout:
            actor.wait_until(sent + timeout)
            raise KubeApiError(f"{method} {path}: timed out (simulated)")
        actor.wait_until(sent + there + back)
        return box["answer"]


def run_seeds(seeds: range, **kwargs: Any) -> list[SimResult]:
    return [Simulation(seed, **kwargs).run() for seed in seeds]
