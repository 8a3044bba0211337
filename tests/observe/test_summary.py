"""Run summary: data accounting, stalls, steady rate, ETT and the summary.json fields."""

from __future__ import annotations

import json

import pytest

from ftlm.errors import DataError
from ftlm.observe.summary import (build_summary, data_accounting, ett, failure_events,
                                  failure_ledger, final_history, median_step_seconds,
                                  proof_problems, replicas_identical, stall_seconds,
                                  steady_tokens_per_second, write_summary)

DESIGN_FIELDS = ("steps_committed", "steps_failed", "wall_seconds", "tokens_committed", "ett",
                 "failures_injected", "failures_detected", "recoveries", "stall_seconds",
                 "final_loss", "state_hashes", "replicas_identical", "data", "groups", "config")
NO_ROLLBACK = {"restores": 0, "rolled_back_steps": 0}


# --- data accounting -------------------------------------------------------------------------

def test_clean_run_has_no_duplicates_or_gaps(runs):
    data = data_accounting(runs.steady_run(10, groups=("A", "B", "C")))
    assert data == {"samples_committed": 10 * runs.BATCH, "duplicates": 0, "gaps": 0,
                    "inconsistent_steps": [], **NO_ROLLBACK}


def test_step_committed_by_different_groups_at_different_times_is_not_a_duplicate(runs):
    events = [runs.commit(1.0, "A", 0, 0, 8), runs.commit(1.1, "B", 0, 0, 8),
              runs.event(1.2, "step_failed", "B", 1, reason="allreduce timeout"),
              runs.commit(1.3, "A", 1, 8, 16),          # A committed step 1, B failed it ...
              runs.commit(2.5, "B", 1, 8, 16),          # ... and B committed it later, same range
              runs.commit(2.6, "A", 2, 16, 24), runs.commit(2.6, "B", 2, 16, 24)]
    assert data_accounting(events) == {"samples_committed": 24, "duplicates": 0, "gaps": 0,
                                       "inconsistent_steps": [], **NO_ROLLBACK}


def test_overlapping_distinct_steps_count_each_position_once_as_duplicate(runs):
    events = [runs.commit(1.0, "A", 0, 0, 8), runs.commit(1.1, "A", 1, 4, 12),
              runs.commit(1.2, "A", 2, 6, 14), runs.commit(1.3, "A", 3, 14, 20)]
    # Positions 4..5 are in two steps, 6..7 in three, 8..11 in two: 8 positions duplicated.
    assert data_accounting(events) == {"samples_committed": 20, "duplicates": 8, "gaps": 0,
                                       "inconsistent_steps": [], **NO_ROLLBACK}


def test_hole_between_steps_counts_gaps_exactly(runs):
    events = [runs.commit(1.0, "A", 0, 0, 8), runs.commit(1.1, "A", 1, 8, 16),
              runs.commit(1.2, "A", 2, 40, 48)]
    assert data_accounting(events) == {"samples_committed": 24, "duplicates": 0, "gaps": 24,
                                       "inconsistent_steps": [], **NO_ROLLBACK}
    # A run that does not start at 0 shows the missing prefix as gaps too.
    assert data_accounting([runs.commit(1.0, "A", 0, 5, 8)])["gaps"] == 5


def test_groups_disagreeing_on_a_steps_range_are_reported(runs):
    events = [runs.commit(1.0, "A", 0, 0, 8), runs.commit(1.0, "B", 0, 0, 8),
              runs.commit(1.1, "A", 1, 8, 16), runs.commit(1.2, "B", 1, 8, 20)]
    data = data_accounting(events)
    assert data["inconsistent_steps"] == [1]
    assert data["samples_committed"] == 16  # the earliest runs.commit's range stands for the step


