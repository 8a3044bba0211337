"""The coordinator server on port 0, driven by the real client and by raw HTTP."""

from __future__ import annotations

import http.client
import json
import logging
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftlm.errors import ConfigError
from ftlm.ft.client import CoordinatorClient, CoordinatorUnavailable, Heartbeater, QuorumTimeout
from ftlm.ft.config import CoordinatorConfig
from ftlm.ft.coordinator import Coordinator
from ftlm.ft.coordinator_address import describe_address
from ftlm.ft.coordinator_status import STATUS_LIMIT
from ftlm.ft.dashboard import render_page
from ftlm.ft.history import GENESIS
from ftlm.ft.membership import MAX_DEAD_LISTED, Issued
from ftlm.ft.quorum import Heartbeat, Member, Quorum, StaleIncarnation, commit_quorum
from ftlm.ft.quorum_answer import MemberQuorum

HB_TIMEOUT = 0.4
HB_INTERVAL = 0.05
JOIN_TIMEOUT = 3.0  # above HB_TIMEOUT + MARGIN: a test that finishes sooner did not wait for it
MARGIN = 1.0  # generous: the machine is shared


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.seen.append((kind, fields))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [f for k, f in list(self.seen) if k == kind]


@pytest.fixture
def start() -> Iterator[Callable[..., Coordinator]]:
    started: list[Coordinator] = []

    def _start(events: Any = None, **overrides: Any) -> Coordinator:
        cfg = dict(heartbeat_timeout=HB_TIMEOUT, join_timeout=JOIN_TIMEOUT, tick_interval=0.02)
        cfg.update(overrides)
        coord = Coordinator(CoordinatorConfig(**cfg), events=events)
        coord.start()
        started.append(coord)
        return coord

    yield _start
    for coord in started:
        coord.stop()


class Group:
    """A group leader: a client plus its heartbeat thread, with the step it reports."""

    def __init__(self, url: str, group: str, incarnation: str = "a", token: str = "", quorum_id: int = 0) -> None:
        self.client = CoordinatorClient(url, group, incarnation, token=token, timeout=2.0)
        self.step, self.quorum_id, self.chain = 0, quorum_id, GENESIS
        self.heartbeater = Heartbeater(self.client, HB_INTERVAL,
                                       lambda: (self.step, self.quorum_id, self.chain, 0.0))
        # Register before returning, so that groups made one after another all count as heartbeating
        # when they first ask (otherwise the first to ask may rightly form a quorum alone).
        self.heartbeater.beat()
        self.heartbeater.start()

    def ask(self, failed: bool = False, timeout: float = 5.0) -> MemberQuorum:
        q = self.client.quorum(self.step, self.quorum_id, failed, {"url": f"http://{self.client.group}"}, timeout,
                               chain=self.chain)
        self.quorum_id = q.quorum_id
        self.last = q
        return q

    def commit(self) -> None:
        """Commit the step of the last quorum as a participant (or jump there after recovering)."""
        q = self.last
        self.step, self.chain = q.step + 1, q.next_chain()

    def stop(self) -> None:
        self.heartbeater.stop()
        self.client.close()


@pytest.fixture
def groups() -> Iterator[Callable[..., Group]]:
    made: list[Group] = []

    def _make(url: str, name: str, incarnation: str = "a", token: str = "", quorum_id: int = 0) -> Group:
        g = Group(url, name, incarnation, token, quorum_id)
        made.append(g)
        return g

    yield _make
    for g in made:
        g.stop()


def ask_all(members: list[Group], **kw: Any) -> list[MemberQuorum]:
    with ThreadPoolExecutor(len(members)) as pool:
        futures = [pool.submit(m.ask, **kw) for m in members]
        return [f.result(timeout=10) for f in futures]


def train_until(member: Group, done: Callable[[MemberQuorum], bool], steps: int = 200) -> MemberQuorum:
    """Step like a training loop (ask, commit) until a quorum satisfies ``done``."""
    for _ in range(steps):
        q = member.ask()
        if done(q):
            return q
        member.commit()
    raise AssertionError(f"{member.client.replica_id}: no such quorum in {steps} steps")


