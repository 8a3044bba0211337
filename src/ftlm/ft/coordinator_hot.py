"""The coordinator's lean HTTP path endpoints: the long-poll of a quorum request as a ``Waiter``,
the checks and the two endpoints ``ftlm.ft.hot_path`` calls (``HotEndpoints``), and the byte
encodings of the common answers.

Responsible for: answering a waiting quorum request by a direct write (or 504 at its deadline,
or forgetting it when its connection closes), the same admission checks as the aiohttp path
(conservatively: anything unusual goes to aiohttp to be judged), and the body of a plain
heartbeat answer without ``json.dumps``.

Not responsible for: parsing HTTP (``ftlm.ft.hot_path``), decoding bodies
(``ftlm.ft.coordinator_requests``), or deciding anything (``ftlm.ft.membership``, driven by
``ftlm.ft.coordinator.Coordinator``, whose parts these classes are: they read its waiters, gate
and the decoders it holds).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import TYPE_CHECKING, Any

from ftlm.ft.coordinator_address import loopback_host
from ftlm.ft.coordinator_requests import HeartbeatBody, QuorumBody
from ftlm.ft.hot_path import HOT_PATHS, HotPathProtocol, json_content_type
from ftlm.ft.quorum import MemberRequest

if TYPE_CHECKING:
    from ftlm.ft.coordinator import Coordinator

# What a waiting long-poll is woken with: (HTTP status, JSON body or None, the body encoded). A
# quorum answers each member with its own compact part (``ftlm.ft.quorum_answer``), whose common
# part is encoded once per quorum, not once per member.
WaiterAnswer = tuple[int, dict[str, Any] | None, bytes]


class Waiter:
    """A quorum long-poll of the lean path (``ftlm.ft.hot_path``): answered by a direct write
    when the state machine decides; no task, no future, no timer of its own (its deadline is in
    the coordinator's heap, checked every ``tick_interval``: a timer handle per request was 5% of
    the lean path's time). Has the ``done``/``set_result`` a future has, so
    ``Coordinator._answer`` wakes both kinds alike."""

    __slots__ = ("_done", "conn", "coord", "req")

    def __init__(self, coord: Coordinator, conn: HotPathProtocol, req: MemberRequest) -> None:
        self.coord = coord
        self.conn = conn
        self.req = req
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, answer: WaiterAnswer) -> None:
        """The coordinator's answer (already removed from its waiters)."""
        if self._done:
            return
        self._done = True
        status, _, raw = answer
        self.conn.respond(status, raw)
        if status != 200:  # told to ask again: do not issue it a quorum nobody receives
            asyncio.get_running_loop().call_soon(self.coord.membership.withdraw, self.req)

    def expire(self) -> None:
        """No answer within the asker's timeout: 504 with the reason, as the aiohttp path."""
        if self._done:
            return
        self._done = True
        self._forget()
        self.conn.respond(504, json.dumps({"error": "quorum timeout",
                                           "reason": self.coord.membership.reason}).encode())
        self.coord.membership.withdraw(self.req)

    def lost(self) -> None:
        """The asker's connection closed before its answer."""
        if self._done:
            return
        self._done = True
        self._forget()
        self.coord.membership.withdraw(self.req)

    def _forget(self) -> None:
        waiting = self.coord._waiters.get(self.req.replica_id, [])
        if self in waiting:
            waiting.remove(self)
            if not waiting:
                del self.coord._waiters[self.req.replica_id]


class HotEndpoints:
    """The coordinator as ``ftlm.ft.hot_path`` sees it: the checks, the two endpoints, the gate."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.read_timeout = coord.config.read_timeout

    def note(self, status: int) -> None:
        self.coord.abuse.note(f"HTTP {status}", "POST (a hot path)")

    def admits(self, headers: dict[str, str]) -> bool:
        """Every check of ``Coordinator._refusal``, conservatively: a request with an Origin or a
        Sec-Fetch-Site header, or any content type but plain JSON, goes to aiohttp to be judged."""
        coord, cfg = self.coord, self.coord.config
        host = headers.get("host")
        if coord._loopback and host is not None and not loopback_host(host):
            return False
        if "origin" in headers or "sec-fetch-site" in headers:
            return False
        if cfg.token and not hmac.compare_digest(headers.get("authorization", "").encode("utf-8", "replace"),
                                                 coord._bearer):
            return False
        if not json_content_type(headers.get("content-type")):
            return False
        return int(headers["content-length"]) <= cfg.max_request_bytes

    def serve(self, path: str, raw: bytes, conn: HotPathProtocol) -> bool:
        coord = self.coord
        coord.fence()
        try:
            parsed = coord._bodies.heartbeat(raw) if path == HOT_PATHS[0] else coord._bodies.quorum(raw)
        except ValueError:
            return False  # aiohttp answers the 400 (and counts it)
        try:
            if isinstance(parsed, HeartbeatBody):
                coord._queue_beat(parsed, conn)
            else:
                coord._quorum_hot(parsed, conn)
        except Exception as e:  # noqa: BLE001 - a bug: answer 500, keep serving, log it (rate-limited)
            coord.abuse.bug(f"coordinator failed answering POST {path}", e)
            conn.respond(500, b'{"error": "internal error; see the coordinator\'s log"}')
        return True

    def started(self, transport: Any) -> Any:
        gate = self.coord._gate
        return gate.started(transport) if gate is not None else None

    def finished(self, token: Any) -> None:
        if self.coord._gate is not None:
            self.coord._gate.finished(token)


class HeartbeatAnswerEncoder:
    """``json.dumps(answer).encode()`` of a heartbeat's answer, by one bytes formatting for the
    common one (nobody dead, nothing to say but the ids): the bytes of ``json.dumps``, a test
    checks it (the general encoder was a tenth of a heartbeat's cost)."""

    _PLAIN = ("quorum_id", "dead", "dead_quorums", "epoch", "rebuilding")
    _TEMPLATE = b'{"quorum_id": %d, "dead": [], "dead_quorums": [], "epoch": %s, "rebuilding": %s}'

    def __init__(self) -> None:
        self._epoch: tuple[Any, bytes] = (None, b"null")

    def encode(self, answer: dict[str, Any]) -> bytes:
        qid = answer.get("quorum_id")
        if (tuple(answer) != self._PLAIN or answer["dead"] or answer["dead_quorums"] or type(qid) is not int
                or type(answer["rebuilding"]) is not bool):
            return json.dumps(answer).encode()
        epoch = answer["epoch"]
        if self._epoch[0] != epoch or type(epoch) is not type(self._epoch[0]):
            self._epoch = (epoch, json.dumps(epoch).encode())
        return self._TEMPLATE % (qid, self._epoch[1], b"true" if answer["rebuilding"] else b"false")


def member_request(body: QuorumBody, now: float) -> MemberRequest:
    """The quorum request a decoded body makes, asked at ``now``."""
    return MemberRequest(f"{body.group}:{body.incarnation}", body.group, body.step, body.last_quorum_id,
                         body.failed, body.meta, now, body.chain, body.watch, body.disk_checked,
                         body.disk_round, body.integrity)

