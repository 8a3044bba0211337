"""Fuzzing the coordinator's request bodies (docs/design.md, 'Security' and 'Testing').

Property, for every ``POST /v1/*`` endpoint (heartbeat, quorum, leave, dead, kill): any body is
either accepted (the endpoint's ordinary answers: 200, a 404 for an unknown group to kill, a 409
for a replaced incarnation, a 504 for a quorum that did not form) or refused with a 400 whose
error is one line; never a 500 or a dropped connection, and a refused body leaves the state
exactly as it was (membership, quorums, deaths, kill marks, the dashboard's history).

Bodies are drawn from four families: near-valid bodies (a valid body of the endpoint with fields
dropped, retyped or set to edge values, from a small pool of group names so that accepted ones
interact: replaced incarnations, leaves, deaths, quorums), arbitrary JSON values, arbitrary
bytes, and hand-made texts that broke JSON servers before (deep nesting, NaN/Infinity, huge
numbers, duplicate keys, other encodings). One coordinator serves all examples over one
keep-alive connection, its tick slowed down so that only requests change its state. Examples per
endpoint: ``FTLM_FUZZ_EXAMPLES`` (default 2000, the ``fuzz`` profile of tests/conftest.py).
"""

from __future__ import annotations

import copy
import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from ftlm.ft.config import CoordinatorConfig
from ftlm.ft.coordinator import Coordinator
from ftlm.ft.history import GENESIS
from ftlm.testing import fuzz

pytestmark = pytest.mark.timeout(300)

FUZZ = settings(parent=settings.get_profile("fuzz"))

VALID: dict[str, dict[str, Any]] = {
    "heartbeat": {"group": "g0", "incarnation": "a", "step": 0, "quorum_id": 0, "chain": GENESIS,
                  "progress_age": 0.0, "known_head": 0},
    "quorum": {"group": "g0", "incarnation": "a", "step": 0, "last_quorum_id": 0, "failed": False,
               "meta": {"store": "127.0.0.1:1"}, "timeout": 0.001, "chain": GENESIS, "disk_checked": 0},
    "leave": {"group": "g0", "incarnation": "a", "reason": "finished"},
    "dead": {"group": "g0", "incarnation": "a", "reason": "process exited with status 1"},
    "kill": {"group": "g0"},
}
ACCEPTED = {"heartbeat": {200, 409}, "quorum": {200, 409, 504}, "leave": {200}, "dead": {200},
            "kill": {200, 404}}

GROUPS = ["g0", "g1", "g2", "g3"]
EDGE_VALUES: list[Any] = [
    -1, 0, 1, 2**53, 2**53 + 1, 10**30, -(10**30), 0.5, -0.0, 1e308, True, False, None, "", " ",
    "g0:a", "g0\n", "a" * 65, "A" * 64, GENESIS.upper(), GENESIS[:-1], [], {}, [GENESIS], {"a": None},
    "\u00e9", "\x00", "\ud800", "\U0001f600"]
NASTY_TEXTS: list[bytes] = [
    b"[" * 20_000 + b"]" * 20_000,
    b'{"a":' * 3_000 + b"1" + b"}" * 3_000,
    b'{"group": "g0", "incarnation": "a", "step": NaN, "quorum_id": 0}',
    b'{"group": "g0", "incarnation": "a", "step": 0, "quorum_id": Infinity}',
    b'{"group": "g0", "incarnation": "a", "step": 0, "quorum_id": 0, "progress_age": -Infinity}',
    b'{"group": "g0", "incarnation": "a", "step": 0, "quorum_id": 0, "progress_age": 1e999}',
    b'{"group": "g0", "incarnation": "a", "step": ' + b"7" * 5000 + b', "quorum_id": 0}',
    b'{"group": "g0", "group": "g1", "incarnation": "a", "step": 0, "quorum_id": 0}',
    b'{"group": "g0", "incarnation": "a", "step": 0, "quorum_id": 0, "meta": {"k": 1, "k": 2}}',
    '{"group": "g0", "incarnation": "a", "step": 0, "quorum_id": 0}'.encode("utf-16"),
    '{"group": "g0", "incarnation": "a", "step": 0, "quorum_id": 0}'.encode("utf-32"),
    b"\xef\xbb\xbf{}", b"", b" ", b"null", b"0", b'"x"', b"[]", b"{", b"}", b"\x00", b"\xff\xfe\xfd",
    b'{"group": "g\\u0000", "incarnation": "a"}', b'{"group": "\\ud800", "incarnation": "a"}',
    b'{"reason": "' + b"x" * 300 + b'", "group": "g0", "incarnation": "a"}',
]

ALPHABET = list("g0123a-_.:") + ["", " ", "\n", "\x00", "\u00e9", "\ud800", "\U0001f600", '"', "\\"]
SPECIAL_NUMBERS: list[Any] = [0, 1, -1, 2**53, 2**53 + 1, -(2**63), 10**20, 0.001, -0.0, 1e308, 5e-324,
                              float("nan"), float("inf"), float("-inf")]


