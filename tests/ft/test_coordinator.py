"""The coordinator server on port 0, driven by the real client and by raw HTTP."""

from __future__ import annotations

import http.client
import json
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftlm.ft.client import CoordinatorClient, CoordinatorUnavailable, Heartbeater, QuorumTimeout
from ftlm.ft.config import CoordinatorConfig
from ftlm.ft.coordinator import Coordinator
from ftlm.ft.history import GENESIS
from ftlm.ft.quorum import Quorum, StaleIncarnation

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

    def __init__(self, url: str, group: str, incarnation: str = "a", token: str = "") -> None:
        self.client = CoordinatorClient(url, group, incarnation, token=token, timeout=2.0)
        self.step, self.quorum_id, self.chain = 0, 0, GENESIS
        self.heartbeater = Heartbeater(self.client, HB_INTERVAL,
                                       lambda: (self.step, self.quorum_id, self.chain, 0.0))
        # Register before returning, so that groups made one after another all count as heartbeating
        # when they first ask (otherwise the first to ask may rightly form a quorum alone).
        self.heartbeater.beat()
        self.heartbeater.start()

    def ask(self, failed: bool = False, timeout: float = 5.0) -> Quorum:
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

    def _make(url: str, name: str, incarnation: str = "a", token: str = "") -> Group:
        g = Group(url, name, incarnation, token)
        made.append(g)
        return g

    yield _make
    for g in made:
        g.stop()


def ask_all(members: list[Group], **kw: Any) -> list[Quorum]:
    with ThreadPoolExecutor(len(members)) as pool:
        futures = [pool.submit(m.ask, **kw) for m in members]
        return [f.result(timeout=10) for f in futures]


def train_until(member: Group, done: Callable[[Quorum], bool], steps: int = 200) -> Quorum:
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


def raw(coord: Coordinator, method: str, path: str, body: bytes | None = None, token: str = "") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", coord.port, timeout=5)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
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
    return data


def test_members_get_the_same_quorum(start, groups) -> None:
    events = Events()
    coord = start(events)
    members = [groups(coord.url, f"g{i}") for i in range(3)]
    quorums = ask_all(members)
    assert len({q.quorum_id for q in quorums}) == 1
    assert all(q == quorums[0] for q in quorums)
    assert quorums[0].participants == ["g0:a", "g1:a", "g2:a"]
    assert quorums[0].member("g1:a").meta == {"url": "http://g1"}
    # The next step with the same members is answered at once and keeps the id.
    for m in members:
        m.step = 1
    again = ask_all(members)
    assert {q.quorum_id for q in again} == {quorums[0].quorum_id} and again[0].step == 1
    assert [f["quorum_id"] for f in events.of("quorum")] == [quorums[0].quorum_id]
    snapshot = coord.status_snapshot()  # the in-process view matches the endpoint
    assert snapshot["last_quorum"] == stable_status(coord)["last_quorum"] == again[0].to_json()


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
    assert survivors[0].replica_ids() == ["g0:a", "g1:a"]
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
        healthy = pool.submit(train_until, g0, lambda q: "g1:new" in q.replica_ids())
        joined = pool.submit(new.ask).result(timeout=10)
        assert healthy.result(timeout=10) == joined
    assert joined.quorum_id > first.quorum_id
    assert joined.participants == ["g0:a"] and joined.sources == {"g1:new": "g0:a"}


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
    moved = [groups(second.url, f"g{i}") for i in range(2)]
    for m in moved:
        m.quorum_id = highest
    quorums = ask_all(moved)
    assert {q.quorum_id for q in quorums} == {highest + 1}


def test_long_poll_times_out_with_the_reason_and_withdraws_the_request(start, groups) -> None:
    coord = start(min_replicas=2)
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
        conn.request("POST", "/v1/heartbeat", body=iter([big[:1500], big[1500:]]), encode_chunked=True)
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