def wait_until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def raw(coord: Coordinator, method: str, path: str, body: bytes | None = None, token: str = "",
        **extra: str) -> tuple[int, bytes]:
    """One request on a fresh connection; ``extra`` headers (``Content_Type=...``) override."""
    conn = http.client.HTTPConnection("127.0.0.1", coord.port, timeout=5)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    headers.update({k.replace("_", "-"): v for k, v in extra.items()})
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def stable_status(coord: Coordinator, token: str = "") -> dict[str, Any]:
    status, body = raw(coord, "GET", "/status", token=token)
    assert status == 200
    data = json.loads(body)
    for m in data["members"]:
        m.pop("heartbeat_age_seconds")
    for d in data["dead"]:
        d.pop("seconds_ago")
    data.pop("charts", None)  # the dashboard's time series: they move with the clock
    return data


def test_members_get_the_same_quorum(start, groups) -> None:
    events = Events()
    coord = start(events)
    members = [groups(coord.url, f"g{i}") for i in range(3)]
    quorums = ask_all(members)
    assert len({q.quorum_id for q in quorums}) == 1
    # Each member gets its own compact answer of the same quorum: the shared part is
    # the same, its rank and data slice are its own; no answer lists the members.
    shared = [{k: v for k, v in q.to_json().items() if k not in ("replica_id", "rank", "participant_index")}
              for q in quorums]
    assert all(s == shared[0] for s in shared)
    assert [(q.replica_id, q.own_rank, q.index) for q in quorums] == [(f"g{i}:a", i, i) for i in range(3)]
    assert quorums[0].size == quorums[0].participant_count == 3 and quorums[0].store == ""
    assert "members" not in quorums[0].to_json() and "participant_ids" not in quorums[0].to_json()
    # The next step with the same members is answered at once and keeps the id.
    for m in members:
        m.step = 1
    again = ask_all(members)
    assert {q.quorum_id for q in again} == {quorums[0].quorum_id} and again[0].step == 1
    assert [f["quorum_id"] for f in events.of("quorum")] == [quorums[0].quorum_id]
    snapshot = coord.status_snapshot()  # the in-process view matches the endpoint
    assert snapshot["last_quorum"] == stable_status(coord)["last_quorum"]
    last = snapshot["last_quorum"]
    assert last["participants"] == ["g0:a", "g1:a", "g2:a"] and last["quorum_id"] == again[0].quorum_id
    assert last["members"][1]["meta"] == {"url": "http://g1"}


def test_hung_member_is_expired_and_survivors_get_a_higher_quorum(start, groups) -> None:
    events = Events()
    coord = start(events)
    g0, g1, g2 = (groups(coord.url, f"g{i}") for i in range(3))
    first = ask_all([g0, g1, g2])[0]
    g2.heartbeater.stop()  # g2 hangs: no more heartbeats, no more requests
    t0 = time.monotonic()
    survivors = ask_all([g0, g1])
    elapsed = time.monotonic() - t0
    assert elapsed < HB_TIMEOUT + MARGIN
    assert {q.quorum_id for q in survivors} == {first.quorum_id + 1}
    assert [q.size for q in survivors] == [2, 2]
    assert stable_status(coord)["last_quorum"]["participants"] == ["g0:a", "g1:a"]
    assert survivors[0].reason.startswith("fast path")
    dead = events.of("member_dead")
    assert dead == [{"group": "g2", "replica_id": "g2:a", "reason": "heartbeat timeout"}]
    answer = g0.client.heartbeat(0, survivors[0].quorum_id)
    assert "g2:a" in answer["dead"] and "alive" not in answer


def test_new_incarnation_replaces_the_old_one(start, groups) -> None:
    events = Events()
    coord = start(events)
    g0, old = groups(coord.url, "g0"), groups(coord.url, "g1", "old")
    first = ask_all([g0, old])[0]
    g0.commit()  # g0 commits its step: whatever the thread timing below, g1:new is behind it
    old.heartbeater.stop()
    new = groups(coord.url, "g1", "new")
    wait_until(lambda: any(m["replica_id"] == "g1:new" for m in stable_status(coord)["members"]))
    assert [m["replica_id"] for m in stable_status(coord)["members"]] == ["g0:a", "g1:new"]
    assert events.of("member_dead") == [{"group": "g1", "replica_id": "g1:old", "reason": "replaced by new incarnation"}]
    with pytest.raises(StaleIncarnation):
        old.client.heartbeat(0, first.quorum_id)
    with pytest.raises(StaleIncarnation):
        old.ask()
    # g0 keeps training; the new incarnation joins at one of its steps as a recovering member.
    with ThreadPoolExecutor(2) as pool:
        healthy = pool.submit(train_until, g0, lambda q: q.size == 2)
        joined = pool.submit(new.ask).result(timeout=10)
        source = healthy.result(timeout=10)
        assert (source.quorum_id, source.digest) == (joined.quorum_id, joined.digest)
    assert joined.quorum_id > first.quorum_id
    # The joiner's answer names its source (with its meta) and the participants its replay needs;
    # the source's names the joiner pulling from it.
    assert joined.participants == ["g0:a"] and joined.source_of("g1:new") == "g0:a"
    assert joined.member("g0:a").meta == {"url": "http://g0"} and joined.index is None
    assert [m.replica_id for m in source.joiners_of("g0:a")] == ["g1:new"] and source.index == 0


