"""Corroborated expiry (peers' reports shorten the failure stall without a supervisor) and the
compact quorum answer, driven through the coordinator's state machine with a hand-driven clock."""

from __future__ import annotations

import json

import pytest

from ftlm.errors import ConfigError
from ftlm.ft.config import CoordinatorConfig, FTConfig
from ftlm.ft.group import GroupProtocol
from ftlm.ft.history import GENESIS
from ftlm.ft.membership import Answer, Event, Issued, Membership
from ftlm.ft.quorum import Heartbeat, Member, MemberRequest, Quorum, QuorumOptions
from ftlm.ft.quorum_answer import AnswerEncoder, MemberQuorum, member_json

HB_TIMEOUT = 1.0
WINDOW = 0.2
GROUPS = ("g0", "g1", "g2")


def job(window: float = WINDOW) -> tuple[Membership, Quorum]:
    """Three groups heartbeating at 0.0 and in one quorum issued at 0.1."""
    m = Membership(QuorumOptions(1, 2.0, HB_TIMEOUT, len(GROUPS), rebuild_grace=0.0, suspect_window=window),
                   epoch="e")
    for g in GROUPS:
        m.heartbeat(0.0, Heartbeat(f"{g}:a", g, 0.0, 0))
    issued = [o.quorum for g in GROUPS
              for o in m.request(0.1, MemberRequest(f"{g}:a", g, 0, -1, False, {}, 0.1, GENESIS))
              if isinstance(o, Issued)]
    assert len(issued) == 1
    return m, issued[0]


def report_failed(m: Membership, group: str, q: Quorum, now: float) -> list:
    return m.request(now, MemberRequest(f"{group}:a", group, 0, q.quorum_id, True, {}, now, GENESIS))


def dead(outputs: list) -> list[tuple[str, str]]:
    return [(o.fields["replica_id"], o.fields["reason"]) for o in outputs
            if isinstance(o, Event) and o.kind == "member_dead"]


def test_a_member_silent_after_its_peers_report_a_failed_step_is_expired_within_the_window() -> None:
    """g2 was SIGKILLed mid-all-reduce: g0 and g1 see the reset and ask again with ``failed``;
    g2 is declared dead one window after the first report, not a heartbeat timeout later, and
    the survivors' quorum forms at once."""
    m, q = job()
    out = report_failed(m, "g0", q, 0.30) + report_failed(m, "g1", q, 0.31)
    assert dead(out) == []
    assert dead(m.tick(0.49)) == []
    out = m.tick(0.50)  # 0.2 s after the first report; the heartbeat timeout would be at 1.0
    gone = dead(out)
    assert [r for r, _ in gone] == ["g2:a"] and "reported the step of quorum" in gone[0][1]
    issued = [o.quorum for o in out if isinstance(o, Issued)]
    assert len(issued) == 1 and issued[0].replica_ids() == ["g0:a", "g1:a"]
    assert issued[0].quorum_id > q.quorum_id


def test_a_report_alone_never_expires_a_member_that_still_speaks() -> None:
    """A buggy or malicious member reporting failures must not evict healthy peers: a suspect that
    heartbeats (or asks) after the report is corroborated as alive."""
    m, q = job()
    report_failed(m, "g0", q, 0.30)
    m.heartbeat(0.35, Heartbeat("g1:a", "g1", 0.35, 0))  # g1 speaks after the report
    m.request(0.40, MemberRequest("g2:a", "g2", 1, q.quorum_id, False, {}, 0.40, q.next_chain()))
    assert dead(m.tick(0.6)) == [] and dead(m.tick(0.9)) == []
    assert set(m.state.heartbeats) == {"g0:a", "g1:a", "g2:a"}


def test_reports_are_ignored_when_off_or_about_another_quorum() -> None:
    m, q = job(window=0.0)
    report_failed(m, "g0", q, 0.30)
    assert dead(m.tick(0.6)) == []  # off: only the heartbeat timeout expires
    m2, q2 = job()
    m2.request(0.30, MemberRequest("g0:a", "g0", 0, q2.quorum_id - 1, True, {}, 0.30, GENESIS))  # stale id
    m2.request(0.30, MemberRequest("g9:a", "g9", 0, q2.quorum_id, True, {}, 0.30, GENESIS))  # not a member
    assert m2.state.suspicion is None and dead(m2.tick(0.6)) == []


def test_suspect_window_is_validated_against_the_timeout_chain() -> None:
    assert FTConfig().suspect_window == pytest.approx(0.2)  # two heartbeat intervals
    assert FTConfig(heartbeat_interval=0.5, heartbeat_timeout=1.2, allreduce_timeout=5.0).suspect_window == 0.85
    with pytest.raises(ConfigError, match="ft.suspect_window=0.05 must lie between"):
        FTConfig(suspect_window=0.05)
    with pytest.raises(ConfigError, match="coordinator.suspect_window=1.0 must be below"):
        CoordinatorConfig(suspect_window=1.0, heartbeat_timeout=1.0)
    with pytest.raises(ConfigError, match="suspect_window=-1"):
        CoordinatorConfig(suspect_window=-1)
    assert FTConfig().coordinator_config().suspect_window == pytest.approx(0.2)


