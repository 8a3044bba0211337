"""The local supervisor's decisions, on stand-in processes (``sleep``, ``sh``) instead of groups.

Each test drives one decision of ``LocalLauncher`` (the start-up watchdog, the hang killer, what a
failed exit means, chaos targets, the end of a run) or of the console view, in well under a second
per test; the end-to-end behaviour with real groups is in ``test_fault_tolerance.py``.
"""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ftlm.config import build_config
from ftlm.errors import EXIT_RETIRED, FtlmError
from ftlm.launch.chaos import ALL_RANKS, COORDINATOR, Chaos
from ftlm.launch.console import ConsoleView
from ftlm.launch.group_process import GroupProcess
from ftlm.launch.local import RETIRED_IN_A_ROW, LocalLauncher
from ftlm.launch.watchdog import TEARDOWN_SECONDS
from ftlm.train.checkpoint_files import MARKER, PREFIX
from ftlm.observe.events import EventLog, read_events


class FakeCoordinator:
    """What the supervisor's decisions need from its coordinator process: when it last came
    up, whether it runs, and a sink for ``POST /v1/dead``."""

    def __init__(self, started: float = 0.0):
        self.started = started
        self.dead: list[tuple[str, str, str]] = []
        self.pid = None

    def running(self) -> bool:
        return True

    def report_dead(self, group: str, incarnation: str, reason: str) -> bool:
        self.dead.append((group, incarnation, reason))
        return True


@pytest.fixture
def launcher(tmp_path):
    """A launcher of 3 groups whose processes the test provides; stops them at the end."""
    config = build_config({"run": {"dir": str(tmp_path / "run")}, "train": {"steps": 100},
                           "ft": {"startup_timeout": 5.0, "heartbeat_timeout": 1.0,
                                  "crash_loop_restarts": 3, "crash_loop_seconds": 60.0,
                                  # its shell processes keep no start-up beacon
                                  "startup_stall_timeout": 0.0}})
    la = LocalLauncher(config, groups=3, progress=False, chaos_mtbf=1.0, chaos_seed=1)
    (la.run_dir / "logs").mkdir(parents=True)
    la.coordinator = FakeCoordinator()
    la.events = EventLog(la.run_dir / "events.jsonl", group="supervisor")
    yield la
    for g in la.groups:
        for p in g.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()


def start(la: LocalLauncher, g: GroupProcess, script: str = "sleep 60", ranks: int = 1) -> None:
    """Give ``g`` a new incarnation made of ``ranks`` shell processes writing to its logs."""
    g.incarnation = f"inc{g.restarts}"
    g.procs, g.log_offsets = [], []
    for rank in range(ranks):
        log = g.log(la.run_dir, rank)
        g.log_offsets.append(log.stat().st_size if log.is_file() else 0)
        with open(log, "ab") as f:
            g.procs.append(subprocess.Popen(["sh", "-c", script], stdout=f, stderr=subprocess.STDOUT))
    g.started, g.restart_at, g.cause = time.time(), None, ""
    g.registered = g.stopped = g.progressed = False
    g.first_step = g.absent_since = None


def member(g: GroupProcess, step: int = 0) -> dict:
    return {"group": g.name, "replica_id": g.replica_id, "step": step, "heartbeat_age_seconds": 0.1}


def wait_exit(g: GroupProcess) -> None:
    for p in g.procs:
        p.wait(timeout=10)


def kinds(la: LocalLauncher, kind: str) -> list[dict]:
    return [e for e in read_events(la.run_dir / "events.jsonl") if e["kind"] == kind]


# -- start-up watchdog and hang killer ------------------------------------------------------------

def test_group_that_never_registers_is_killed_after_the_startup_timeout(launcher):
    g0, g1, g2 = launcher.groups
    for g in launcher.groups:
        start(launcher, g)
    now = time.time()
    g1.started = now - 6.0  # SIGSTOPped before its first heartbeat, 6 s ago (timeout 5 s)
    g2.started = now - 2.0  # still starting, within the timeout
    status = {"members": [member(g0)], "dead": []}
    launcher._observe(status, now)
    launcher._watchdog(status, launcher.events, now)
    assert not g1.running() and g0.running() and g2.running()
    killed = kinds(launcher, "member_killed")
    assert [(e["target"], e["reason"], e["incarnation"]) for e in killed] == \
        [("g1", "start-up timeout", g1.incarnation)]
    # Its exit is then a failure the supervisor caused, not a crash, and it restarts.
    launcher._reap(launcher.events, time.time())
    exit_ = kinds(launcher, "group_exit")[-1]
    assert (exit_["target"], exit_["ok"], exit_["cause"]) == ("g1", False, "hung")
    assert g1.restart_at is not None and launcher.fatal == ""
    assert launcher.coordinator.dead[-1][:2] == ("g1", g1.incarnation)


