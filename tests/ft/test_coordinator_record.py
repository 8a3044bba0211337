"""The coordinator's record (``ftlm.ft.coordinator_record``): a group found corrupt once before a
coordinator restart and once after is quarantined, as it would be by one coordinator; a group that
left finished before the restart is still counted as finished after it; the states a corrupt
group may have handed on stay suspect after it."""

from __future__ import annotations

import json
import logging

import pytest

from ftlm.ft.coordinator_record import RecordingEvents, restore, with_record
from ftlm.ft.quorum import Convicted, MemberRequest
from ftlm.ft.quorum import Heartbeat
from ftlm.ft.quorum.integrity import is_quarantined
from ftlm.ft.membership import Membership
from ftlm.ft.quorum import QuorumOptions
from tests.ft.test_membership_integrity import BAD, GOOD, Job, _copy_before_the_verdict


def _convict_g1(job: Job, record: RecordingEvents) -> None:
    """Steps until g1's digest is outvoted; the events go through ``record`` as the coordinator's."""
    job.step_all()
    job.step_all({"g0": GOOD, "g1": BAD, "g2": GOOD})
    for e in job.events:
        record.emit(e.kind, **e.fields)


def test_a_conviction_before_a_restart_counts_after_it(tmp_path):
    path = tmp_path / "coordinator_record.jsonl"
    first = Job(3)
    _convict_g1(first, RecordingEvents(path))
    convictions = [json.loads(line) for line in path.read_text().splitlines() if "suspect" not in line]
    assert [(c["group"], c["host"]) for c in convictions] == [("g1", "host-g1")]
    # A new coordinator (empty state) on the same record: g1's second conviction quarantines it.
    second = Job(3)
    assert restore(path, second.m) == 2  # the conviction and the suspect states
    assert second.m.integrity.corrupt_count == {"g1": 1}
    # The convicted incarnation is refused by the new coordinator too (its refusal may have been
    # lost with the old one); the group's next incarnation is let in, and convicted again.
    with pytest.raises(Convicted, match="was retired"):
        second.m.request(second.now, MemberRequest("g1:a", "g1", 0, -1, False, {"store": "host-g1:29500"},
                                                   second.now, second.state["g1"][1]))
    second.inc["g1"] = "b"
    assert isinstance(with_record(str(path), Job(1).m, None), RecordingEvents)
    assert with_record("", Job(1).m, None) is None  # no path: no record
    _convict_g1(second, RecordingEvents(path))
    (mismatch,) = second.kinds("state_mismatch")
    assert mismatch["times"] == 2 and mismatch["quarantined"] is True
    assert is_quarantined(second.m.integrity, "g1", "host-g1")
    # Its next incarnation on that host is refused as a convicted one.
    with pytest.raises(Convicted):
        second.m.request(second.now, MemberRequest("g1:b", "g1", 0, -1, False, {"store": "host-g1:29500"},
                                                   second.now, second.state["g1"][1]))
    assert sum("suspect" not in line for line in path.read_text().splitlines()) == 2


def test_copies_and_splits_are_not_counted_as_convictions_and_a_torn_line_is_skipped(tmp_path, caplog):
    path = tmp_path / "coordinator_record.jsonl"
    record = RecordingEvents(path)
    record.emit("state_mismatch", group="g2", host="h", step=5, majority="", digest="x")  # no majority
    record.emit("state_mismatch", group="g3", host="h", step=5, majority=GOOD, copied_from="g1:a")
    record.emit("quorum", quorum_id=1)
    assert not path.exists()
    path.write_text('{"group": "g1", "host": "h", "step": 3}\n{"group": "g1", "ho')  # a torn append
    m = Job(1).m
    with caplog.at_level(logging.WARNING, logger="ftlm.coordinator"):
        assert restore(path, m) == 1
    assert m.integrity.corrupt_count == {"g1": 1} and not m.integrity.quarantined
    assert f"{path}:2 is not a record of the coordinator's" in caplog.text
    assert restore(tmp_path / "missing.jsonl", Job(1).m) == 0


