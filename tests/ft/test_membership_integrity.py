"""Silent data corruption found by the coordinator: groups report a digest of the state they hold
with their quorum requests (``ftlm.ft.quorum.integrity``), driven through the coordinator's state
machine with a hand-driven clock."""

from __future__ import annotations

import pytest

from ftlm.ft.coordinator_requests import decode_body, parse_quorum_request
from ftlm.ft.history import GENESIS, extend_chain
from ftlm.ft.membership import Answer, Event, Issued, Membership
from ftlm.ft.quorum import Convicted, Heartbeat, MemberRequest, QuorumOptions
from ftlm.ft.quorum.integrity import (
    DigestReport,
    IntegrityBook,
    copied,
    expect,
    judge,
    pending,
    record,
    suspect_since,
    tainted,
)

GOOD, BAD, OTHER = "a" * 32, "b" * 32, "c" * 32


class Job:
    """Groups ``g0..g{n-1}`` on hosts ``host-g*``, each committing every step it is given."""

    def __init__(self, n: int) -> None:
        self.m = Membership(QuorumOptions(1, 2.0, 30.0, n, rebuild_grace=0.0), epoch="e")
        self.now = 0.0
        self.inc = {f"g{i}": "a" for i in range(n)}
        self.state = {g: (0, GENESIS) for g in self.inc}
        self.before = dict(self.state)  # the state each held at the last quorum it took part in
        self.last_id = {g: -1 for g in self.inc}
        self.events: list[Event] = []
        self.retired: dict[str, str] = {}
        self.bodies: dict[str, dict] = {}
        self.issued: list = []
        self.answered: set[str] = set()
        for g in self.inc:
            self.m.heartbeat(self.now, Heartbeat(self.rid(g), g, self.now, 0))

    def rid(self, g: str) -> str:
        return f"{g}:{self.inc[g]}"

    def ask(self, g: str, digest: str | None = None, at: tuple[int, str] | None = None) -> None:
        self.now += 0.01
        step, chain = self.state[g]
        integrity = None
        if digest is not None:
            integrity = (*(at if at is not None else self.state[g]), digest)
        req = MemberRequest(self.rid(g), g, step, self.last_id[g], False, {"store": f"host-{g}:29500"},
                            self.now, chain, integrity=integrity)
        self.take(self.m.request(self.now, req))

    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.take(self.m.tick(self.now))

    def take(self, outputs: list) -> None:
        for o in outputs:
            if isinstance(o, Event):
                self.events.append(o)
            elif isinstance(o, Answer) and o.status == 409:
                assert o.body.get("convicted") is True, o.body  # its process exits with EXIT_RETIRED
                self.retired[o.replica_id] = o.body["error"]
                self.bodies[o.replica_id] = o.body
            elif isinstance(o, Answer) and o.status == 200:
                self.answered.add(o.replica_id)
            elif isinstance(o, Issued):
                self.issued.append(o.quorum)
                self.commit(o.quorum)

    def commit(self, q) -> None:
        for rid in q.participants:
            g = rid.split(":")[0]
            self.last_id[g] = q.quorum_id
            self.before[g] = self.state[g]
            self.state[g] = (q.step + 1, extend_chain(q.chain, q.step, q.quorum_id, q.participants))

    def step_all(self, digests: dict[str, str] | None = None) -> None:
        """Every live group asks for the next quorum, reporting ``digests`` of the state it held
        in its last quorum (digested while that step ran, as ``ftlm.ft.integrity``)."""
        held = dict(self.before)
        for g in self.inc:
            if self.rid(g) not in self.retired:
                self.ask(g, (digests or {}).get(g), at=held[g] if digests else None)

    def kinds(self, kind: str) -> list[dict]:
        return [e.fields for e in self.events if e.kind == kind]


def test_minority_group_is_retired_and_named():
    job = Job(3)
    job.step_all()  # quorum at step 0: everyone commits
    job.step_all({"g0": GOOD, "g1": BAD, "g2": GOOD})  # the state of step 1, with the next request
    assert list(job.retired) == ["g1:a"]
    assert "differs from the majority" in job.retired["g1:a"]
    (mismatch,) = job.kinds("state_mismatch")
    assert mismatch["group"] == "g1" and mismatch["host"] == "host-g1" and mismatch["step"] == 0
    assert mismatch["digests"] == {"g0": GOOD, "g1": BAD, "g2": GOOD} and mismatch["majority"] == GOOD
    # The majority's next quorum goes on without it.
    issued = [e.fields for e in job.events if e.kind == "quorum"]
    assert issued[-1]["step"] == 1 and issued[-1]["participants"] == ["g0:a", "g2:a"]
    # Its incarnation is refused from now on, as a convicted one.
    with pytest.raises(Convicted):
        job.ask("g1")