def test_startup_clock_stops_while_the_coordinator_is_down(launcher):
    g = launcher.groups[0]
    start(launcher, g)
    now = time.time()
    g.started = now - 8.0
    # The coordinator was down for 4 s of those 8 (nobody could register meanwhile), and it has
    # been restarted again and again since: only the 4 s it was up count (timeout 5 s).
    launcher._outages = [(now - 7.0, now - 5.0), (now - 4.0, now - 2.0)]
    launcher._watchdog({"members": [], "dead": []}, launcher.events, now)
    assert g.running()
    launcher._watchdog({"members": [], "dead": []}, launcher.events, now + 1.5)
    assert not g.running()
    # While it is down, no clock runs at all.
    g2 = launcher.groups[1]
    start(launcher, g2)
    g2.started = now - 30.0
    launcher._outages, launcher._down_since = [], now - 29.0
    launcher._watchdog({"members": [], "dead": []}, launcher.events, now)
    assert g2.running()


def test_registered_group_missing_from_the_members_is_killed_after_the_grace(launcher):
    g0, g1, _ = launcher.groups
    start(launcher, g0)
    start(launcher, g1)
    t0 = time.time()
    launcher._observe({"members": [member(g0), member(g1)]}, t0)
    # g1 hangs (a non-leader rank: the coordinator retires it for lack of progress).
    status = {"members": [member(g0)],
              "dead": [{"replica_id": g1.replica_id, "group": "g1", "seconds_ago": 0.5,
                        "reason": "no progress for 20 s (hung rank or training thread)"}]}
    launcher._observe(status, t0 + 0.1)
    launcher._watchdog(status, launcher.events, t0 + 1.0)
    assert g1.running(), "killed before the grace of 3 heartbeat timeouts"
    launcher._watchdog(status, launcher.events, t0 + 3.5)
    assert not g1.running() and g0.running()
    assert kinds(launcher, "member_killed")[0]["reason"].startswith("declared dead: no progress")


def test_group_that_left_the_job_gets_the_grace_to_exit_not_the_heartbeat_timeout(launcher):
    """A group that left (finished, preempted) sends no heartbeat any more, then saves, writes its
    summary and stops its snapshot server before it exits: on a busy box that took over three
    heartbeat timeouts, and the watchdog killed it as hung after it had finished, so its final
    state was never reported (``test_late_joiner_catches_up`` failed with two state hashes)."""
    g0, g1, _ = launcher.groups
    start(launcher, g0)
    start(launcher, g1)
    t0 = time.time()
    launcher._observe({"members": [member(g0), member(g1)]}, t0)
    status = {"members": [member(g0)], "dead": [],
              "left": [{"replica_id": g1.replica_id, "group": "g1", "reason": "finished",
                        "seconds_ago": 0.1}]}
    launcher._observe(status, t0 + 0.1)
    launcher._watchdog(status, launcher.events, t0 + 10.0)
    assert g1.running(), "a group that left was killed after the heartbeat grace"
    # The coordinator forgets old leaves (or restarts): the launcher does not.
    status = {"members": [member(g0)], "dead": []}
    launcher._observe(status, t0 + 60.0)
    grace = launcher.config.cluster.grace_seconds
    launcher._watchdog(status, launcher.events, t0 + grace)
    assert g1.running()
    launcher._watchdog(status, launcher.events, t0 + grace + 0.5)
    assert not g1.running() and g0.running()
    assert kinds(launcher, "member_killed")[0]["reason"] == (
        f"did not exit within cluster.grace_seconds={grace} s of leaving the job")


def test_a_killed_group_still_exiting_does_not_take_the_launcher_down(launcher, capsys):
    """A SIGKILLed process with gigabytes to free took over 10 s to exit on a starved box, and
    ``GroupProcess.kill`` raised ``TimeoutExpired`` out of the watchdog: the whole job died
    (bench.ft_vs_torchft, 82M). It now says so and leaves the reaping to the loop, and the
    watchdog does not kill the same incarnation again while it exits."""
    g0, g1, _ = launcher.groups
    start(launcher, g0)
    start(launcher, g1)
    t0 = time.time()
    launcher._observe({"members": [member(g0), member(g1)]}, t0)
    signals = []

    def slow_wait(timeout=None):
        raise subprocess.TimeoutExpired("train", timeout)

    real = g1.procs[0]
    g1.procs[0] = SimpleNamespace(pid=real.pid, poll=lambda: None, kill=lambda: signals.append("KILL"),
                                  wait=slow_wait)
    status = {"members": [member(g0)], "dead": []}
    launcher._observe(status, t0 + 0.1)
    launcher._watchdog(status, launcher.events, t0 + 3.5)
    launcher._watchdog(status, launcher.events, t0 + 4.0)
    assert signals == ["KILL"] and len(kinds(launcher, "member_killed")) == 1
    assert f"process {real.pid} still exiting" in capsys.readouterr().err
    g1.procs[0] = real  # the fixture stops the real one


