"""The coordinator server: an HTTP shell around the pure quorum decision of ``ftlm.ft.quorum``.

Responsible for: receiving heartbeats and quorum requests from group leaders, answering quorum
long-polls, re-evaluating on every request and on a tick (so join and heartbeat timeouts fire
without traffic), the status page, Prometheus metrics, auth, size limits and input validation.

Not responsible for: the rules of the quorum (``quorum.compute_quorum``), the per-step protocol
of a group (``ftlm.ft.manager``), or restarting anything. It holds only soft state; after a restart
it rebuilds itself from the next heartbeats and never issues an id below one members report.

Endpoints (all require ``Authorization: Bearer <token>`` when a token is configured, ``GET /``
and ``GET /metrics`` included, as DESIGN.md section 9 asks; Prometheus sends it with
``authorization: {credentials: ...}``):
  POST /v1/heartbeat  {group, incarnation, step, quorum_id} -> {quorum_id, alive, dead}
  POST /v1/quorum     {group, incarnation, step, last_quorum_id, failed, meta, timeout}
                      -> 200 Quorum JSON | 504 {error, reason} | 409 {error} (replaced incarnation)
  POST /v1/kill       {group} -> {replica_ids} | 404 {error}: marks the group's live replica; its
                      next heartbeat answers carry ``"kill": true`` (chaos drills; its manager kills it)
  GET  /status        JSON;  GET / the live dashboard (``ftlm.ft.dashboard``);  GET /metrics Prometheus.
The one exception to the token: ``GET /`` without it answers 401 with the dashboard page but no
data, so a browser can load it and send the token (taken from ``#token=...``) with its requests.
All asyncio state is touched only from the server's own event loop thread.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ftlm.errors import ConfigError
from ftlm.ft.config import CoordinatorConfig
from ftlm.ft.dashboard import DashboardLog, member_state, render_page
from ftlm.ft.history import is_chain
from ftlm.ft.membership import DEAD_MEMORY_SECONDS, Answer, Event, Issued, Membership, Output
from ftlm.ft.quorum import MAX_CLAIM, Heartbeat, MemberRequest, Quorum, QuorumOptions, StaleIncarnation
from ftlm.observe.metrics import make_metric

log = logging.getLogger(__name__)

MAX_POLL_SECONDS = 60.0  # longest a quorum long-poll may hold a connection
_START_TIMEOUT = 10.0


class _NoEvents:
    """Null event sink used when the coordinator has no run directory."""

    def emit(self, kind: str, **fields: Any) -> None:
        pass


# What a waiting long-poll is woken with: (HTTP status, JSON body).
_Answer = tuple[int, dict[str, Any]]


class Coordinator:
    """One job's coordinator, served from a background thread with its own event loop."""

    def __init__(self, config: CoordinatorConfig, events: Any = None) -> None:
        self.config = config
        self.events = events if events is not None else _NoEvents()
        self.options = QuorumOptions(config.min_replicas, config.join_timeout, config.heartbeat_timeout,
                                     config.expected_groups, progress_timeout=config.progress_timeout)
        self.metrics = _Metrics()
        self.dashboard = DashboardLog()
        self.membership = Membership(self.options)
        self._waiters: dict[str, list[asyncio.Future[_Answer]]] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._port: int | None = None

    # ----------------------------------------------------------------- lifecycle (caller's thread)

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the coordinator is not started; call start() first")
        return self._port

    @property
    def url(self) -> str:
        host = self.config.host
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def start(self) -> str:
        """Start serving in a background thread; returns the base URL once it accepts connections."""
        if self._thread is not None:
            raise RuntimeError("Coordinator.start() called twice; create a new Coordinator instead")
        self._thread = threading.Thread(target=self._run_loop, name="ftlm-coordinator", daemon=True)
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT):
            raise RuntimeError(f"the coordinator did not start within {_START_TIMEOUT} s")
        if self._start_error is not None:
            self._thread.join(_START_TIMEOUT)
            err = self._start_error
            raise ConfigError(
                f"coordinator cannot listen on {self.config.host}:{self.config.port}: {err} "
                "(choose another coordinator.port, or 0 for any free port)"
            ) from err
        log.info("coordinator listening on %s", self.url)
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
        url = self.start()
        stop = threading.Event()
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda *_: stop.set())
        print(f"ftlm coordinator listening on {url} (Ctrl-C to stop)", flush=True)
        try:
            while not stop.wait(0.5) and self._thread is not None and self._thread.is_alive():
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.stop()

    def _run_loop(self) -> None:
        loop = asyncio.new_event_loop()
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

    async def _startup(self) -> None:
        app = web.Application(middlewares=[self._guard], client_max_size=self.config.max_request_bytes)
        app.router.add_post("/v1/heartbeat", self._handle_heartbeat)
        app.router.add_post("/v1/quorum", self._handle_quorum)
        app.router.add_post("/v1/kill", self._handle_kill)
        app.router.add_post("/v1/leave", self._handle_leave)
        app.router.add_post("/v1/dead", self._handle_dead)
        app.router.add_get("/status", self._handle_status)
        app.router.add_get("/metrics", self._handle_metrics)
        app.router.add_get("/", self._handle_page)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self._port = int(self._runner.addresses[0][1])
        self._tick_task = asyncio.get_running_loop().create_task(self._tick())

    async def _shutdown(self) -> None:
        if self._tick_task is not None:
            self._tick_task.cancel()
        for rid in list(self._waiters):
            self._answer(rid, (503, {"error": "coordinator stopping; ask again"}))
        await asyncio.sleep(0)  # let the woken handlers write their answers
        if self._runner is not None:
            await self._runner.cleanup()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_interval)
            try:
                self._evaluate(time.monotonic())
            except Exception:  # noqa: BLE001 - a bug must not stop failure detection for good
                log.exception("coordinator tick failed")

    # ------------------------------------------------------------------ decisions (loop thread)

    @property
    def _state(self):
        return self.membership.state

    def _evaluate(self, now: float) -> None:
        self._apply(self.membership.tick(now))

    def _apply(self, outputs: list[Output]) -> None:
        """Carry out what the membership state machine decided: answers, events, metrics."""
        for o in outputs:
            if isinstance(o, Answer):
                self._answer(o.replica_id, (o.status, o.body))
            elif isinstance(o, Event):
                if o.kind == "member_dead":
                    log.warning("member %s is dead: %s", o.fields["replica_id"], o.fields["reason"])
                    self.metrics.member_failures.inc()
                elif o.kind == "restore":
                    log.warning("rollback from step %s to step %s: %s", o.fields["from_step"],
                                o.fields["to_step"], o.fields["reason"])
                elif o.kind == "quorum":
                    log.info("quorum %d at step %d: %s", o.fields["quorum_id"], o.fields["step"],
                             o.fields["reason"])
                self._emit(o.kind, **o.fields)
            elif isinstance(o, Issued):
                self.metrics.quorum_issued(o.quorum, o.latency)
                self.dashboard.quorum_issued(o.quorum)

    def report_dead(self, replica_id: str, reason: str = "process exited") -> None:
        """A supervisor saw the replica's process end: drop it now instead of waiting for its
        heartbeat to expire, so the survivors' next quorum forms at once. Any thread."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return
        group = replica_id.split(":", 1)[0]
        loop.call_soon_threadsafe(
            lambda: self._apply(self.membership.report_dead(time.monotonic(), replica_id, group, reason)))

    def _answer(self, replica_id: str, answer: _Answer) -> None:
        for fut in self._waiters.pop(replica_id, []):
            if not fut.done():
                fut.set_result(answer)

    def _emit(self, kind: str, **fields: Any) -> None:
        try:
            self.events.emit(kind, **fields)
        except Exception:  # noqa: BLE001 - a broken event sink must not take membership down
            log.exception("event sink failed on %s", kind)

    # ------------------------------------------------------------------- handlers (loop thread)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        token = self.config.token
        if token:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                if request.method == "GET" and request.path == "/":
                    return web.Response(status=401, text=_render_status_html(None), content_type="text/html")
                return web.json_response({"error": "unauthorized: send 'Authorization: Bearer <token>'"}, status=401)
        size = request.content_length
        if size is not None and size > self.config.max_request_bytes:
            return _too_large(size, self.config.max_request_bytes)
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return _too_large(None, self.config.max_request_bytes)

    async def _read_json(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"body is not valid JSON: {e}") from e

    async def _handle_heartbeat(self, request: web.Request) -> web.Response:
        try:
            hb = _parse_heartbeat(await self._read_json(request))
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        now = time.monotonic()
        rid = f"{hb.group}:{hb.incarnation}"
        beat = Heartbeat(rid, hb.group, now, hb.step, hb.quorum_id, hb.chain, now - hb.progress_age,
                         hb.known_head)
        try:
            answer, outputs = self.membership.heartbeat(now, beat)
        except StaleIncarnation as e:
            return web.json_response({"error": str(e)}, status=409)
        self._apply(outputs)
        return web.json_response(answer)

    async def _handle_leave(self, request: web.Request) -> web.Response:
        try:
            body = await self._read_json(request)
            group, incarnation = _name_field(body, "group"), _name_field(body, "incarnation")
            reason = _text_field(body, "reason")
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        rid = f"{group}:{incarnation}"
        log.info("member %s left: %s", rid, reason)
        self._apply(self.membership.leave(time.monotonic(), rid, group, reason))
        return web.json_response({"replica_id": rid, "left": True})

    async def _handle_dead(self, request: web.Request) -> web.Response:
        try:
            body = await self._read_json(request)
            group, incarnation = _name_field(body, "group"), _name_field(body, "incarnation")
            reason = _text_field(body, "reason")
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        rid = f"{group}:{incarnation}"
        self._apply(self.membership.report_dead(time.monotonic(), rid, group, reason))
        return web.json_response({"replica_id": rid, "dead": True})

    async def _handle_kill(self, request: web.Request) -> web.Response:
        try:
            group = _name_field(await self._read_json(request), "group")
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        targets = self.membership.kill(group)
        if not targets:
            return web.json_response({"error": f"group {group!r} has no live replica to kill"}, status=404)
        log.warning("kill requested for group %s (%s)", group, ", ".join(targets))
        self.metrics.kill_requests.inc()
        self.dashboard.kill_requested(group, targets)
        return web.json_response({"group": group, "replica_ids": targets})

    async def _handle_quorum(self, request: web.Request) -> web.Response:
        try:
            body = _parse_quorum_request(await self._read_json(request))
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        now = time.monotonic()
        rid = f"{body.group}:{body.incarnation}"
        req = MemberRequest(rid, body.group, body.step, body.last_quorum_id, body.failed, body.meta, now,
                            body.chain)
        fut: asyncio.Future[_Answer] = asyncio.get_running_loop().create_future()
        try:
            outputs = self.membership.request(now, req)
        except StaleIncarnation as e:
            return web.json_response({"error": str(e)}, status=409)
        self._waiters.setdefault(rid, []).append(fut)
        self._apply(outputs)
        try:
            status, answer = await asyncio.wait_for(fut, min(body.timeout, MAX_POLL_SECONDS))
        except asyncio.TimeoutError:
            status, answer = 504, {"error": "quorum timeout", "reason": self.membership.reason}
        finally:
            waiting = self._waiters.get(rid, [])
            if fut in waiting:
                waiting.remove(fut)
                if not waiting:
                    del self._waiters[rid]
            if not fut.done() or fut.cancelled() or fut.result()[0] != 200:
                # The asker is gone or told to ask again: do not issue it a quorum nobody receives.
                self.membership.withdraw(req)
        return web.json_response(answer, status=status)

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        """The state as ``GET /status`` shows it; callable from any thread."""
        loop = self._loop
        if loop is not None and loop.is_running() and threading.current_thread() is not self._thread:
            return asyncio.run_coroutine_threadsafe(self._status_async(), loop).result(timeout)
        return self._status_now()

    def status_snapshot(self, timeout: float = 5.0) -> dict[str, Any]:
        """Same as ``status()``; the name the local supervisor polls."""
        return self.status(timeout)

    async def _status_async(self) -> dict[str, Any]:
        return self._status_now()

    def _status_now(self) -> dict[str, Any]:
        now = time.monotonic()
        prev: Quorum | None = self._state.prev_quorum
        members = [
            {
                "group": hb.group,
                "replica_id": rid,
                "incarnation": rid.partition(":")[2],
                "state": member_state(rid, prev),
                "step": hb.step,
                "heartbeat_age_seconds": round(now - hb.last_seen, 3),
                "pending": rid in self._state.pending,
            }
            for rid, hb in sorted(self._state.heartbeats.items(), key=lambda kv: kv[1].group)
        ]
        return {
            "quorum_id": self._state.quorum_id,
            "reason": self.membership.reason,
            "head_step": self._state.max_step,
            "members": members,
            "last_quorum": prev.to_json() if prev is not None else None,
            "dead": [
                {"replica_id": rid, "group": g, "reason": why, "seconds_ago": round(now - t, 3)}
                for t, rid, g, why in self.membership.recent_dead(now)
            ],
            "min_replicas": self.config.min_replicas,
            **self.dashboard.to_json(),
        }

    async def _handle_status(self, request: web.Request) -> web.Response:
        return web.json_response(self._status_now())

    async def _handle_page(self, request: web.Request) -> web.Response:
        return web.Response(text=_render_status_html(self._status_now()), content_type="text/html")

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        self.metrics.refresh(now, self._state, len(self.membership.recent_dead(now)))
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})


def _too_large(size: int | None, limit: int) -> web.Response:
    got = f" ({size} bytes)" if size is not None else ""
    return web.json_response({"error": f"request body{got} over the limit of {limit} bytes"}, status=413)


# ---------------------------------------------------------------------------- request validation

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_NAME_RULE = "1-64 letters, digits, '_', '.' or '-' (no ':')"


@dataclass
class _QuorumBody:
    group: str
    incarnation: str
    step: int
    last_quorum_id: int
    failed: bool
    meta: dict[str, Any]
    timeout: float
    chain: str


@dataclass
class _HeartbeatBody:
    group: str
    incarnation: str
    step: int
    quorum_id: int
    chain: str
    progress_age: float
    known_head: int


def _field(body: Any, name: str) -> Any:
    if not isinstance(body, dict):
        raise ValueError(f"body must be a JSON object, got {type(body).__name__}")
    if name not in body:
        raise ValueError(f"missing field {name!r}")
    return body[name]


def _name_field(body: Any, name: str) -> str:
    value = _field(body, name)
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"{name}={str(value)[:80]!r} must be {_NAME_RULE}")
    return value


def _text_field(body: Any, name: str, default: str = "") -> str:
    value = body.get(name, default) if isinstance(body, dict) else default
    if not isinstance(value, str) or len(value) > 200:
        raise ValueError(f"{name} must be a string of at most 200 characters")
    return value


def _int_field(body: Any, name: str, lowest: int) -> int:
    value = _field(body, name)
    if not isinstance(value, int) or isinstance(value, bool) or not lowest <= value <= MAX_CLAIM:
        raise ValueError(f"{name}={str(value)[:80]} must be an integer in [{lowest}, 2**53]")
    return value


def _chain_field(body: Any) -> str:
    from ftlm.ft.history import GENESIS
    value = body.get("chain", GENESIS) if isinstance(body, dict) else GENESIS
    if not is_chain(value):
        raise ValueError(f"chain={str(value)[:80]!r} must be 64 lowercase hex digits")
    return value


def _parse_heartbeat(body: Any) -> _HeartbeatBody:
    age = body.get("progress_age", 0.0) if isinstance(body, dict) else 0.0
    if not isinstance(age, (int, float)) or isinstance(age, bool) or not 0 <= age < 1e9:
        raise ValueError(f"progress_age={str(age)[:80]} must be a number of seconds >= 0")
    return _HeartbeatBody(
        _name_field(body, "group"),
        _name_field(body, "incarnation"),
        _int_field(body, "step", 0),
        _int_field(body, "quorum_id", -1),
        _chain_field(body),
        float(age),
        _int_field(body, "known_head", 0) if isinstance(body, dict) and "known_head" in body else 0,
    )


def _parse_quorum_request(body: Any) -> _QuorumBody:
    failed, meta, timeout = _field(body, "failed"), _field(body, "meta"), _field(body, "timeout")
    if not isinstance(failed, bool):
        raise ValueError(f"failed={str(failed)[:80]!r} must be true or false")
    if not isinstance(meta, dict):
        raise ValueError(f"meta must be a JSON object, got {type(meta).__name__}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < 1e9:
        raise ValueError(f"timeout={str(timeout)[:80]} must be a number of seconds > 0 (at most {MAX_POLL_SECONDS:g} used)")
    return _QuorumBody(
        _name_field(body, "group"),
        _name_field(body, "incarnation"),
        _int_field(body, "step", 0),
        _int_field(body, "last_quorum_id", -1),
        failed,
        meta,
        float(timeout),
        _chain_field(body),
    )


# ----------------------------------------------------------------------------------- metrics


class _Metrics:
    """The coordinator's Prometheus metrics, in a registry of its own (several may share a process).

    Names and help texts live in ``ftlm.observe.metrics``; members by state are one gauge per
    state because the design allows no labels but job, group and rank.
    """

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.quorum_id = make_metric("ftlm_coordinator_quorum_id", r)
        self.members = make_metric("ftlm_coordinator_members", r)
        self.by_state = {state: make_metric(f"ftlm_coordinator_members_{state}", r)
                         for state in ("participating", "recovering", "joining", "dead")}
        self.participants = make_metric("ftlm_coordinator_participants", r)
        self.heartbeat_age = make_metric("ftlm_coordinator_heartbeat_age_seconds", r, ("group",))
        self.quorums = make_metric("ftlm_coordinator_quorums_issued_total", r)
        self.member_failures = make_metric("ftlm_coordinator_member_failures_total", r)
        self.kill_requests = make_metric("ftlm_coordinator_kill_requests_total", r)
        self.latency = make_metric("ftlm_coordinator_quorum_latency_seconds", r)

    def quorum_issued(self, quorum: Quorum, latency: float) -> None:
        self.quorums.inc()
        self.latency.observe(max(latency, 0.0))
        self.quorum_id.set(quorum.quorum_id)
        self.participants.set(len(quorum.participants))

    def refresh(self, now: float, state: Any, dead: int) -> None:
        """Set the gauges that derive from the state (called on each scrape); ``dead``: recent deaths."""
        self.members.set(len(state.heartbeats))
        counts = {"participating": 0, "recovering": 0, "joining": 0}
        for rid in state.heartbeats:
            counts[member_state(rid, state.prev_quorum)] += 1
        for name, n in counts.items():
            self.by_state[name].set(n)
        self.by_state["dead"].set(dead)
        self.heartbeat_age.clear()  # groups that left must not linger as stale series
        for hb in state.heartbeats.values():
            self.heartbeat_age.labels(group=hb.group).set(max(now - hb.last_seen, 0.0))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# --------------------------------------------------------------------------------- status page


def _render_status_html(status: dict[str, Any] | None) -> str:
    """The live dashboard page; ``status`` None for a caller without the token (no data shown)."""
    return render_page(status)
