"""The compact quorum answer's encoder (``ftlm.ft.quorum_answer.AnswerEncoder``): its byte template
for plain participants gives exactly the bytes of ``json.dumps(member_json(...))``."""

from __future__ import annotations

import json

from ftlm.ft.history import GENESIS
from ftlm.ft.quorum import Member, Quorum
from ftlm.ft.quorum_answer import AnswerEncoder, MemberQuorum, member_json


def _quorum(qid: int, rids: list[str], behind: list[str], watchers: dict[str, tuple[str, ...]]) -> Quorum:
    up = [r for r in rids if r not in behind]
    meta = {"store": "10.0.0.1:29500", "transfer": ["http://10.0.0.1:29600"], "note": "é \"q\""}
    members = [Member(r, r.split(":")[0], 3, meta, watchers.get(r, ())) for r in rids]
    return Quorum(qid, 3, members, up, behind, {r: up[i % len(up)] for i, r in enumerate(behind)}, 12.5,
                  "synthetic", GENESIS, "epoch-1")


def test_every_member_gets_the_bytes_of_its_member_json() -> None:
    """Plain participants (the template), recovering members, their sources and a watcher, over
    two quorums in turn (the encoder switches its shared part and its template)."""
    rids = [f"g{i:02d}:a" for i in range(12)] + ["odd.name_1:b-2"]
    first = _quorum(7, rids, ["g03:a", "g09:a"], {"g05:a": ("g03:a", "zz:a")})
    second = _quorum(8, rids[:-2], [], {})
    encoder = AnswerEncoder()
    for q in (first, second, first):
        for m in q.members:
            got = encoder.encode(q, m.replica_id)
            assert got == json.dumps(member_json(q, m.replica_id)).encode(), m.replica_id
            answer = MemberQuorum.from_json(got)
            assert answer.replica_id == m.replica_id and answer.own_rank == q.rank(m.replica_id)
            assert answer.index == q.participant_index(m.replica_id)