class Choices(fuzz.Choices):
    """Reads choices from a byte string; reading past the end gives zeros (the first entry).

    One hypothesis ``binary`` draw per example, turned into a body here (as libFuzzer's
    FuzzedDataProvider does): a hypothesis draw per choice costs several times more, and
    shrinking the bytes still shrinks the body.
    """

    def __init__(self, data: bytes) -> None:
        super().__init__(data, alphabet=ALPHABET, numbers=SPECIAL_NUMBERS)

    def json(self, depth: int = 0) -> Any:
        """Any value ``json.dumps`` can write (NaN and Infinity included, as Python writes them)."""
        kind = self.below(8 if depth < 3 else 5)
        if kind == 0:
            return None
        if kind == 1:
            return bool(self.below(2))
        if kind == 2:
            return self.number()
        if kind == 3:
            return self.text(12)
        if kind == 4:
            return self.pick(EDGE_VALUES)
        if kind == 5:
            return [self.json(depth + 1) for _ in range(self.below(4))]
        return {self.text(6): self.json(depth + 1) for _ in range(self.below(4))}


def _short_poll(body: Any) -> Any:
    """A quorum request that would be valid waits at most 1 ms (the fuzz must not long-poll)."""
    if isinstance(body, dict):
        t = body.get("timeout")
        if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < 1e9:
            body["timeout"] = 0.001
    return body


def near_valid(c: Choices, endpoint: str) -> bytes:
    """A valid body of ``endpoint`` with some fields dropped, retyped or set to edge values."""
    body = copy.deepcopy(VALID[endpoint])
    body["group"] = c.pick(GROUPS)
    if "incarnation" in body:
        body["incarnation"] = c.pick(["a", "b", "c", c.text(4)])
    for key in [*VALID[endpoint], "extra"]:
        action = c.below(6)  # 0-2: keep
        if action == 3:
            body.pop(key, None)
        elif action == 4:
            body[key] = c.pick(EDGE_VALUES)
        elif action == 5:
            body[key] = c.json()
    return json.dumps(_short_poll(body)).encode()


def make_body(data: bytes, endpoint: str) -> bytes:
    c = Choices(data)
    kind = c.below(8)
    if kind < 4:
        return near_valid(c, endpoint)
    if kind == 4:  # a near-valid text with a few bytes overwritten or inserted
        text = bytearray(near_valid(c, endpoint))
        for _ in range(1 + c.below(3)):
            at, byte = c.below(len(text) + 1), c.raw(1)
            if c.below(2):
                text[at:at + 1] = byte
            else:
                text[at:at] = byte
        return bytes(text)
    if kind == 5:
        return json.dumps(_short_poll(c.json())).encode()
    if kind == 6:
        return c.pick(NASTY_TEXTS)
    return data[c.pos:]  # arbitrary bytes


class Server:
    """One coordinator and one keep-alive connection to it, shared by every example."""

    def __init__(self) -> None:
        # No timer-driven change: heartbeats never expire and the tick comes once in 1000 s.
        self.coord = Coordinator(CoordinatorConfig(heartbeat_timeout=3600.0, tick_interval=1000.0,
                                                   join_timeout=0.0))
        self.coord.start()
        self.conn = http.client.HTTPConnection("127.0.0.1", self.coord.port, timeout=10)
        self.state = self.snapshot()

    def snapshot(self) -> Any:
        m, d = self.coord.membership, self.coord.dashboard
        return self.coord.call_in_loop(lambda: copy.deepcopy(
            (m.state, list(m.dead), set(m.kill_requests),
             {k: v for k, v in d.to_json().items() if k != "charts"})))  # charts move with the clock

    def post(self, endpoint: str, body: bytes) -> tuple[int, bytes]:
        for attempt in range(2):
            try:
                self.conn.request("POST", f"/v1/{endpoint}", body=body,
                                  headers={"Content-Type": "application/json"})
                resp = self.conn.getresponse()
                return resp.status, resp.read()
            except (http.client.RemoteDisconnected, ConnectionError):
                self.conn.close()  # the server closed an idle connection: once more on a fresh one
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        self.conn.close()
        self.coord.stop()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.stop()


def check(server: Server, endpoint: str, body: bytes) -> None:
    note(f"POST /v1/{endpoint} {body[:300]!r}")
    before = server.state
    status, answer = server.post(endpoint, body)
    server.state = after = server.snapshot()
    note(f"-> {status} {answer[:300]!r}")
    assert status == 400 or status in ACCEPTED[endpoint], f"answered {status}"
    parsed = json.loads(answer)
    assert isinstance(parsed, dict)
    if status == 400:
        error = parsed["error"]
        assert isinstance(error, str) and error and "\n" not in error and len(error) < 400
        assert after == before, "a refused body changed the state"
    else:
        assert status in ACCEPTED[endpoint], (status, parsed)


@pytest.mark.parametrize("endpoint", sorted(VALID))
@FUZZ
@given(data=st.binary(min_size=1, max_size=160))
def test_any_body_is_accepted_or_a_one_line_400_that_changes_nothing(server, endpoint, data) -> None:
    check(server, endpoint, make_body(data, endpoint))


def test_the_valid_bodies_are_accepted(server) -> None:
    """The fuzz starts from bodies the endpoints accept (else it would only test refusals)."""
    for endpoint in ("heartbeat", "quorum", "kill", "leave", "dead"):
        body = dict(VALID[endpoint], group="g9")
        if endpoint != "kill":
            body["incarnation"] = "valid"
        status, answer = server.post(endpoint, json.dumps(body).encode())
        assert status in ACCEPTED[endpoint] and status != 409, (endpoint, status, answer)
    assert status == 200