def test_restarted_coordinator_never_issues_a_lower_id(start, groups) -> None:
    first = start()
    members = [groups(first.url, f"g{i}") for i in range(2)]
    for _ in range(3):
        ask_all(members, failed=True)  # every failed commit bumps the id
    highest = members[0].quorum_id
    assert highest == 3
    for m in members:
        m.stop()
    first.stop()
    second = start()
    # The groups' first heartbeats tell the new coordinator the last id they knew.
    moved = [groups(second.url, f"g{i}", quorum_id=highest) for i in range(2)]
    quorums = ask_all(moved)
    assert {q.quorum_id for q in quorums} == {highest + 1}


def test_long_poll_times_out_with_the_reason_and_withdraws_the_request(start, groups) -> None:
    coord = start(min_replicas=2, expected_groups=1)  # the one group reported: no rebuild wait
    g0 = groups(coord.url, "g0")
    with pytest.raises(QuorumTimeout, match="need min_replicas=2"):
        g0.ask(timeout=0.2)
    assert [m["pending"] for m in stable_status(coord)["members"]] == [False]


def test_stop_answers_waiting_long_polls(start, groups) -> None:
    coord = start(min_replicas=2)
    g0 = groups(coord.url, "g0")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(g0.ask, timeout=30)
        wait_until(lambda: stable_status(coord)["members"][0]["pending"])
        t0 = time.monotonic()
        coord.stop()
        with pytest.raises(CoordinatorUnavailable):
            waiting.result(timeout=10)
        assert time.monotonic() - t0 < 5


def test_token_required_everywhere_and_refusals_change_nothing(start, groups) -> None:
    coord = start(token="s3cret")
    g0 = groups(coord.url, "g0", token="s3cret")
    ask_all([g0])
    wait_until(lambda: stable_status(coord, token="s3cret")["reason"] == "no member has asked for a quorum")
    before = stable_status(coord, token="s3cret")
    hb = json.dumps({"group": "g9", "incarnation": "x", "step": 0, "quorum_id": 0}).encode()
    for method, path, body in [
        ("POST", "/v1/heartbeat", hb),
        ("POST", "/v1/quorum", hb),
        ("GET", "/status", None),
        ("GET", "/metrics", None),
        ("GET", "/", None),
    ]:
        assert raw(coord, method, path, body)[0] == 401
        assert raw(coord, method, path, body, token="wrong")[0] == 401
    assert stable_status(coord, token="s3cret") == before  # g0 keeps heartbeating; ages are left out


def test_oversize_and_malformed_requests_are_refused_and_change_nothing(start, groups) -> None:
    coord = start(max_request_bytes=2048)
    g0 = groups(coord.url, "g0")
    ask_all([g0])
    wait_until(lambda: stable_status(coord)["reason"] == "no member has asked for a quorum")
    before = stable_status(coord)
    big = json.dumps({"group": "g1", "incarnation": "a", "step": 0, "quorum_id": 0, "pad": "x" * 4096}).encode()
    assert raw(coord, "POST", "/v1/heartbeat", big)[0] == 413
    conn = http.client.HTTPConnection("127.0.0.1", coord.port, timeout=5)
    try:  # without a Content-Length the limit holds as the body streams in
        conn.request("POST", "/v1/heartbeat", body=iter([big[:1500], big[1500:]]), encode_chunked=True,
                     headers={"Content-Type": "application/json"})
        assert conn.getresponse().status == 413
    finally:
        conn.close()
    good = {"group": "g1", "incarnation": "a", "step": 0, "last_quorum_id": 0, "failed": False, "meta": {}, "timeout": 1}
    bad_bodies = [
        b"{not json",
        b"\xff\xfe",
        b"[1, 2]",
        json.dumps({k: v for k, v in good.items() if k != "step"}).encode(),
        json.dumps({**good, "step": "3"}).encode(),
        json.dumps({**good, "step": -1}).encode(),
        json.dumps({**good, "failed": "no"}).encode(),
        json.dumps({**good, "meta": [1]}).encode(),
        json.dumps({**good, "timeout": 0}).encode(),
        json.dumps({**good, "group": "g1:x"}).encode(),
        json.dumps({**good, "incarnation": ""}).encode(),
    ]
    for body in bad_bodies:
        status, answer = raw(coord, "POST", "/v1/quorum", body)
        assert status == 400, body
        assert json.loads(answer)["error"]
    assert raw(coord, "POST", "/v1/heartbeat", b'{"group": "g1"}')[0] == 400
    assert stable_status(coord) == before
    assert raw(coord, "GET", "/status")[0] == 200  # still serving


