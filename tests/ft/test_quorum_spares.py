"""Hot spares in the coordinator's decision (``ftlm.ft.quorum.spares``) and in a member's answer:
a job of three training places and one spare, driven through the coordinator's state machine
with a hand-driven clock."""

from __future__ import annotations

from ftlm.ft.group import GroupProtocol
from ftlm.ft.history import GENESIS
from ftlm.ft.membership import Event, Issued, Membership, Output
from ftlm.ft.quorum import Heartbeat, MemberRequest, Quorum, QuorumOptions, assign_roles
from ftlm.ft.quorum_answer import AnswerEncoder, MemberQuorum

GROUPS = ("g0", "g1", "g2", "g3")


def options(max_participants: int = 3) -> QuorumOptions:
    return QuorumOptions(1, 2.0, 1.0, len(GROUPS), rebuild_grace=0.0, max_participants=max_participants)


def ask(m: Membership, rid: str, now: float, step: int = 0, last_quorum_id: int = -1,
        chain: str = GENESIS, failed: bool = False) -> list[Output]:
    req = MemberRequest(rid, rid.partition(":")[0], step, last_quorum_id, failed, {}, now, chain)
    return m.request(now, req)


def issued(out: list[Output]) -> list[Quorum]:
    return [o.quorum for o in out if isinstance(o, Issued)]


def first_quorum(max_participants: int = 3) -> tuple[Membership, Quorum]:
    m = Membership(options(max_participants), epoch="e")
    for g in GROUPS:
        m.heartbeat(0.0, Heartbeat(f"{g}:a", g, 0.0, 0))
    qs = [q for g in GROUPS for q in issued(ask(m, f"{g}:a", 0.1))]
    assert len(qs) == 1
    return m, qs[0]


def test_assign_roles_keeps_the_trainers_and_fills_free_places_in_member_order() -> None:
    holders = ["g0:a", "g1:a", "g2:a", "g3:a"]
    assert assign_roles(holders, None, 0) == (holders, [])  # no spares configured
    assert assign_roles(holders[:3], None, 3) == (holders[:3], [])  # no more holders than places
    assert assign_roles(holders, None, 3) == (holders[:3], ["g3:a"])
    prev = Quorum(1, 0, [], ["g1:a", "g2:a", "g3:a"], [], {}, 0.0, spares=["g0:a"])
    # The trainers of the previous quorum keep their places: no role changes while nothing fails.
    assert assign_roles(holders, prev, 3) == (["g1:a", "g2:a", "g3:a"], ["g0:a"])
    # g2 is gone: the spare g0 takes the free place; the lists keep member order.
    assert assign_roles(["g0:a", "g1:a", "g3:a"], prev, 3) == (["g0:a", "g1:a", "g3:a"], [])


def test_a_spare_follows_every_step_and_is_promoted_when_a_participant_dies() -> None:
    """g3 stands by as a spare: it holds the head, is a member (it joins the all-reduce with
    zeros) and trains no slice. When g1 dies, the next quorum gives g3 g1's place at once, with
    no catch-up (it holds the head), and records the promotion."""
    m, q0 = first_quorum()
    assert q0.participants == ["g0:a", "g1:a", "g2:a"] and q0.spares == ["g3:a"]
    assert q0.recovering == [] and q0.size == 4 and q0.participant_count == 3
    assert q0.participant_index("g3:a") is None and not q0.is_recovering("g3:a") and q0.is_spare("g3:a")
    chain1 = q0.next_chain()
    # Everyone commits step 0 (the spare too: it applied the average) and asks for step 1.
    outs = [o for g in GROUPS for o in ask(m, f"{g}:a", 0.2, 1, q0.quorum_id, chain1)]
    q1 = issued(outs)[0]
    assert q1.step == 1 and q1.spares == ["g3:a"] and q1.quorum_id == q0.quorum_id
    assert not [o for o in outs if isinstance(o, Event) and o.kind == "spare_promoted"]
    # g1 dies during step 1; the others commit it and ask for step 2.
    m.report_dead(0.30, "g1:a", "g1", "process exited")
    chain2 = q1.next_chain()
    outs = [o for g in ("g0", "g2", "g3") for o in ask(m, f"{g}:a", 0.35, 2, q1.quorum_id, chain2)]
    q2 = issued(outs)[0]
    assert q2.participants == ["g0:a", "g2:a", "g3:a"] and q2.spares == [] and q2.recovering == []
    promotion = [o.fields for o in outs if isinstance(o, Event) and o.kind == "spare_promoted"]
    assert len(promotion) == 1 and m.promotions == 1
    assert promotion[0]["promoted"] == ["g3"] and promotion[0]["replaced"] == ["g1"]
    assert promotion[0]["step"] == 2 and abs(promotion[0]["seconds"] - 0.05) < 1e-6


