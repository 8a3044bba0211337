"""The coordinator's lease election (``ftlm.launch.lease``): the rules one step at a time, a seeded
simulation of thousands of schedules, and real ``ftlm coordinator --lease`` processes behind a
Service with a group training through a takeover."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ftlm.errors import ConfigError
from ftlm.launch.lease import (EXIT_LEASE_LOST, LEADER_LABEL, KubeApi, KubeApiError, LeaseElector,
                               LeaseTiming, PodLabels)
from ftlm.testing.kube_api import FakeKubeApi, KubeState

sys.path.insert(0, str(Path(__file__).parent))
from lease_sim import Simulation, run_seeds  # noqa: E402

TIMING = LeaseTiming(duration=10.0, deadline=6.0, retry=1.0)


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def elector(state: KubeState, identity: str, clock: Clock, lost: list[str] | None = None) -> LeaseElector:
    return LeaseElector(state.in_process(), "default", "job-coordinator", identity, TIMING, clock=clock,
                        on_lost=(lost.append if lost is not None else None))


def test_a_standby_waits_the_whole_duration_on_its_own_clock_whatever_the_lease_says():
    """The holder's renewTime is never trusted (clocks differ): the standby takes the lease only
    after seeing the same record for ``duration`` s on its own clock."""
    state = KubeState()
    a_clock, b_clock = Clock(0.0), Clock(5_000.0)  # far apart, as two nodes' clocks may be
    a, b = elector(state, "a", a_clock), elector(state, "b", b_clock)
    assert a.try_acquire_or_renew() and a.leading
    assert not b.try_acquire_or_renew()  # first seen now
    b_clock.t += TIMING.duration - 0.01
    assert not b.try_acquire_or_renew()
    a_clock.t += 1.0
    assert a.try_acquire_or_renew()  # a renews: b's wait starts again
    b_clock.t += 1.0
    assert not b.try_acquire_or_renew()
    b_clock.t += TIMING.duration - 0.01
    assert not b.try_acquire_or_renew()
    b_clock.t += 0.02
    assert b.try_acquire_or_renew() and b.previous_holder == "a"
    spec = state.lease("job-coordinator")["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1


def test_the_holder_fences_itself_before_a_standby_can_take_over():
    lost: list[str] = []
    state, clock = KubeState(), Clock()
    a = elector(state, "a", clock, lost)
    assert a.try_acquire_or_renew()
    clock.t = TIMING.deadline - 0.001
    a.hold()
    assert not lost
    clock.t = TIMING.deadline
    a.hold()
    a.hold()
    assert len(lost) == 1 and "not renewed within 6 s" in lost[0]
    assert TIMING.deadline < TIMING.duration


def test_a_renewal_counts_from_when_it_started_not_when_it_was_answered():
    """A renewal answered late keeps the holder only until ``deadline`` after it was sent."""
    lost: list[str] = []
    state, clock = KubeState(), Clock()
    a = elector(state, "a", clock, lost)
    api = a.api
    api.after = lambda: setattr(clock, "t", clock.t + 4.0)  # 4 s for each answer to come back
    assert a.try_acquire_or_renew()  # sent at 0 (GET), answered at 8 (two calls)
    a.hold()
    assert lost  # 0 + 6 < 8: fenced at once


def test_of_two_candidates_for_a_free_lease_one_wins():
    state, clock = KubeState(), Clock()
    a, b = elector(state, "a", clock), elector(state, "b", clock)
    # Both read "not found", then both create: the second POST is a conflict.
    real = state.handle
    seen: list[str] = []

    def both_read_first(method, path, body):
        if method == "POST" and not seen:
            seen.append("a")
            b.try_acquire_or_renew()  # b read "not found" too, and its POST lands first
        return real(method, path, body)

    state.handle = both_read_first  # type: ignore[method-assign]
    assert not a.try_acquire_or_renew()  # 409: already exists
    assert b.leading and not a.leading
    assert state.lease("job-coordinator")["spec"]["holderIdentity"] == "b"


def test_a_write_from_a_stale_read_is_refused():
    state, clock = KubeState(), Clock()
    a, b = elector(state, "a", clock), elector(state, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    clock.t += TIMING.duration + 1
    real = state.handle

    def a_renews_between_bs_read_and_write(method, path, body):
        if method == "PUT" and body["spec"]["holderIdentity"] == "b":
            state.handle = real  # type: ignore[method-assign]
            clock.t -= TIMING.duration + 1
            assert a.try_acquire_or_renew()  # a's renewal lands first
            clock.t += TIMING.duration + 1
        return real(method, path, body)

    state.handle = a_renews_between_bs_read_and_write  # type: ignore[method-assign]
    assert not b.try_acquire_or_renew()  # 409: b read the version a replaced
    assert state.lease("job-coordinator")["spec"]["holderIdentity"] == "a"


def test_a_released_lease_is_taken_at_once():
    state, clock = KubeState(), Clock()
    a, b = elector(state, "a", clock), elector(state, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    a.release()
    assert not a.leading
    a.hold()  # a stopping holder is not fenced (it stops on its own)
    assert b.try_acquire_or_renew() and b.previous_holder == ""  # released: no holder


def test_an_api_outage_fences_the_holder_and_nobody_takes_over_until_it_is_back():
    lost: list[str] = []
    state, clock = KubeState(), Clock()
    a, b = elector(state, "a", clock, lost), elector(state, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    state.failing = True
    fenced_at = []
    a.on_lost = lambda reason: fenced_at.append(clock.t)
    for _ in range(8):
        clock.t += 1.0
        try:
            assert not a.try_acquire_or_renew()  # once lapsed: fenced, no request
        except KubeApiError as e:
            assert "HTTP 503" in str(e)
        a.hold()
    assert fenced_at == [TIMING.deadline]  # 6 s after its last renewal began
    state.failing = False
    clock.t = TIMING.duration - 0.5
    assert not b.try_acquire_or_renew()  # b saw the record at 0: not yet
    clock.t = TIMING.duration + 0.5
    assert b.try_acquire_or_renew()  # unchanged for more than 10 s on b's clock


def test_a_forbidden_call_names_the_role_it_needs():
    state, clock = KubeState(), Clock()
    state.handle = lambda method, path, body: (403, {"message": 'leases "x" is forbidden'})  # type: ignore[method-assign]
    with pytest.raises(KubeApiError, match="forbidden.*leases get, create and update; pods list and patch"):
        elector(state, "a", clock).try_acquire_or_renew()


def test_a_fractional_duration_is_stated_rounded_up():
    """A taker waits what the holder states: rounding 2.4 s down to 2 would let it take the
    lease while a holder with a 2.3 s deadline still answers."""
    state, clock = KubeState(), Clock()
    timing = LeaseTiming(duration=2.4, deadline=2.3, retry=0.5)
    a = LeaseElector(state.in_process(), "default", "x", "a", timing, clock=clock)
    assert a.try_acquire_or_renew()
    assert state.lease("x")["spec"]["leaseDurationSeconds"] == 3


def test_lease_timing_refuses_a_deadline_past_the_duration():
    with pytest.raises(ConfigError, match="retry < deadline < duration"):
        LeaseTiming(duration=5.0, deadline=6.0, retry=1.0)


def test_seeded_schedules_never_let_an_older_holder_answer_after_a_newer_one():
    """Hundreds of schedules (freezes, crashes, graceful stops, slow and lost API requests, API
    outages, clock skew, three processes): answers never go back to an older acquisition. The
    slow tier runs thousands."""
    results = run_seeds(range(300), processes=3, horizon=200.0)
    violations = [v for r in results for v in r.violations]
    assert not violations, violations[:5]
    terms = sum(len(r.terms) for r in results)
    # The schedules do what they are for: many takeovers, fences and restarts.
    assert terms > 3 * len(results) and sum(r.fences for r in results) > 100
    assert sum(r.crashes for r in results) > 50 and sum(r.releases for r in results) > 20


@pytest.mark.slow
def test_seeded_schedules_thousands():
    results = run_seeds(range(300, 3300), processes=3, horizon=200.0)
    violations = [v for r in results for v in r.violations]
    assert not violations, violations[:5]


def test_the_simulation_finds_a_holder_that_does_not_fence():
    """The simulation can fail: with the fence turned off, an old holder answers after a new one."""
    import ftlm.launch.lease as lease
    found = 0
    real = lease.LeaseElector.hold
    try:
        lease.LeaseElector.hold = lambda self: None  # type: ignore[method-assign]
        for seed in range(200):
            found += bool(Simulation(seed, processes=2, horizon=200.0).run().violations)
            if found:
                break
    finally:
        lease.LeaseElector.hold = real  # type: ignore[method-assign]
    assert found


def test_the_simulation_finds_a_lapsed_holder_taking_a_free_lease_again():
    """Seed 29, the bug the simulation found: a holder frozen past its lease resumed, found the
    lease released, and took it again with its old state. With that rule back, seed 29 fails."""
    import ftlm.launch.lease as lease
    real = lease.LeaseElector.try_acquire_or_renew

    def old_rule(self):
        if self._valid_until != float("-inf") and self.clock() >= self._valid_until:
            self._valid_until = float("-inf")  # lapsed, yet treated as a fresh candidate
        return real(self)

    lease.LeaseElector.try_acquire_or_renew = old_rule  # type: ignore[method-assign]
    try:
        assert Simulation(29, processes=3, horizon=200.0).run().violations
    finally:
        lease.LeaseElector.try_acquire_or_renew = real  # type: ignore[method-assign]
    assert not Simulation(29, processes=3, horizon=200.0).run().violations


def test_pod_labels_move_the_service_to_the_new_holder():
    state = KubeState()
    state.add_pod("a", "10.0.0.1", 29510, labels={"app": "c"})
    state.add_pod("b", "10.0.0.2", 29510, labels={"app": "c"})
    labels = PodLabels(state.in_process(), "default")
    selector = {"app": "c", LEADER_LABEL: "true"}
    assert state.endpoints(selector) == []
    assert labels.set("a", leader=True)
    assert state.endpoints(selector) == [("10.0.0.1", 29510)]
    assert labels.set("a", leader=False) and labels.set("b", leader=True)
    assert state.endpoints(selector) == [("10.0.0.2", 29510)]
    assert labels.set("gone", leader=False)  # a pod that no longer exists has no label to drop
    assert labels.set("a", leader=True)  # a stale label (a holder that could not drop its own)
    assert labels.labelled() == ["a", "b"]
    assert labels.take_over("b") and state.endpoints(selector) == [("10.0.0.2", 29510)]


def test_kube_api_over_http_and_its_errors():
    with FakeKubeApi() as fake:
        api = KubeApi(fake.url)
        assert api.call("GET", "/apis/coordination.k8s.io/v1/namespaces/default/leases/x")[0] == 404
        e = LeaseElector(api, "default", "x", "me", TIMING)
        assert e.try_acquire_or_renew() and e.leading
        assert fake.state.lease("x")["spec"]["holderIdentity"] == "me"
    with pytest.raises(KubeApiError, match="GET http://127.0.0.1"):
        KubeApi(fake.url, timeout=1.0).call("GET", "/api/v1/namespaces/default/pods/x")


def test_a_standby_on_a_taken_port_names_the_fix():
    import socket
    from ftlm.launch.lease import StandbyListener
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}.*choose another: --port"):
            StandbyListener("127.0.0.1", port, lambda: "")


def test_a_standby_answers_503_naming_the_holder():
    import urllib.error
    import urllib.request
    from ftlm.launch.lease import StandbyListener
    listener = StandbyListener("127.0.0.1", _free_port(), lambda: "coord-a")
    try:
        port = listener.sock.getsockname()[1]
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10)
        assert e.value.code == 503 and "coord-a" in e.value.read().decode()
        # A scrape finds the target up, saying it is a standby (no failed-scrape alerts).
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200 and "ftlm_coordinator_standby 1" in r.read().decode()
    finally:
        listener.close()


def test_lease_without_a_cluster_names_the_fix(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("FTLM_KUBE_API", raising=False)
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_HOST.*FTLM_KUBE_API"):
        KubeApi.from_environment()


# ---------------------------------------------------------------------- real processes, a group

# Shorter than the product's (10 / 6 / 1 s) to keep the test short, long enough that a loaded box
# (a renewal delayed by seconds) does not fence a healthy holder.
REAL = LeaseTiming(duration=6.0, deadline=4.0, retry=0.5)
REAL_FT = dict(heartbeat_interval=0.1, heartbeat_timeout=3.0, allreduce_timeout=4.0,
               quorum_timeout=10.0, give_up_seconds=300.0)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _coordinator(name: str, port: int, api_url: str, config: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "FTLM_KUBE_API": api_url, "POD_NAME": name, "POD_NAMESPACE": "default"}
    env.pop("FTLM_TOKEN", None)
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ftlm.cli", "coordinator", str(config), "--port", str(port),
             "--lease", "job-coordinator", "--lease-duration", str(REAL.duration),
             "--lease-deadline", str(REAL.deadline), "--lease-retry", str(REAL.retry)],
            stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait(condition, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} within {timeout} s")


class _Group(threading.Thread):
    """One replica group stepping through the Service: start_step, allreduce, commit, forever."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        import torch  # noqa: F401 - imported here, not at collection
        from ftlm.ft.config import FTConfig
        from ftlm.ft.manager import Manager
        self.manager = Manager(FTConfig(**REAL_FT, groups=1), "g0", "i0", url)
        self.commits: list[tuple[float, int]] = []  # (when, step)
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def run(self) -> None:
        import torch
        from ftlm.ft.history import GENESIS
        try:
            self.manager.join(0, GENESIS)
            chain, step = GENESIS, 0
            while not self.done.is_set():
                plan = self.manager.start_step(step, chain, lambda: ({"w": torch.zeros(2)}, {}))
                self.manager.allreduce([torch.ones(2)])
                if self.manager.commit():
                    chain = plan.quorum.next_chain()
                    with self.lock:
                        self.commits.append((time.monotonic(), step))
                    step += 1
                time.sleep(0.02)
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            self.error = e
        finally:
            self.manager.close()

    def committed_after(self, t: float) -> list[int]:
        with self.lock:
            return [s for when, s in self.commits if when > t]


