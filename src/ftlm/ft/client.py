"""Synchronous client of the coordinator, used by a group's leader, plus its heartbeat thread.

Responsible for: speaking the coordinator's HTTP protocol (``ftlm.ft.coordinator``) with keep-alive
connections, one per calling thread, over TLS for an ``https://`` URL (the server's certificate
checked against ``tls_ca``, or the system's CAs), finding the coordinator again at every new
connection (``ftlm.ft.coordinator_address``: the address file its launcher rewrites, a DNS name
resolved again), and turning its answers into ``Quorum`` objects or typed errors the manager can
act on: ``CoordinatorUnreachable`` when no HTTP answer came at all.

Not responsible for: retry policy or deadlines (the manager retries ``CoordinatorUnavailable`` and
``QuorumTimeout``, ``ftlm.ft.quorum_wait`` says for how long), nor for sharing
the answer with the other ranks of the group.
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from ftlm.errors import ConfigError
from ftlm.ft.coordinator_address import CoordinatorAddress
from ftlm.ft.history import GENESIS
from ftlm.ft.http_client import Endpoint, EndpointError
from ftlm.ft.quorum import Convicted, StaleIncarnation
from ftlm.ft.quorum_answer import MemberQuorum
from ftlm.ft.tls import client_context

log = logging.getLogger(__name__)

__all__ = [
    "CoordinatorClient",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "CoordinatorUnreachable",
    "Convicted",
    "Heartbeater",
    "QuorumTimeout",
    "StaleIncarnation",
]


FINISHED_LEAVE_RETRY_SECONDS = 30.0
"""How long a finished group keeps telling an unreachable coordinator that it leaves (a
coordinator restarting: its standby serves within a second, a cold start within seconds). A
finished leave that never arrives leaves every group still at the final state waiting for it
until ``ft.quorum_timeout``; other leaves are tried once (a group that left silently is found
dead by its missing heartbeats)."""


class CoordinatorError(Exception):
    """The coordinator answered with an unexpected error (a bug on one side; not worth retrying)."""


class CoordinatorUnavailable(CoordinatorError):
    """The coordinator could not be reached or did not answer in time; it may be restarting."""


class CoordinatorUnreachable(CoordinatorUnavailable):
    """No HTTP answer at all: the connection was refused, reset or timed out (the coordinator is
    down, stopped, or its node is gone). ``sent_at``: when the request went out (monotonic)."""

    def __init__(self, message: str, sent_at: float) -> None:
        super().__init__(message)
        self.sent_at = sent_at


class QuorumTimeout(CoordinatorError):
    """No quorum including this group was issued within the requested time (HTTP 504).

    ``reload``: the head's step when the coordinator answered early because no live group holds
    it: a group behind it should load a newer durable checkpoint, if it has one, and ask again;
    ``reload_round``: above 0 when it looked already for that step and must look again."""

    def __init__(self, reason: str, reload: int | None = None, reload_round: int = 0) -> None:
        super().__init__(f"no quorum yet: {reason}")
        self.reason = reason
        self.reload = reload
        self.reload_round = reload_round


def reload_word(answer: dict[str, Any]) -> tuple[int | None, int]:
    """An answer's ``reload`` (the head's step, None without a valid one) and ``reload_round``
    (0 without a valid one)."""
    head, again = answer.get("reload"), answer.get("reload_round", 0)
    return (head if type(head) is int and head >= 0 else None,
            again if type(again) is int and again >= 0 else 0)


def suspect_word(answer: dict[str, Any]) -> tuple[int, str] | None:
    """A 409 answer's ``suspect_state`` (step, chain): the state whose checkpoint the retired
    process sets aside (``quorum.Convicted``); None without a valid one."""
    word = answer.get("suspect_state")
    if (isinstance(word, list) and len(word) == 2 and type(word[0]) is int and word[0] >= 0
            and isinstance(word[1], str) and 0 < len(word[1]) <= 128):
        return word[0], word[1]
    return None


# Errors that mean "no usable answer from the server" rather than "the server said no".
# OSError covers refused and reset connections and socket timeouts.
_NETWORK_ERRORS = (OSError, http.client.HTTPException)


class CoordinatorClient:
    """Talks to the coordinator for one incarnation of one replica group; safe to share across threads.

    ``tls_ca`` (``ft.tls_ca``): the PEM CA that signed an ``https://`` coordinator's certificate,
    which must also name the URL's host; empty trusts the system's CAs. With ``tls_ca`` set the URL
    must be ``https://``: the token is never sent in plain text to a job that configured TLS.
    ``address_file``: a file the launcher rewrites with the coordinator's URL when it starts it
    elsewhere (``FTLM_COORDINATOR_FILE``), read again for every new connection.
    """

    def __init__(self, url: str, group: str, incarnation: str, token: str = "", timeout: float = 5.0,
                 tls_ca: str = "", address_file: str = "") -> None:
        self._tls = client_context(tls_ca) if tls_ca else None
        self.address = CoordinatorAddress(url, address_file)
        try:
            self.endpoint = Endpoint.parse(url, token, self._tls)
        except EndpointError as e:
            if e.plain_with_tls:
                raise ConfigError(f"coordinator url {url!r} is plain http:// but ft.tls_ca is set: "
                                  f"use the coordinator's https:// URL (FTLM_COORDINATOR), or unset "
                                  f"ft.tls_ca") from None
            raise ConfigError(f"coordinator url {url!r} must look like http://HOST:PORT or "
                              f"https://HOST:PORT (FTLM_COORDINATOR)") from None
        self.url = self.endpoint.url
        self.group = group
        self.incarnation = incarnation
        self.timeout = timeout
        self._headers = self.endpoint.headers(**{"Content-Type": "application/json"})
        self._local = threading.local()  # one keep-alive connection per calling thread
        self._all: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._answered = False  # any answer yet (a first failure may be a scheme mix-up)
        self.last_request_at = float("-inf")  # when the last quorum request was sent (monotonic)

    @property
    def replica_id(self) -> str:
        return f"{self.group}:{self.incarnation}"

    def heartbeat(self, step: int, quorum_id: int, chain: str = GENESIS, progress_age: float = 0.0,
                  known_head: int = 0) -> dict[str, Any]:
        """Report liveness, the committed state ``(step, chain)`` and seconds since the last progress.

        Returns ``{"quorum_id", "dead": [recently dead replica ids of the quorums in flight],
        "rebuilding": bool}`` (and ``"kill": true`` for a chaos drill).
        """
        body = self.heartbeat_body(step, quorum_id, chain, progress_age, known_head)
        _, answer = self._request("POST", "/v1/heartbeat", body, self.timeout)
        return answer

    def heartbeat_body(self, step: int, quorum_id: int, chain: str = GENESIS, progress_age: float = 0.0,
                       known_head: int = 0) -> dict[str, Any]:
        """The JSON body ``heartbeat`` sends (load tests send it over their own connections)."""
        return {"group": self.group, "incarnation": self.incarnation, "step": step, "quorum_id": quorum_id,
                "chain": chain, "progress_age": round(max(0.0, progress_age), 3),
                "known_head": max(known_head, step)}

    def leave(self, reason: str, at: tuple[int, str] | None = None) -> None:
        """Leave the job on purpose (finished, stopped, preempted): not reported as a failure.
        ``at``: the state (step, chain) it leaves with (a finished group's final state)."""
        body: dict[str, Any] = {"group": self.group, "incarnation": self.incarnation, "reason": reason[:200]}
        if at is not None:
            body.update(step=at[0], chain=at[1])
        self._request("POST", "/v1/leave", body, self.timeout)

    def report_dead(self, group: str, incarnation: str, reason: str) -> None:
        """Tell the coordinator a replica's process ended (supervisors)."""
        body = {"group": group, "incarnation": incarnation, "reason": reason[:200]}
        self._request("POST", "/v1/dead", body, self.timeout)

    def quorum(self, step: int, last_quorum_id: int, failed: bool, meta: dict[str, Any], timeout: float,
               chain: str = GENESIS, watch: list[str] | tuple[str, ...] = (),
               disk_checked: int = -1, disk_round: int = 0,
               integrity: tuple[int, str, str] | None = None) -> MemberQuorum:
        """Ask for the quorum of the next step, waiting up to ``timeout`` seconds (server caps at 60 s).

        Returns this member's answer (``ftlm.ft.quorum_answer``), which says which of the replica
        ids in ``watch`` are members. ``failed`` with the current quorum's id reports that its step
        failed here: the coordinator then declares dead the peers that stay silent.
        ``disk_checked``: the head step for which this group looked for a newer durable
        checkpoint, after a ``QuorumTimeout`` with ``reload``; ``disk_round``: its ``reload_round``.
        ``integrity``: ``(step, chain, digest)``, the digest of the state this group held at that
        committed state (``ftlm.ft.integrity``). Raises QuorumTimeout when none was issued in time, CoordinatorUnavailable when the server is
        unreachable, StaleIncarnation when this incarnation was replaced by a newer one (or
        retired: ``Convicted`` when for failing the steps it took part in).
        """
        body = self.quorum_body(step, last_quorum_id, failed, meta, timeout, chain, watch, disk_checked, disk_round,
                                integrity)
        # A quorum request is a heartbeat too (the coordinator records it as one): the heartbeat
        # thread skips a beat when one went out within its interval.
        self.last_request_at = time.monotonic()
        # The socket waits for the long-poll plus the ordinary timeout for the answer to travel.
        _, answer = self._request("POST", "/v1/quorum", body, timeout + self.timeout)
        try:
            return MemberQuorum.from_json(answer)
        except ValueError as e:
            raise CoordinatorError(f"coordinator at {self.url} sent a malformed quorum: {e}") from e

    def quorum_body(self, step: int, last_quorum_id: int, failed: bool, meta: dict[str, Any], timeout: float,
                    chain: str = GENESIS, watch: list[str] | tuple[str, ...] = (),
                    disk_checked: int = -1, disk_round: int = 0,
                    integrity: tuple[int, str, str] | None = None) -> dict[str, Any]:
        """The JSON body ``quorum`` sends (load tests send it over their own connections)."""
        body = {"group": self.group, "incarnation": self.incarnation, "step": step,
                "last_quorum_id": last_quorum_id, "failed": failed, "meta": meta, "timeout": timeout,
                "chain": chain}
        if watch:
            body["watch"] = list(watch)
        if disk_checked >= 0:
            body["disk_checked"] = disk_checked
            if disk_round > 0:
                body["disk_round"] = disk_round
        if integrity is not None:
            body["integrity"] = dict(zip(("step", "chain", "digest"), integrity))
        return body

    @property
    def headers(self) -> dict[str, str]:
        """The headers of every request: content type and, with a job token, the bearer token."""
        return dict(self._headers)

    def status(self) -> dict[str, Any]:
        """The coordinator's ``/status`` JSON."""
        _, answer = self._request("GET", "/status", None, self.timeout)
        return answer

    def close(self) -> None:
        """Close every connection this client opened (from any thread)."""
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()
        self._local = threading.local()

    # ------------------------------------------------------------------------------ internals

    def _connection(self, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        conn = getattr(self._local, "conn", None)
        reused = conn is not None
        if conn is None:
            conn = self._endpoint_now().connect(timeout)
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, reused

    def _endpoint_now(self) -> Endpoint:
        """Where the coordinator is now: a new URL in the address file replaces the endpoint
        (a malformed one is logged and the last good one kept)."""
        url = self.address.current().rstrip("/")
        if url != self.endpoint.url:
            try:
                self.endpoint = Endpoint.parse(url, self.endpoint.token, self._tls)
                self.url = self.endpoint.url
            except EndpointError as e:
                log.warning("ignoring the coordinator address %r: %s", url, e)
        return self.endpoint

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
            with self._lock:
                if conn in self._all:
                    self._all.remove(conn)

    def _request(self, method: str, path: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        sent_at = time.monotonic()
        for attempt in range(2):
            conn, reused = self._connection(timeout)
            try:
                conn.request(method, path, body=data, headers=self._headers)
                resp = conn.getresponse()
                raw = resp.read()
                status = resp.status
                break
            except _NETWORK_ERRORS as e:
                self._drop_connection()
                # A kept-alive connection the server closed while idle fails on first use: retry once
                # on a fresh one. Timeouts are not retried: the server may be hung.
                if attempt == 0 and reused and not isinstance(e, TimeoutError):
                    continue
                raise self._network_error(e, sent_at) from e
        self._answered = True
        try:
            answer = json.loads(raw) if raw else {}
        except ValueError:
            answer = {"error": raw[:200].decode(errors="replace")}
        if status == 200:
            return status, answer
        message = answer.get("error", "") if isinstance(answer, dict) else str(answer)
        if status == 504:
            body = answer if isinstance(answer, dict) else {}
            raise QuorumTimeout(str(body.get("reason", message)), *reload_word(body))
        if status == 409:
            body = answer if isinstance(answer, dict) else {}
            if body.get("convicted") is True:
                raise Convicted(message, suspect_word(body))
            raise StaleIncarnation(message)
        if status == 401:
            raise ConfigError(
                f"coordinator at {self.url} refused the token ({message}); give every process the job's "
                "token (FTLM_TOKEN)"
            )
        if status in (502, 503):
            raise CoordinatorUnavailable(f"coordinator at {self.url} answered {status}: {message}")
        raise CoordinatorError(f"coordinator at {self.url} answered {status} to {method} {path}: {message}")

    def _network_error(self, e: BaseException, sent_at: float) -> Exception:
        """The typed error of a request that got no answer, naming the fix where there is one.
        A TLS handshake that fails on its own terms is a configuration to fix (it counts against
        ``ft.quorum_timeout``); one cut short (EOF) is the coordinator going away."""
        if isinstance(e, ssl.SSLCertVerificationError):
            return ConfigError(
                f"coordinator at {self.url}: its TLS certificate did not verify ({e.verify_message}); "
                f"give this process the PEM CA that signed it (ft.tls_ca) and reach the coordinator "
                f"at a name its certificate lists")
        if isinstance(e, ssl.SSLError) and not isinstance(e, ssl.SSLEOFError):
            return CoordinatorUnavailable(
                f"coordinator at {self.url}: TLS handshake failed ({e.reason or e}); if it serves plain "
                f"http://, use an http:// URL (FTLM_COORDINATOR), or give it ft.tls_cert and ft.tls_key")
        hint = ""
        if (self.endpoint.ssl_context is None and not self._answered
                and isinstance(e, (http.client.RemoteDisconnected, ConnectionResetError))):
            hint = ("; a coordinator serving https:// closes plain http:// connections like this: "
                    "if it has ft.tls_cert, use its https:// URL and ft.tls_ca")
        return CoordinatorUnreachable(f"coordinator at {self.url} unreachable: {e!r}{hint}", sent_at)


class Heartbeater:
    """A daemon thread that heartbeats every ``interval`` seconds until stopped.

    ``get_state()`` returns ``(step, quorum_id)`` or ``(step, quorum_id, chain, progress_age[,
    known_head])`` to
    report; ``on_answer(answer)`` receives each answer (the manager aborts an all-reduce when a
    member of its quorum is listed dead).
    A quorum request of the same client counts as a beat: the thread sends one only when neither
    went out for ``interval``. An unreachable coordinator is retried quietly (one log line when it goes away and one when it
    comes back). A replaced incarnation stops the thread and is kept in ``stale``.
    ``on_kill()`` is called once, from this thread, when an answer carries ``"kill": true`` (a chaos
    kill requested through the coordinator's ``POST /v1/kill``); the thread keeps beating after it.
    """

    def __init__(
        self,
        client: CoordinatorClient,
        interval: float,
        get_state: Callable[[], tuple],
        on_answer: Callable[[dict[str, Any]], None] | None = None,
        on_kill: Callable[[], None] | None = None,
    ) -> None:
        if interval <= 0:
            raise ConfigError(f"heartbeat interval={interval!r} must be a number of seconds > 0")
        self.client = client
        self.interval = interval
        self.get_state = get_state
        self.on_answer = on_answer
        self.on_kill = on_kill
        self.killed = False  # a kill was asked for (on_kill called at most once)
        self.last_answer: dict[str, Any] | None = None
        self.stale: StaleIncarnation | None = None
        self.failures = 0  # consecutive heartbeats without an answer
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("Heartbeater.start() called twice")
        self._thread = threading.Thread(target=self._run, name=f"ftlm-heartbeat-{self.client.group}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop and join the thread; waits at most ``timeout`` (default: one request's timeout + 1 s)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout if timeout is not None else self.client.timeout + 1.0)
            if self._thread.is_alive():
                log.warning("heartbeat thread of %s did not stop in time", self.client.replica_id)

    def beat(self) -> None:
        """Send one heartbeat now (the thread calls this; tests may too)."""
        answer = self.client.heartbeat(*self.get_state())
        self.last_answer = answer
        if self.on_answer is not None:
            self.on_answer(answer)
        if answer.get("kill") is True and not self.killed:
            self.killed = True
            log.warning("coordinator asked to kill %s (chaos drill)", self.client.replica_id)
            if self.on_kill is not None:
                self.on_kill()

    def _run(self) -> None:
        try:
            self._beat_until_stopped()
        finally:
            self.client._drop_connection()  # this thread's keep-alive connection dies with it

    def _beat_until_stopped(self) -> None:
        while not self._stop.is_set():
            # A quorum request sent within the interval was a heartbeat already: a member that
            # steps faster than it heartbeats sends one message a step.
            since = time.monotonic() - self.client.last_request_at
            if since < self.interval:
                self._stop.wait(self.interval - since)
                continue
            try:
                self.beat()
                if self.failures:
                    log.info("coordinator reachable again after %d missed heartbeats", self.failures)
                self.failures = 0
            except CoordinatorUnavailable as e:
                if self.failures == 0:
                    log.warning("heartbeat of %s failed, will keep trying: %s", self.client.replica_id, e)
                self.failures += 1
            except StaleIncarnation as e:
                log.error("%s", e)
                self.stale = e
                return
            except Exception as e:  # noqa: BLE001 - keep beating: one bad answer must not stop liveness
                if self.failures == 0:
                    log.exception("heartbeat of %s failed: %s", self.client.replica_id, e)
                self.failures += 1
            self._stop.wait(self.interval)