def test_agreeing_groups_go_on_untouched():
    job = Job(3)
    job.step_all()
    job.step_all({g: GOOD for g in job.inc})
    assert not job.retired and not job.kinds("state_mismatch")
    assert job.m.integrity.last_agreed == 0
    assert len(job.answered) == 3


def test_no_verdict_until_every_participant_reported():
    job = Job(3)
    job.step_all()
    held = dict(job.before)
    job.ask("g0", BAD, at=held["g0"])
    job.ask("g1", GOOD, at=held["g1"])
    assert not job.kinds("state_mismatch")  # g2 may still side with either
    job.ask("g2", GOOD, at=held["g2"])
    assert [e["group"] for e in job.kinds("state_mismatch")] == ["g0"]


def test_two_groups_that_differ_roll_back_and_convict_nobody():
    job = Job(2)
    job.step_all()
    job.step_all({"g0": GOOD, "g1": BAD})
    assert sorted(job.retired) == ["g0:a", "g1:a"]
    assert {e["group"] for e in job.kinds("state_mismatch")} == {"g0", "g1"}
    (rollback,) = job.kinds("integrity_rollback")
    assert rollback["step"] == 0 and "durable checkpoint" in rollback["reason"]
    assert job.m.integrity.corrupt_count == {}  # nobody can be told corrupt


def test_group_corrupt_twice_is_quarantined_on_its_host():
    job = Job(3)
    job.step_all()
    job.step_all({"g0": GOOD, "g1": BAD, "g2": GOOD})
    # Its next incarnation recovers and takes part again, then is found corrupt again.
    job.inc["g1"] = "b"
    job.m.heartbeat(job.now, Heartbeat(job.rid("g1"), "g1", job.now, 0))
    job.ask("g1")
    for _ in range(3):  # g1 recovers (not a participant, no report) and catches up
        job.state["g1"] = job.state["g0"]
        job.step_all()
    job.step_all({"g0": OTHER, "g1": BAD, "g2": OTHER})
    assert "g1:b" in job.retired
    assert job.kinds("state_mismatch")[-1]["quarantined"] is True
    assert job.kinds("state_mismatch")[-1]["times"] == 2
    job.inc["g1"] = "c"
    with pytest.raises(Convicted, match="quarantined"):
        job.ask("g1")


def test_late_report_against_a_verdict():
    book = IntegrityBook()
    expect(book, 4, GENESIS, frozenset({"g0:a", "g1:a", "g2:a"}))
    members = {"g0:a", "g1:a"}  # g2 died before it reported
    assert record(book, DigestReport("g0:a", "g0", "h", 4, GENESIS, GOOD), members) == []
    (verdict,) = record(book, DigestReport("g1:a", "g1", "h", 4, GENESIS, GOOD), members)
    assert verdict.agreed
    (late,) = record(book, DigestReport("g2:a", "g2", "h", 4, GENESIS, BAD), members | {"g2:a"})
    assert [r.group for r in late.corrupt] == ["g2"] and book.corrupt_count == {"g2": 1}


def test_judge_three_different_digests_has_no_majority():
    reports = [DigestReport(f"g{i}:a", f"g{i}", "h", 1, GENESIS, d) for i, d in enumerate((GOOD, BAD, OTHER))]
    verdict = judge(reports)
    assert verdict.majority == "" and len(verdict.corrupt) == 3


def test_quorum_body_integrity_field_is_checked():
    base = ('{"group": "g0", "incarnation": "a", "step": 2, "last_quorum_id": 1, "failed": false, '
            '"meta": {}, "timeout": 1.0, "chain": "' + GENESIS + '", "integrity": %s}')
    body = parse_quorum_request(decode_body((base % ('{"step": 2, "chain": "%s", "digest": "%s"}'
                                                      % (GENESIS, GOOD))).encode()))
    assert body.integrity == (2, GENESIS, GOOD)
    with pytest.raises(ValueError, match="integrity.digest"):
        parse_quorum_request(decode_body((base % ('{"step": 2, "chain": "%s", "digest": "XYZ"}'
                                                  % GENESIS)).encode()))
    with pytest.raises(ValueError, match="exactly step, chain and digest"):
        parse_quorum_request(decode_body((base % '{"step": 2}').encode()))


def test_a_state_held_again_by_new_incarnations_is_compared_anew():
    """Groups restarted from a checkpoint of a state judged before (a rollback) hold it again:
    their digests are compared with each other, not with the earlier lone reporter's."""
    book = IntegrityBook()
    expect(book, 10, GENESIS, frozenset({"g2:a"}))
    (first,) = record(book, DigestReport("g2:a", "g2", "h", 10, GENESIS, GOOD), {"g2:a"})
    assert first.agreed
    members = {"g0:b", "g1:b", "g2:b"}
    expect(book, 10, GENESIS, frozenset(members))
    assert record(book, DigestReport("g0:b", "g0", "h", 10, GENESIS, BAD), members) == []
    assert record(book, DigestReport("g1:b", "g1", "h", 10, GENESIS, BAD), members) == []
    (again,) = record(book, DigestReport("g2:b", "g2", "h", 10, GENESIS, BAD), members)
    assert again.agreed and again.majority == BAD
    expect(book, 10, GENESIS, frozenset({"g0:b", "g1:b"}))  # a retry by the same members: judged
    assert book.judged[(10, GENESIS)] is again