def test_metrics_parse_and_use_the_ftlm_vocabulary(start, groups) -> None:
    coord = start()
    members = [groups(coord.url, f"g{i}") for i in range(2)]
    ask_all(members)
    status, body = raw(coord, "GET", "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for name in [
        "ftlm_coordinator_quorum_id",
        "ftlm_coordinator_members",
        "ftlm_coordinator_heartbeat_age_seconds",
        "ftlm_coordinator_quorums_issued",
        "ftlm_coordinator_member_failures",
        "ftlm_coordinator_quorum_latency_seconds",
    ]:
        assert name in families, name
    assert all(name.startswith("ftlm_coordinator_") for name in families)
    for family in families.values():
        for sample in family.samples:
            assert set(sample.labels) - {"le"} <= {"job", "group", "rank"}
    assert families["ftlm_coordinator_quorum_id"].samples[0].value == 1
    ages = {s.labels["group"] for s in families["ftlm_coordinator_heartbeat_age_seconds"].samples}
    assert ages == {"g0", "g1"}


def test_status_page_is_html_naming_the_members(start, groups) -> None:
    coord = start()
    members = [groups(coord.url, "g0"), groups(coord.url, "g1", "b2")]
    ask_all(members)
    status, body = raw(coord, "GET", "/")
    page = body.decode()
    assert status == 200 and page.lstrip().lower().startswith("<!doctype html>")
    assert "g0:a" in page and "g1:b2" in page and "participant" in page