def test_group_that_comes_back_within_the_grace_is_not_killed(launcher):
    g = launcher.groups[0]
    start(launcher, g)
    t0 = time.time()
    launcher._observe({"members": [member(g)]}, t0)
    launcher._observe({"members": []}, t0 + 0.1)  # starved of CPU for a moment
    launcher._observe({"members": [member(g)]}, t0 + 2.0)
    launcher._watchdog({"members": [member(g)], "dead": []}, launcher.events, t0 + 10.0)
    assert g.running()


# -- what an exit means ---------------------------------------------------------------------------

def test_exit_status_2_before_registering_stops_the_launch_with_the_groups_error(launcher):
    g = launcher.groups[1]
    start(launcher, g, "echo 'loading data'; echo 'ftlm: error: data.dir=/nope has no "
                       "manifest.json; run ftlm data prepare first' >&2; exit 2")
    wait_exit(g)
    launcher._reap(launcher.events, time.time())
    assert launcher.fatal == ("group g1 cannot start (exit status 2): data.dir=/nope has no "
                              "manifest.json; run ftlm data prepare first")


def test_crash_loop_stops_the_launch_after_n_exits_without_progress(launcher):
    g = launcher.groups[0]
    for i in range(3):
        start(launcher, g, f"echo 'Fatal Python error: attempt {i}'; exit 1")
        wait_exit(g)
        launcher._reap(launcher.events, time.time())
        assert (launcher.fatal == "") == (i < 2), launcher.fatal
        g.restarts += 1
    assert "crash-looping: 3 exits within 60 s" in launcher.fatal
    assert launcher.fatal.endswith("last exit status 1: Fatal Python error: attempt 2")


_DIVERGED = ("echo 'ftlm: error: the loss or gradient was not finite in 3 attempts in a row at step 1'"
             " >&2; exit 2")


def test_status_2_from_registered_groups_twice_at_the_same_step_stops_the_launch(launcher):
    """A 2-group run with train.lr=1e30 looped for minutes: every group stopped with the
    divergence error, was restarted, caught up (progress, to the crash-loop rule), diverged
    again. Two such exits with the job no further stop it with the group's own error."""
    g0, g1 = launcher.groups[:2]
    launcher._best = (1, 2)
    start(launcher, g0, _DIVERGED)
    g0.registered = g0.progressed = True
    wait_exit(g0)
    launcher._reap(launcher.events, time.time())
    assert launcher.fatal == "" and g0.restart_at is not None  # one exit: restarted as before
    start(launcher, g1, _DIVERGED)
    g1.registered = g1.progressed = True
    wait_exit(g1)
    launcher._reap(launcher.events, time.time())
    assert launcher.fatal == ("group g1 stopped with an error a restart repeats (exit status 2; "
                              "group g0 did too, and the job is still at step 1): the loss or "
                              "gradient was not finite in 3 attempts in a row at step 1")


def test_status_2_again_after_the_job_moved_on_is_restarted(launcher):
    g = launcher.groups[0]
    for top in (10, 11, 30):  # one group, the job further each time: no loop
        launcher._best = (top, 1)
        start(launcher, g, _DIVERGED)
        g.registered = g.progressed = True
        wait_exit(g)
        launcher._reap(launcher.events, time.time())
        assert launcher.fatal == ""
        g.restarts += 1
    launcher._best = (30, 1)
    start(launcher, g, _DIVERGED)  # the same group, the job no further: it would loop
    g.registered = True
    wait_exit(g)
    launcher._reap(launcher.events, time.time())
    assert launcher.fatal.startswith("group g0 stopped with an error a restart repeats (exit status 2; "
                                     "it did too, and the job is still at step 30): the loss")


def test_exits_caused_by_chaos_or_after_progress_are_not_a_crash_loop(launcher):
    g = launcher.groups[0]
    for i in range(5):
        start(launcher, g)
        if i % 2:
            g.cause = "chaos"
        else:
            g.registered, g.progressed = True, True  # it committed before it died
        g.procs[0].kill()
        wait_exit(g)
        launcher._reap(launcher.events, time.time())
        g.restarts += 1
    assert launcher.fatal == ""
    causes = [e["cause"] for e in kinds(launcher, "group_exit")]
    assert causes == ["crash", "chaos", "crash", "chaos", "crash"]


def test_a_rank_exiting_with_the_retired_status_retires_its_group_without_reading_its_log(launcher):
    """The coordinator retired the group for failing its steps (a bad link or device): a rank
    exits with EXIT_RETIRED, and that status alone makes the exit ``retired`` (the rank printed
    nothing; a crash whose log has the verdict's words stays a crash). Retired exits are not a
    crash loop; after RETIRED_IN_A_ROW of them the group is not started again."""
    g = launcher.groups[1]
    start(launcher, g, "echo 'ftlm: error: its link (or its device) fails the steps it takes part in' >&2; exit 1")
    wait_exit(g)
    launcher._reap(launcher.events, time.time())
    for _ in range(RETIRED_IN_A_ROW):
        g.restarts += 1
        start(launcher, g, "sleep 60", ranks=2)
        g.procs[1].kill()  # rank 1 is retired while rank 0 still runs
        g.procs[1].wait()
        g.procs[1] = subprocess.Popen(["sh", "-c", f"exit {EXIT_RETIRED}"])
        g.procs[1].wait()
        launcher._reap(launcher.events, time.time())
    exits = [(e["cause"], e["code"]) for e in kinds(launcher, "group_exit")]
    assert exits == [("crash", 1)] + [("retired", EXIT_RETIRED)] * RETIRED_IN_A_ROW
    assert g.lost and launcher.fatal == ""
    assert kinds(launcher, "group_lost")[0]["reason"].startswith(
        f"the coordinator retired its last {RETIRED_IN_A_ROW} processes in a row")


