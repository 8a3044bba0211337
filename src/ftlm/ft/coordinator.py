"""The coordinator server: an HTTP shell around the membership state machine (``ftlm.ft.membership``).

Responsible for: receiving heartbeats and quorum requests from group leaders, answering quorum
long-polls, re-evaluating on every request and on a tick (so join and heartbeat timeouts fire
without traffic), the status page, Prometheus metrics, and everything that keeps an untrusted
network from wedging it: auth, same-origin checks, content types, size limits, strict input
validation (``ftlm.ft.coordinator_requests``), a cap on connections and a deadline on every
request (``ftlm.ft.connection_gate``), TLS, and logs that summarise abuse instead of echoing it.

Not responsible for: the rules of the quorum (``quorum.compute_quorum``, driven through
``Membership``), the per-step protocol of a group (``ftlm.ft.manager``), or restarting anything. It
holds only soft state; after a restart it rebuilds itself from the next heartbeats and never
issues an id below one members report.

Endpoints (all require ``Authorization: Bearer <token>`` when a token is configured, ``GET /``
and ``GET /metrics`` included (docs/design.md, 'Security'); Prometheus sends it with
``authorization: {credentials: ...}``):
  POST /v1/heartbeat  {group, incarnation, step, quorum_id} -> {quorum_id, dead, dead_quorums, epoch,
                      rebuilding[, reload, reload_round]}: ``dead_quorums`` are the ids of the quorums
                      in flight (of ``epoch``) with a dead member, whose members abort their
                      all-reduce; ``reload`` as in a quorum answer below, for a member behind the
                      head that has not asked
  POST /v1/quorum     {group, incarnation, step, last_quorum_id, failed, meta, timeout[, chain, watch,
                      disk_checked, disk_round]}
                      -> 200 this member's answer (``ftlm.ft.quorum_answer``) | 504 {error, reason}
                      (with ``reload``: the head's step, which no live group holds: load a newer
                      durable checkpoint, if any, and ask again with ``disk_checked``; and
                      ``reload_round`` when it looked already but must look again, echoed as
                      ``disk_round``) | 409 {error} (replaced incarnation, or one retired
                      because attempts without it committed, ``quorum.Probe``). ``failed`` with ``last_quorum_id`` of the current quorum
                      reports its step failed: peers silent since are declared dead
                      after ``suspect_window`` (corroborated by their silence)
  POST /v1/leave, /v1/dead  {group, incarnation, reason[, step, chain]}: a replica left on purpose
                      (at that state) / its process ended
  POST /v1/kill       {group} -> {replica_ids} | 404 {error}: marks the group's live replica; its
                      next heartbeat answers carry ``"kill": true`` (chaos drills; its manager kills it)
  GET  /status[?offset=N&limit=M]  JSON, at most ``STATUS_LIMIT`` members per page (``members_total``,
                      ``next_offset``), the newest ``MAX_DEAD_LISTED`` deaths (``dead_total``);
  GET  /  the live dashboard (``ftlm.ft.dashboard``);  GET /metrics  Prometheus.
The one exception to the token: ``GET /`` without it answers 401 with the dashboard page but no
data, so a browser can load it and send the token (taken from ``#token=...``) with its requests.

What a request must also pass: every POST carries ``Content-Type:
application/json`` (415 otherwise: an HTML form or a ``text/plain`` fetch from another site cannot
send it without a CORS preflight, which is never granted); a request with an ``Origin`` that is
not the coordinator's own, or a POST a browser marks ``Sec-Fetch-Site: cross-site``, gets 403;
a coordinator bound to loopback answers only requests whose ``Host`` is a loopback name (a page
rebinding its own DNS name to 127.0.0.1 is refused). Bodies are at most ``max_request_bytes``
(413), arrive within ``read_timeout`` (408) and must be strict JSON (400, one line, nothing changed).

Two paths serve HTTP on the one port, so that thousands of groups cost it little:
``ftlm.ft.hot_path`` answers the common,
well-formed heartbeat and quorum request straight from the connection's protocol (a quorum
long-poll is a ``Waiter``: a callback and a deadline in a heap, no task), after the same checks
and the same strict decoding; every other request, a refused one included, is handed from its
first byte to aiohttp, which answers it as described above. The loop is uvloop's where installed.

All asyncio state is touched only from the server's own event loop thread.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import heapq
import hmac
import itertools
import json
import logging
import ssl
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from ftlm import native
from ftlm.errors import ConfigError
from ftlm.ft.config import CoordinatorConfig, is_loopback
from ftlm.ft.connection_gate import AbuseLog, ConnectionGate, CountingLogger, fd_budget, loop_exception_handler
from ftlm.ft.coordinator_requests import (ClientBodies, HeartbeatBody, QuorumBody, decode_body, parse_heartbeat,
                                          parse_kill, parse_member, parse_quorum_request)
from ftlm.ft.coordinator_address import LOCAL_ALIAS, describe_address, url_of
from ftlm.ft.http_guard import foreign_request, non_json_post
from ftlm.ft.coordinator_hot import HeartbeatAnswerEncoder, HotEndpoints, Waiter, WaiterAnswer, member_request
from ftlm.ft.coordinator_status import STATUS_LIMIT, CoordinatorMetrics, status_json
from ftlm.ft.dashboard import DashboardLog, render_page
from ftlm.ft.hot_path import HotPathProtocol
from ftlm.ft.membership import Answer, Event, Issued, Membership, Output
from ftlm.ft.quorum import Convicted, Heartbeat, QuorumOptions, StaleIncarnation
from ftlm.ft.quorum_answer import AnswerEncoder
from ftlm.until_signal import wait_until_signalled
from ftlm.ft.tls import server_context

log = logging.getLogger(__name__)

MAX_POLL_SECONDS = 60.0  # longest a quorum long-poll may hold a connection
LOG_INTERVAL = 10.0
"""Seconds between two summary lines of refused connections and requests."""
_START_TIMEOUT = 10.0
_BEAT_SLICE = 0.002
"""Seconds of queued heartbeats the lean path answers per pass of the event loop."""
_BEAT_MAX_WAIT = 0.1
"""Longest a queued heartbeat waits before it is answered whatever the slice (at most a tenth
of ``heartbeat_timeout``): quorum requests go first, heartbeats are never starved."""
_BACKLOG = 512
# Answers worth a count in the abuse summary (a 404 of an unknown route is a scanner, too).
_REFUSALS = frozenset({400, 401, 403, 404, 405, 408, 413, 415})

T = TypeVar("T")


def _unfenced() -> None:
    """``Coordinator.fence`` of a coordinator that answers for as long as it runs."""


class _NoEvents:
    """Null event sink used when the coordinator has no run directory."""

    def emit(self, kind: str, **fields: Any) -> None:
        pass


class _SlowBody(Exception):
    """The request body did not arrive within ``read_timeout``."""


class Coordinator:
    """One job's coordinator, served from a background thread with its own event loop."""

    def __init__(self, config: CoordinatorConfig, events: Any = None) -> None:
        self.config = config
        self.events = events if events is not None else _NoEvents()
        self.options = QuorumOptions(config.min_replicas, config.join_timeout, config.heartbeat_timeout,
                                     config.expected_groups, progress_timeout=config.progress_timeout,
                                     suspect_window=config.suspect_window,
                                     probe_after=config.probe_after_failures,
                                     max_participants=config.max_participants)
        self._encoder = AnswerEncoder()
        self._bodies = ClientBodies()  # the lean path's body decoding
        self._beat_json = HeartbeatAnswerEncoder()
        self.metrics = CoordinatorMetrics()
        self.dashboard = DashboardLog()
        self.membership = Membership(self.options)
        self.abuse = AbuseLog(log, LOG_INTERVAL)
        self._loopback = is_loopback(config.host)
        self._ssl: ssl.SSLContext | None = None
        self._gate: ConnectionGate | None = None
        self._server: asyncio.AbstractServer | None = None
        self._waiters: dict[str, list[asyncio.Future[WaiterAnswer] | Waiter]] = {}
        self._tick_pending = False  # a re-evaluation is queued for the end of this loop pass
        # The lean path's heartbeats not yet answered: (when read, body, connection), oldest first.
        self._beats: collections.deque[tuple[float, HeartbeatBody, HotPathProtocol]] = collections.deque()
        self._beats_pending = False  # ``_drain_beats`` is queued
        self._beat_max_wait = min(_BEAT_MAX_WAIT, config.heartbeat_timeout / 10)
        self._bearer = f"Bearer {config.token}".encode()
        self._deadlines: list[tuple[float, int, Waiter]] = []  # the lean path's long-polls (heap)
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._port: int | None = None
        # Called before every answer and decision: returns while this coordinator may answer,
        # ends the process when it may not (a lost Kubernetes lease: ftlm.launch.lease).
        self.fence: Callable[[], None] = _unfenced

    # ----------------------------------------------------------------- lifecycle (caller's thread)

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the coordinator is not started; call start() first")
        return self._port

    @property
    def serving(self) -> bool:
        """Whether the server thread runs (started and not stopped)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def scheme(self) -> str:
        return "https" if self.config.tls_cert else "http"

    @property
    def url(self) -> str:
        """A URL that reaches the server from this machine (loopback when bound to all interfaces)."""
        return url_of(self.scheme, LOCAL_ALIAS.get(self.config.host, self.config.host), self.port)

    def describe(self) -> str:
        """Where people can reach the server (``describe_address``)."""
        return describe_address(self.scheme, self.config.host, self.port)

    def start(self) -> str:
        """Start serving in a background thread; returns the base URL once it accepts connections."""
        if self._thread is not None:
            raise RuntimeError("Coordinator.start() called twice; create a new Coordinator instead")
        if self.config.tls_cert:  # here, so that a bad certificate is the caller's ConfigError
            self._ssl = server_context(self.config.tls_cert, self.config.tls_key)
        self._thread = threading.Thread(target=self._run_loop, name="ftlm-coordinator", daemon=True)
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT):
            raise RuntimeError(f"the coordinator did not start within {_START_TIMEOUT} s")
        if self._start_error is not None:
            self._thread.join(_START_TIMEOUT)
            err = self._start_error
            raise ConfigError(
                f"coordinator cannot listen on {self.config.host}:{self.config.port}: {err} "
                "(choose another port: `ftlm coordinator --port N`, 0 for any free one; "
                "cluster.coordinator_port in a generated Kubernetes or Slurm job)"
            ) from err
        if not self.config.token and not self._loopback:
            log.warning("coordinator on %s without a job token (--insecure): anyone who reaches "
                        "it can kill groups and steer the job", self.config.host)
        log.info("coordinator listening on %s (hot path %s)", self.describe(), native.STATUS)
        return self.url

    def stop(self, timeout: float = 5.0) -> None:
        """Answer waiting long-polls with 503, close the server and join its thread (bounded)."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None or not thread.is_alive():
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        if thread.is_alive():
            log.warning("coordinator thread did not stop within %.1f s", timeout)

    def serve_forever(self) -> None:
        """Serve until SIGINT or SIGTERM (for the ``ftlm coordinator`` command)."""
        def start() -> None:
            self.start()
            quiet_collector()
            print(f"ftlm coordinator listening on {self.describe()} (hot path {native.STATUS}; Ctrl-C to stop)",
                  flush=True)
            if not self.config.token:
                who = "any process on this machine" if self._loopback else "anyone who reaches this port"
                print(f"ftlm coordinator: warning: no job token (FTLM_TOKEN or ft.token_file): {who} "
                      f"can read the job's status, kill groups and report deaths", file=sys.stderr, flush=True)
        wait_until_signalled(lambda: self.serving, self.stop, start)

    def call_in_loop(self, fn: Callable[[], T], timeout: float = 5.0) -> T:
        """Run ``fn`` on the server's event loop thread and return its result; from any thread."""
        loop = self._loop
        if loop is None or not loop.is_running() or threading.current_thread() is self._thread:
            return fn()

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout)

    @property
    def open_connections(self) -> int:
        """Connections the server holds open right now."""
        return self.call_in_loop(lambda: self._gate.open if self._gate is not None else 0)

    def _run_loop(self) -> None:
        loop = new_event_loop()
        loop.set_exception_handler(loop_exception_handler(self.abuse))
        self._loop = loop
        try:
            loop.run_until_complete(self._startup())
        except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
            self._start_error = e
            self._ready.set()
            loop.run_until_complete(self._shutdown())
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._shutdown())
            loop.close()

    def make_app(self) -> web.Application:
        """The aiohttp application (routes and the guarding middleware), without a server."""
        app = web.Application(middlewares=[self._guard], client_max_size=self.config.max_request_bytes)
        app.router.add_post("/v1/heartbeat", self._handle_heartbeat)
        app.router.add_post("/v1/quorum", self._handle_quorum)
        app.router.add_post("/v1/kill", self._handle_kill)
        app.router.add_post("/v1/leave", self._handle_leave)
        app.router.add_post("/v1/dead", self._handle_dead)
        app.router.add_get("/status", self._handle_status)
        app.router.add_get("/metrics", self._handle_metrics)
        app.router.add_get("/", self._handle_page)
        return app

    async def _startup(self) -> None:
        cfg = self.config
        limit = fd_budget(cfg.max_connections)
        if limit < cfg.max_connections:
            log.warning("coordinator.max_connections=%d lowered to %d: the process may open no more "
                        "files (raise `ulimit -n`)", cfg.max_connections, limit)
        self._gate = ConnectionGate(limit, cfg.read_timeout, self.abuse)
        # aiohttp's own bounds on what it parses; a too-long line or header is a 400.
        self._runner = web.AppRunner(
            self.make_app(), access_log=None, shutdown_timeout=1.0, keepalive_timeout=cfg.read_timeout,
            lingering_time=min(1.0, cfg.read_timeout), max_line_size=4096, max_field_size=8190,
            max_headers=64, logger=CountingLogger(self.abuse))
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        hot, fallback = HotEndpoints(self), self._runner.server
        self._server = await loop.create_server(
            self._gate.factory(lambda: HotPathProtocol(hot, fallback)), cfg.host, cfg.port, ssl=self._ssl,
            backlog=_BACKLOG, ssl_handshake_timeout=cfg.read_timeout if self._ssl is not None else None)
        self._port = int(self._server.sockets[0].getsockname()[1])
        self._tasks = [loop.create_task(self._tick()), loop.create_task(self._sweep())]
        # Ticked on a timer from now on: a longer silence of its own is a stall (SIGSTOP), not the groups'.
        self.membership.ticks_every(self.config.tick_interval)

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for rid in list(self._waiters):
            self._answer(rid, 503, {"error": "coordinator stopping; ask again"})
        while self._beats:
            self._beats.popleft()[2].respond(503, b'{"error": "coordinator stopping; send it again"}')
        await asyncio.sleep(0)  # let the woken handlers write their answers
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._gate is not None:
            self._gate.close_all()
        await asyncio.sleep(0)  # let the closed transports release their sockets

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_interval)
            try:
                now = time.monotonic()
                self._evaluate(now)
                self._expire_waiters(now)
            except Exception:  # noqa: BLE001 - a bug must not stop failure detection for good
                log.exception("coordinator tick failed")

    async def _sweep(self) -> None:
        """Close connections past their deadline; write the abuse summary when one is due."""
        while True:
            await asyncio.sleep(min(0.5, self.config.read_timeout / 4))
            try:
                if self._gate is not None:
                    self._gate.sweep()
                self.abuse.flush()
            except Exception:  # noqa: BLE001 - keep sweeping
                log.exception("coordinator connection sweep failed")

    # ------------------------------------------------------------------ decisions (loop thread)

    @property
    def _state(self):
        return self.membership.state

    def _evaluate(self, now: float) -> None:
        self._apply(self.membership.tick(now))

    def _tick_soon(self) -> None:
        """Re-evaluate once after this pass of the event loop: a step's asks and the
        heartbeats around them arrive in bursts of hundreds, and deciding after each message cost
        about 5 us a message (a third of the state machine's time) for decisions that only the
        burst's last message changes. Loop thread."""
        if self._tick_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven in-process without a loop (tests): decide now
            self._evaluate(time.monotonic())
            return
        self._tick_pending = True
        loop.call_soon(self._deferred_tick)

    def _deferred_tick(self) -> None:
        self._tick_pending = False
        try:
            self._evaluate(time.monotonic())
        except Exception:  # noqa: BLE001 - as the timer's tick: a bug must not stop the decisions
            log.exception("coordinator tick failed")

    def _expire_waiters(self, now: float) -> None:
        """Answer 504 to the lean path's long-polls past their timeout (within a tick of it)."""
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            waiter = heapq.heappop(heap)[2]
            if not waiter.done():
                waiter.expire()
        if len(heap) > 4 * len(self._waiters) + 1024:  # mostly answered ones: keep it bounded
            self._deadlines = [e for e in heap if not e[2].done()]
            heapq.heapify(self._deadlines)

    def _apply(self, outputs: list[Output]) -> None:
        """Carry out what the membership state machine decided: answers, events, metrics.

        A quorum's answers (a run of them among the outputs) are written longest-waiting member
        first, not in member order: the first to ask has waited for all the others already, and
        at 2,000 groups the last of a step's answers leaves tens of ms after the first.
        Everything else keeps the state machine's order."""
        self.fence()
        run: dict[str, Answer] = {}  # a quorum's answers not written yet
        for o in outputs:
            if isinstance(o, Answer) and o.quorum is not None and o.replica_id not in run:
                if o.replica_id in self._waiters:  # else nobody waits (it asked again, or gave up)
                    run[o.replica_id] = o
                continue
            if run:
                self._answer_quorum(run)
                run = {}
            if isinstance(o, Answer):
                if o.replica_id not in self._waiters:
                    continue  # nobody waits (it asked again, or gave up): nothing to encode
                if o.quorum is not None:  # each member gets its own part
                    self._answer(o.replica_id, o.status, None, self._encoder.encode(o.quorum, o.replica_id))
                else:
                    self._answer(o.replica_id, o.status, o.body)
            elif isinstance(o, Event):
                if o.kind == "member_dead":
                    log.warning("member %s is dead: %s", o.fields["replica_id"], o.fields["reason"])
                    self.metrics.member_failures.inc()
                elif o.kind == "restore":
                    log.warning("rollback from step %s to step %s: %s", o.fields["from_step"],
                                o.fields["to_step"], o.fields["reason"])
                elif o.kind == "spare_promoted":
                    log.warning("spare %s promoted in quorum %d, replacing %s, %.2f s after the "
                                "coordinator knew", ", ".join(o.fields["promoted"]), o.fields["quorum_id"],
                                ", ".join(o.fields["replaced"]) or "-", o.fields["seconds"])
                    self.metrics.spare_promoted(o.fields["seconds"])
                elif o.kind == "quorum":
                    log.info("quorum %d at step %d: %s", o.fields["quorum_id"], o.fields["step"],
                             o.fields["reason"])
                elif o.kind == "state_mismatch" and o.fields.get("copied_from"):
                    log.error("group %s copied its state from %s before that was found corrupt at step %s: "
                              "retired", o.fields["group"], o.fields["copied_from"], o.fields["step"])
                    self.metrics.state_mismatches.inc()
                elif o.kind == "suspect_states":
                    log.error("states of steps %s-%s may hold the bits of %s, found corrupt at step %s: "
                              "only %s vouch for them", o.fields["from_step"], o.fields["to_step"],
                              o.fields["replica_id"], o.fields["step"], ", ".join(o.fields["vouched"]) or "nobody")
                elif o.kind == "state_mismatch":
                    log.error("group %s (host %s) holds another state than %s at step %s: retired%s",
                              o.fields["group"], o.fields["host"] or "?",
                              "the majority" if o.fields["majority"] else "its peers", o.fields["step"],
                              " and quarantined on its host" if o.fields["quarantined"] else "")
                    self.metrics.state_mismatches.inc()
                elif o.kind == "state_agreed":
                    log.info("the state digests of %s agree at step %s", ", ".join(o.fields["groups"]),
                             o.fields["step"])
                elif o.kind == "integrity_rollback":
                    log.error("no majority of groups agrees on the state at step %s: %s",
                              o.fields["step"], o.fields["reason"])
                elif o.kind == "coordinator_stalled":
                    log.warning("this coordinator processed nothing for %.1f s (stopped, swapped out or "
                                "starved of CPU): %s", o.fields["seconds"], o.fields["reason"])
                self._emit(o.kind, **o.fields)
            elif isinstance(o, Issued):
                self.metrics.quorum_issued(o.quorum, o.latency)
                self.dashboard.quorum_issued(o.quorum)
        if run:
            self._answer_quorum(run)

    def _answer_quorum(self, answers: dict[str, Answer]) -> None:
        """Write quorum answers in the order their members asked (``_waiters`` keeps it: a member
        enters it with its first waiting request and leaves it when answered); each member gets
        its own part."""
        for rid in [r for r in self._waiters if r in answers]:
            o = answers[rid]
            self._answer(rid, o.status, None, self._encoder.encode(o.quorum, rid))  # type: ignore[arg-type]

    def report_dead(self, replica_id: str, reason: str = "process exited") -> None:
        """A supervisor saw the replica's process end: drop it now instead of waiting for its
        heartbeat to expire, so the survivors' next quorum forms at once. Any thread."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return
        group = replica_id.split(":", 1)[0]
        loop.call_soon_threadsafe(
            lambda: self._apply(self.membership.report_dead(time.monotonic(), replica_id, group, reason)))

    def _answer(self, replica_id: str, status: int, body: dict[str, Any] | None, raw: bytes | None = None) -> None:
        waiting = self._waiters.pop(replica_id, [])
        if not waiting:
            return
        answer = (status, body, raw if raw is not None else json.dumps(body).encode())
        for fut in waiting:
            if not fut.done():
                fut.set_result(answer)

    def _emit(self, kind: str, **fields: Any) -> None:
        try:
            self.events.emit(kind, **fields)
        except Exception:  # noqa: BLE001 - a broken event sink must not take membership down
            log.exception("event sink failed on %s", kind)

    # --------------------------------------------------------------- request guard (loop thread)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        conn = self._gate.started(request.transport) if self._gate is not None else None
        try:
            response = await self._checked(request, handler)
        except web.HTTPException as e:  # aiohttp's own answers: unknown route, wrong method
            self._count(request, e.status)
            raise
        finally:
            if conn is not None:
                self._gate.finished(conn)  # type: ignore[union-attr]
        self._count(request, response.status)
        return response

    async def _checked(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.fence()
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return _too_large(None, self.config.max_request_bytes)
        except _SlowBody:
            response = _error(408, f"request body not received within {self.config.read_timeout:g} s")
            response.force_close()
            return response
        except (web.HTTPException, ConnectionError):
            raise
        except Exception as e:  # noqa: BLE001 - a bug: answer 500, keep serving, log it (rate-limited)
            self.abuse.bug(f"coordinator failed answering {request.method} {request.path[:80]}", e)
            return _error(500, "internal error; see the coordinator's log")

    def _refusal(self, request: web.Request) -> web.StreamResponse | None:
        """Why the request must not reach a handler, as its answer; None when it may."""
        headers = request.headers
        foreign = foreign_request(request.method, headers, bound=self.config.host, scheme=self.scheme,
                                  who="the coordinator", url=self.url)
        if foreign is not None:
            return _error(*foreign)
        token = self.config.token
        if token:
            given = headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode("utf-8", "replace"), f"Bearer {token}".encode()):
                if request.method == "GET" and request.path == "/":
                    return web.Response(status=401, text=render_page(None), content_type="text/html")
                return _error(401, "unauthorized: send 'Authorization: Bearer <token>'")
        not_json = non_json_post(request.method, request.content_type)
        if not_json is not None:
            return _error(*not_json)
        size = request.content_length
        if size is not None and size > self.config.max_request_bytes:
            return _too_large(size, self.config.max_request_bytes)
        return None

    def _count(self, request: web.Request, status: int) -> None:
        if status in _REFUSALS:
            self.abuse.note(f"HTTP {status}", f"{request.method} {request.path[:60]}")

    async def _read_json(self, request: web.Request) -> Any:
        """The body as strict JSON (ValueError: a 400), read within ``read_timeout`` (408)."""
        if request.content.is_eof():  # the whole body came with the headers: nothing to wait for
            return decode_body(await request.read())
        try:  # (wait_for costs a task and a timer per request: only for bodies still arriving)
            raw = await asyncio.wait_for(request.read(), self.config.read_timeout)
        except asyncio.TimeoutError:
            raise _SlowBody() from None
        return decode_body(raw)

    # ------------------------------------------------------------------- handlers (loop thread)

    async def _handle_heartbeat(self, request: web.Request) -> web.Response:
        try:
            hb = parse_heartbeat(await self._read_json(request))
        except ValueError as e:
            return _error(400, str(e))
        status, raw = self._heartbeat(hb)
        return web.Response(body=raw, status=status, content_type="application/json", charset="utf-8")

    def _heartbeat(self, hb: HeartbeatBody) -> tuple[int, bytes]:
        """A heartbeat's answer (status, JSON); both HTTP paths."""
        now = time.monotonic()
        rid = f"{hb.group}:{hb.incarnation}"
        beat = Heartbeat(rid, hb.group, now, hb.step, hb.quorum_id, hb.chain, now - hb.progress_age,
                         hb.known_head)
        try:
            answer, outputs = self.membership.heartbeat(now, beat, tick=False)
        except StaleIncarnation as e:
            return 409, _stale_body(e)
        self._apply(outputs)
        self._tick_soon()
        return 200, self._beat_json.encode(answer)

    def _queue_beat(self, hb: HeartbeatBody, conn: HotPathProtocol) -> None:
        """A heartbeat on the lean path: answered after the quorum requests read in this pass of
        the event loop and the decision they lead to.

        At 2,000 groups each group's heartbeat falls shortly before its next quorum request (an
        interval after the previous one), and a step's 2,000 heartbeats took as long to handle as
        the gap before the asks: the last ask of a step waited behind them. A heartbeat has
        seconds (``heartbeat_timeout``) where an ask holds up a training step, so heartbeats are
        answered in slices of ``_BEAT_SLICE`` s per pass of the loop, after its decisions; none
        waits more than ``_beat_max_wait``. It is recorded when it is handled, as before (a busy
        loop delayed it the same way). Loop thread."""
        self._beats.append((time.monotonic(), hb, conn))
        if self._beats_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven in-process without a loop (tests): answer now
            self._drain_beats()
            return
        self._beats_pending = True
        loop.call_soon(self._drain_beats)

    def _drain_beats(self) -> None:
        """Answer queued heartbeats for one slice (all that waited too long), after any decision
        queued for this pass (unless the oldest waited too long); queue the rest for the next pass
        of the loop."""
        self._beats_pending = False
        beats = self._beats
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None and self._tick_pending and beats and (
                time.monotonic() - beats[0][0] < self._beat_max_wait):  # decide first
            self._beats_pending = True
            loop.call_soon(self._drain_beats)
            return
        end = time.perf_counter() + _BEAT_SLICE
        while beats:
            _, hb, conn = beats.popleft()
            try:
                conn.respond(*self._heartbeat(hb))
            except Exception as e:  # noqa: BLE001 - a bug: answer 500, keep serving, log it (rate-limited)
                self.abuse.bug("coordinator failed answering POST /v1/heartbeat", e)
                conn.respond(500, b'{"error": "internal error; see the coordinator\'s log"}')
            if beats and time.perf_counter() >= end and time.monotonic() - beats[0][0] < self._beat_max_wait:
                break
        if beats and loop is not None:
            self._beats_pending = True
            loop.call_soon(self._drain_beats)

    def _quorum_hot(self, body: QuorumBody, conn: HotPathProtocol) -> None:
        """A quorum request on the lean path: as ``_handle_quorum``, the wait a ``Waiter``."""
        now = time.monotonic()
        req = member_request(body, now)
        rid = req.replica_id
        try:
            outputs = self.membership.request(now, req, tick=False)
        except StaleIncarnation as e:
            conn.respond(409, _stale_body(e))
            return
        waiter = Waiter(self, conn, req)
        self._waiters.setdefault(rid, []).append(waiter)
        heapq.heappush(self._deadlines, (now + min(body.timeout, MAX_POLL_SECONDS), next(self._seq), waiter))
        conn.on_lost = waiter.lost
        self._apply(outputs)
        self._tick_soon()

    async def _handle_leave(self, request: web.Request) -> web.Response:
        try:
            m = parse_member(await self._read_json(request))
        except ValueError as e:
            return _error(400, str(e))
        rid = f"{m.group}:{m.incarnation}"
        log.info("member %s left: %s", rid, m.reason)
        self._apply(self.membership.leave(time.monotonic(), rid, m.group, m.reason, m.at))
        return web.json_response({"replica_id": rid, "left": True})

    async def _handle_dead(self, request: web.Request) -> web.Response:
        try:
            m = parse_member(await self._read_json(request))
        except ValueError as e:
            return _error(400, str(e))
        rid = f"{m.group}:{m.incarnation}"
        self._apply(self.membership.report_dead(time.monotonic(), rid, m.group, m.reason))
        return web.json_response({"replica_id": rid, "dead": True})

    async def _handle_kill(self, request: web.Request) -> web.Response:
        try:
            group = parse_kill(await self._read_json(request))
        except ValueError as e:
            return _error(400, str(e))
        targets = self.membership.kill(group)
        if not targets:
            return _error(404, f"group {group!r} has no live replica to kill")
        log.warning("kill requested for group %s (%s)", group, ", ".join(targets))
        self.metrics.kill_requests.inc()
        self.dashboard.kill_requested(group, targets)
        return web.json_response({"group": group, "replica_ids": targets})

    async def _handle_quorum(self, request: web.Request) -> web.Response:
        try:
            body = parse_quorum_request(await self._read_json(request))
        except ValueError as e:
            return _error(400, str(e))
        now = time.monotonic()
        req = member_request(body, now)
        rid = req.replica_id
        fut: asyncio.Future[WaiterAnswer] = asyncio.get_running_loop().create_future()
        try:
            outputs = self.membership.request(now, req, tick=False)
        except StaleIncarnation as e:
            return web.Response(body=_stale_body(e), status=409, content_type="application/json")
        self._waiters.setdefault(rid, []).append(fut)
        self._apply(outputs)
        self._tick_soon()
        try:
            status, _, raw = await asyncio.wait_for(fut, min(body.timeout, MAX_POLL_SECONDS))
        except asyncio.TimeoutError:
            status = 504
            raw = json.dumps({"error": "quorum timeout", "reason": self.membership.reason}).encode()
        finally:
            waiting = self._waiters.get(rid, [])
            if fut in waiting:
                waiting.remove(fut)
                if not waiting:
                    del self._waiters[rid]
            if not fut.done() or fut.cancelled() or fut.result()[0] != 200:
                # The asker is gone or told to ask again: do not issue it a quorum nobody receives.
                self.membership.withdraw(req)
        return web.Response(body=raw, status=status, content_type="application/json", charset="utf-8")

    # ------------------------------------------------------------------------------------ status

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        """The state as ``GET /status`` shows it (first page); callable from any thread."""
        return self.call_in_loop(self._status_now, timeout)

    def status_snapshot(self, timeout: float = 5.0) -> dict[str, Any]:
        """Same as ``status()``; the name the local supervisor polls."""
        return self.status(timeout)

    def _status_now(self, offset: int = 0, limit: int = STATUS_LIMIT, now: float | None = None) -> dict[str, Any]:
        return status_json(self.membership, self.dashboard, self.config.min_replicas,
                           time.monotonic() if now is None else now, offset, limit)

    async def _handle_status(self, request: web.Request) -> web.Response:
        try:
            offset = _query_int(request, "offset", 0, 0, 2**31)
            limit = _query_int(request, "limit", STATUS_LIMIT, 1, STATUS_LIMIT)
        except ValueError as e:
            return _error(400, str(e))
        return web.json_response(self._status_now(offset, limit))

    async def _handle_page(self, request: web.Request) -> web.Response:
        return web.Response(text=render_page(self._status_now()), content_type="text/html")

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        self.metrics.refresh(now, self._state, len(self.membership.recent_dead(now)))
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})