def test_serve_forever_prints_its_url_and_stops_on_sigterm() -> None:
    code = (
        "from ftlm.ft.config import CoordinatorConfig\n"
        "from ftlm.ft.coordinator import Coordinator\n"
        "Coordinator(CoordinatorConfig()).serve_forever()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert select.select([proc.stdout], [], [], 30)[0], "no URL printed"
        line = proc.stdout.readline()
        url = line.split("listening on ", 1)[1].split()[0]
        client = CoordinatorClient(url, "g0", "a")
        assert client.heartbeat(0, 0)["dead"] == []
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()


# ------------------------------------------------------------------------------- malformed bodies


def test_every_malformed_body_is_a_one_line_400_and_changes_nothing(start, groups) -> None:
    # A long heartbeat timeout: on a loaded machine g0's heartbeat may lag, and an expiry during
    # the test would be a change that no malformed body made.
    coord = start(heartbeat_timeout=30.0, expected_groups=1)
    g0 = groups(coord.url, "g0")
    ask_all([g0])
    wait_until(lambda: stable_status(coord)["reason"] == "no member has asked for a quorum")
    before = stable_status(coord)
    hb = '{"group": "g1", "incarnation": "a", "step": 0, "quorum_id": 0'
    q = ('{"group": "g1", "incarnation": "a", "step": 0, "last_quorum_id": 0, "failed": false, '
         '"timeout": 1, "meta": ')
    cases = {
        "/v1/heartbeat": [
            b"[" * 30_000 + b"]" * 30_000,  # was a RecursionError and a 500
            b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
            (hb + ', "meta": ' + "[" * 40 + "]" * 40 + "}").encode(),  # deeper than MAX_DEPTH
            (hb + ', "progress_age": 1e999}').encode(),
            (hb + ', "progress_age": NaN}').encode(),
            (hb + ', "progress_age": Infinity}').encode(),
            (hb.replace('"step": 0', '"step": ' + "9" * 5000) + "}").encode(),  # beyond int parsing
            (hb + ', "step": 1}').encode(),  # a key given twice
            (hb + "}").encode("utf-16"),  # valid JSON, not UTF-8
            b"\xef\xbb\xbf" + (hb + "}").encode(),  # a BOM
            (hb + ', "chain": ["x"]}').encode(),
            (hb + ', "known_head": true}').encode(),
        ],
        "/v1/quorum": [
            (q + '{"x": NaN}}').encode(),
            (q + '{"x": -Infinity}}').encode(),
            (q + '{"x": 1e400}}').encode(),
            (q + '{"x": 1}, "timeout": 2}').encode(),
            (q + "[" * 30 + "]" * 30 + "}").encode(),
        ],
        "/v1/leave": [b'{"group": "g1", "incarnation": "a", "reason": "done\\nERROR forged log line"}',
                      b'{"group": "g1", "incarnation": "a", "reason": "\\ud800"}',
                      b'{"group": "g1", "incarnation": "a", "reason": 7}',
                      b'{"group": "g1", "incarnation": "a", "reason": "finished", "step": -1}',
                      b'{"group": "g1", "incarnation": "a", "reason": "finished", "step": 3, "chain": "xyz"}'],
        "/v1/dead": [b'{"group": "g1", "incarnation": ["a"]}', b'{"group": {"$ne": null}}'],
        "/v1/kill": [b'{"group": 1e999}', b'{"group": "g0", "group": "g1"}', b"null", b'"g0"'],
    }
    for path, bodies in cases.items():
        for body in bodies:
            status, answer = raw(coord, "POST", path, body)
            assert status == 400, (path, body[:80], answer[:200])
            error = json.loads(answer)["error"]
            assert error and "\n" not in error and len(error) < 300, error
    assert stable_status(coord) == before
    assert "kill" not in g0.client.heartbeat(0, 0)


# ---------------------------------------------------------------------- origin, content type, token


def test_non_loopback_bind_without_a_token_is_refused_unless_insecure() -> None:
    for host in ("0.0.0.0", "::", "10.1.2.3", "coordinator.example"):
        with pytest.raises(ConfigError, match="--insecure") as info:
            CoordinatorConfig(host=host)
        assert "FTLM_TOKEN" in str(info.value) and "\n" not in str(info.value)
        assert CoordinatorConfig(host=host, token="t").host == host
        assert CoordinatorConfig(host=host, insecure=True).insecure
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert CoordinatorConfig(host=host).host == host


def test_coordinator_command_refuses_all_interfaces_without_a_token(monkeypatch, capsys) -> None:
    from ftlm.cli import main

    monkeypatch.delenv("FTLM_TOKEN", raising=False)
    assert main(["coordinator", "--host", "0.0.0.0", "--port", "0"]) == 2  # refused before binding
    out = capsys.readouterr()
    assert out.err.startswith("ftlm: error: coordinator.host='0.0.0.0'") and "--insecure" in out.err
    assert out.err.count("\n") == 1 and "listening" not in out.out


def test_all_interfaces_are_described_by_every_address() -> None:
    line = describe_address("http", "0.0.0.0", 29510, ["node7", "10.0.0.5"])
    assert line == "all interfaces (0.0.0.0) port 29510: http://127.0.0.1:29510, http://node7:29510, http://10.0.0.5:29510"
    assert describe_address("https", "::", 1, ["fd00::5"]) == "all interfaces (::) port 1: https://[::1]:1, https://[fd00::5]:1"
    assert describe_address("http", "10.0.0.5", 80) == "http://10.0.0.5:80"
    assert "all interfaces" in describe_address("http", "0.0.0.0", 1)  # this machine's own addresses


def test_state_changing_posts_need_json_and_the_same_origin(start, groups) -> None:
    coord = start(token="s3cret")
    g0 = groups(coord.url, "g0", token="s3cret")
    kill = json.dumps({"group": "g0"}).encode()
    # What a page on another site can send without a CORS preflight: refused, nothing killed.
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        assert raw(coord, "POST", "/v1/kill", kill, token="s3cret", Content_Type=content_type)[0] == 415
    conn = http.client.HTTPConnection("127.0.0.1", coord.port, timeout=5)
    try:  # no Content-Type at all
        conn.request("POST", "/v1/kill", body=kill, headers={"Authorization": "Bearer s3cret"})
        assert conn.getresponse().status == 415
    finally:
        conn.close()
    for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"},
                    {"Origin": f"http://127.0.0.1:{coord.port + 1}"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Sec-Fetch-Site": "same-site"}):
        extra = {k.replace("-", "_"): v for k, v in headers.items()}
        status, body = raw(coord, "POST", "/v1/kill", kill, token="s3cret", **extra)
        assert status == 403 and "only the coordinator's own page" in json.loads(body)["error"], headers
    assert raw(coord, "GET", "/status", token="s3cret", Origin="http://evil.example")[0] == 403
    assert "kill" not in g0.client.heartbeat(0, 0)
    # The dashboard's own request: same origin, JSON, the token.
    status, body = raw(coord, "POST", "/v1/kill", kill, token="s3cret", Origin=coord.url,
                       Sec_Fetch_Site="same-origin")
    assert status == 200 and json.loads(body)["replica_ids"] == ["g0:a"]
    assert g0.client.heartbeat(0, 0)["kill"] is True


def test_loopback_coordinator_answers_only_loopback_host_names(start) -> None:
    """A page that rebinds its own DNS name to 127.0.0.1 reaches the port but names itself in Host."""
    coord = start()
    assert raw(coord, "GET", "/status", Host=f"evil.example:{coord.port}")[0] == 403
    assert raw(coord, "POST", "/v1/kill", b'{"group": "g0"}', Host="evil.example")[0] == 403
    for host in (f"localhost:{coord.port}", f"127.0.0.1:{coord.port}", "[::1]:8080", "localhost"):
        assert raw(coord, "GET", "/status", Host=host)[0] == 200, host


# ------------------------------------------------------------ connections: deadline, cap, logging


def connect(coord: Coordinator) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", coord.port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def closed_by_server(s: socket.socket, timeout: float) -> bytes | None:
    """What the server sent before closing ``s`` within ``timeout`` s; None if it stayed open."""
    s.settimeout(timeout)
    got = b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except (TimeoutError, socket.timeout):
        return None
    except ConnectionResetError:
        pass
    return got


def test_slowloris_headers_are_cut_off_after_the_read_timeout(start) -> None:
    coord = start(read_timeout=0.5)
    s = connect(coord)
    try:
        s.sendall(b"POST /v1/heartbeat HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        t0 = time.monotonic()
        closed = False
        while time.monotonic() - t0 < 0.5 + MARGIN + 2:  # one header byte every 50 ms: never done
            try:
                s.sendall(b"X")
            except OSError:
                closed = True
                break
            if closed_by_server(s, 0.05) is not None:
                closed = True
                break
        assert closed, "a connection trickling its headers was never closed"
        assert time.monotonic() - t0 < 0.5 + MARGIN + 1
    finally:
        s.close()
    wait_until(lambda: coord.open_connections == 0)


def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_closes(start) -> None:
    coord = start(read_timeout=0.5)
    s = connect(coord)
    try:
        s.sendall(b"POST /v1/heartbeat HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"group\": ")
        answer = closed_by_server(s, 0.5 + MARGIN + 2)
        assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
    finally:
        s.close()
    assert stable_status(coord)["members"] == []


def test_idle_connections_are_closed_and_a_heartbeat_gets_through_hundreds_of_them(start) -> None:
    coord = start(read_timeout=1.0)
    idle = [connect(coord) for _ in range(300)]
    try:
        wait_until(lambda: coord.open_connections == 300)
        client = CoordinatorClient(coord.url, "g0", "a", timeout=2.0)
        try:
            t0 = time.monotonic()
            assert client.heartbeat(0, 0)["dead"] == []
            assert time.monotonic() - t0 < MARGIN
        finally:
            client.close()
        wait_until(lambda: coord.open_connections == 0, timeout=1.0 + MARGIN + 3)
        assert all(closed_by_server(s, 1.0) is not None for s in idle[:10])
    finally:
        for s in idle:
            s.close()


def test_connections_beyond_the_cap_are_refused_while_members_keep_beating(start, groups) -> None:
    coord = start(max_connections=16, read_timeout=60.0)
    answers: list[dict] = []
    member = groups(coord.url, "g0")
    member.heartbeater.on_answer = answers.append
    wait_until(lambda: len(answers) >= 2)  # its thread holds a keep-alive connection
    member.client._drop_connection()  # the main thread's connection from the first beat
    wait_until(lambda: coord.open_connections == 1)
    flood = [connect(coord) for _ in range(40)]
    try:
        wait_until(lambda: coord.open_connections == 16)
        answered: set[socket.socket] = set()  # the refused: 503 and closed at once

        def refused() -> int:
            ready, _, _ = select.select([s for s in flood if s not in answered], [], [], 0.05)
            answered.update(ready)
            return len(answered)

        wait_until(lambda: refused() == 40 - 15)
        for s in answered:
            got = closed_by_server(s, 1.0)
            assert got is not None and got.startswith(b"HTTP/1.1 503 "), got
        assert coord.open_connections == 16  # the 15 admitted ones are still open and idle
        late = connect(coord)
        got = closed_by_server(late, 2.0)
        late.close()
        assert got is not None and (got == b"" or got.startswith(b"HTTP/1.1 503")), got
        n = len(answers)
        wait_until(lambda: len(answers) >= n + 5)  # the member's heartbeats keep getting through
        assert member.heartbeater.failures == 0
    finally:
        for s in flood:
            s.close()
    wait_until(lambda: coord.open_connections == 1)
    fresh = CoordinatorClient(coord.url, "g1", "a", timeout=2.0)
    try:
        assert fresh.heartbeat(0, 0)["dead"] == []
    finally:
        fresh.close()


def test_bad_connections_are_summarised_in_one_log_line_per_interval(start, caplog) -> None:
    coord = start(token="s3cret", read_timeout=0.5)
    coord.abuse.interval = 60.0
    caplog.clear()
    caplog.set_level(logging.DEBUG)
    for i in range(150):
        s = connect(coord)
        try:
            s.sendall([b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",  # aiohttp: a traceback each
                       b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(40),  # TLS to a plain port
                       b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"][i % 3])
            assert closed_by_server(s, 5) is not None
        finally:
            s.close()
    # The first problem is reported at once; the rest wait for the interval (flushed here).
    wait_until(lambda: any("refused in the last" in r.getMessage() for r in caplog.records), timeout=5)
    coord.call_in_loop(lambda: coord.abuse.flush(force=True))
    noisy = [r for r in caplog.records if r.name.startswith(("aiohttp", "asyncio", "ftlm.ft"))]
    assert 1 <= len(noisy) <= 2, [r.getMessage()[:200] for r in noisy[:5]]
    counts: dict[str, int] = {}
    for r in noisy:
        line = r.getMessage()
        assert line.startswith("refused in the last") and "\n" not in line and len(line) < 1000, line
        for what, n in re.findall(r"(?:: |; )([^;:(]+?) x(\d+)", line):
            counts[what] = counts.get(what, 0) + int(n)
    assert counts == {"malformed HTTP": 100, "HTTP 401": 50}, counts


# ---------------------------------------------------------------------------- answers stay small


def test_status_and_heartbeat_answers_stay_small_with_20k_groups(caplog) -> None:
    """20,000 heartbeating groups, a quorum of all of them, then half of them dead: the deaths
    come from the state machine's own expiry. The members and the quorum are written into its
    state directly (its tables keep their index up to date), which keeps the test about the
    answers' sizes rather than about recording."""
    caplog.set_level(logging.ERROR)  # 10,000 "member is dead" lines
    coord = Coordinator(CoordinatorConfig(heartbeat_timeout=5.0))
    m, n, now = coord.membership, 20_000, 1000.0
    rids = [f"g{i:05d}:a" for i in range(n)]
    for rid in rids:
        m.state.heartbeats[rid] = Heartbeat(rid, rid[:6], now, 0)
    coord._apply(m.tick(now))  # a fresh job: the head is step 0
    meta = {"store": "10.0.0.1:29500", "transfer": ["http://10.0.0.1:29600"]}
    up, behind = rids[: 3 * n // 4], rids[3 * n // 4:]
    quorum = Quorum(1, 0, [Member(r, r[:6], 0, meta) for r in rids], up, behind,
                    {r: up[i % len(up)] for i, r in enumerate(behind)}, now, "synthetic", GENESIS, m.state.epoch)
    commit_quorum(m.state, quorum)
    coord._apply([Issued(quorum, 0.0, True)])
    for rid in rids[::2]:  # the even groups keep heartbeating; the odd ones fall silent
        m.state.heartbeats[rid] = Heartbeat(rid, rid[:6], now + 4.0, 0)
    coord._apply(m.tick(now + 6.0))
    assert len(m.recent_dead(now + 6.0)) == n // 2

    status = coord._status_now(now=now + 6.0)
    size = len(json.dumps(status))
    assert size < 1_000_000, size
    assert len(status["members"]) == STATUS_LIMIT and status["members_total"] == n // 2
    assert status["next_offset"] == STATUS_LIMIT
    assert len(status["dead"]) == MAX_DEAD_LISTED and status["dead_total"] == n // 2
    last = status["last_quorum"]
    assert last["truncated"] and last["participants_total"] == len(up) and last["recovering_total"] == len(behind)
    assert max(len(last[k]) for k in ("members", "participants", "recovering", "sources")) <= STATUS_LIMIT
    assert [(len(q["participants"]), q["participants_total"]) for q in status["quorums"]] == [(20, len(up))]
    assert len(status["recoveries"]) <= 50
    assert {"members", "dead", "last_quorum", "quorum_id", "reason"} <= set(status)
    page = coord._status_now(offset=(n // 2) - 10, now=now + 6.0)
    assert len(page["members"]) == 10 and page["next_offset"] is None
    assert page["members"][-1]["state"] == "recovering" and page["members"][-1]["source"] in up
    assert len(render_page(status)) < 1_200_000  # GET / embeds the same bounded status

    answer, _ = m.heartbeat(now + 6.0, Heartbeat(rids[0], rids[0][:6], now + 6.0, 0))
    assert len(answer["dead"]) == MAX_DEAD_LISTED and len(json.dumps(answer)) < 16 * 1024


def test_status_pages_through_the_members(start, groups) -> None:
    coord = start()
    for i in range(5):
        groups(coord.url, f"g{i}")
    seen, offset = [], 0
    while offset is not None:
        status, body = raw(coord, "GET", f"/status?offset={offset}&limit=2")
        assert status == 200
        page = json.loads(body)
        assert len(page["members"]) <= 2 and page["members_total"] == 5
        seen += [m["group"] for m in page["members"]]
        offset = page["next_offset"]
    assert seen == [f"g{i}" for i in range(5)]
    for bad in ("offset=-1", "limit=0", f"limit={STATUS_LIMIT + 1}", "offset=x", "limit=1e3"):
        status, body = raw(coord, "GET", f"/status?{bad}")
        assert status == 400 and "must be an integer" in json.loads(body)["error"], bad


def test_peers_reports_expire_a_silent_member_long_before_its_heartbeat_times_out(start, groups) -> None:
    """Without a supervisor: g2 dies mid-step (its heartbeats stop); g0 and g1 report the
    failed step with their next request and get a quorum without g2 within the suspect window,
    not after the 3 s heartbeat timeout. A member that still heartbeats is never expired by them."""
    events = Events()
    coord = start(events, heartbeat_timeout=3.0, suspect_window=0.3)
    g0, g1, g2, g3 = (groups(coord.url, f"g{i}") for i in range(4))
    first = ask_all([g0, g1, g2, g3])[0]
    g2.heartbeater.stop()  # g2 is gone; g3 lives (heartbeats) but is slow to ask
    t0 = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        survivors = [pool.submit(g.ask, failed=True) for g in (g0, g1)]
        time.sleep(1.0)  # g3 asks a second later, still within its own heartbeats
        survivors.append(pool.submit(g3.ask))
        quorums = [f.result(timeout=10) for f in survivors]
    elapsed = time.monotonic() - t0
    assert elapsed < 3.0 - 0.5, elapsed  # before the heartbeat timeout
    assert {q.quorum_id for q in quorums} == {first.quorum_id + 1} and quorums[0].size == 3
    dead = events.of("member_dead")
    assert [d["replica_id"] for d in dead] == ["g2:a"] and "reported the step" in dead[0]["reason"]


def test_a_leave_says_the_state_it_finished_at(start, groups) -> None:
    """A finished group's leave carries its final state (``ManagerClient.leave(reason, at)``):
    the coordinator counts it as finished there even if its last heartbeat was a step older."""
    coord = start(heartbeat_timeout=30.0, expected_groups=1)
    g0 = groups(coord.url, "g0")
    ask_all([g0])
    final = (7, "e" * 64)
    g0.heartbeater.stop()  # as ``Manager.leave`` does
    g0.client.leave("finished", final)
    wait_until(lambda: coord.membership._finished_at.get("g0") == final)