def _result_line(g: GroupProcess, step: int) -> str:
    return f"echo 'FTLM_RESULT {{\"step\": {step}, \"state_hash\": \"h\", \"incarnation\": \"{g.incarnation}\"}}'"


def test_group_stopped_by_sigterm_before_the_end_restarts_as_a_preempted_pod_would(launcher):
    """A SIGTERM (spot reclaim, drain) makes a group leave and exit 0 before the last
    step; the launcher brings it back as a new incarnation (a replaced pod, a requeued job)
    instead of counting it finished, and it is no crash."""
    g = launcher.groups[1]
    g.incarnation = "inc0"
    start(launcher, g, _result_line(g, 40))
    wait_exit(g)
    now = time.time()
    launcher._reap(launcher.events, now)
    assert not g.finished and g.restart_at == pytest.approx(now + launcher.config.ft.restart_delay)
    (exit_event,) = kinds(launcher, "group_exit")
    assert exit_event["ok"] is True and exit_event["preempted"] is True and exit_event["final_step"] == 40
    assert launcher.fatal == "" and g.crash_times == []


def test_chaos_preemption_signals_the_ranks_and_a_stop_during_set_up_is_a_preemption(launcher):
    """A chaos SIGTERM reaches the chosen ranks (here every rank: a trap writes it down); a group
    that then exits 0 before printing a result (stopped during its set-up, before it joined) comes
    back as a preempted one, not as a crash."""
    launcher.chaos = Chaos(mtbf=1.0, seed=0, preempt=True)
    launcher.chaos.choose = lambda *a: SimpleNamespace(target="g1", rank=ALL_RANKS, signal="SIGTERM")
    g = launcher.groups[1]
    start(launcher, g, "trap 'echo got-term; exit 0' TERM; echo ready; while :; do sleep 0.05; done",
          ranks=2)
    for _ in range(200):  # bounded: 10 s for both shells to set their trap
        if all("ready" in g.log(launcher.run_dir, r).read_text() for r in (0, 1)):
            break
        time.sleep(0.05)
    launcher._inject(launcher.events, {"members": []})
    assert g.terminated and g.cause == ""
    wait_exit(g)
    assert [p.returncode for p in g.procs] == [0, 0]
    assert all("got-term" in g.log(launcher.run_dir, r).read_text() for r in (0, 1))
    now = time.time()
    launcher._reap(launcher.events, now)
    (exit_event,) = kinds(launcher, "group_exit")
    assert exit_event["ok"] is True and exit_event["preempted"] is True and exit_event["final_step"] is None
    assert g.restart_at == pytest.approx(now + launcher.config.ft.restart_delay) and launcher.fatal == ""
    (injected,) = kinds(launcher, "failure_injected")
    assert injected["signal"] == "SIGTERM" and injected["target_rank"] == ALL_RANKS


def test_a_rank_the_preemption_signal_ended_itself_stopped_as_asked(launcher):
    """Soak, seed 1 with preemptions: a second SIGTERM reached a rank on its way out, after the
    trainer had given SIGTERM back (Python's own handling ends a process then), and its exit
    -15 was counted as a crash. For a preempted incarnation that is a stop, as at start-up
    before any handler is in place."""
    launcher.chaos.choose = lambda *a: SimpleNamespace(target="g1", rank=ALL_RANKS, signal="SIGTERM")
    g = launcher.groups[1]
    g.incarnation = "inc0"
    start(launcher, g, _result_line(g, 40) + "; exec sleep 30", ranks=2)  # no trap: SIGTERM ends it
    for _ in range(200):  # bounded: 10 s for the result lines
        if g.final_result(launcher.run_dir, launcher.ranks) is not None:
            break
        time.sleep(0.05)
    launcher._inject(launcher.events, {"members": []})
    wait_exit(g)
    assert [p.returncode for p in g.procs] == [-signal.SIGTERM] * 2
    launcher._reap(launcher.events, time.time())
    (exit_event,) = kinds(launcher, "group_exit")
    assert exit_event["ok"] is True and exit_event["preempted"] is True and exit_event["final_step"] == 40
    assert launcher.fatal == "" and g.restart_at is not None