def test_a_finished_leave_is_recorded_with_the_state_it_left_with_and_counted_after_a_restart(tmp_path):
    """g1 leaves finished at step 7 while its last heartbeat still says step 6: the leave's own
    state counts. A coordinator restarted on the record counts g1 in ``groups_left`` at that
    state (not at another), and forgets it once g1 is heard from again."""
    path = tmp_path / "coordinator_record.jsonl"
    first = Job(2)
    record = RecordingEvents(path)
    first.m.heartbeat(first.now, Heartbeat("g1:a", "g1", first.now, 6, chain="c" * 64))
    for o in first.m.leave(first.now, "g1:a", "g1", "finished", (7, "d" * 64)):
        if hasattr(o, "kind"):
            record.emit(o.kind, **o.fields)
    (line,) = path.read_text().splitlines()
    assert {k: v for k, v in json.loads(line).items() if k != "ts"} == {
        "left": "finished", "group": "g1", "step": 7, "chain": "d" * 64}
    second = Job(2)
    second.m.state.heartbeats.pop("g1:a")  # g1 is gone: the new coordinator never hears it
    assert restore(path, second.m) == 1
    assert second.m._finished_at == {"g1": (7, "d" * 64)}
    assert second.m.options_now().expected_groups == 2  # (an earlier launch's entry: not gone)
    second.m.heartbeat(second.now, Heartbeat("g1:b", "g1", second.now, 0))
    assert second.m._finished_at == {}  # back: no longer finished


def test_the_coordinator_command_and_its_launchers_pass_a_record(tmp_path):
    """``ftlm launch local`` keeps the record next to events.jsonl (cold start and standby)."""
    from ftlm.launch.coordinator_process import RECORD_NAME, CoordinatorProcess

    proc = CoordinatorProcess(tmp_path / "config.toml", 0, "t", tmp_path / "events.jsonl", tmp_path / "c.log")
    assert proc.record == tmp_path / RECORD_NAME


def _restarted_corrupt_group_at_the_head(job: Job, m: Membership) -> None:
    """The coordinator restarted with ``m``; every group vouched for is gone; g0, found corrupt
    before the restart, comes back from a checkpoint it wrote of the job's newest state."""
    head = job.m.state.head
    job.m = m
    job.inc = {"g0": "b"}
    job.state["g0"] = job.before["g0"] = head
    job.last_id["g0"] = -1
    for _ in range(20):  # up to the rollback grace (two heartbeat timeouts, 60 s) and past it
        if "g0:b" in job.retired or job.kinds("restore"):
            return
        job.m.heartbeat(job.now, Heartbeat(job.rid("g0"), "g0", job.now, head[0], chain=head[1]))
        job.ask("g0")
        job.tick(5.0)


def test_suspect_states_and_who_is_vouched_for_survive_a_restart(tmp_path):
    """Rule I2 across a coordinator restart: g0 was found corrupt after g3 copied from it; the
    states since its last agreement stay suspect for the restarted coordinator, so g0's next
    process, back from its own checkpoint of the newest state with nobody vouched for left, is
    retired and sets that checkpoint aside. A coordinator without the record would take that
    state as the job's and train on from g0's bits."""
    path = tmp_path / "coordinator_record.jsonl"
    job = _copy_before_the_verdict()
    record = RecordingEvents(path)
    for e in job.events:
        record.emit(e.kind, **e.fields)
    head, suspect = job.m.state.head, job.m.state.suspect
    assert suspect and any(head[1] in e.states.get(head[0], ()) for e in suspect)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert any("suspect" in line for line in lines)
    # g0 (outvoted) and g3 (its copy) are retired, and the record says so, g0's as a conviction.
    retired = {line["retired"]: line for line in lines if "retired" in line}
    assert set(retired) == {"g0:a", "g3:b"} and "host" in retired["g0:a"] and "host" not in retired["g3:b"]
    options = QuorumOptions(1, 2.0, 30.0, 4, rebuild_grace=0.0)

    restarted = Membership(options, epoch="f")
    assert restore(path, restarted) == len(lines)
    assert [(e.states, e.vouched) for e in restarted.state.suspect] == [(e.states, e.vouched) for e in suspect]
    _restarted_corrupt_group_at_the_head(job, restarted)
    assert not job.kinds("restore")  # never rolled back to the suspect state
    assert "g0:b" in job.retired, job.m.reason
    assert job.bodies["g0:b"]["suspect_state"] == list(head)

    forgetful = _copy_before_the_verdict()  # the same job, its coordinator restarted without a record
    _restarted_corrupt_group_at_the_head(forgetful, Membership(options, epoch="f"))
    assert "g0:b" not in forgetful.retired


