"""The coordinator's live dashboard (rendered in headless Chromium) and its chaos kill endpoint."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from ftlm import native
from ftlm.ft.client import CoordinatorClient, Heartbeater
from ftlm.ft.config import CoordinatorConfig
from ftlm.ft.coordinator import Coordinator
from ftlm.ft.dashboard import HISTORY, NAMES_KEPT, DashboardLog, render_page
from ftlm.ft.quorum import Quorum

TOKEN = "s3cret"


class Member:
    """A group leader heartbeating with an ``on_kill`` callback."""

    def __init__(self, url: str, group: str, incarnation: str = "a") -> None:
        self.client = CoordinatorClient(url, group, incarnation, token=TOKEN, timeout=2.0)
        self.killed = threading.Event()
        self.heartbeater = Heartbeater(self.client, 0.05, lambda: (0, 0), on_kill=self.killed.set)
        self.heartbeater.beat()
        self.heartbeater.start()

    def stop(self) -> None:
        self.heartbeater.stop()
        self.client.close()


@pytest.fixture
def job() -> Iterator[tuple[Coordinator, list[Member]]]:
    coord = Coordinator(CoordinatorConfig(token=TOKEN, heartbeat_timeout=2.0, join_timeout=2.0, expected_groups=2))
    coord.start()
    members = [Member(coord.url, "g0"), Member(coord.url, "g1", "b7")]
    try:
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(m.client.quorum, 0, 0, False, {}, 10.0) for m in members]:
                f.result(timeout=15)
        yield coord, members
    finally:
        for m in members:
            m.stop()
        coord.stop()


def request(coord: Coordinator, method: str, path: str, body: Any = None, token: str = "") -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", coord.port, timeout=5)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def test_kill_needs_the_token_and_reaches_only_the_named_group(job) -> None:
    coord, (g0, g1) = job
    assert request(coord, "POST", "/v1/kill", {"group": "g0"})[0] == 401
    assert request(coord, "POST", "/v1/kill", {"group": "g0"}, token="wrong")[0] == 401
    assert "kill" not in g0.client.heartbeat(0, 0) and not g0.killed.is_set()
    assert request(coord, "POST", "/v1/kill", {"group": "nope"}, token=TOKEN)[0] == 404
    assert request(coord, "POST", "/v1/kill", {"group": "g0:a"}, token=TOKEN)[0] == 400
    status, body = request(coord, "POST", "/v1/kill", {"group": "g0"}, token=TOKEN)
    assert status == 200 and json.loads(body) == {"group": "g0", "replica_ids": ["g0:a"]}
    assert g0.killed.wait(5), "on_kill was not called from the heartbeat thread"
    assert g0.client.heartbeat(0, 0)["kill"] is True  # every answer says so until the replica is gone
    assert "kill" not in g1.client.heartbeat(0, 0) and not g1.killed.is_set() and g0.heartbeater.killed
    kills = json.loads(request(coord, "GET", "/status", token=TOKEN)[1])["kills"]
    assert [(k["group"], k["replica_ids"]) for k in kills] == [("g0", ["g0:a"])]
    metrics = request(coord, "GET", "/metrics", token=TOKEN)[1]
    assert re.search(r"^ftlm_coordinator_kill_requests_total 1\.0$", metrics, re.M)
    # The restarted incarnation is not the one marked: it is not told to die.
    g0.stop()
    fresh = CoordinatorClient(coord.url, "g0", "new", token=TOKEN)
    try:
        assert "kill" not in fresh.heartbeat(0, 0)
    finally:
        fresh.close()


def test_status_lists_states_incarnations_and_quorum_history(job) -> None:
    coord, _ = job
    status = json.loads(request(coord, "GET", "/status", token=TOKEN)[1])
    assert [(m["group"], m["incarnation"], m["state"]) for m in status["members"]] == [
        ("g0", "a", "participating"), ("g1", "b7", "participating")]
    assert [(q["quorum_id"], q["participants"]) for q in status["quorums"]] == [(1, ["g0:a", "g1:b7"])]
    assert status["convicted"] == [] and status["hot_path"] == native.STATUS
    coord.call_in_loop(lambda: coord._state.convicted.update({"g1": 2, "g0": 1}), 5.0)
    status = json.loads(request(coord, "GET", "/status", token=TOKEN)[1])
    assert status["convicted"] == [{"group": "g1", "times": 2}, {"group": "g0", "times": 1}]  # the latest last
    metrics = request(coord, "GET", "/metrics", token=TOKEN)[1]
    assert re.search(r"^ftlm_coordinator_members_participating 2\.0$", metrics, re.M)
    assert re.search(r"^ftlm_coordinator_members_joining 0\.0$", metrics, re.M)


def test_page_without_the_token_is_refused_and_shows_no_data(job) -> None:
    coord, _ = job
    status, page = request(coord, "GET", "/")
    assert status == 401 and page.startswith("<!doctype html>")
    assert "g0:a" not in page and "const initial = null;" in page
    status, page = request(coord, "GET", "/", token=TOKEN)
    assert status == 200 and '"replica_id": "g0:a"' in page


def test_the_pages_kill_button_sends_what_the_coordinator_accepts(job) -> None:
    """The button's request as the script builds it: POST, JSON, the token, from the page's origin
    (a browser adds Origin and Sec-Fetch-Site); the coordinator refuses any other shape."""
    coord, (g0, _) = job
    script = render_page(None)
    assert 'fetch("/v1/kill", {method: "POST", headers: headers(), body: JSON.stringify({group})})' in script
    assert '{"Content-Type": "application/json"}' in script and 'h["Authorization"] = "Bearer " + t' in script
    browser = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}", "Origin": coord.url,
               "Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors", "Host": coord.url.split("//")[1]}
    conn = http.client.HTTPConnection("127.0.0.1", coord.port, timeout=5)
    try:
        conn.request("POST", "/v1/kill", body=json.dumps({"group": "g0"}), headers=browser)
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["replica_ids"] == ["g0:a"]
    finally:
        conn.close()
    assert g0.killed.wait(5)


def test_dashboard_log_lists_a_bounded_number_of_names() -> None:
    log = DashboardLog()
    many = [f"g{i:03d}:a" for i in range(300)]
    log.quorum_issued(Quorum(1, 0, [], many[:200], many[200:], {r: many[0] for r in many[200:]}, 0.0, "r"))
    q = log.to_json()["quorums"][0]
    assert (len(q["participants"]), q["participants_total"]) == (NAMES_KEPT, 200)
    assert (len(q["recovering"]), q["recovering_total"]) == (NAMES_KEPT, 100)
    assert len(log.to_json()["recoveries"]) == HISTORY
    recoveries = [r["replica_id"] for r in log.to_json()["recoveries"]]
    assert (recoveries[0], recoveries[-1]) == ("g299:a", "g250:a")  # the newest kept, newest first


def _quorum(qid: int, step: int, recovering: list[str] = ()) -> Quorum:
    return Quorum(qid, step, [], ["g0:a"], list(recovering), {r: "g0:a" for r in recovering}, 0.0, "r")


def test_dashboard_log_keeps_the_latest_distinct_quorums_newest_first() -> None:
    log = DashboardLog()
    log.quorum_issued(_quorum(1, 0), unix=10.0)
    log.quorum_issued(_quorum(1, 1), unix=11.0)  # same quorum, next step
    log.quorum_issued(_quorum(2, 2, ["g1:b"]), unix=12.0)
    view = log.to_json()
    assert [(q["quorum_id"], q["step"], q["last_step"]) for q in view["quorums"]] == [(2, 2, 2), (1, 0, 1)]
    assert view["recoveries"] == [{"replica_id": "g1:b", "source": "g0:a", "step": 2, "quorum_id": 2, "unix": 12.0}]
    for qid in range(3, 3 + 2 * HISTORY):
        log.quorum_issued(_quorum(qid, qid))
    ids = [q["quorum_id"] for q in log.to_json()["quorums"]]
    assert len(ids) == HISTORY and ids[0] == 2 + 2 * HISTORY and ids == sorted(ids, reverse=True)


# ------------------------------------------------------------------------------ real browser


class _Cells(HTMLParser):
    """Text of each row of the table with id ``members``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._in_table = self._in_body = False
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._in_table = dict(attrs).get("id") == "members"
        elif tag == "tbody" and self._in_table:
            self._in_body = True
        elif tag == "tr" and self._in_body:
            self.rows.append([])
        elif tag == "td" and self._in_body:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._in_table = self._in_body = False

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def chromium(binary: str, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'chromium-profile'}", "--window-size=1200,800"]
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=60)