def test_accounting_handles_huge_ranges_without_materialising_positions(runs):
    big = 10**12
    events = [runs.commit(1.0, "A", 0, 0, big), runs.commit(1.1, "A", 1, big // 2, 2 * big),
              runs.commit(1.2, "A", 2, 3 * big, 4 * big)]
    assert data_accounting(events) == {"samples_committed": 3 * big, "duplicates": big // 2,
                                       "gaps": big, "inconsistent_steps": [], **NO_ROLLBACK}


def test_accounting_of_a_hundred_thousand_steps_scales_with_steps_not_samples(runs):
    # 10^8 samples: a per-sample algorithm would take minutes and gigabytes; the sweep over range
    # edges handles it in well under a second (speed itself is not asserted: the box is shared).
    events = [runs.commit(float(i), "A", i, i * 1024, (i + 1) * 1024) for i in range(100_000)]
    data = data_accounting(events)
    assert data["samples_committed"] == 100_000 * 1024 and data["gaps"] == 0


def test_malformed_commit_ranges_are_data_errors(runs):
    with pytest.raises(DataError, match="samples"):
        data_accounting([runs.event(1.0, "commit", "A", 0, samples=[8, 4], tokens=1)])
    with pytest.raises(DataError, match="tokens"):
        data_accounting([runs.event(1.0, "commit", "A", 0, samples=[0, 4])])


# --- failures and stalls ---------------------------------------------------------------------

def test_injected_failure_detected_twice_counts_as_one_failure_and_one_detection(runs):
    fails = failure_events(runs.failure_run(pause=1.3))
    assert [(f.kind, f.group) for f in fails] == [("failure_injected", "C"),
                                                  ("recovery_start", "C")]


def test_stall_is_the_longest_healthy_gap_minus_the_median_step(runs):
    events = runs.failure_run(pause=1.3)
    median = median_step_seconds(events)
    assert median == pytest.approx(0.1)
    stalls = stall_seconds(events, median)
    assert stalls == [pytest.approx(1.2, abs=1e-6), 0.0]  # the rejoin did not pause anyone


def test_no_stall_when_the_healthy_groups_kept_committing(runs):
    events = runs.failure_run(pause=0.1)
    assert stall_seconds(events, median_step_seconds(events)) == [0.0, 0.0]


def test_a_gap_is_charged_to_one_event_only(runs):
    # The rejoin starts inside the gap the failure caused: the gap is the failure's.
    events = runs.steady_run(60, groups=("A", "B"), pause_after=20, pause=2.1, stop={"B": 21})
    t_gap = 1000.0 + 20 * 0.1
    events += [runs.event(t_gap + 0.01, "failure_injected", "", -1, target="B"),
               runs.event(t_gap + 0.5, "recovery_start", "B", 21)]
    assert stall_seconds(events, 0.1) == [pytest.approx(2.0, abs=1e-6), 0.0]


def test_healthy_groups_that_never_commit_again_wait_in_the_end_not_in_a_stall(runs):
    # A blocks forever waiting for B (a wedged all-reduce) until the run is interrupted: no
    # commit closes a gap, so the wait is the timeline's end, after the last commit.
    events = runs.steady_run(10, groups=("A", "B"), stop={"A": 5, "B": 5})
    last = max(e["ts"] for e in events)
    events += [runs.event(1000.45, "failure_injected", "", -1, target="B"),
               runs.event(last + 3.0, "run_end", "", -1, reason="interrupted")]
    assert stall_seconds(events, 0.1) == [0.0]
    summary = build_summary(events, wall_seconds=3.0, state_hashes={}, config={}, groups=["A", "B"])
    assert summary["timeline"]["end_seconds"] == pytest.approx(3.0, abs=1e-3)


def test_member_dead_of_a_group_that_exited_cleanly_is_not_a_failure(runs):
    events = runs.steady_run(10, groups=("A", "B"))
    events += [runs.event(1001.0, "group_exit", "B", 10, ok=True),
               runs.event(1002.0, "member_dead", "coordinator", -1, target="B")]
    assert failure_events(events) == []


# --- steady rate and ETT ---------------------------------------------------------------------

def test_steady_rate_ignores_warm_up_steps(runs):
    events = [runs.commit(1000.0 + 0.5 * i, "A", i, i * 8, (i + 1) * 8, tokens=100)
              for i in range(3)]
    t = 1000.0 + 0.5 * 2
    events += [runs.commit(t + 0.1 * k, "A", 2 + k, (2 + k) * 8, (3 + k) * 8, tokens=100)
               for k in range(1, 30)]
    assert steady_tokens_per_second(events, [], margin=1.0) == pytest.approx(1000.0)


def test_ett_is_one_for_a_failure_free_steady_run(runs):
    events = runs.steady_run(100, groups=("A", "B"))
    summary = build_summary(events, wall_seconds=100 * 0.1, state_hashes={"A": "h", "B": "h"},
                            config={}, groups=["A", "B"])
    assert summary["steady_tokens_per_second"] == pytest.approx(runs.TOKENS / 0.1)
    assert summary["ett"] == pytest.approx(1.0)
    assert summary["stall_seconds"] == []


def test_ett_with_an_injected_pause_is_the_productive_fraction(runs):
    events = runs.failure_run(pause=1.3)
    wall = 100 * 0.1 + 1.2  # 100 steps of 0.1 s plus the 1.2 s stall
    summary = build_summary(events, wall_seconds=wall, state_hashes={"A": "h", "B": "h"},
                            config={}, groups=["A", "B", "C"])
    assert summary["steady_tokens_per_second"] == pytest.approx(runs.TOKENS / 0.1, rel=1e-6)
    assert summary["ett"] == pytest.approx(10.0 / 11.2, abs=1e-4)


def test_ett_guards_zero_denominators():
    assert ett(100, 0.0, 10.0) == 0.0 and ett(100, 10.0, 0.0) == 0.0
    assert ett(50, 10.0, 10.0) == pytest.approx(0.5)


# --- summary.json ----------------------------------------------------------------------------

def test_build_summary_has_every_design_field_with_the_run_values(runs):
    events = runs.failure_run(pause=1.3)
    events.append(runs.event(1002.0, "step_failed", "A", 10, reason="peer died"))
    hashes = {"A": "ab" * 32, "B": "ab" * 32, "C": "ab" * 32}
    summary = build_summary(events, wall_seconds=11.2, state_hashes=hashes,
                            config={"run": {"name": "t"}}, groups=["A", "B", "C"])
    assert all(field in summary for field in DESIGN_FIELDS)
    assert summary["steps_committed"] == 100
    assert summary["steps_failed"] == 1
    assert summary["tokens_committed"] == 100 * runs.TOKENS
    assert summary["failures_injected"] == 1
    assert summary["failures_detected"] == 1
    assert summary["recoveries"] == 1
    assert summary["stall_seconds"] == [pytest.approx(1.2, abs=1e-3), 0.0]
    assert summary["final_loss"] == pytest.approx(5.0 - 0.01 * 99)
    assert summary["replicas_identical"] is True
    assert summary["data"] == {"samples_committed": 100 * runs.BATCH, "duplicates": 0, "gaps": 0,
                               "inconsistent_steps": [], **NO_ROLLBACK}
    assert summary["groups"] == ["A", "B", "C"] and summary["config"] == {"run": {"name": "t"}}
    assert summary["median_step_seconds"] == pytest.approx(0.1)


def test_replicas_identical_needs_equal_hashes_and_at_least_one(runs):
    events = runs.steady_run(5)
    build = lambda hashes: build_summary(events, wall_seconds=1.0, state_hashes=hashes,
                                         config={}, groups=["A", "B"])["replicas_identical"]
    assert build({"A": "x", "B": "x"}) is True
    assert build({"A": "x", "B": "y"}) is False
    assert build({}) is False


def test_empty_run_summarises_without_errors():
    summary = build_summary([], wall_seconds=0.0, state_hashes={}, config={}, groups=[])
    assert summary["steps_committed"] == 0 and summary["ett"] == 0.0
    assert summary["final_loss"] is None and summary["data"]["samples_committed"] == 0


def test_write_summary_is_strict_json_and_leaves_no_temporary_file(runs, tmp_path):
    summary = build_summary(runs.steady_run(5), wall_seconds=0.5, state_hashes={"A": "x"},
                            config={"train": {"lr": float("nan")}}, groups=["A"])
    path = tmp_path / "summary.json"
    write_summary(path, summary)
    write_summary(path, summary)
    assert json.loads(path.read_text())["steps_committed"] == 5
    assert json.loads(path.read_text())["config"] == {"train": {"lr": None}}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


# --- rollbacks (restore events) --------------------------------------------------------------

def _rollback_run(runs) -> list[dict]:
    """A and B commit steps 0..9 (8 samples a step); both die; the coordinator rolls the job back
    to step 6 (a checkpoint C loaded) and C alone commits steps 6..11 with 4 samples a step."""
    events = runs.steady_run(10, groups=("A", "B"))
    t = 1002.0
    events.append(runs.event(t, "restore", "coordinator", -1, from_step=10, to_step=6,
                             reason="every holder of step 10 died", source="checkpoint"))
    for k, step in enumerate(range(6, 12)):
        start = 48 + 4 * k
        events.append(runs.commit(t + 0.1 * (k + 1), "C", step, start, start + 4, participants=1))
    return events


def test_commits_superseded_by_a_restore_leave_the_history(runs):
    events = _rollback_run(runs)
    data = data_accounting(events)
    # Steps 0..5 from A and B ([0, 48)), 6..11 from C ([48, 72)): exactly once, no disagreement.
    assert data == {"samples_committed": 72, "duplicates": 0, "gaps": 0, "inconsistent_steps": [],
                    "restores": 1, "rolled_back_steps": 4}
    history, rolled_back = final_history(events)
    assert rolled_back == 4
    assert sorted({e["step"] for e in history if e["kind"] == "commit" and e["group"] != "C"}) \
        == list(range(6))


def test_summary_counts_the_final_history_only(runs):
    summary = build_summary(_rollback_run(runs), wall_seconds=3.0, state_hashes={"C": "h"},
                            config={"train": {"steps": 12}}, groups=["C"])
    assert summary["steps_committed"] == 12
    assert summary["tokens_committed"] == 12 * runs.TOKENS
    assert summary["data"]["restores"] == 1 and summary["data"]["rolled_back_steps"] == 4
    assert summary["problems"] == []


def test_a_restore_supersedes_only_commits_made_before_it(runs):
    events = runs.steady_run(4, groups=("A",))
    # The restore to step 2 comes after the commits of steps 0..3: steps 2 and 3 are superseded,
    # then re-committed after it with the same ranges.
    events.append(runs.event(1000.35, "restore", "coordinator", -1, from_step=4, to_step=2,
                             reason="test", source="live"))
    events += [runs.commit(1000.4, "A", 2, 16, 24), runs.commit(1000.5, "A", 3, 24, 32)]
    history, rolled_back = final_history(events)
    assert rolled_back == 2
    assert [e["ts"] for e in history if e["kind"] == "commit" and e["step"] >= 2] == [1000.4, 1000.5]


def _chained(runs, ts, group, step, start, end, chain, parent, participants=2):
    return runs.commit(ts, group, step, start, end, participants=participants) | {"chain": chain, "parent": parent}


def _chained_run(runs, steps, groups=("A", "B"), t0=1000.0, first=0, start=0):
    """Commits of steps ``first..first+steps-1`` by ``groups``, 0.1 s and 8 samples a step from
    ``start``; the state after step k is ``a{k+1}`` (``a0`` the first parent)."""
    return [_chained(runs, t0 + 0.1 * k, g, first + k, start + 8 * k, start + 8 * k + 8, f"a{first + k + 1}",
                     f"a{first + k}", len(groups))
            for k in range(steps) for g in groups]


def test_the_final_history_follows_the_chain_of_the_jobs_last_state(runs):
    """With chains, the history is the commits the last state descends from: the rollback run of
    ``_rollback_run``, each commit naming its state and its parent."""
    events = _chained_run(runs, 10)
    events.append(runs.event(1002.0, "restore", "coordinator", 6, from_step=10, to_step=6, chain="a6",
                             reason="every holder of step 10 died", source="checkpoint"))
    events += [_chained(runs, 1002.1 + 0.1 * k, "C", 6 + k, 48 + 4 * k, 52 + 4 * k, f"c{7 + k}",
                        f"c{6 + k}" if k else "a6", 1) for k in range(6)]
    assert data_accounting(events) == {"samples_committed": 72, "duplicates": 0, "gaps": 0,
                                       "inconsistent_steps": [], "restores": 1, "rolled_back_steps": 4}


def test_a_rollback_a_later_restore_undid_keeps_the_steps_it_had_dropped(runs):
    """The coordinator gave up waiting for the holder of step 6 (loading it from disk) and rolled
    back to step 5; once the holder said it had step 6, it went forward to it, and the job went on
    from there. By restores alone, step 5's commit stayed dropped: 8 samples counted as skipped."""
    events = _chained_run(runs, 6)
    events.append(runs.event(1001.0, "restore", "coordinator", 5, from_step=6, to_step=5, chain="a5"))
    events.append(runs.event(1001.1, "restore", "coordinator", 6, from_step=5, to_step=6, chain="a6"))
    events += _chained_run(runs, 3, groups=("B",), t0=1001.2, first=6, start=48)
    assert data_accounting(events) == {"samples_committed": 72, "duplicates": 0, "gaps": 0,
                                       "inconsistent_steps": [], "restores": 2, "rolled_back_steps": 0}
    legacy = [{k: v for k, v in e.items() if k not in ("chain", "parent")} for e in events]
    assert data_accounting(legacy)["gaps"] == 8  # what the record said before chains were walked


def test_a_step_a_group_committed_alone_before_it_died_is_not_in_the_history(runs):
    """At step 4 A's all-reduce completed and B's failed; A committed and died before anyone heard
    of its step 5; B took step 4 again alone, with its own half of the batch. No restore is
    written, and the two commits of step 4 disagree: only B's is the job's."""
    events = _chained_run(runs, 4)
    events.append(_chained(runs, 1000.5, "A", 4, 32, 40, "x5", "a4"))
    events += [_chained(runs, 1000.6, "B", 4, 32, 36, "b5", "a4", 1),
               _chained(runs, 1000.7, "B", 5, 36, 40, "b6", "b5", 1)]
    assert data_accounting(events) == {"samples_committed": 40, "duplicates": 0, "gaps": 0,
                                       "inconsistent_steps": [], "restores": 0, "rolled_back_steps": 1}
    legacy = [{k: v for k, v in e.items() if k not in ("chain", "parent")} for e in events]
    assert data_accounting(legacy)["inconsistent_steps"] == [4]


def test_a_rollback_after_the_last_commit_ends_the_history_at_its_state(runs):
    events = _chained_run(runs, 6)
    events.append(runs.event(1001.0, "restore", "coordinator", 3, from_step=6, to_step=3, chain="a3"))
    history, rolled_back = final_history(events)
    assert sorted({e["step"] for e in history if e["kind"] == "commit"}) == [0, 1, 2] and rolled_back == 3


def test_a_relaunch_from_an_older_checkpoint_ends_the_history_at_it_until_it_commits(runs):
    """``launch local`` relaunched from the checkpoint of step 3 writes a restore without a chain
    (it resumed from the state the commit of step 2 made); before its first commit the job's
    history ends there, after it the new commits extend it."""
    events = _chained_run(runs, 6)
    events.append(runs.event(1001.0, "restore", "supervisor", 3, from_step=6, to_step=3, chain=None))
    history, rolled_back = final_history(events)
    assert sorted({e["step"] for e in history if e["kind"] == "commit"}) == [0, 1, 2] and rolled_back == 3
    events.append(_chained(runs, 1001.1, "A", 3, 24, 32, "r4", "a3"))
    history, rolled_back = final_history(events)
    assert sorted({e["step"] for e in history if e["kind"] == "commit"}) == [0, 1, 2, 3] and rolled_back == 3


def test_a_broken_chain_leaves_the_steps_before_it_out_and_says_so(runs):
    """A commit whose parent no commit made (a record missing events): the steps before it are
    not proven, and show as skipped samples."""
    events = _chained_run(runs, 3) + [_chained(runs, 1001.0, "A", 3, 24, 32, "a4", "unknown")]
    data = data_accounting(events)
    assert (data["samples_committed"], data["gaps"]) == (8, 24)


def test_malformed_restore_is_a_data_error(runs):
    with pytest.raises(DataError, match="to_step"):
        final_history([runs.event(1.0, "restore", "coordinator", -1, from_step=3)])


# --- failures: injected vs detected ----------------------------------------------------------

def test_a_hang_detected_late_is_one_failure_injected_and_detected(runs):
    events = runs.steady_run(300, groups=("A", "B"), stop={"B": 41})
    t = 1000.0 + 40 * 0.1 + 0.02
    events += [
        runs.event(t, "failure_injected", "supervisor", -1, target="B", target_rank=1,
                   signal="SIGSTOP", incarnation="b1"),
        # A hung non-leader rank: the heartbeat lives, the progress timeout fires 17 s later.
        runs.event(t + 17.0, "member_dead", "coordinator", -1, target="B", replica_id="B:b1",
                   reason="no progress"),
        runs.event(t + 20.0, "member_killed", "supervisor", -1, target="B", incarnation="b1",
                   reason="declared dead"),
        runs.event(t + 20.1, "group_exit", "supervisor", -1, target="B", incarnation="b1",
                   ok=False, code=-9, cause="chaos"),
    ]
    summary = build_summary(events, wall_seconds=30.0, state_hashes={}, config={},
                            groups=["A", "B"])
    assert (summary["failures_injected"], summary["failures_detected"],
            summary["failures_undetected"]) == (1, 1, 0)
    assert [(f.kind, f.how) for f in failure_events(events)] == [("failure_injected", "hung")]
    assert summary["crashes"] == [] and summary["failures_unexplained"] == 0


def test_a_clean_leave_is_not_a_failure_and_a_kill_seen_twice_is_one(runs):
    events = runs.steady_run(10, groups=("A", "B"))
    events += [
        runs.event(1000.5, "failure_injected", "supervisor", -1, target="A", signal="SIGKILL",
                   incarnation="a1"),
        runs.event(1000.6, "group_exit", "supervisor", -1, target="A", incarnation="a1", ok=False,
                   code=-9, cause="chaos"),
        runs.event(1000.61, "member_dead", "coordinator", -1, target="A", replica_id="A:a1",
                   reason="process exited"),
        # B finishes: it leaves; a late expiry of its heartbeat is not a death.
        runs.event(1001.0, "member_left", "coordinator", -1, target="B", replica_id="B:b1",
                   reason="finished"),
        runs.event(1002.5, "member_dead", "coordinator", -1, target="B", replica_id="B:b1",
                   reason="heartbeat timeout"),
    ]
    ledger = failure_ledger(events)
    assert [(f.group, f.kind) for f in ledger.detected] == [("A", "group_exit")]
    assert ledger.undetected == [] and ledger.unexplained == []


def test_injected_failures_nobody_noticed_are_reported(runs):
    events = runs.steady_run(10, groups=("A", "B"))
    events += [runs.event(1000.5, "failure_injected", "supervisor", -1, target="B",
                          signal="SIGSTOP", incarnation="b1"),
               runs.event(1000.6, "failure_injected", "supervisor", -1, target="coordinator",
                          signal="SIGKILL"),
               runs.event(1003.0, "coordinator_restart", "supervisor", -1, port=1234)]
    summary = build_summary(events, wall_seconds=3.0, state_hashes={}, config={}, groups=["A", "B"])
    assert (summary["failures_injected"], summary["failures_detected"],
            summary["failures_undetected"]) == (2, 1, 1)


def test_a_slow_link_is_not_a_failure_to_detect(runs):
    events = runs.steady_run(10, groups=("A", "B"))
    events.append(runs.event(1000.5, "failure_injected", "A", 5, point="slow_serve",
                             signal="none", seconds=3.0))
    summary = build_summary(events, wall_seconds=3.0, state_hashes={}, config={}, groups=["A", "B"])
    assert (summary["failures_injected"], summary["failures_undetected"]) == (0, 0)
    assert [f.how for f in failure_events(events)] == ["slowed"]


def test_a_chaos_preemption_is_not_a_failure_to_detect(runs):
    """Chaos SIGTERMs a group: it leaves and exits 0 (``preempted``); nothing is to be detected,
    and its leave is not unexplained. Stalls still attribute the gap to it (``preempted``)."""
    events = runs.steady_run(10, groups=("A", "B"))
    events += [runs.event(1000.5, "failure_injected", "supervisor", -1, target="B", target_rank=-1,
                          signal="SIGTERM", incarnation="b1"),
               runs.event(1000.6, "member_left", "coordinator", -1, target="B", replica_id="B:b1",
                          reason="stopped"),
               runs.event(1000.9, "group_exit", "supervisor", -1, target="B", incarnation="b1",
                          ok=True, preempted=True, final_step=6)]
    summary = build_summary(events, wall_seconds=3.0, state_hashes={}, config={}, groups=["A", "B"])
    assert (summary["failures_injected"], summary["failures_detected"], summary["failures_undetected"],
            summary["failures_unexplained"]) == (0, 0, 0, 0)
    assert [f.how for f in failure_events(events)] == ["preempted"]


def test_a_kill_of_a_group_that_already_left_expects_no_detection(runs):
    """Soak with preemptions, seed 22: chaos SIGKILLed a group a second after it had left the job
    (preempted, on its way out); nothing could detect it, and it is not undetected."""
    events = runs.steady_run(10, groups=("A", "B"))
    events += [runs.event(1000.5, "member_left", "coordinator", -1, target="B", replica_id="B:b1",
                          reason="stopped"),
               runs.event(1000.8, "failure_injected", "supervisor", -1, target="B", target_rank=0,
                          signal="SIGKILL", incarnation="b1"),
               runs.event(1000.9, "group_exit", "supervisor", -1, target="B", incarnation="b1",
                          ok=False, code=-9, cause="chaos")]
    summary = build_summary(events, wall_seconds=3.0, state_hashes={}, config={}, groups=["A", "B"])
    assert (summary["failures_injected"], summary["failures_undetected"],
            summary["failures_unexplained"]) == (1, 0, 0)


def test_crashes_are_exits_nobody_caused(runs):
    events = runs.steady_run(10, groups=("A", "B"))
    events += [runs.event(1000.5, "group_exit", "supervisor", -1, target="B", incarnation="b1",
                          ok=False, code=1, cause="crash"),
               runs.event(1000.7, "group_exit", "supervisor", -1, target="A", incarnation="a1",
                          ok=False, code=-9, cause="chaos")]
    summary = build_summary(events, wall_seconds=3.0, state_hashes={}, config={}, groups=["A", "B"])
    assert summary["crashes"] == [{"group": "B", "incarnation": "b1", "code": 1}]
    assert summary["failures_unexplained"] == 2
    assert [f.group for f in failure_ledger(events).unexplained] == ["B", "A"]


# --- the final proof -------------------------------------------------------------------------

def test_replicas_identical_means_one_equal_hash_per_group(runs):
    events = runs.steady_run(5, groups=("A", "B", "C"))
    summary = build_summary(events, wall_seconds=1.0, state_hashes={"A": "x", "B": "x"},
                            config={"train": {"steps": 5}}, groups=["A", "B", "C"])
    assert summary["replicas_identical"] is False  # C never reported its state
    assert summary["problems"] == ["no final state from C (it did not finish)"]
    assert replicas_identical({"A": "x", "B": "x", "C": "x"}, ["A", "B", "C"]) is True
    assert replicas_identical({"A": "x"}, ["A"]) is True


def test_proof_problems_name_every_broken_invariant(runs):
    events = [runs.commit(1.0, "A", 0, 0, 8), runs.commit(1.0, "B", 0, 0, 8),
              runs.commit(1.1, "A", 1, 4, 12), runs.commit(1.2, "A", 2, 20, 28)]
    summary = build_summary(events, wall_seconds=1.0, state_hashes={"A": "a" * 64, "B": "b" * 64},
                            config={"train": {"steps": 10}}, groups=["A", "B"])
    assert proof_problems(summary) == [
        f"replicas differ: A={'a' * 12}, B={'b' * 12}", "4 sample(s) trained twice",
        "8 sample(s) skipped", "only 3 of 10 steps committed"]


def test_a_launchers_summary_checks_the_state_model_safetensors_holds(runs):
    """``launch local`` records the model file's stamp (``model``) with each group's final step:
    the file must hold the furthest group's state (a straggler that wrote last replaced it)."""
    events = [runs.commit(1.0, "A", 0, 0, 8), runs.commit(1.0, "B", 0, 0, 8)]
    summary = build_summary(events, wall_seconds=1.0, state_hashes={"A": "a" * 64, "B": "a" * 64},
                            config={"train": {"steps": 1}}, groups=["A", "B"])
    assert proof_problems(summary) == []  # no launcher's fields: nothing to check
    summary["final_steps"] = {"A": 1, "B": 1}
    summary["model"] = {"step": 1, "chain": "c"}
    assert proof_problems(summary) == []
    summary["model"] = {"step": 0, "chain": "c"}
    assert proof_problems(summary) == ["model.safetensors holds step 0, not the job's final step 1"]
    summary["model"] = None
    assert proof_problems(summary) == ["model.safetensors is missing from the run directory, or says no state"]
    summary["final_steps"] = {"A": None, "B": None}  # no group finished: the run failed elsewhere
    assert proof_problems(summary) == []


def test_gpu_hours_split_a_failed_group_into_stalled_starting_recovering_and_idle(runs):
    # failure_run: 3 groups from t=1000 to 1011.8; C killed at 1004.02, starts until 1007.02,
    # recovers until 1008.02, then commits no more; A and B wait 2.0 s instead of 0.1 s once.
    summary = build_summary(runs.failure_run(2.0), wall_seconds=1.0, state_hashes={},
                            config={"cost": {"ranks_per_group": 2}}, groups=["A", "B", "C"])
    hours = {k: v * 3600 / 2 for k, v in summary["gpu_hours"].items()}  # seconds per GPU
    assert hours["total"] == pytest.approx(3 * 11.8, abs=1e-3)
    assert hours["starting"] == pytest.approx(3.0, abs=1e-3)
    assert hours["recovering"] == pytest.approx(1.0, abs=1e-3)
    assert hours["idle"] == pytest.approx(11.8 - 8.02, abs=1e-3)
    assert hours["stalled"] == pytest.approx(2 * 1.9 + 0.02, abs=1e-3)
    assert sum(hours[s] for s in ("training", "stalled", "recovering", "starting", "idle")) \
        == pytest.approx(hours["total"], abs=1e-3)
    assert "cost" not in summary  # no prices configured


def test_gpu_hours_leave_out_the_time_between_two_launches_of_a_resumed_job(runs):
    """A relaunch appends to the record (``launch local`` resuming from a checkpoint): the hour
    between the first launch's end and the second's start held no GPU."""
    first = [runs.event(999.0, "run_start", "supervisor")] + runs.steady_run(11, groups=("A",), dt=0.36)
    first.append(runs.event(1004.6, "run_end", "supervisor"))
    second = [runs.event(4600.0, "run_start", "supervisor")] + [
        runs.commit(4601.0 + 0.36 * k, "A", 11 + k, 4 * (11 + k), 4 * (12 + k)) for k in range(11)]
    summary = build_summary(first + second, wall_seconds=3600.0, state_hashes={"A": "a" * 64},
                            config={}, groups=["A"])
    hours = {k: v * 3600 for k, v in summary["gpu_hours"].items()}
    # 5.6 s of the first launch (start-up included), 4.6 s of the second, nothing in between.
    assert hours["total"] == pytest.approx(5.6 + 4.6, abs=0.01)  # (hours are rounded to 1e-6)
    assert hours["starting"] == pytest.approx(2 * (1.0 - 0.36), abs=0.01)  # each to its first step


def test_cost_per_million_committed_tokens_on_demand_and_spot(runs):
    events = runs.steady_run(11, groups=("A",), dt=0.36)  # 3.6 s of one GPU: 0.001 GPU-hour
    summary = build_summary(events, wall_seconds=3.6, state_hashes={"A": "a" * 64},
                            config={"cost": {"on_demand_per_gpu_hour": 4.0,
                                             "spot_per_gpu_hour": 1.0}}, groups=["A"])
    assert summary["gpu_hours"]["total"] == pytest.approx(0.001)
    cost = summary["cost"]
    assert cost["on_demand_total"] == pytest.approx(0.004)
    assert cost["spot_total"] == pytest.approx(0.001)
    tokens = summary["tokens_committed"]
    assert cost["on_demand_per_million_tokens"] == pytest.approx(0.004 / tokens * 1e6, rel=1e-4)
    assert cost["spot_per_million_tokens"] == pytest.approx(0.001 / tokens * 1e6, rel=1e-4)


def test_bad_cost_section_is_a_config_error(runs):
    from ftlm.errors import ConfigError
    with pytest.raises(ConfigError, match="cost.spot_per_gpu_hour"):
        build_summary(runs.steady_run(3), wall_seconds=1.0, state_hashes={},
                      config={"cost": {"spot_per_gpu_hour": -2}}, groups=["A", "B"])
    with pytest.raises(ConfigError, match="unknown key"):
        build_summary(runs.steady_run(3), wall_seconds=1.0, state_hashes={},
                      config={"cost": {"price": 2}}, groups=["A", "B"])