def test_a_copy_of_a_vouched_member_is_vouched_for_after_a_restart(tmp_path):
    """A quorum that tells a recovering member to copy from one vouched for changes who may
    claim the suspect states: a ``suspect_vouched`` event, kept in the record."""
    path = tmp_path / "coordinator_record.jsonl"
    job = _copy_before_the_verdict()
    job.inc["g3"], job.state["g3"] = "c", (0, job.state["g3"][1])
    job.m.heartbeat(job.now, Heartbeat(job.rid("g3"), "g3", job.now, 0))
    for _ in range(3):
        job.step_all()
    (vouched,) = job.kinds("suspect_vouched")  # (g2 recovering from g1 changed nothing: vouched already)
    assert vouched["sources"]["g3:c"] == "g1:a"
    record = RecordingEvents(path)
    for e in job.events:
        record.emit(e.kind, **e.fields)
    restarted = Membership(QuorumOptions(1, 2.0, 30.0, 4, rebuild_grace=0.0), epoch="f")
    restore(path, restarted)
    assert "g3:c" in restarted.state.suspect[-1].vouched
    assert restarted.state.suspect[-1].vouched == job.m.state.suspect[-1].vouched


def test_a_malformed_suspect_line_is_skipped_and_names_itself(tmp_path, caplog):
    path = tmp_path / "coordinator_record.jsonl"
    path.write_text('{"suspect": [{"states": {"x": ["c"]}, "vouched": {}}]}\n{"suspect": 3}\n'
                    '{"suspect": [{"states": {"2": ["c"]}, "vouched": {"g0:a": [1, null]}}]}\n')
    m = Job(1).m
    with caplog.at_level(logging.WARNING, logger="ftlm.coordinator"):
        assert restore(path, m) == 1
    assert f"{path}:1 is not a record" in caplog.text and f"{path}:2 is not a record" in caplog.text
    ((states, vouched),) = [(e.states, e.vouched) for e in m.state.suspect]
    assert states == {2: {"c"}} and vouched == {"g0:a": (1, None)}