def _agree(book: IntegrityBook, step: int, digests: dict[str, str]) -> None:
    """Judge the state of ``step`` from the digests of the replica ids given."""
    expect(book, step, GENESIS, frozenset(digests))
    for rid, digest in digests.items():
        record(book, DigestReport(rid, rid.split(":")[0], "h", step, GENESIS, digest), set(digests))


def test_the_copies_of_a_corrupt_state_are_traced_through_copies_of_copies():
    """Rule I2: whoever copied from the corrupt member after its last agreed digest, directly or
    through another member, may hold its bits; a copy made before that digest does not."""
    book = IntegrityBook()
    _agree(book, 5, {"x:a": GOOD, "y:a": GOOD})
    copied(book, 3, {"w:a": "x:a"})  # before step 5, whose digest x agreed on
    copied(book, 7, {"y:b": "x:a"})
    copied(book, 9, {"z:a": "y:b"})
    copied(book, 8, {"v:a": "y:a"})  # from a member that never copied from x
    assert suspect_since(book, "x:a", 10) == 6
    assert tainted(book, "x:a", 10) == {"y:b": "x:a", "z:a": "y:b"}
    # An agreement judged later, at a later step, was with its own copies: it vouches for nothing
    # before the step it is found corrupt at.
    _agree(book, 15, {"x:a": BAD, "y:b": BAD})
    assert suspect_since(book, "x:a", 10) == 6


def test_a_lone_digest_agrees_with_nothing():
    book = IntegrityBook()
    expect(book, 5, GENESIS, frozenset({"x:a"}))
    (verdict,) = record(book, DigestReport("x:a", "x", "h", 5, GENESIS, BAD), {"x:a"})
    assert verdict.agreed  # nobody differs...
    assert book.agreed_at == {}  # ...but nothing was compared: x is not vouched for at step 5
    assert suspect_since(book, "x:a", 10) == 0
    assert pending(book, {"x:a"}) == []


def _copy_before_the_verdict() -> Job:
    """Four groups commit step 0; g0's state is corrupt. g3 restarts behind and is told to copy
    from g0 (participant 0) before g2, slow, has sent its digest of step 0."""
    job = Job(4)
    job.step_all()
    held = dict(job.before)
    job.inc["g3"], job.state["g3"] = "b", (0, GENESIS)
    job.m.heartbeat(job.now, Heartbeat(job.rid("g3"), "g3", job.now, 0))
    job.ask("g0", BAD, at=held["g0"])
    job.ask("g1", GOOD, at=held["g1"])
    job.ask("g3")
    job.tick(2.5)  # the join timeout: the quorum goes on without g2
    (q,) = job.issued[-1:]
    assert q.participants == ["g0:a", "g1:a"] and q.sources == {"g3:b": "g0:a"}
    job.ask("g2", GOOD, at=held["g2"])  # the verdict: g0 is outvoted
    return job


def test_a_group_that_copied_the_corrupt_state_before_the_verdict_is_retired_with_it():
    job = _copy_before_the_verdict()
    assert sorted(job.retired) == ["g0:a", "g3:b"]
    copied_one = [e for e in job.kinds("state_mismatch") if e.get("copied_from")]
    assert [(e["replica_id"], e["copied_from"]) for e in copied_one] == [("g3:b", "g0:a")]
    assert job.m.integrity.corrupt_count == {"g0": 1}  # a copy is not a faulty device
    (suspect,) = job.kinds("suspect_states")
    assert suspect["replica_id"] == "g0:a" and suspect["copied"] == {"g3:b": "g0:a"}
    assert suspect["vouched"] == ["g1:a", "g2:a"]


def test_a_restarted_group_holding_a_suspect_state_recovers_instead_of_training():
    """g0 took part in step 1 before it was found corrupt and may have written its checkpoint;
    its next process loads it and claims the job's newest state: it must copy from a group
    vouched for, not train on its bits."""
    job = _copy_before_the_verdict()
    newest = job.state["g1"]  # step 2: what g0 and g1 committed
    job.inc["g0"], job.state["g0"] = "b", newest
    job.m.heartbeat(job.now, Heartbeat(job.rid("g0"), "g0", job.now, newest[0], chain=newest[1]))
    job.step_all()
    job.step_all()
    assert job.m.state.head[0] >= newest[0]
    (q,) = [q for q in job.issued if q.step == newest[0]][-1:]
    assert "g0:b" in q.recovering and "g0:b" not in q.participants
    assert q.sources["g0:b"] in ("g1:a", "g2:a")