def test_dashboard_renders_both_groups_in_headless_chromium(job, tmp_path) -> None:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("chromium not installed (Debian package 'chromium'; `make system-deps` installs it)")
    coord, _ = job
    # Plain navigation sends no header: the page arrives as a 401 without data, so the members can
    # only appear if the script read the token from the fragment and fetched /status with it.
    url = f"{coord.url}/#token={TOKEN}"
    out = chromium(binary, tmp_path, "--virtual-time-budget=5000", "--dump-dom", url)
    assert out.returncode == 0, out.stderr[-2000:]
    cells = _Cells()
    cells.feed(out.stdout)
    rows = {r[0]: r for r in cells.rows}
    assert set(rows) == {"g0", "g1"}, out.stdout[-3000:]
    assert rows["g0"][1:3] == ["a", "participating"] and rows["g1"][1:3] == ["b7", "participating"]
    assert float(rows["g0"][4]) < 2.0  # heartbeat age, fresh
    assert rows["g0"][7] == "kill"
    assert "quorum id 1" in out.stdout and "g0:a, g1:b7" in out.stdout  # summary and quorum history
    assert f"hot path {native.STATUS}" in out.stdout
    shot = tmp_path / "dash.png"
    out = chromium(binary, tmp_path, "--virtual-time-budget=5000", f"--screenshot={shot}", url)
    assert out.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", out.stderr[-2000:]
    assert shot.stat().st_size > 10_000
    print(f"dashboard screenshot: {shot}")