def test_states_before_a_coordinators_first_head_are_suspect_until_trained_again():
    """A coordinator that started at step 20 never saw the chains of steps 1-19: a group found
    corrupt there (no agreement known) may have written a checkpoint at any of them, so every
    state at those steps is suspect for a member nobody vouched for; a state the job commits at
    one of them afterwards (another history, after a rollback) is not. Both survive the record."""
    from ftlm.ft.quorum.integrity import (
        IntegrityBook, Verdict, committed, head_suspect, restore_suspect, suspect_snapshot, suspect_states,
        untrusted)
    from ftlm.ft.quorum.types import CoordinatorState

    state = CoordinatorState()
    state.first_head, state.head = 20, (22, "c22")
    state.head_log = {20: "c20", 21: "c21", 22: "c22"}
    entry = suspect_states(state, IntegrityBook(), Verdict(22, "c22", {"g0": "x", "g1": "y"}, "", ()), 0)
    assert entry.unknown == (1, 20) and set(entry.states) == {20, 21, 22}
    assert untrusted(state, "g1:b", (12, "any chain the coordinator never saw"))
    assert untrusted(state, "g1:b", (21, "c21")) and not untrusted(state, "g1:b", (21, "another"))
    assert not untrusted(state, "g1:b", (0, "genesis"))  # step 0 is every group's
    # Rolled back past them, the job trains step 11 again: the new state is the job's, the old
    # one is still suspect.
    state.head = (11, "new11")
    committed(state, state.head)
    assert not head_suspect(state) and not untrusted(state, "g1:b", (11, "new11"))
    assert untrusted(state, "g1:b", (11, "old11"))
    restarted = CoordinatorState()
    restore_suspect(restarted, json.loads(json.dumps(suspect_snapshot(state))))
    assert (restarted.suspect[0].unknown, restarted.suspect[0].cleared) == ((1, 20), {11: {"new11"}})
    assert untrusted(restarted, "g1:b", (12, "old12")) and not untrusted(restarted, "g1:b", (11, "new11"))
    with pytest.raises(ValueError, match="unknown"):
        restore_suspect(restarted, [{"states": {}, "vouched": {}, "unknown": [1]}])
    # A coordinator that saw the job from its start has no such steps.
    fresh = CoordinatorState()
    fresh.first_head, fresh.head, fresh.head_log = 0, (5, "c5"), {0: "c0", 5: "c5"}
    assert suspect_states(fresh, IntegrityBook(), Verdict(5, "c5", {}, "", ()), 0).unknown == (0, 0)


def test_a_retirement_is_refused_again_after_a_restart_and_a_malformed_one_skipped(tmp_path, caplog):
    path = tmp_path / "coordinator_record.jsonl"
    record = RecordingEvents(path)
    record.emit("member_dead", group="g2", replica_id="g2:a", reason="suspect", retired="it holds a suspect state",
                set_aside=[7, "c7"])
    record.emit("member_dead", group="g2", replica_id="g2:z", reason="heartbeat timeout")  # not a retirement
    with path.open("a") as f:
        f.write('{"retired": "g1:a", "why": "x", "set_aside": [7]}\n')
    m = Job(1).m
    with caplog.at_level(logging.WARNING, logger="ftlm.coordinator"):
        assert restore(path, m) == 1
    assert "set_aside must be null or [step, chain]" in caplog.text
    with pytest.raises(Convicted, match="it holds a suspect state") as refused:
        m.request(1.0, MemberRequest("g2:a", "g2", 7, -1, False, {}, 1.0, "c7"))
    assert refused.value.suspect_state == (7, "c7")


def test_an_agreement_before_a_restart_bounds_the_suspect_states_after_it(tmp_path):
    """The digests of g0..g2 agreed at step 1 (a ``state_agreed`` event, kept in the record); the
    restarted coordinator knows that a group found corrupt later held good bits up to there."""
    from ftlm.ft.quorum.integrity import suspect_since

    path = tmp_path / "coordinator_record.jsonl"
    job = Job(3)
    job.step_all()
    job.step_all()
    job.step_all({"g0": GOOD, "g1": GOOD, "g2": GOOD})
    (agreed,) = job.kinds("state_agreed")
    assert agreed["groups"] == ["g0", "g1", "g2"] and agreed["replica_ids"] == ["g0:a", "g1:a", "g2:a"]
    record = RecordingEvents(path)
    for e in job.events:
        record.emit(e.kind, **e.fields)
    restarted = Membership(QuorumOptions(1, 2.0, 30.0, 3, rebuild_grace=0.0), epoch="f")
    assert restore(path, restarted) == 1
    step = agreed["step"]
    assert suspect_since(restarted.integrity, "g1:a", step + 5) == step + 1
    assert suspect_since(Membership(QuorumOptions(1, 2.0, 30.0, 3), epoch="g").integrity, "g1:a", step + 5) == 0