def test_with_nobody_vouched_for_left_a_suspect_state_is_set_aside():
    """Every group vouched for dies; the restarted corrupt group holds the job's newest state,
    from a checkpoint it wrote: it is retired and told to set that checkpoint aside (it starts
    again from an older one) instead of the job rolling back to its bits."""
    job = _copy_before_the_verdict()
    head = job.m.state.head
    job.inc["g0"] = "b"
    job.m.heartbeat(job.now, Heartbeat(job.rid("g0"), "g0", job.now, head[0], chain=head[1]))
    for g in ("g1", "g2"):
        job.take(job.m.report_dead(job.now, job.rid(g), g, "SIGKILL"))
    job.inc = {"g0": "b"}
    job.state["g0"] = head
    for _ in range(14):  # the rollback grace (two heartbeat timeouts, 60 s) passes
        if "g0:b" in job.retired:
            break
        job.m.heartbeat(job.now, Heartbeat(job.rid("g0"), "g0", job.now, head[0], chain=head[1]))
        job.tick(5.0)
    assert not job.kinds("restore")  # never rolled back to the suspect state
    assert "g0:b" in job.retired, job.m.reason
    assert job.bodies["g0:b"]["suspect_state"] == [head[0], head[1]]
    with pytest.raises(Convicted) as refused:
        job.ask("g0")
    assert refused.value.suspect_state == head


def test_two_groups_that_differ_never_resume_from_a_state_after_their_last_agreement():
    """Two groups agree on the state of step 0, then differ on the state of step 2 (one of them
    was corrupted in between; nobody can tell which). Each is retired and told to set aside the
    checkpoint of the state it reported; restarted from a checkpoint of step 2 or of step 1
    (written after the agreement, maybe by the corrupt group), they are retired again and set
    that one aside too; from step 0's state the job rolls back and trains on."""
    job = Job(2)
    job.step_all()  # step 0 committed
    job.step_all({"g0": GOOD, "g1": GOOD})  # the state of step 0 agrees; step 1 committed
    assert job.m.integrity.last_agreed == 0
    job.step_all()  # step 2 committed
    job.step_all({"g0": GOOD, "g1": BAD})  # the state of step 2 differs
    assert sorted(job.retired) == ["g0:a", "g1:a"]
    reported = job.before["g0"]
    assert all(job.bodies[r]["suspect_state"] == list(reported) for r in job.retired)
    (rollback,) = job.kinds("integrity_rollback")
    assert rollback["last_agreed"] == 0 and "at or before step 0" in rollback["reason"]
    (suspect,) = job.kinds("suspect_states")
    assert suspect["from_step"] == 1 and suspect["vouched"] == []

    def restart_from(state: tuple[int, str], incarnation: str) -> None:
        job.inc = {g: incarnation for g in ("g0", "g1")}
        for g in job.inc:
            job.state[g] = job.before[g] = state
            job.last_id[g] = -1
            job.m.heartbeat(job.now, Heartbeat(job.rid(g), g, job.now, state[0], chain=state[1]))
        for _ in range(20):  # up to the rollback grace (two heartbeat timeouts, 60 s) and past it
            if all(job.rid(g) in job.retired for g in job.inc) or any(
                    set(q.participants) == {job.rid(g) for g in job.inc} for q in job.issued):
                return
            for g in job.inc:
                if job.rid(g) in job.retired:
                    continue
                try:
                    job.m.heartbeat(job.now, Heartbeat(job.rid(g), g, job.now, state[0], chain=state[1]))
                    job.ask(g)
                except Convicted as e:  # retired in the meantime (its answer was a 409)
                    job.retired[job.rid(g)] = str(e)
                    job.bodies[job.rid(g)] = {"suspect_state": list(e.suspect_state or ())}
            job.tick(5.0)

    chain1 = extend_chain(GENESIS, 0, job.issued[0].quorum_id, job.issued[0].participants)
    for incarnation, state in (("b", reported), ("c", (1, chain1))):
        restart_from(state, incarnation)
        assert not [q for q in job.issued if job.rid("g0") in q.participants], \
            f"trained from the suspect state {state}"
        assert all(job.bodies[job.rid(g)]["suspect_state"] == list(state) for g in job.inc), job.m.reason
    restart_from((0, GENESIS), "d")
    assert not [r for r in job.retired if r.endswith(":d")]
    (first, *_) = [q for q in job.issued if q.participants == ["g0:d", "g1:d"]]
    assert first.step == 0 and first.chain == GENESIS  # the job goes on from step 0's state