def test_a_group_that_hangs_after_printing_its_result_is_killed_and_its_result_stands(launcher):
    """Soak, seed 1 with preemptions: a group left the job, printed its result, and was then
    SIGSTOPped while exiting (a teardown can hang as well); the supervisor skipped it as
    "exiting" forever and the job waited out ft.give_up_seconds. Now it waits
    cluster.grace_seconds, kills it, and takes the result it printed."""
    g = launcher.groups[1]
    g.incarnation = "inc0"
    start(launcher, g, _result_line(g, 40) + "; kill -STOP $$")
    for _ in range(200):  # bounded: 10 s for the result line
        if g.printed_result(launcher.run_dir):
            break
        time.sleep(0.05)
    now = time.time()
    g.started = now - 10.0  # never seen registered (it joined and left between two polls)
    launcher._watchdog({"members": [], "dead": []}, launcher.events, now)
    assert g.running() and not kinds(launcher, "member_killed")  # exiting: given the grace
    later = now + launcher.config.cluster.grace_seconds + 1
    launcher._watchdog({"members": [], "dead": []}, launcher.events, later)
    (killed,) = kinds(launcher, "member_killed")
    assert "printed its result but did not exit" in killed["reason"]
    wait_exit(g)
    launcher._reap(launcher.events, later)
    (exit_event,) = kinds(launcher, "group_exit")
    assert exit_event["ok"] is True and exit_event["preempted"] is True and exit_event["final_step"] == 40
    assert g.restart_at is not None and launcher.fatal == ""


def test_a_group_exiting_on_its_own_error_is_not_killed_as_hung_within_the_teardown(launcher):
    """A group that stopped on its own error (the divergence error, status 2) stops heartbeating
    before its process ends; on a loaded machine the coordinator declared it dead and the
    watchdog killed it (-9) before it exited, so its status (a restart repeats it) was lost and
    the launch restarted it again and again. With its error line printed it gets TEARDOWN_SECONDS."""
    g = launcher.groups[0]
    start(launcher, g, "echo 'ftlm: error: the loss or gradient was not finite in 3 attempts' >&2; kill -STOP $$")
    for _ in range(200):  # bounded: 10 s for the error line
        if g.printed_error(launcher.run_dir):
            break
        time.sleep(0.05)
    t0 = time.time()
    launcher._observe({"members": [member(g)], "dead": []}, t0)
    launcher._observe({"members": [], "dead": []}, t0 + 0.1)  # its heartbeat ended
    dead = {"members": [], "dead": [{"replica_id": g.replica_id, "reason": "heartbeat timeout"}]}
    launcher._watchdog(dead, launcher.events, t0 + 5.0)  # past the grace of 3 heartbeat timeouts
    assert g.running() and not kinds(launcher, "member_killed")
    launcher._watchdog(dead, launcher.events, t0 + 5.0 + TEARDOWN_SECONDS + 0.5)
    (killed,) = kinds(launcher, "member_killed")  # a teardown that hangs is still bounded
    assert killed["reason"] == "declared dead: heartbeat timeout"
    other = launcher.groups[1]
    start(launcher, other)  # no error line: killed at the grace, as before
    launcher._observe({"members": [member(other)], "dead": []}, t0)
    launcher._observe({"members": [], "dead": []}, t0 + 0.1)
    launcher._watchdog({"members": [], "dead": []}, launcher.events, t0 + 5.0)
    assert len(kinds(launcher, "member_killed")) == 2
    # Two ranks, one printed its error and the other did not (it hangs, the first may be stuck
    # on it in its teardown): killed at the grace, as before.
    third = launcher.groups[2]
    start(launcher, third, ranks=2)
    with open(third.log(launcher.run_dir, 0), "ab") as f:  # rank 0's error; rank 1 says nothing
        f.write(b"ftlm: error: declared hung\n")
    assert not third.printed_error(launcher.run_dir)
    launcher._observe({"members": [member(third)], "dead": []}, t0)
    launcher._observe({"members": [], "dead": []}, t0 + 0.1)
    launcher._watchdog({"members": [], "dead": []}, launcher.events, t0 + 5.0)
    assert len(kinds(launcher, "member_killed")) == 3


