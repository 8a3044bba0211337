"""The coordinator client and its heartbeat thread, against a real coordinator on port 0."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ftlm.errors import ConfigError
from ftlm.ft.client import (CoordinatorClient, CoordinatorUnavailable, CoordinatorUnreachable, Heartbeater,
                            QuorumTimeout)
from ftlm.ft.config import CoordinatorConfig, FTConfig
from ftlm.ft.coordinator import Coordinator
from ftlm.ft.quorum import FAILS_ITS_STEPS, Convicted, StaleIncarnation, remove_member


@pytest.fixture
def start() -> Iterator[Callable[..., Coordinator]]:
    started: list[Coordinator] = []

    def _start(**overrides: Any) -> Coordinator:
        cfg = dict(heartbeat_timeout=0.4, join_timeout=3.0, tick_interval=0.02)
        cfg.update(overrides)
        coord = Coordinator(CoordinatorConfig(**cfg))
        coord.start()
        started.append(coord)
        return coord

    yield _start
    for coord in started:
        coord.stop()


@pytest.fixture
def client() -> Iterator[Callable[..., CoordinatorClient]]:
    made: list[CoordinatorClient] = []

    def _make(*args: Any, **kwargs: Any) -> CoordinatorClient:
        made.append(CoordinatorClient(*args, **kwargs))
        return made[-1]

    yield _make
    for c in made:
        c.close()


def wait_until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_replica_id_and_url_validation() -> None:
    assert CoordinatorClient("http://127.0.0.1:1", "g0", "abc").replica_id == "g0:abc"
    assert CoordinatorClient("https://coordinator.example:29510", "g0", "abc").url.startswith("https://")
    for bad in ("127.0.0.1:8000", "ftp://127.0.0.1:1", "http://127.0.0.1:99999", "https://"):
        with pytest.raises(ConfigError, match="FTLM_COORDINATOR"):
            CoordinatorClient(bad, "g0", "abc")


def test_unreachable_coordinator_raises_unavailable(client) -> None:
    client = client(f"http://127.0.0.1:{free_port()}", "g0", "a", timeout=1.0)
    with pytest.raises(CoordinatorUnavailable):
        client.heartbeat(0, 0)
    before = time.monotonic()
    with pytest.raises(CoordinatorUnreachable) as refused:  # no HTTP answer at all
        client.quorum(0, 0, False, {}, timeout=0.5)
    assert before <= refused.value.sent_at <= time.monotonic()


def test_a_coordinator_moved_to_another_port_is_found_through_the_address_file(start, client, tmp_path) -> None:
    from ftlm.ft.coordinator_address import write_address

    first = start()
    address = tmp_path / "coordinator.url"
    write_address(address, first.url)
    c = client(first.url, "g0", "a", timeout=1.0, address_file=str(address))
    c.heartbeat(0, 0)
    first.stop()
    second = start()
    write_address(address, second.url)
    # The kept-alive connection to the first fails on use; the retry's new connection reads
    # the file again.
    c.heartbeat(0, 0)
    assert c.url == second.url
    assert [m["replica_id"] for m in second.status()["members"]] == ["g0:a"]
    address.write_text("not a url\n")  # half-written or wrong: the last good address stays
    c._drop_connection()
    c.heartbeat(0, 0)
    assert c.url == second.url


def test_heartbeat_quorum_status_round_trip(start, client) -> None:
    coord = start(expected_groups=1)
    client = client(coord.url, "g0", "a")
    answer = client.heartbeat(0, 0)
    assert answer == {"quorum_id": 0, "dead": [], "dead_quorums": [], "epoch": coord.membership.state.epoch,
                      "rebuilding": False}
    q = client.quorum(0, 0, False, {"transfer": "http://x"}, timeout=2)
    assert (q.replica_id, q.participant_index("g0:a"), q.size, q.step) == ("g0:a", 0, 1, 0)
    assert client.status()["last_quorum"]["quorum_id"] == q.quorum_id


def test_quorum_timeout_carries_the_reason(start, client) -> None:
    coord = start(min_replicas=2, expected_groups=1)
    client = client(coord.url, "g0", "a")
    with pytest.raises(QuorumTimeout) as info:
        client.quorum(0, 0, False, {}, timeout=0.2)
    assert "min_replicas=2" in info.value.reason


def test_wrong_token_is_a_config_error_naming_the_fix(start, client) -> None:
    coord = start(token="right")
    with pytest.raises(ConfigError, match="FTLM_TOKEN"):
        client(coord.url, "g0", "a", token="wrong").heartbeat(0, 0)
    assert client(coord.url, "g0", "a", token="right").heartbeat(0, 0)["dead"] == []
    assert [m["replica_id"] for m in coord.status()["members"]] == ["g0:a"]


def test_threads_share_a_client_with_one_connection_each(start, client) -> None:
    coord = start()
    client = client(coord.url, "g0", "a")

    def beat_many(_: int) -> int:
        for _ in range(20):
            assert client.heartbeat(0, 0)["dead"] == []
        return threading.get_ident()

    with ThreadPoolExecutor(4) as pool:
        idents = set(pool.map(beat_many, range(4)))
    assert len(client._all) == len(idents)  # keep-alive: one connection per thread, reused
    client.close()
    assert client._all == []


def test_heartbeater_reports_state_and_pushes_dead_quorum_peers(start, client) -> None:
    coord = start()
    seen: list[dict] = []
    other = client(coord.url, "g1", "b")
    me = client(coord.url, "g0", "a")
    # Both beat while they ask (a loaded machine may take longer than the heartbeat timeout).
    beats = [Heartbeater(c, 0.05, lambda: (0, 0)) for c in (other, me)]
    for b in beats:
        b.beat()
        b.start()
    with ThreadPoolExecutor(2) as pool:  # one quorum with both, so g1 becomes a peer of g0
        list(pool.map(lambda c: c.quorum(0, 0, False, {}, timeout=5), [me, other]))
    for b in beats:
        b.stop()
    hb = Heartbeater(me, 0.02, lambda: (7, 1, "0" * 64, 0.5), seen.append)
    hb.start()
    try:
        wait_until(lambda: len(seen) >= 3)
        assert seen[0]["dead"] == []
        members = {m["replica_id"]: m for m in other.status()["members"]}
        assert members["g0:a"]["step"] == 7
        # g1 stops heartbeating: g0's answers name it dead after the timeout (abort what is in flight).
        wait_until(lambda: "g1:b" in seen[-1]["dead"])
    finally:
        hb.stop()
    assert not hb._thread.is_alive()


def test_heartbeater_survives_a_coordinator_restart_on_the_same_port(start, client) -> None:
    first = start()
    port = first.port
    hb = Heartbeater(client(first.url, "g0", "a", timeout=0.5), 0.02, lambda: (0, 4))
    hb.start()
    try:
        wait_until(lambda: hb.last_answer is not None)
        first.stop()
        wait_until(lambda: hb.failures >= 2)  # down: it keeps trying without raising
        assert hb._thread.is_alive()
        second = start(port=port)
        wait_until(lambda: hb.failures == 0 and second.status()["members"] != [])
        # The heartbeat's quorum id told the new coordinator where the ids stood.
        assert second.status()["quorum_id"] == 4
    finally:
        hb.stop()


def test_heartbeater_stops_when_its_incarnation_is_replaced(start, client) -> None:
    coord = start()
    hb = Heartbeater(client(coord.url, "g0", "old"), 0.02, lambda: (0, 0))
    hb.start()
    try:
        wait_until(lambda: hb.last_answer is not None)
        client(coord.url, "g0", "new").heartbeat(0, 0)
        wait_until(lambda: hb.stale is not None)
        assert isinstance(hb.stale, StaleIncarnation)
        hb._thread.join(2)
        assert not hb._thread.is_alive()
    finally:
        hb.stop()


def test_a_process_convicted_of_failing_its_steps_is_told_so_in_a_field(start, client) -> None:
    """An incarnation the coordinator convicted of failing the steps it takes part in is refused
    with 409 and ``"convicted": true`` (heartbeats and quorum requests alike): its client raises
    ``Convicted`` (the CLI exits with EXIT_RETIRED); one replaced by a newer incarnation gets a
    plain ``StaleIncarnation``."""
    coord = start()
    convicted, replaced = client(coord.url, "g0", "a"), client(coord.url, "g1", "old")
    convicted.heartbeat(0, 0)
    replaced.heartbeat(0, 0)
    why = f"was retired: its link to the others (or its device) {FAILS_ITS_STEPS}"
    coord.call_in_loop(lambda: remove_member(coord.membership.state, "g0:a", time.monotonic(), why=why))
    client(coord.url, "g1", "new").heartbeat(0, 0)
    with pytest.raises(Convicted, match="g0:a was retired"):
        convicted.heartbeat(0, 0)
    with pytest.raises(Convicted):
        convicted.quorum(0, -1, False, {}, timeout=1.0)
    with pytest.raises(StaleIncarnation) as refused:
        replaced.heartbeat(0, 0)
    assert not isinstance(refused.value, Convicted)


def test_a_process_retired_for_a_suspect_state_is_told_which_checkpoint_to_set_aside(start, client) -> None:
    """Rule I2: the 409 of a process retired because its state may hold a corrupt group's bits
    names that state (``suspect_state``): its ``Convicted`` carries it (the session moves that
    checkpoint aside before exiting), on heartbeats and quorum requests alike."""
    coord = start()
    suspect = client(coord.url, "g0", "a")
    suspect.heartbeat(0, 0)
    state = coord.membership.state

    def retire() -> None:
        state.set_aside["g0:a"] = (12, "c" * 64)
        remove_member(state, "g0:a", time.monotonic(), why="was retired: its state may hold a corrupt group's bits")
    coord.call_in_loop(retire)
    with pytest.raises(Convicted) as refused:
        suspect.heartbeat(0, 0)
    assert refused.value.suspect_state == (12, "c" * 64)
    with pytest.raises(Convicted) as refused:
        suspect.quorum(0, -1, False, {}, timeout=1.0)
    assert refused.value.suspect_state == (12, "c" * 64)


# ---------------------------------------------------------------------------------------- TLS


@pytest.fixture
def tls_coordinator(tls_files, start) -> Coordinator:
    """A coordinator serving https:// with the job CA's certificate for 127.0.0.1, set up the way
    ``ftlm coordinator`` does it: from the ``[ft]`` section."""
    ft = FTConfig(tls_cert=str(tls_files.cert), tls_key=str(tls_files.key), tls_ca=str(tls_files.ca))
    cfg = ft.coordinator_config(token="t")
    assert (cfg.tls_cert, cfg.tls_key) == (ft.tls_cert, ft.tls_key)
    coord = start(token="t", tls_cert=cfg.tls_cert, tls_key=cfg.tls_key)
    assert coord.url.startswith("https://127.0.0.1:")
    return coord


def test_heartbeat_and_quorum_over_tls(tls_coordinator, tls_files, client) -> None:
    members = [client(tls_coordinator.url, f"g{i}", "a", token="t", tls_ca=str(tls_files.ca)) for i in range(2)]
    beats = [Heartbeater(c, 0.05, lambda: (0, 0)) for c in members]
    try:
        for b in beats:
            b.beat()
            b.start()
        with ThreadPoolExecutor(2) as pool:
            quorums = list(pool.map(lambda c: c.quorum(0, 0, False, {"k": "v"}, timeout=10), members))
    finally:
        for b in beats:
            b.stop()
    assert [(q.quorum_id, q.participant_index(q.replica_id)) for q in quorums] == [(quorums[0].quorum_id, 0),
                                                                                   (quorums[0].quorum_id, 1)]
    assert members[0].heartbeat(0, quorums[0].quorum_id)["dead"] == []
    assert [m["replica_id"] for m in members[1].status()["members"]] == ["g0:a", "g1:a"]


def test_client_without_the_ca_fails_naming_the_fix(tls_coordinator, tls_files, client) -> None:
    url = tls_coordinator.url
    with pytest.raises(ConfigError, match=r"did not verify .*ft\.tls_ca"):
        client(url, "g0", "a", token="t").heartbeat(0, 0)  # the system's CAs: not the job's
    with pytest.raises(ConfigError, match=r"ft\.tls_ca"):
        client(url, "g0", "a", token="t", tls_ca=str(tls_files.other_ca)).heartbeat(0, 0)
    with pytest.raises(CoordinatorUnavailable, match="https://"):
        client(url.replace("https://", "http://"), "g0", "a", token="t").heartbeat(0, 0)
    with pytest.raises(ConfigError, match="plain http://"):
        client(url.replace("https://", "http://"), "g0", "a", tls_ca=str(tls_files.ca))
    with pytest.raises(ConfigError, match="does not exist"):
        client(url, "g0", "a", tls_ca="/nonexistent/ca.pem")
    assert tls_coordinator.status()["members"] == []  # nobody got through


def test_https_client_of_a_plain_coordinator_names_the_mix_up(start, tls_files, client) -> None:
    coord = start()
    url = coord.url.replace("http://", "https://")
    with pytest.raises(CoordinatorUnavailable, match="TLS handshake failed.*http:// URL"):
        client(url, "g0", "a", tls_ca=str(tls_files.ca)).heartbeat(0, 0)


def test_coordinator_with_an_unusable_certificate_is_a_config_error(tls_files, tmp_path) -> None:
    broken = tmp_path / "broken.pem"
    broken.write_text("not a certificate")
    for cert, key in ((tls_files.cert, broken), (broken, tls_files.key), (tls_files.cert, tmp_path / "none.key")):
        coord = Coordinator(CoordinatorConfig(tls_cert=str(cert), tls_key=str(key)))
        with pytest.raises(ConfigError, match="TLS"):
            coord.start()
    with pytest.raises(ConfigError, match="set both"):
        CoordinatorConfig(tls_cert=str(tls_files.cert))


def test_a_look_on_disk_voided_by_a_departure_is_asked_again_over_http(start, client) -> None:
    """A restarted coordinator: g1 (step 3) and g2 (step 5) say the job had reached step 9. g1 looks
    on disk and finds nothing newer; then g2, newer, leaves (it may have saved step 5 on its way
    out): g1's waiting request is answered ``reload`` again in ``reload_round`` 1, and its look of
    round 1 lets the rollback go to step 5."""
    coord = start(expected_groups=2, heartbeat_timeout=5.0, join_timeout=5.0)
    c1, c2 = client(coord.url, "g1", "a"), client(coord.url, "g2", "a")
    s3, s5 = "3" * 64, "5" * 64
    c1.heartbeat(3, 0, s3, 0.0, 9)
    c2.heartbeat(5, 0, s5, 0.0, 9)
    for c, step, chain in ((c1, 3, s3), (c2, 5, s5)):
        with pytest.raises(QuorumTimeout) as told:
            c.quorum(step, 0, False, {}, timeout=2.0, chain=chain)
        assert (told.value.reload, told.value.reload_round) == (9, 0)
    got: dict[str, Any] = {}

    def look_and_wait() -> None:  # looked (nothing newer than step 3): waits for the rollback
        try:
            c1.quorum(3, 0, False, {}, timeout=10.0, chain=s3, disk_checked=9)
        except QuorumTimeout as e:
            got["again"] = e
    waiter = threading.Thread(target=look_and_wait)
    waiter.start()
    wait_until(lambda: "g1:a" in coord.call_in_loop(lambda: dict(coord.membership.state.pending)))
    c2.leave("stopped")
    waiter.join(10.0)
    assert not waiter.is_alive() and (got["again"].reload, got["again"].reload_round) == (9, 1)
    q = c1.quorum(5, 0, False, {}, timeout=5.0, chain=s5, disk_checked=9, disk_round=1)  # loaded step 5
    assert (q.step, q.size) == (5, 1)