def test_the_repaired_group_catches_up_and_comes_back_as_the_spare() -> None:
    m, q0 = first_quorum()
    m.report_dead(0.15, "g1:a", "g1", "process exited")
    chain1 = q0.next_chain()
    q1 = [q for g in ("g0", "g2", "g3") for q in issued(ask(m, f"{g}:a", 0.2, 1, q0.quorum_id, chain1))][0]
    assert q1.participants == ["g0:a", "g2:a", "g3:a"]
    # g1's new incarnation joins behind: it recovers from a participant, the others train.
    m.heartbeat(0.25, Heartbeat("g1:b", "g1", 0.25, 0))
    chain2 = q1.next_chain()
    outs = ask(m, "g1:b", 0.28)
    outs += [o for rid in ("g0:a", "g2:a", "g3:a") for o in ask(m, rid, 0.3, 2, q1.quorum_id, chain2)]
    q2 = issued(outs)[-1]
    assert q2.recovering == ["g1:b"] and q2.participants == ["g0:a", "g2:a", "g3:a"] and not q2.spares
    # Caught up (it holds the head): the places are taken, so it stands by.
    chain3 = q2.next_chain()
    outs = [o for rid in ("g0:a", "g1:b", "g2:a", "g3:a") for o in ask(m, rid, 0.4, 3, q2.quorum_id, chain3)]
    q3 = issued(outs)[-1]
    assert q3.participants == ["g0:a", "g2:a", "g3:a"] and q3.spares == ["g1:b"]


def test_a_spare_that_fell_behind_is_never_promoted() -> None:
    """The spare g3 missed step 1's commit (it asks with step 1's state while the head is at 2):
    when g1 dies, g3 recovers instead of taking the place; the job trains on two places until
    g3 holds the head again."""
    m, q0 = first_quorum()
    chain1 = q0.next_chain()
    q1 = [q for g in GROUPS for q in issued(ask(m, f"{g}:a", 0.2, 1, q0.quorum_id, chain1))][0]
    chain2 = q1.next_chain()
    m.report_dead(0.25, "g1:a", "g1", "process exited")
    outs = [o for g in ("g0", "g2") for o in ask(m, f"{g}:a", 0.3, 2, q1.quorum_id, chain2)]
    outs += ask(m, "g3:a", 0.3, 1, q1.quorum_id, chain1, failed=True)
    q2 = issued(outs)[-1]
    assert q2.participants == ["g0:a", "g2:a"] and q2.recovering == ["g3:a"] and not q2.spares
    assert not [o for o in outs if isinstance(o, Event) and o.kind == "spare_promoted"]


def test_a_spare_s_answer_says_so_and_its_group_commits_the_average() -> None:
    """The compact answer tells the spare its role; ``GroupProtocol`` treats it as neither
    participant nor recovering member, and a committed step moves its state as a participant's."""
    _, q0 = first_quorum()
    answer = MemberQuorum.from_json(AnswerEncoder().encode(q0, "g3:a"))
    assert answer.spare and answer.spare_count == 1 and answer.index is None
    assert not answer.is_recovering("g3:a") and answer.participant_count == 3
    trainer = MemberQuorum.from_json(AnswerEncoder().encode(q0, "g0:a"))
    assert not trainer.spare and trainer.index == 0 and trainer.spare_count == 1
    assert MemberQuorum.from_json(answer.to_json()) == answer
    proto = GroupProtocol("g3:a", max_consecutive_failures=3)
    role = proto.on_quorum(answer)
    assert role.spare and not role.recovering and role.participant_index is None and role.fetch_from is None
    assert proto.on_outcome(True) and (proto.step, proto.chain) == (1, q0.next_chain())


def test_without_spares_every_holder_trains() -> None:
    _, q0 = first_quorum(max_participants=0)
    assert q0.participants == [f"{g}:a" for g in GROUPS] and q0.spares == []
    assert Quorum.from_json(q0.to_json()).spares == []