def test_a_standby_coordinator_takes_over_a_frozen_holder_and_the_group_trains_on(tmp_path):
    """Two ``ftlm coordinator --lease`` processes behind a Service (``ServiceProxy``): the holder
    is frozen (SIGSTOP: a node that stops answering) mid-training; the standby takes the lease
    after its duration, the Service follows the label, the group commits again. The old holder,
    resumed, ends itself (``EXIT_LEASE_LOST``) instead of answering; a graceful stop releases."""
    from ftlm.testing.kube_api import ServiceProxy
    config = tmp_path / "c.toml"
    config.write_text("[ft]\n" + "".join(f"{k} = {v}\n" for k, v in REAL_FT.items()) + "groups = 1\n")
    selector = {LEADER_LABEL: "true"}
    procs: dict[str, subprocess.Popen] = {}
    group = None
    with FakeKubeApi() as fake, ServiceProxy(fake.state, selector) as service:
        state = fake.state
        try:
            for name in ("coord-a", "coord-b"):
                port = _free_port()
                state.add_pod(name, "127.0.0.1", port)
                procs[name] = _coordinator(name, port, fake.url, config, tmp_path / f"{name}.log")
            def labelled():
                exited = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
                assert not exited, f"coordinators exited: {exited}; see {tmp_path}"
                return state.endpoints(selector)

            assert len(_wait(labelled, 120, "no coordinator labelled leader")) == 1
            holder = state.lease("job-coordinator")["spec"]["holderIdentity"]
            other = next(n for n in procs if n != holder)
            _wait(lambda: "standby for lease" in (tmp_path / f"{other}.log").read_text(), 120,
                  f"{other} did not become a standby")
            group = _Group(service.url)
            group.start()
            _wait(lambda: len(group.commits) >= 3 or group.error, 120, "the group did not commit 3 steps")
            assert group.error is None, group.error
            frozen_at = time.monotonic()
            os.kill(procs[holder].pid, signal.SIGSTOP)
            new = _wait(lambda: state.lease("job-coordinator")["spec"]["holderIdentity"] == other, 60,
                        f"{other} did not take the lease")
            assert new
            took = time.monotonic() - frozen_at
            assert took >= REAL.duration - REAL.deadline  # it waited for the lease to lapse
            steps = _wait(lambda: group.committed_after(frozen_at) or group.error, 120,
                          "no commit after the takeover")
            assert group.error is None, group.error
            pod_b = next(p for (ns, n), p in state.pods.items() if n == other)
            assert state.endpoints(selector) == [("127.0.0.1", pod_b["port"])]
            # The old holder, resumed, must not answer: it ends itself.
            os.kill(procs[holder].pid, signal.SIGCONT)
            assert procs[holder].wait(30) == EXIT_LEASE_LOST
            assert "stopping so that only one coordinator answers" in (tmp_path / f"{holder}.log").read_text()
            more = _wait(lambda: len(group.committed_after(frozen_at)) >= len(steps) + 3 or group.error,
                         60, "the group stopped committing")
            assert group.error is None and more
            # A graceful stop releases the lease (empty holder) for an immediate takeover.
            group.done.set()
            group.join(30)
            procs[other].send_signal(signal.SIGTERM)
            assert procs[other].wait(30) == 0
            assert state.lease("job-coordinator")["spec"]["holderIdentity"] == ""
        finally:
            if group is not None:
                group.done.set()
            for p in procs.values():
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGCONT)
                    p.kill()
                    p.wait(10)