GC_THRESHOLDS = (50_000, 50, 1_000)
"""The cyclic collector's thresholds in a coordinator process: with the defaults (700, 10, 10)
2,000 groups' messages set off a full collection every few seconds, a pause that walked every
member's records while a step's answers waited (p99 at 2,000 groups 274-403 ms with them,
202-213 ms without). Cycles are rare here; reference counting frees the rest."""


def quiet_collector() -> None:
    """For a process that serves a coordinator and nothing else: what exists after start-up is
    moved out of the collector's sight (``gc.freeze``), and collections run less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The coordinator's event loop: uvloop's where it is installed (libuv's loop costs the
    coordinator about half as much per message as asyncio's own at 2,000 groups),
    asyncio's otherwise; the server behaves the same on both."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _stale_body(e: StaleIncarnation) -> bytes:
    """The 409 answer to a refused incarnation; ``convicted`` tells a process retired for failing
    its steps (``quorum.Convicted``) from one replaced or declared hung."""
    body: dict[str, object] = {"error": str(e)}
    if isinstance(e, Convicted):
        body["convicted"] = True
        if e.suspect_state is not None:
            body["suspect_state"] = list(e.suspect_state)
    return json.dumps(body).encode()


def _too_large(size: int | None, limit: int) -> web.Response:
    got = f" ({size} bytes)" if size is not None else ""
    return _error(413, f"request body{got} over the limit of {limit} bytes")


def _query_int(request: web.Request, name: str, default: int, lowest: int, highest: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 10 and lowest <= int(raw) <= highest):
        raise ValueError(f"{name}={raw[:20]!r} must be an integer in [{lowest}, {highest}]")
    return int(raw)