def test_heartbeat_answers_name_the_quorum_that_lost_a_member() -> None:
    m, q = job(window=0.0)
    answer, _ = m.heartbeat(0.2, Heartbeat("g0:a", "g0", 0.2, 0))
    assert answer["dead_quorums"] == [] and answer["epoch"] == "e"
    m.report_dead(0.3, "g2:a", "g2", "process exited")
    answer, _ = m.heartbeat(0.4, Heartbeat("g0:a", "g0", 0.4, 0))
    assert answer["dead"] == ["g2:a"] and answer["dead_quorums"] == [q.quorum_id]


def big_quorum(n: int) -> Quorum:
    ids = [f"g{i:05d}:{'0123456789abcdef' * 2}" for i in range(n)]
    meta = lambda r: {"store": f"10.0.0.{int(r[1:6]) % 250}:29500",  # noqa: E731
                      "transfer": [f"http://10.0.0.1:{29600 + int(r[1:6])}"], "recover_request": 1}
    recovering = ids[-2:]
    members = [Member(r, r.split(":")[0], 7 if r in recovering else 9, meta(r),
                      watch=(ids[0],) if r == ids[3] else ()) for r in ids]
    parts = ids[:-2]
    return Quorum(12, 9, members, parts, recovering, {r: parts[i] for i, r in enumerate(recovering)},
                  100.0, "fast path", "a" * 64, "e")


def test_the_answer_of_a_member_is_small_and_says_what_the_whole_quorum_says() -> None:
    """At 2,000 groups the whole quorum is ~330 KB; a participant's own
    answer is a few hundred bytes, and every question the group protocol asks gets the same
    answer from it as from the whole quorum."""
    q = big_quorum(2000)
    encoder = AnswerEncoder()
    whole = len(json.dumps(q.to_json()))
    for rid in (q.members[0].replica_id, q.members[3].replica_id, q.members[1000].replica_id, q.recovering[0]):
        raw = encoder.encode(q, rid)
        assert json.loads(raw) == member_json(q, rid)
        view = MemberQuorum.from_json(raw)
        assert MemberQuorum.from_json(view.to_json()) == view
        assert (view.rank(rid), view.participant_index(rid), view.size, view.participant_count,
                view.recovering_count, view.group_count, view.digest, view.store, view.next_chain()) == (
                   q.rank(rid), q.participant_index(rid), q.size, q.participant_count, q.recovering_count,
                   q.group_count, q.digest, q.store, q.next_chain())
        assert view.is_recovering(rid) == q.is_recovering(rid) and view.source_of(rid) == q.source_of(rid)
        assert view.joiners_of(rid) == [Member(m.replica_id, m.group, m.step, m.meta) for m in q.joiners_of(rid)]
        if not q.is_recovering(rid) and not q.joiners_of(rid):
            assert len(raw) < 1024, len(raw)  # vs the whole quorum below
    assert whole > 300 * 1024
    joiner = MemberQuorum.from_json(encoder.encode(q, q.recovering[0]))
    assert joiner.participants == q.participants and joiner.member(q.members[0].replica_id).meta["transfer"]
    watcher = MemberQuorum.from_json(encoder.encode(q, q.members[3].replica_id))
    assert watcher.present(q.members[0].replica_id) and not watcher.present("gx:gone")
    with pytest.raises(ValueError, match="does not list the participants"):
        _ = watcher.participants
    with pytest.raises(ValueError, match="not a quorum answer"):
        MemberQuorum.from_json(b'{"replica_id": "g0:a"}')


def test_the_group_protocol_decides_the_same_from_its_answer_as_from_the_whole_quorum() -> None:
    """A source serving a joiner, the joiner, and a participant: every role is the same."""
    q = big_quorum(40)
    for rid in (q.members[0].replica_id, q.members[1].replica_id, q.recovering[0], q.recovering[1]):
        a, b = GroupProtocol(rid, 5), GroupProtocol(rid, 5)
        ra, rb = a.on_quorum(q), b.on_quorum(MemberQuorum.from_json(member_json(q, rid)))
        fields = ("participant_index", "recovering", "drain", "reconfigure", "publish", "fetch_from", "retain")
        assert [getattr(ra, f) for f in fields] == [getattr(rb, f) for f in fields]
        assert ra.participants == rb.participants == 38 and a.request() == b.request()


def test_a_coordinator_answer_output_carries_the_quorum_not_a_body() -> None:
    m, q = job()
    answers = [o for o in m.request(0.5, MemberRequest("g0:a", "g0", 1, q.quorum_id, False, {}, 0.5,
                                                       q.next_chain())) if isinstance(o, Answer)]
    assert answers == []  # waiting for the others
    out = [o for g in ("g1", "g2") for o in m.request(0.6, MemberRequest(f"{g}:a", g, 1, q.quorum_id, False, {},
                                                                          0.6, q.next_chain()))]
    answers = [o for o in out if isinstance(o, Answer)]
    assert [(a.replica_id, a.status, a.body) for a in answers] == [(f"{g}:a", 200, None) for g in GROUPS]
    assert all(a.quorum is answers[0].quorum for a in answers)