def test_a_group_that_left_and_printed_its_result_gets_only_the_teardown_to_exit(launcher):
    """Soak seed 46 with preemptions: a group preempted at step 744 of 800 left the job, printed
    its result and was SIGSTOPped on its way out; it was waited for cluster.grace_seconds after
    its leave and again after its result (240 s), the others finished meanwhile and the job gave
    up with a replica short of the last step. With every rank's result printed only its exit is
    left: it is killed after TEARDOWN_SECONDS, its result stands and it restarts."""
    g = launcher.groups[1]
    g.incarnation = "inc0"
    start(launcher, g, _result_line(g, 40) + "; kill -STOP $$")
    for _ in range(200):  # bounded: 10 s for the result line
        if g.final_result(launcher.run_dir, launcher.ranks) is not None:
            break
        time.sleep(0.05)
    t0 = time.time()
    launcher._observe({"members": [member(g)], "dead": []}, t0)
    launcher._observe({"members": [], "dead": [], "left": [{"replica_id": g.replica_id, "group": "g1",
                                                            "reason": "stopped", "seconds_ago": 0.1}]}, t0 + 0.1)
    launcher._watchdog({"members": [], "dead": []}, launcher.events, t0 + 0.2)
    assert g.running() and not kinds(launcher, "member_killed")  # its teardown is bounded from here
    launcher._watchdog({"members": [], "dead": []}, launcher.events, t0 + 0.2 + TEARDOWN_SECONDS - 0.5)
    assert g.running()
    later = t0 + 0.2 + TEARDOWN_SECONDS + 0.5  # far inside cluster.grace_seconds of its leave
    assert later - t0 < launcher.config.cluster.grace_seconds
    launcher._watchdog({"members": [], "dead": []}, launcher.events, later)
    (killed,) = kinds(launcher, "member_killed")
    assert killed["reason"] == f"left the job and printed its result but did not exit within {TEARDOWN_SECONDS:g} s"
    wait_exit(g)
    launcher._reap(launcher.events, later)
    (exit_event,) = kinds(launcher, "group_exit")
    assert exit_event["ok"] is True and exit_event["preempted"] is True and exit_event["final_step"] == 40
    assert g.restart_at is not None and launcher.fatal == ""


def test_group_that_reached_the_last_step_or_its_time_limit_finishes(launcher):
    g0, g1 = launcher.groups[:2]
    g0.incarnation = "inc0"
    start(launcher, g0, _result_line(g0, 100))  # train.steps
    launcher.config.train.max_seconds = 0.5
    g1.incarnation = "inc0"
    start(launcher, g1, "sleep 0.6; " + _result_line(g1, 40))  # stopped by train.max_seconds
    wait_exit(g0)
    wait_exit(g1)
    launcher._reap(launcher.events, time.time())
    assert g0.finished and g1.finished and g0.restart_at is None and g1.restart_at is None
    assert not any(e.get("preempted") for e in kinds(launcher, "group_exit"))


# -- chaos ----------------------------------------------------------------------------------------

def test_chaos_stops_once_a_group_reached_the_last_step(launcher):
    g0 = launcher.groups[0]
    start(launcher, g0)
    assert not launcher._ending({"members": [member(g0, 99)]})
    assert launcher._ending({"members": [member(g0, 100)]})
    g0.finished = True
    assert launcher._ending({"members": []})


def test_chaos_hits_starting_groups_but_never_the_last_up_to_date_one(launcher):
    g0, g1, g2 = launcher.groups
    for g in launcher.groups:
        start(launcher, g)
    # g0 is the only participant; g1 is starting (never registered), g2 recovering.
    status = {"members": [member(g0, 10), member(g2, 0)],
              "last_quorum": {"participants": [g0.replica_id], "recovering": [g2.replica_id]}}
    for _ in range(12):
        launcher._inject(launcher.events, status)
        for g in (g1, g2):
            if g.cause == "chaos":  # hit: the next incarnation takes its place
                g.kill()
                start(launcher, g)
        assert g0.running() and not g0.stopped and g0.cause == ""
    injected = kinds(launcher, "failure_injected")
    assert {e["target"] for e in injected} == {"g1", "g2"}
    assert any(e["registered"] is False for e in injected)


def test_chaos_draws_hang_non_leader_ranks_and_the_coordinator():
    chaos = Chaos(mtbf=1.0, seed=0, hang=True, coordinator=True)
    draws = [chaos.choose(["g0", "g1"], ranks=2, coordinator_up=True) for _ in range(300)]
    assert {(f.target, f.rank, f.signal) for f in draws if f.target != COORDINATOR} == \
        {(g, r, s) for g in ("g0", "g1") for r in (0, 1) for s in ("SIGKILL", "SIGSTOP")}
    assert 50 < sum(f.target == COORDINATOR for f in draws) < 150  # one target in three
    assert all(f.signal == "SIGKILL" for f in draws if f.target == COORDINATOR)
    plain = Chaos(mtbf=1.0, seed=0)
    assert all(plain.choose(["g0"], 2, True).signal == "SIGKILL" for _ in range(50))
    assert plain.choose([], 2, True) is None
    assert Chaos(mtbf=0.0, seed=0).next_gap() is None


