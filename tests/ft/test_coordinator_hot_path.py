"""The coordinator's lean path for heartbeat and quorum (``ftlm.ft.hot_path``): what it serves
itself, and that everything else reaches aiohttp from its first byte and is answered as before."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ftlm.ft.client import CoordinatorClient
from ftlm.ft.config import CoordinatorConfig
from ftlm.ft.coordinator import Coordinator
from ftlm.ft.coordinator_hot import HotEndpoints
from ftlm.ft.history import GENESIS
from ftlm.ft.hot_path import HotPathProtocol

TOKEN = "s3cret"


@pytest.fixture
def coord(request: pytest.FixtureRequest) -> Iterator[Coordinator]:
    """A coordinator expecting the groups the test names (indirect parameter, default 1): it
    ends rebuilding its membership as soon as they all reported."""
    c = Coordinator(CoordinatorConfig(heartbeat_timeout=5.0, join_timeout=5.0, tick_interval=0.02,
                                      token=TOKEN, min_replicas=1,
                                      expected_groups=getattr(request, "param", 1)))
    c.start()
    yield c
    c.stop()


def _request(path: str, body: dict[str, Any] | bytes, token: str = TOKEN, extra: str = "",
             content_type: str = "application/json") -> bytes:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            f"Authorization: Bearer {token}\r\n{extra}Content-Length: {len(raw)}\r\n\r\n").encode() + raw


def _beat(group: str = "g0", step: int = 0) -> dict[str, Any]:
    return {"group": group, "incarnation": "a", "step": step, "quorum_id": -1}


def _ask(group: str = "g0", timeout: float = 5.0) -> dict[str, Any]:
    return {"group": group, "incarnation": "a", "step": 0, "last_quorum_id": -1, "failed": False,
            "meta": {}, "timeout": timeout, "chain": GENESIS}


class Conn:
    """A raw keep-alive connection that reads whole answers (Content-Length bodies)."""

    def __init__(self, c: Coordinator) -> None:
        self.sock = socket.create_connection(("127.0.0.1", c.port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers["content-length"])
        while len(self.buf) < length:
            self._more()
        body, self.buf = self.buf[:length], self.buf[length:]
        return int(lines[0].split()[1]), headers, body

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, f"connection closed; got {self.buf[:200]!r}"
        self.buf += chunk

    def closed(self, timeout: float = 5.0) -> bool:
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
        finally:
            self.sock.settimeout(10)

    def close(self) -> None:
        self.sock.close()


def _protocols(c: Coordinator) -> list[HotPathProtocol]:
    return c.call_in_loop(lambda: [g.inner for g in c._gate._open.values()])  # type: ignore[union-attr]


def _handed_over(c: Coordinator) -> list[bool]:
    return [p.fallback is not None for p in _protocols(c)]


def wait_until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_the_real_client_is_served_by_the_lean_path(coord: Coordinator) -> None:
    client = CoordinatorClient(coord.url, "g0", "a", token=TOKEN, timeout=5.0)
    try:
        assert client.heartbeat(0, -1)["dead"] == []
        q = client.quorum(0, -1, False, {"store": "h:1"}, 5.0)
        assert q.size == 1 and q.replica_id == "g0:a" and q.rank("g0:a") == 0
        assert client.heartbeat(0, q.quorum_id)["quorum_id"] == q.quorum_id
        assert _handed_over(coord) == [False]  # one keep-alive connection, never given to aiohttp
        assert client.status()["members"][0]["replica_id"] == "g0:a"  # then aiohttp: same connection
        assert _handed_over(coord) == [True]
    finally:
        client.close()


def test_pipelined_requests_are_answered_in_order(coord: Coordinator) -> None:
    conn = Conn(coord)
    try:
        conn.send(_request("/v1/heartbeat", _beat("g0")) + _request("/v1/quorum", _ask("g0"))
                  + _request("/v1/heartbeat", _beat("g0", step=1)))
        status, headers, body = conn.answer()
        assert status == 200 and json.loads(body)["dead"] == []
        status, headers, body = conn.answer()  # the only member: its quorum at once
        assert status == 200 and headers["content-type"] == "application/json; charset=utf-8"
        quorum = json.loads(body)
        assert quorum["size"] == 1 and quorum["replica_id"] == "g0:a"
        status, _, body = conn.answer()
        assert status == 200 and json.loads(body)["quorum_id"] == quorum["quorum_id"]
        assert _handed_over(coord) == [False]
    finally:
        conn.close()


def _two_members(coord: Coordinator) -> tuple[Conn, Conn]:
    """Connections of groups g0 and g1, each having heartbeated once (the job's 2 groups)."""
    conns = Conn(coord), Conn(coord)
    for conn, group in zip(conns, ("g0", "g1")):
        conn.send(_request("/v1/heartbeat", _beat(group)))
        assert conn.answer()[0] == 200
    return conns


@pytest.mark.parametrize("coord", [2], indirect=True)
def test_a_long_poll_is_answered_when_the_last_member_asks(coord: Coordinator) -> None:
    a, b = _two_members(coord)
    try:
        a.send(_request("/v1/quorum", _ask("g0")))
        assert not a.closed(0.3)  # waiting for g1 (nothing sent, nothing closed)
        b.send(_request("/v1/quorum", _ask("g1")))
        got = [json.loads(conn.answer()[2]) for conn in (a, b)]
        assert [g["size"] for g in got] == [2, 2] and got[0]["quorum_id"] == got[1]["quorum_id"]
        assert sorted(g["rank"] for g in got) == [0, 1]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("coord", [2], indirect=True)
def test_a_long_poll_times_out_with_504_and_its_request_is_withdrawn(coord: Coordinator) -> None:
    a, b = _two_members(coord)
    try:
        a.send(_request("/v1/quorum", _ask("g0", timeout=0.3)))
        status, _, body = a.answer()
        assert status == 504 and json.loads(body)["error"] == "quorum timeout"
        wait_until(lambda: coord.call_in_loop(lambda: "g0:a" not in coord._state.pending))
        assert coord.call_in_loop(lambda: coord._waiters) == {}
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("coord", [2], indirect=True)
def test_a_closed_long_poll_is_withdrawn(coord: Coordinator) -> None:
    a, b = _two_members(coord)
    try:
        a.send(_request("/v1/quorum", _ask("g0")))
        wait_until(lambda: coord.call_in_loop(lambda: "g0:a" in coord._waiters))
        a.close()
        wait_until(lambda: coord.call_in_loop(
            lambda: "g0:a" not in coord._waiters and "g0:a" not in coord._state.pending))
    finally:
        b.close()


@pytest.mark.parametrize("request_bytes, status, message", [
    (_request("/v1/heartbeat", _beat(), token="wrong"), 401, "unauthorized"),
    (_request("/v1/heartbeat", _beat(), content_type="text/plain"), 415, "Content-Type"),
    (_request("/v1/heartbeat", _beat(), extra="Origin: http://evil.example\r\n"), 403, "cross-origin"),
    (_request("/v1/heartbeat", b'{"group": "g0", "group": "g1"}'), 400, "more than once"),
    (_request("/v1/heartbeat", {**_beat(), "step": -1}), 400, "step=-1"),
    (_request("/v1/quorum", b"[" * 40 + b"]" * 40), 400, "nests deeper"),
    (_request("/v1/quorum", b'{"a": NaN}'), 400, "not a JSON number"),
    (_request("/v1/heartbeat", b"x" * 70000), 413, "over the limit"),
    ((b"POST /v1/heartbeat HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
      b"Content-Type: application/json\r\nAuthorization: Bearer s3cret\r\n\r\n0\r\n\r\n"), 400, "not valid JSON"),
])
def test_refusals_reach_aiohttp_and_are_answered_as_before(coord: Coordinator, request_bytes: bytes,
                                                           status: int, message: str) -> None:
    conn = Conn(coord)
    try:
        conn.send(_request("/v1/heartbeat", _beat("g9")))
        assert conn.answer()[0] == 200  # the lean path first, on this same connection
        conn.send(request_bytes)
        got, _, body = conn.answer()
        assert got == status and message in json.loads(body)["error"], body
        assert _handed_over(coord) == [True]
    finally:
        conn.close()


def test_a_body_after_its_headers_is_read_and_answered(coord: Coordinator) -> None:
    conn = Conn(coord)
    try:
        data = _request("/v1/heartbeat", _beat())
        cut = data.index(b"\r\n\r\n") + 4
        conn.send(data[:10])
        time.sleep(0.05)  # (not waiting for anything: lets the pieces arrive apart)
        conn.send(data[10:cut])
        time.sleep(0.05)
        conn.send(data[cut:])
        assert conn.answer()[0] == 200
        assert _handed_over(coord) == [False]  # http.client sends every body apart from its headers
    finally:
        conn.close()


def test_a_body_that_does_not_follow_its_headers_gets_408_and_the_connection_closes() -> None:
    c = Coordinator(CoordinatorConfig(token=TOKEN, read_timeout=0.3, tick_interval=0.02))
    c.start()
    conn = Conn(c)
    try:
        data = _request("/v1/heartbeat", _beat())
        conn.send(data[:-5])
        status, headers, body = conn.answer()
        assert status == 408 and headers["connection"] == "close"
        assert "not received within 0.3 s" in json.loads(body)["error"]
        assert conn.closed()
        wait_until(lambda: c.open_connections == 0)
    finally:
        conn.close()
        c.stop()


def test_connection_close_is_honoured(coord: Coordinator) -> None:
    conn = Conn(coord)
    try:
        conn.send(_request("/v1/heartbeat", _beat(), extra="Connection: close\r\n"))
        status, headers, _ = conn.answer()
        assert status == 200 and headers["connection"] == "close"
        assert conn.closed()
    finally:
        conn.close()


def test_a_stale_incarnation_gets_409_on_the_lean_path(coord: Coordinator) -> None:
    conn = Conn(coord)
    try:
        conn.send(_request("/v1/heartbeat", {**_beat(), "incarnation": "b"}))
        assert conn.answer()[0] == 200
        conn.send(_request("/v1/heartbeat", _beat()))  # incarnation "a" replaces "b"
        assert conn.answer()[0] == 200
        conn.send(_request("/v1/heartbeat", {**_beat(), "incarnation": "b"}))  # the replaced one
        status, _, body = conn.answer()
        assert status == 409 and "error" in json.loads(body)
        assert _handed_over(coord) == [False]
    finally:
        conn.close()


def test_the_coordinator_serves_from_uvloop_where_installed(coord: Coordinator) -> None:
    uvloop = pytest.importorskip("uvloop")
    assert isinstance(coord._loop, uvloop.Loop)


class _Recorder:
    """A transport that records, in one shared list, which member's connection was written to."""

    def __init__(self, name: str, log: list[tuple[str, bytes]]) -> None:
        self.name, self.log = name, log

    def write(self, data: bytes) -> None:
        self.log.append((self.name, data))

    def is_closing(self) -> bool:
        return False


def _four_groups(c: Coordinator) -> tuple[dict[str, HotPathProtocol], list]:
    """Four groups on the lean path's protocols over recording transports, each heartbeated once;
    returns their connections and the log of what was written to them."""
    hot, log = HotEndpoints(c), []
    conns = {}
    for g in ("g0", "g1", "g2", "g3"):
        conns[g] = HotPathProtocol(hot, lambda: None)  # type: ignore[arg-type, return-value]
        conns[g].connection_made(_Recorder(g, log))  # type: ignore[arg-type]
        conns[g].data_received(_request("/v1/heartbeat", _beat(g)))
    return conns, log


def test_a_quorums_answers_go_out_in_the_order_its_members_asked() -> None:
    """The member that asked first has waited longest: its answer is written first, whatever its
    rank (in-process: the lean path's protocols over recording transports, no event loop)."""
    c = Coordinator(CoordinatorConfig(heartbeat_timeout=60.0, join_timeout=60.0, token=TOKEN, min_replicas=1,
                                      expected_groups=4))
    conns, log = _four_groups(c)
    log.clear()
    order = ["g3", "g1", "g0", "g2"]
    for g in order:
        conns[g].data_received(_request("/v1/quorum", _ask(g, timeout=60.0)))
    assert [name for name, _ in log] == order
    answers = [json.loads(data.split(b"\r\n\r\n", 1)[1]) for _, data in log]
    assert [a["rank"] for a in answers] == [3, 1, 0, 2] and {a["size"] for a in answers} == {4}


def test_a_burst_of_asks_is_evaluated_once_after_the_loop_pass_that_read_it(monkeypatch) -> None:
    """The coordinator records each message and decides once after the pass of its
    event loop that read them, not after every message; the quorum still forms and every member
    gets its answer."""
    import asyncio

    c = Coordinator(CoordinatorConfig(heartbeat_timeout=60.0, join_timeout=60.0, token=TOKEN, min_replicas=1,
                                      expected_groups=4))
    ticks = []
    real = c._evaluate  # the one caller of ``membership.tick``
    monkeypatch.setattr(c, "_evaluate", lambda now: ticks.append(now) or real(now))

    async def burst() -> list:
        conns, log = _four_groups(c)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        log.clear()
        ticks.clear()
        for g in conns:  # one pass of the loop reads all four asks
            conns[g].data_received(_request("/v1/quorum", _ask(g, timeout=60.0)))
        assert log == [] and ticks == []  # nothing decided yet
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return log

    log = asyncio.run(burst())
    assert len(ticks) == 1
    assert sorted(name for name, _ in log) == ["g0", "g1", "g2", "g3"]
    answers = [json.loads(data.split(b"\r\n\r\n", 1)[1]) for _, data in log]
    assert {a["size"] for a in answers} == {4}


@pytest.mark.parametrize("answer", [
    {"quorum_id": 7, "dead": [], "dead_quorums": [], "epoch": "ab12", "rebuilding": False},
    {"quorum_id": -1, "dead": [], "dead_quorums": [], "epoch": "x\"y\u00e9", "rebuilding": True},
    {"quorum_id": 7, "dead": ["g1:a"], "dead_quorums": [6], "epoch": "ab12", "rebuilding": False},
    {"quorum_id": 7, "dead": [], "dead_quorums": [], "epoch": None, "rebuilding": False},
    {"quorum_id": 7, "dead": [], "dead_quorums": [], "epoch": "e", "rebuilding": False, "kill": True},
    {"quorum_id": 7, "dead": [], "dead_quorums": [], "epoch": "e", "rebuilding": False, "declared_dead": True,
     "reload": 40},
    {"dead": [], "quorum_id": 7, "dead_quorums": [], "epoch": "e", "rebuilding": False},
    {"quorum_id": True, "dead": [], "dead_quorums": [], "epoch": "e", "rebuilding": 0},
])
def test_a_heartbeats_answer_is_encoded_as_json_dumps_does(answer) -> None:
    from ftlm.ft.coordinator_hot import HeartbeatAnswerEncoder

    encoder = HeartbeatAnswerEncoder()
    for _ in range(2):  # the epoch's encoding is kept between answers
        assert encoder.encode(answer) == json.dumps(answer).encode()
    assert encoder.encode({**answer, "epoch": "other"}) == json.dumps({**answer, "epoch": "other"}).encode()


def test_heartbeats_are_answered_after_the_asks_of_a_pass_but_never_starved() -> None:
    """A heartbeat read in a pass of the loop is answered after the decision that
    pass's asks queue; a decision always pending (asks in every pass) delays it at most
    ``_beat_max_wait`` (0.1 s)."""
    import asyncio

    c = Coordinator(CoordinatorConfig(heartbeat_timeout=60.0, join_timeout=60.0, token=TOKEN, min_replicas=1,
                                      expected_groups=4))

    async def run() -> tuple[list, float]:
        conns, log = _four_groups(c)
        for _ in range(3):
            await asyncio.sleep(0)
        log.clear()
        real_tick, ticks = c._deferred_tick, []

        def tick() -> None:
            real_tick()
            ticks.append(time.monotonic())
            c._tick_soon()  # another decision is always due: as asks arriving in every pass
        c._deferred_tick = tick  # type: ignore[method-assign]
        c._tick_soon()
        start = time.monotonic()
        conns["g0"].data_received(_request("/v1/heartbeat", _beat("g0")))
        deadline = start + 5.0
        while not log and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        c._deferred_tick = real_tick  # type: ignore[method-assign]
        return log, time.monotonic() - start

    log, waited = asyncio.run(run())
    assert [name for name, _ in log] == ["g0"] and b" 200 OK" in log[0][1]
    assert 0.09 <= waited < 2.0  # held while decisions were due, answered once it had waited 0.1 s
