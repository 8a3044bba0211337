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
from collections import deque
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ftlm.errors import ConfigError
from ftlm.ft.config import CoordinatorConfig
from ftlm.ft.dashboard import DashboardLog, member_state, render_page
from ftlm.ft.quorum import (
    CoordinatorState,
    Heartbeat,
    MemberRequest,
    Quorum,
    QuorumOptions,
    StaleIncarnation,
    commit_quorum,
    compute_quorum,
    expire,
    record_heartbeat,
    record_request,
    withdraw_request,
)
from ftlm.observe.metrics import make_metric

log = logging.getLogger(__name__)

MAX_POLL_SECONDS = 60.0  # longest a quorum long-poll may hold a connection
DEAD_MEMORY_SECONDS = 60.0  # how long heartbeat answers keep listing a dead replica
_START_TIMEOUT = 10.0
REASON_TIMEOUT = "heartbeat timeout"
REASON_REPLACED = "replaced by new incarnation"


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
                                     config.expected_groups)
        self.metrics = _Metrics()
        self.dashboard = DashboardLog()
        self._kill: set[str] = set()  # replica ids whose heartbeat answers say "kill"
        self._state = CoordinatorState()
        self._reason = "no member has asked for a quorum"
        self._waiters: dict[str, list[asyncio.Future[_Answer]]] = {}
        self._dead: deque[tuple[float, str, str, str]] = deque()  # (monotonic time, replica id, group, reason)
        self._last_emitted_id: int | None = None
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

    def _evaluate(self, now: float) -> None:
        for rid in expire(now, self._state, self.options):
            self._mark_dead(now, rid, rid.split(":", 1)[0], REASON_TIMEOUT)
        quorum, self._reason = compute_quorum(now, self._state, self.options)
        if quorum is None:
            return
        started = self._state.round_started
        commit_quorum(self._state, quorum)
        self.metrics.quorum_issued(quorum, now - started if started is not None else 0.0)
        self.dashboard.quorum_issued(quorum)
        if quorum.quorum_id != self._last_emitted_id:
            self._last_emitted_id = quorum.quorum_id
            log.info("quorum %d at step %d: %s", quorum.quorum_id, quorum.step, quorum.reason)
            self._emit(
                "quorum",
                quorum_id=quorum.quorum_id,
                step=quorum.step,
                participants=list(quorum.participants),
                recovering=list(quorum.recovering),
                reason=quorum.reason,
            )
        body = quorum.to_json()
        for rid in quorum.replica_ids():
            self._answer(rid, (200, body))

    def report_dead(self, replica_id: str, reason: str = "process exited") -> None:
        """A supervisor saw the replica's process end: drop it now instead of waiting for its
        heartbeat to expire, so the survivors' next quorum forms at once. Any thread."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return

        def drop() -> None:
            now = time.monotonic()
            if self._state.heartbeats.pop(replica_id, None) is None:
                return  # already expired, or never known
            self._state.pending.pop(replica_id, None)
            self._mark_dead(now, replica_id, replica_id.split(":", 1)[0], reason)
            self._evaluate(now)

        loop.call_soon_threadsafe(drop)

    def _mark_dead(self, now: float, replica_id: str, group: str, reason: str) -> None:
        log.warning("member %s is dead: %s", replica_id, reason)
        self._dead.append((now, replica_id, group, reason))
        self.metrics.member_failures.inc()
        self._emit("member_dead", group=group, replica_id=replica_id, reason=reason)
        if reason == REASON_REPLACED:
            self._answer(replica_id, (409, {"error": f"{replica_id} was {reason}; this process must exit"}))
        else:
            self._answer(replica_id, (504, {"error": "quorum timeout", "reason": f"{replica_id}: {reason}"}))

    def _answer(self, replica_id: str, answer: _Answer) -> None:
        for fut in self._waiters.pop(replica_id, []):
            if not fut.done():
                fut.set_result(answer)

    def _emit(self, kind: str, **fields: Any) -> None:
        try:
            self.events.emit(kind, **fields)
        except Exception:  # noqa: BLE001 - a broken event sink must not take membership down
            log.exception("event sink failed on %s", kind)

    def _recent_dead(self, now: float) -> list[str]:
        while self._dead and now - self._dead[0][0] > DEAD_MEMORY_SECONDS:
            self._dead.popleft()
        return [rid for _, rid, _, _ in self._dead]

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
            group, incarnation, step, quorum_id = _parse_heartbeat(await self._read_json(request))
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        now = time.monotonic()
        rid = f"{group}:{incarnation}"
        try:
            replaced = record_heartbeat(self._state, Heartbeat(rid, group, now, step, quorum_id))
        except StaleIncarnation as e:
            return web.json_response({"error": str(e)}, status=409)
        for old in replaced:
            self._mark_dead(now, old, group, REASON_REPLACED)
        self._evaluate(now)
        answer = {
            "quorum_id": self._state.quorum_id,
            "alive": sorted(self._state.heartbeats),
            "dead": self._recent_dead(now),
        }
        if self._kill:
            self._kill.intersection_update(self._state.heartbeats)  # forget replicas already gone
            if rid in self._kill:
                answer["kill"] = True
        return web.json_response(answer)

    async def _handle_kill(self, request: web.Request) -> web.Response:
        try:
            group = _name_field(await self._read_json(request), "group")
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        targets = sorted(rid for rid, hb in self._state.heartbeats.items() if hb.group == group)
        if not targets:
            return web.json_response({"error": f"group {group!r} has no live replica to kill"}, status=404)
        log.warning("kill requested for group %s (%s)", group, ", ".join(targets))
        self._kill.update(targets)
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
        req = MemberRequest(rid, body.group, body.step, body.last_quorum_id, body.failed, body.meta, now)
        try:
            replaced = record_request(self._state, req)
        except StaleIncarnation as e:
            return web.json_response({"error": str(e)}, status=409)
        for old in replaced:
            self._mark_dead(now, old, body.group, REASON_REPLACED)
        fut: asyncio.Future[_Answer] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(rid, []).append(fut)
        self._evaluate(now)
        try:
            status, answer = await asyncio.wait_for(fut, min(body.timeout, MAX_POLL_SECONDS))
        except asyncio.TimeoutError:
            status, answer = 504, {"error": "quorum timeout", "reason": self._reason}
        finally:
            waiting = self._waiters.get(rid, [])
            if fut in waiting:
                waiting.remove(fut)
                if not waiting:
                    del self._waiters[rid]
            if not fut.done() or fut.cancelled() or fut.result()[0] != 200:
                # The asker is gone or told to ask again: do not issue it a quorum nobody receives.
                withdraw_request(self._state, req)
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
            "reason": self._reason,
            "members": members,
            "last_quorum": prev.to_json() if prev is not None else None,
            "dead": [
                {"replica_id": rid, "group": g, "reason": why, "seconds_ago": round(now - t, 3)}
                for t, rid, g, why in self._dead
                if now - t <= DEAD_MEMORY_SECONDS
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
        self.metrics.refresh(now, self._state, len(self._recent_dead(now)))
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


def _field(body: Any, name: str) -> Any:
    if not isinstance(body, dict):
        raise ValueError(f"body must be a JSON object, got {type(body).__name__}")
    if name not in body:
        raise ValueError(f"missing field {name!r}")
    return body[name]


def _name_field(body: Any, name: str) -> str:
    value = _field(body, name)
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"{name}={value!r} must be {_NAME_RULE}")
    return value


def _int_field(body: Any, name: str, lowest: int) -> int:
    value = _field(body, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        raise ValueError(f"{name}={value!r} must be an integer >= {lowest}")
    return value


def _parse_heartbeat(body: Any) -> tuple[str, str, int, int]:
    return (
        _name_field(body, "group"),
        _name_field(body, "incarnation"),
        _int_field(body, "step", 0),
        _int_field(body, "quorum_id", -1),
    )


def _parse_quorum_request(body: Any) -> _QuorumBody:
    failed, meta, timeout = _field(body, "failed"), _field(body, "meta"), _field(body, "timeout")
    if not isinstance(failed, bool):
        raise ValueError(f"failed={failed!r} must be true or false")
    if not isinstance(meta, dict):
        raise ValueError(f"meta must be a JSON object, got {type(meta).__name__}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be a number of seconds > 0 (at most {MAX_POLL_SECONDS:g} used)")
    return _QuorumBody(
        _name_field(body, "group"),
        _name_field(body, "incarnation"),
        _int_field(body, "step", 0),
        _int_field(body, "last_quorum_id", -1),
        failed,
        meta,
        float(timeout),
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

    def refresh(self, now: float, state: CoordinatorState, dead: int) -> None:
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