def test_chaos_preemptions_reach_every_rank_or_one_and_leave_older_schedules_alone():
    chaos = Chaos(mtbf=1.0, seed=0, hang=True, preempt=True)
    draws = [chaos.choose(["g0", "g1"], ranks=2, coordinator_up=True) for _ in range(600)]
    terms = [f for f in draws if f.signal == "SIGTERM"]
    assert 150 < len(terms) < 250  # a third of the failures of groups
    assert {f.rank for f in terms} == {ALL_RANKS, 0, 1}
    assert 90 < sum(f.rank == ALL_RANKS for f in terms) < 180  # two in three reach every rank
    assert {f.signal for f in draws} == {"SIGKILL", "SIGSTOP", "SIGTERM"}
    one_rank = Chaos(mtbf=1.0, seed=0, preempt=True)
    assert {f.rank for f in (one_rank.choose(["g0"], 1, True) for _ in range(60))
            if f.signal == "SIGTERM"} == {ALL_RANKS}
    # Without preempt, the same seed draws what it drew before preemptions existed.
    old = Chaos(mtbf=1.0, seed=5, hang=True, coordinator=True)
    assert [(f.target, f.rank, f.signal) for f in (old.choose(["g0", "g1"], 2, True)
                                                  for _ in range(10))] == EARLIER_SEED_5


EARLIER_SEED_5 = [("coordinator", 0, "SIGKILL"), ("g1", 0, "SIGKILL"), ("g1", 0, "SIGKILL"),
                  ("coordinator", 0, "SIGKILL"), ("g0", 0, "SIGKILL"), ("g1", 0, "SIGSTOP"),
                  ("g1", 0, "SIGKILL"), ("g0", 1, "SIGKILL"), ("g1", 1, "SIGSTOP"), ("g0", 0, "SIGKILL")]
"""Chaos(mtbf=1, seed=5, hang=True, coordinator=True)'s first ten draws before preemptions existed."""


# -- the end of a run -----------------------------------------------------------------------------

def test_group_dying_near_the_end_restarts_while_another_group_is_still_there(launcher, monkeypatch):
    g0, g1, g2 = launcher.groups
    spawned = []
    monkeypatch.setattr(launcher, "_spawn", lambda g, *_: spawned.append(g.name))
    g0.finished, g0.result = True, {"step": 100, "state_hash": "h"}
    start(launcher, g2)  # still running: g1 can recover from it or from g0 while g0 serves
    g1.restart_at = time.time() - 1
    launcher._restart_due(launcher.events, Path("config.toml"), "http://x", time.time())
    assert spawned == ["g1"] and not g1.lost


def test_group_dying_after_every_other_group_left_is_lost_not_restarted(launcher, monkeypatch):
    g0, g1, g2 = launcher.groups
    spawned = []
    monkeypatch.setattr(launcher, "_spawn", lambda g, *_: spawned.append(g.name))
    for g in (g0, g2):
        g.finished, g.result = True, {"step": 100, "state_hash": "h"}
    g1.restart_at = time.time() - 1
    launcher._restart_due(launcher.events, Path("config.toml"), "http://x", time.time())
    assert spawned == [] and g1.lost
    assert kinds(launcher, "group_lost")[0]["target"] == "g1"


def test_group_dying_after_every_other_group_left_restarts_onto_the_final_checkpoint(launcher, monkeypatch):
    """Soak seed 46 with preemptions: a group preempted near the end could not come back before the
    others finished; it was lost, and the run failed a replica short. The last step is always made
    durable: a new incarnation resumes there and trains nothing, so it is restarted. Not for a
    checkpoint of an earlier step (it would train alone), nor with ``checkpoint.resume`` off."""
    g0, g1, g2 = launcher.groups
    spawned = []
    monkeypatch.setattr(launcher, "_spawn", lambda g, *_: spawned.append(g.name))
    for g in (g0, g2):
        g.finished, g.result = True, {"step": 100, "state_hash": "h"}  # train.steps
    root = launcher.run_dir / "checkpoints"
    for step in (50, 100):
        (root / f"{PREFIX}{step:08d}").mkdir(parents=True)
    (root / f"{PREFIX}{50:08d}" / MARKER).write_text("{}")
    g1.restart_at = time.time() - 1
    launcher._restart_due(launcher.events, Path("config.toml"), "http://x", time.time())
    assert spawned == [] and g1.lost  # step 100 is not complete (no marker): only step 50 is
    (root / f"{PREFIX}{100:08d}" / MARKER).write_text("{}")
    g1.lost, g1.restart_at = False, time.time() - 1
    launcher._restart_due(launcher.events, Path("config.toml"), "http://x", time.time())
    assert spawned == ["g1"] and not g1.lost
    launcher.config.checkpoint.resume = False
    g1.restart_at = time.time() - 1
    launcher._restart_due(launcher.events, Path("config.toml"), "http://x", time.time())
    assert spawned == ["g1"] and g1.lost


# -- the console ----------------------------------------------------------------------------------

def test_console_off_a_terminal_writes_a_plain_line_every_few_seconds():
    stream, now = io.StringIO(), [0.0]
    g = GroupProcess("g0", procs=[SimpleNamespace(poll=lambda: None)])
    view = ConsoleView(100, [g], enabled=True, stream=stream, clock=lambda: now[0], interval=5.0)
    for i in range(200):  # 20 s of supervisor ticks
        now[0] = i * 0.1
        view.update({"quorum_id": 3, "members": [{"group": "g0", "replica_id": "g0:a", "step": i // 2}],
                     "last_quorum": {"participants": ["g0:a"]}})
    g.finished, g.result = True, {"step": 100}
    view.update({"members": []})
    view.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert 4 <= len(lines) <= 6, lines
    assert lines[0] == "step 0/100 q3 P=1 g0:train@0"
    assert lines[-1].startswith("step 100/100") and "g0:done@100" in lines[-1]


def test_console_bar_on_a_terminal_reaches_the_last_step():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    g = GroupProcess("g0", procs=[SimpleNamespace(poll=lambda: 0)])
    view = ConsoleView(100, [g], enabled=True, stream=Tty())
    view.update({"members": [{"group": "g0", "replica_id": "g0:a", "step": 99}]})
    g.finished, g.result = True, {"step": 100}  # it committed the last step and left
    view.update({"members": []})
    assert view.bar.n == 100
    view.close()


def test_coordinator_that_cannot_start_is_a_one_line_error(tmp_path):
    from ftlm.launch.coordinator_process import CoordinatorProcess
    config = tmp_path / "bad.toml"
    config.write_text("[ft]\nheartbeat_timeout = -1\n")
    coordinator = CoordinatorProcess(config, 0, "t", tmp_path / "events.jsonl", tmp_path / "c.log")
    with pytest.raises(FtlmError, match=r"exited with status 2 at start: ft.heartbeat_timeout=-1"):
        coordinator.start(ready_timeout=60)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_relaunch_into_the_same_run_directory_keeps_the_job_token(tmp_path):
    """Checkpoint manifests are signed with the token: a new token per launch made a relaunch
    refuse every checkpoint of the run (found while building checkpoint integrity)."""
    import stat

    from ftlm.train.job_token import run_token as _run_token

    first = _run_token(tmp_path)
    assert len(first) == 32 and _run_token(tmp_path) == first
    assert stat.S_IMODE((tmp_path / "token").stat().st_mode) == 0o600
    other = tmp_path / "other"
    other.mkdir()
    assert _run_token(other) != first


def test_the_end_kills_every_late_process_even_one_slow_to_exit_and_returns():
    """At the end of a run, what outlived its SIGTERM grace is SIGKILLed, all of it, and a process
    still exiting after that (gigabytes to unmap on a loaded machine) is reported, not raised:
    once a slow exit raised out of the launcher and left the other groups and the coordinator
    running."""
    import os as _os
    import subprocess as _subprocess
    from types import SimpleNamespace

    from ftlm.launch.local import LocalLauncher

    class SlowToDie:  # ignores SIGTERM; after SIGKILL, still "exiting" at the first wait
        pid = _os.getpid()  # SIGCONT to ourselves is harmless

        def __init__(self):
            self.killed, self.waits_after_kill, self.code = False, 0, None

        def poll(self):
            return self.code

        def terminate(self):
            pass

        def kill(self):
            self.killed = True

        def wait(self, timeout=None):
            if self.killed:
                self.waits_after_kill += 1
                if self.waits_after_kill > 1:
                    self.code = -9
                    return self.code
            raise _subprocess.TimeoutExpired("fake", timeout)

    procs = [SlowToDie(), SlowToDie()]
    launcher = LocalLauncher.__new__(LocalLauncher)
    launcher.term_grace = 0.05
    launcher.groups = [SimpleNamespace(procs=[p], finished=True) for p in procs]
    launcher._terminate_all()
    assert all(p.killed for p in procs)


def test_regular_chaos_hits_only_participants_at_fixed_intervals() -> None:
    """``bench.spares``' chaos: a failure every ``mtbf`` seconds exactly, of a group that trained
    in the last quorum (a spare, a starting or a recovering group is never hit)."""
    from types import SimpleNamespace

    from ftlm.launch.chaos_injection import ChaosInjection

    chaos = Chaos(mtbf=30.0, seed=1, regular=True, participants_only=True)
    assert [chaos.next_gap() for _ in range(3)] == [30.0, 30.0, 30.0]
    killed: list[str] = []

    class Proc:
        def __init__(self, name: str) -> None:
            self.name, self.pid = name, 0

        def kill(self) -> None:
            killed.append(self.name)

    def group(name: str) -> SimpleNamespace:
        return SimpleNamespace(name=name, replica_id=f"{name}:a", procs=[Proc(name)], stopped=False,
                               finished=False, restart_at=None, incarnation="a", registered=True,
                               cause=None, running=lambda: True)

    injector = ChaosInjection()
    injector.groups = [group(n) for n in ("g0", "g1", "g2", "g3")]
    injector.ranks, injector.chaos, injector._healthy = 1, chaos, set()
    injector.coordinator = SimpleNamespace(running=lambda: True)
    events = SimpleNamespace(emit=lambda *a, **k: None)
    status = {"last_quorum": {"participants": ["g1:a", "g2:a", "g3:a"], "spares": ["g0:a"]}}
    for _ in range(40):
        injector._inject(events, status)
    assert killed and "g0" not in killed and set(killed) <= {"g1", "g2", "g3"}
