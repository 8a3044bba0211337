"""Load test of the real coordinator: N simulated groups heartbeating every second and asking for a
quorum every step at one step per second.

``python -m bench.coordinator_load --groups 2000 --seconds 30`` measures one size;
``python -m bench.coordinator_load --sweep 100,500,1000,2000,4000 --seconds 20`` measures each and
rewrites this benchmark's section of BENCHMARKS.md (``--no-write`` leaves it alone).

What runs for real: ``ftlm coordinator`` in a process of its own (its CPU and memory are read from
/proc, apart from the clients'), over HTTP on 127.0.0.1, with the request bodies and headers of
``ftlm.ft.client.CoordinatorClient`` (which speaks through ``http.client``: the same header lines
are sent here). What is simulated: the groups, all in this one asyncio process, each with two
keep-alive connections as a real leader has (its quorum thread's and its heartbeat thread's),
spoken over by a lean HTTP/1.1 client of this module (``LeanConnection``: pre-built header bytes,
byte-template bodies, Content-Length answers, driven by timer and protocol callbacks rather than a
task per group; aiohttp's client cost ~0.2 ms a request, so 2,000 groups' clients alone took most
of a core on the 2-core box): a group "trains" by waiting for its next step time, commits the
quorum's step (the answer's ``next_chain``) and asks again with the new state; heartbeats report the
committed state, and, as ``ftlm.ft.client.Heartbeater`` does, a group skips a heartbeat when its
quorum request went out within the heartbeat interval. Each member reads and parses its own compact
answer (``ftlm.ft.quorum_answer``).

Measured, over the steady window (after the first quorum and a warm-up, before the failure drill):
quorum latency per request (ask to answer, which includes waiting for the slowest peer of the
step) p50/p99, the achieved steps per second, coordinator CPU (process CPU seconds per wall second)
and RSS, and the client process's CPU (if it is near 100%, the clients, not the coordinator, limit
what is measured). Failure detection: a few seconds before the end one group stops heartbeating and
asking; detection latency is the time from its last answered heartbeat until a heartbeat answer of
another group names it dead, and the time until the first quorum without it is issued. With
``--trace`` the coordinator process also timestamps each quorum request and answer (bench-only
patches, ``traced_coordinator``) and each latency is cut into its parts (``decompose``): the
other groups' asks, the coordinator's socket, deciding and fan-out, the load generator's read.
``--pin`` runs the coordinator's process on one CPU and the load generator on the others (a
coordinator with a core of its own, as on a host of its own).

Not measured here: the real manager's step protocol (``tests/ft``, ``ftlm sim check``), TLS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from ftlm.ft.client import CoordinatorClient
from ftlm.ft.coordinator import new_event_loop, quiet_collector
from ftlm.ft.history import GENESIS

STEP_SECONDS = 1.0
HEARTBEAT_SECONDS = 1.0
HEARTBEAT_TIMEOUT = 3.0
HOT_PATH_ENV: dict[str, dict[str, str]] = {"built": {}, "compiled": {"FTLM_NATIVE": "1"},
                                           "interpreted": {"FTLM_NATIVE": "0"}}
"""``--hot-path``: the coordinator's modules as ``make setup`` left them, compiled (an error if they
are not built) or interpreted (``ftlm.native``)."""
"""The coordinator's ``ft.heartbeat_timeout`` here: three missed heartbeats at one per second."""
WARMUP_STEPS = 3
RAMP_RATE = 500.0
"""Groups that start per second."""
DRILL_BEFORE_END = 8.0
"""Seconds before the end at which one group stops (its detection is then measured)."""
META = {"store": "10.0.0.1:29500", "transfer": ["http://10.0.0.1:29600"], "recover_request": 0}
"""What a real manager puts in ``meta`` (sizes the quorum answers like a real job's)."""
SWEEP = (100, 500, 1000, 2000, 4000)


class LeanConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of a simulated group: one request at a time, answers
    with a Content-Length body, driven by callbacks (no task per group: a step's 2,000 asks and
    answers would each be a task switch of the load generator's one thread)."""

    def __init__(self, host: str, port: int, headers: dict[str, str], path: str) -> None:
        self.host, self.port = host, port
        lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Accept-Encoding: identity"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        self._head = ("\r\n".join(lines) + "\r\nContent-Length: ").encode()
        self.transport: asyncio.Transport | None = None
        self._buf = b""
        self._done: Callable[[int, bytes, float], None] | None = None
        self._failed: Callable[[BaseException], None] | None = None
        self._length = -1  # the body length of the answer being read, -1 before its headers
        self.sent_at = 0.0  # when the last request was handed to the kernel

    @property
    def connected(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    async def connect(self) -> None:
        await asyncio.get_running_loop().create_connection(lambda: self, self.host, self.port)

    def send(self, body: bytes, done: Callable[[int, bytes, float], None],
             failed: Callable[[BaseException], None]) -> None:
        """Write a request with ``body`` now (the connection must be open); ``done(status, body,
        when its last byte was read)`` is called from the protocol callback when the answer is
        read (the time is taken there, not when a waiting task would run again), ``failed``
        when the connection closes first."""
        self._done, self._failed = done, failed
        self.transport.write(b"%s%d\r\n\r\n%s" % (self._head, len(body), body))  # type: ignore[union-attr]
        self.sent_at = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._buf, self._length = b"", -1

    def data_received(self, data: bytes) -> None:
        self._buf = self._buf + data if self._buf else data
        while True:
            if self._length < 0:
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = self._buf[:end]
                found = _CONTENT_LENGTH.search(head)
                self._status = int(head[9:12])
                self._length = int(found.group(1)) if found else 0
                self._buf = self._buf[end + 4:]
            if len(self._buf) < self._length:
                return
            body, self._buf = self._buf[:self._length], self._buf[self._length:]
            self._length = -1
            done, self._done, self._failed = self._done, None, None
            if done is not None:
                done(self._status, body, time.monotonic())

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        failed, self._done, self._failed = self._failed, None, None
        if failed is not None:
            failed(ConnectionResetError(f"connection closed: {exc}"))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)


def body_template(body: dict[str, Any], fields: dict[str, Any]) -> bytes:
    """``json.dumps(body)`` as a %-template whose ``fields`` (name -> "%d", or "\"%s\"" for a string
    that needs no escaping) are filled in per request: the bytes ``CoordinatorClient`` would send,
    without building and encoding a dict each time (the load generator's cost, not a real group's)."""
    marks = {name: f"\x00{k}\x00" for k, name in enumerate(fields)}
    text = json.dumps({**body, **{name: marks[name] for name in fields if name in body}})
    text = text.replace("%", "%%")
    for name, fmt in fields.items():
        text = text.replace(json.dumps(marks[name]), fmt)
    return text.encode()


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank); NaN without values (printed as "-" in the table)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class CoordinatorUnderTest:
    """``ftlm coordinator --port 0`` in its own process; CPU and memory from /proc."""

    def __init__(self, groups: int, token: str, log_path: Path, heartbeat: float = HEARTBEAT_SECONDS,
                 trace: Path | None = None, floor: bool = False, cpus: set[int] | None = None,
                 hot_path: str = "built") -> None:
        sets = [f"ft.groups={groups}", f"ft.heartbeat_interval={heartbeat}",
                f"ft.heartbeat_timeout={HEARTBEAT_TIMEOUT}", "ft.join_timeout=5.0", "ft.min_replicas=1",
                # two connections a group (as real leaders), as a job of that many groups must set it
                f"ft.coordinator_max_connections={max(4096, 2 * groups + 64)}"]
        code = "import sys; from ftlm.cli import main; sys.exit(main())"
        if trace is not None:  # the same command, with the bench's timestamps (traced_coordinator)
            code = f"import sys; from bench.coordinator_load import traced_coordinator; sys.exit(traced_coordinator({str(trace)!r}))"
        cmd = [sys.executable, "-c", code, "coordinator", "--port", "0"]
        for s in sets:
            cmd += ["--set", s]
        if floor:  # bench.coordinator_floor in its place: the least a server can do for this load
            cmd = [sys.executable, "-m", "bench.coordinator_floor", str(groups)]
        env = {**os.environ, "FTLM_TOKEN": token, **HOT_PATH_ENV[hot_path]}
        self.hot_path = "-"  # what the coordinator says it runs (``ftlm.native``)
        self.log_path = log_path
        self._log = open(log_path, "w")
        # ``cpus``: the coordinator's process (every thread it starts) runs on these CPUs only.
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, env=env, text=True,
                                     preexec_fn=pin)
        self.url = self._wait_for_url()

    def _wait_for_url(self) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            found = re.search(r"listening on (http://\S+)", line)
            if found:
                said = re.search(r"hot path (compiled|interpreted)", line)
                self.hot_path = said.group(1) if said else "-"
                return found.group(1)
        self.stop()
        raise RuntimeError(f"the coordinator did not start; see {self.log_path}")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def memory_mib(self) -> tuple[float, float]:
        """(RSS, peak RSS) in MiB."""
        found = dict(line.split(":", 1) for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
                     if ":" in line)
        return int(found["VmRSS"].split()[0]) / 1024, int(found["VmHWM"].split()[0]) / 1024

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@dataclass
class Result:
    groups: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    after_last: list[float] = field(default_factory=list)  # answer time - the step's last ask
    steps: int = 0
    steady_seconds: float = 0.0
    coord_cpu: float = 0.0
    client_cpu: float = 0.0
    rss_mib: float = 0.0
    peak_rss_mib: float = 0.0
    detect_dead: float | None = None
    detect_quorum: float | None = None
    errors: dict[str, int] = field(default_factory=dict)
    answer_bytes: int = 0
    first_quorum_seconds: float = 0.0
    messages: int = 0  # heartbeats and quorum requests answered in the steady window
    machine_us: float = 0.0  # the sans-I/O state machine's time per message, in-process
    heartbeat: float = HEARTBEAT_SECONDS  # the groups' heartbeat interval
    parts: dict[str, float] = field(default_factory=dict)  # the --trace decomposition (ms)
    hot_path: str = "-"  # compiled or interpreted (``ftlm.native``), as the coordinator said

    def parts_row(self) -> list[str]:
        """The decomposition table's row (``--trace``)."""
        p = self.parts
        pair = (lambda k: f"{p[k + ' p50']:.0f} / {p[k + ' p99']:.0f}")
        one = (lambda k: f"{p[k + ' p50']:.0f}")
        return [str(self.groups), f"{self.heartbeat:g}", self.hot_path, pair("total"), pair("peers"), one("last ask late"),
                pair("socket"), one("decide"), one("fan-out"), pair("coordinator"), pair("client"),
                f"{p['handling us']:.0f}"]

    def row(self) -> list[str]:
        lat = self.latencies
        rate = self.steps / self.steady_seconds if self.steady_seconds else 0.0
        fmt = (lambda v: "-" if v is None else f"{v:.2f}")
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "0"
        per_message = self.coord_cpu * self.steady_seconds / self.messages * 1e3 if self.messages else float("nan")
        last = self.after_last
        ms = (lambda values, q: f"{_percentile(values, q) * 1000:.0f}" if values else "-")
        return [str(self.groups), f"{self.heartbeat:g}", self.hot_path, ms(lat, 0.5), ms(lat, 0.99), ms(last, 0.5), ms(last, 0.99), f"{rate:.2f}", fmt(self.detect_dead), fmt(self.detect_quorum),
                f"{self.coord_cpu * 100:.0f}%", f"{self.messages / self.steady_seconds:.0f}" if self.steady_seconds else "-",
                f"{per_message:.2f}", f"{self.machine_us:.0f}",
                f"{self.rss_mib:.0f} ({self.peak_rss_mib:.0f})",
                f"{self.client_cpu * 100:.0f}%", f"{self.answer_bytes / 1024:.0f}", errors]


HEADERS = ["groups", "heartbeat s", "hot path", "quorum p50 (ms)", "quorum p99 (ms)", "after the last ask p50 (ms)",
           "after the last ask p99 (ms)", "steps/s", "detected dead (s)",
           "quorum without it (s)", "coordinator CPU", "messages/s", "coordinator CPU ms/message",
           "state machine us/message", "coordinator RSS MiB (peak)", "client CPU", "quorum answer KiB",
           "errors"]


PARTS_HEADERS = ["groups", "heartbeat s", "hot path", "quorum ms p50 / p99", "(1) peers' asks ms", "of which the last ask late ms",
                 "(2) last ask in the socket ms", "(3a) decide ms", "(3b) fan-out ms", "(3) coordinator ms",
                 "(4) load generator reads ms", "quorum request handled in us"]


def state_machine_us(groups: int, hot_path: str) -> float:
    """``state_machine_seconds_per_message`` in microseconds, in a process of its own that runs the
    coordinator's modules as ``hot_path`` says."""
    code = ("import sys; from bench.coordinator_load import state_machine_seconds_per_message as f; "
            f"print(f({groups}))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **HOT_PATH_ENV[hot_path]},
                         capture_output=True, text=True, timeout=600, check=True)
    return float(out.stdout.split()[-1]) * 1e6


def state_machine_seconds_per_message(groups: int, messages: int = 4000) -> float:
    """The sans-I/O ``Membership`` alone, in this process: seconds per heartbeat or quorum request
    of a steady job (every group asks, the last request issues the quorum, every group reports
    the commit in a heartbeat); best of 3. No HTTP, no JSON: what the protocol's rules cost."""
    from ftlm.ft.membership import Issued, Membership
    from ftlm.ft.quorum import Heartbeat, MemberRequest, QuorumOptions

    best = float("inf")
    for _ in range(3):
        m = Membership(QuorumOptions(1, 5.0, 30.0, groups), epoch="bench")
        rids = [f"g{i:05d}:a" for i in range(groups)]
        now = 0.0
        for r in rids:
            m.heartbeat(now, Heartbeat(r, r[:6], now, 0))
        claims = dict.fromkeys(rids, (0, GENESIS, -1))
        sent, start = 0, time.perf_counter()
        while sent < messages:
            quorum = None
            for r in rids:
                now += 1e-4
                step, chain, qid = claims[r]
                for o in m.request(now, MemberRequest(r, r[:6], step, qid, False, dict(META), now, chain)):
                    quorum = o.quorum if isinstance(o, Issued) else quorum
            assert quorum is not None, m.reason
            step, chain, qid = quorum.step + 1, quorum.next_chain(), quorum.quorum_id
            for r in rids:
                now += 1e-4
                claims[r] = (step, chain, qid)
                m.heartbeat(now, Heartbeat(r, r[:6], now, step, qid, chain))
            sent += 2 * groups
        best = min(best, (time.perf_counter() - start) / sent)
    return best


class LoadTest:
    """The simulated groups of one run: two ``LeanConnection`` s each, driven by timer and protocol
    callbacks on one event loop; ``/status`` (the failure drill's watcher) through an aiohttp
    session."""

    def __init__(self, url: str, groups: int, seconds: float, token: str,
                 heartbeat: float = HEARTBEAT_SECONDS) -> None:
        self.url = url
        self.heartbeat = heartbeat
        self.n = groups
        self.seconds = seconds
        self.clients = [CoordinatorClient(url, f"g{i:05d}", "a", token=token) for i in range(groups)]
        self.headers = self.clients[0].headers
        where = url.split("://", 1)[1]
        self.host, self.port = where.rsplit(":", 1)[0], int(where.rsplit(":", 1)[1])
        # Each group's two keep-alive connections (its quorum thread's and its heartbeat thread's).
        self.conns = {(i, path): LeanConnection(self.host, self.port, self.headers, path)
                      for i in range(groups) for path in ("/v1/quorum", "/v1/heartbeat")}
        # The bodies CoordinatorClient sends, as templates (checked against it below).
        self.ask_bodies = [body_template(c.quorum_body(0, 0, False, META, 30.0, GENESIS),
                                         {"step": "%d", "last_quorum_id": "%d", "chain": "\"%s\""})
                           for c in self.clients]
        self.beat_bodies = [body_template(c.heartbeat_body(0, 0, GENESIS),
                                          {"step": "%d", "quorum_id": "%d", "chain": "\"%s\"", "known_head": "%d"})
                            for c in self.clients]
        c = self.clients[-1]
        assert self.ask_bodies[-1] % (7, 3, GENESIS.encode()) == json.dumps(
            c.quorum_body(7, 3, False, META, 30.0, GENESIS)).encode()
        assert self.beat_bodies[-1] % (7, 3, GENESIS.encode(), 7) == json.dumps(c.heartbeat_body(7, 3, GENESIS)).encode()
        self.state = [(0, GENESIS, -1) for _ in range(groups)]  # (step, chain, last quorum id)
        self.stopped = [False] * groups
        self.asked_at = [float("-inf")] * groups  # a quorum request is a heartbeat (the client skips one)
        self.samples: list[tuple[float, float, int]] = []  # (answer time, latency, quorum step)
        self.errors: dict[str, int] = {}
        self.victim = groups // 2
        self.victim_last_beat: float | None = None
        self.victim_stopped_at: float | None = None
        self.dead_seen_at: float | None = None
        self.excluded_at: float | None = None
        self.first_quorum_at: float | None = None
        self.answer_bytes = 0
        self.end = 0.0
        self.first_timeout = ""  # the first 504 answer (when and why), for the report
        self.answered: list[float] = []  # when each heartbeat or quorum request was answered
        self.last_ask: dict[int, float] = {}  # step -> when the last group asked for its quorum
        # (group, step asked for, when it meant to ask, request written to the socket, answer
        # read): the --trace decomposition
        self.exchanges: list[tuple[int, int, float, float, float]] = []
        self.ask_due = [0.0] * groups  # when each group means to send its next quorum request
        self.in_flight = 0
        self._answers: list[tuple[int, int, float, float, int, bytes, float]] = []  # read, not yet handled
        self._tasks: set[asyncio.Task[None]] = set()

    def ramp(self, i: int) -> float:
        """When group ``i`` starts: RAMP_RATE groups a second connect (a real job's groups start
        over minutes; thousands of connects at once overflow the listen backlog)."""
        return i / RAMP_RATE

    def _error(self, what: str, e: BaseException | None = None) -> None:
        if what not in self.errors and e is not None:
            print(f"first {what}: {str(e)[:200]}", file=sys.stderr, flush=True)
        self.errors[what] = self.errors.get(what, 0) + 1

    async def run(self) -> None:
        # (for /status only) idle pooled connections go before the coordinator's read_timeout (5 s).
        connector = aiohttp.TCPConnector(limit=16, keepalive_timeout=4.0)
        timeout = aiohttp.ClientTimeout(total=60.0)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                         json_serialize=json.dumps) as self.session:
            loop = asyncio.get_running_loop()
            start = time.monotonic()
            self.start = start
            self.end = start + self.n / RAMP_RATE + self.seconds
            for i in range(self.n):
                loop.call_later(self.ramp(i), self._start_group, i)
            watcher = asyncio.create_task(self._watch_status())
            await asyncio.sleep(self.end - time.monotonic())
            deadline = time.monotonic() + 10.0  # then closing withdraws the long-polls left
            while (self.in_flight or self._tasks) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await watcher
            for conn in self.conns.values():
                conn.close()

    # -- one group: its connections, its quorum requests, its heartbeats (all callbacks) ---------

    def _later(self, delay: float, fn: Callable[[int], None], i: int) -> None:
        asyncio.get_running_loop().call_later(max(0.0, delay), fn, i)

    def _start_group(self, i: int) -> None:
        self._spawn(self._open(i))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open(self, i: int) -> None:
        for path in ("/v1/quorum", "/v1/heartbeat"):
            try:
                await self.conns[(i, path)].connect()
            except OSError as e:
                self._error(f"connect {type(e).__name__}", e)
        self.ask_due[i] = time.monotonic() + random.random() * 0.5
        self._later(self.ask_due[i] - time.monotonic(), self._ask, i)
        self._later(random.random() * self.heartbeat, self._beat, i)  # spread over the interval

    async def _reconnect(self, conn: LeanConnection, then: Callable[[int], None], i: int, retry: float) -> None:
        """Open ``conn`` again (the server closed it, or refused it over its cap), then ``then(i)``."""
        try:
            await conn.connect()
        except OSError as e:
            self._error(f"connect {type(e).__name__}", e)
            self._later(retry, then, i)
            return
        then(i)

    def _ask(self, i: int) -> None:
        now = time.monotonic()
        if now >= self.end:
            return
        if i == self.victim and now >= self.end - DRILL_BEFORE_END:
            self.stopped[i] = True
            self.victim_stopped_at = now
            return
        conn = self.conns[(i, "/v1/quorum")]
        if not conn.connected:
            self._spawn(self._reconnect(conn, self._ask, i, 0.5))
            return
        step, chain, qid = self.state[i]
        due = self.ask_due[i]
        self.last_ask[step] = now
        self.asked_at[i] = now
        self.in_flight += 1
        conn.send(self.ask_bodies[i] % (step, qid, chain.encode()),
                  lambda status, raw, at: self._asked(i, step, due, now, status, raw, at),
                  lambda e: self._ask_failed(i, e))

    def _ask_failed(self, i: int, e: BaseException) -> None:
        self.in_flight -= 1
        self._error(f"quorum {type(e).__name__}", e)
        self.ask_due[i] = time.monotonic() + 0.5
        self._later(0.5, self._ask, i)

    def _asked(self, i: int, step: int, due: float, asked: float, status: int, raw: bytes, now: float) -> None:
        """An answer was read at ``now`` (protocol callback): its handling waits until the answers
        read in this pass of the loop are all timed. A real group parses its answer in its own
        process; here one thread reads 2,000 of them, and parsing each before reading the next
        made the last one read ~20 ms after it arrived, a delay that was the load generator's."""
        self._answers.append((i, step, due, asked, status, raw, now))
        if len(self._answers) == 1:
            asyncio.get_running_loop().call_soon(self._take_answers)

    def _take_answers(self) -> None:
        answers, self._answers = self._answers, []
        for answer in answers:
            self._answered(*answer)

    def _answered(self, i: int, step: int, due: float, asked: float, status: int, raw: bytes, now: float) -> None:
        self.in_flight -= 1
        self.answered.append(now)
        if status != 200:
            self._error(f"quorum HTTP {status}")
            if status == 504 and not self.first_timeout:
                self.first_timeout = f"{now - self.start:.1f} s: {raw[:300].decode(errors='replace')}"
            self.ask_due[i] = now + 0.1
            self._later(0.1, self._ask, i)
            return
        try:  # this member's own compact answer (ftlm.ft.quorum_answer): parsed by each member
            answer = json.loads(raw)
            qid, qstep, new_chain, size = (int(answer["quorum_id"]), int(answer["step"]),
                                           str(answer["next_chain"]), int(answer["size"]))
        except (ValueError, KeyError, TypeError):
            self._error("quorum answer unreadable")
            return
        self.answer_bytes = max(self.answer_bytes, len(raw))
        if self.first_quorum_at is None:
            self.first_quorum_at = now
        if self.victim_stopped_at is not None and self.excluded_at is None and size < self.n:
            self.excluded_at = now  # the first quorum without the stopped group
        self.samples.append((now, now - asked, qstep))
        self.exchanges.append((i, step, due, self.conns[(i, "/v1/quorum")].sent_at, now))
        if i == self.victim:  # a quorum request is a heartbeat (the coordinator records it as one)
            self.victim_last_beat = now
        # Train the step until the next step time, then commit it: the next ask reports it.
        self.state[i] = (qstep + 1, new_chain, qid)
        self.ask_due[i] = now + STEP_SECONDS + random.random() * 0.01
        self._later(self.ask_due[i] - time.monotonic(), self._ask, i)

    def _beat(self, i: int) -> None:
        now = time.monotonic()
        if now >= self.end or self.stopped[i]:
            return
        since = now - self.asked_at[i]
        if since < self.heartbeat:  # as ftlm.ft.client.Heartbeater: the request was the beat
            self._later(self.heartbeat - since, self._beat, i)
            return
        conn = self.conns[(i, "/v1/heartbeat")]
        if not conn.connected:
            self._spawn(self._reconnect(conn, self._beat, i, self.heartbeat))
            return
        step, chain, qid = self.state[i]
        self.in_flight += 1
        conn.send(self.beat_bodies[i] % (step, qid, chain.encode(), step),
                  lambda status, raw, at: self._beaten(i, status, at), lambda e: self._beat_failed(i, e))

    def _beat_failed(self, i: int, e: BaseException) -> None:
        self.in_flight -= 1
        self._error(f"heartbeat {type(e).__name__}", e)
        self._later(self.heartbeat, self._beat, i)

    def _beaten(self, i: int, status: int, now: float) -> None:
        self.in_flight -= 1
        self.answered.append(now)
        if status != 200:
            self._error(f"heartbeat HTTP {status}")
        elif i == self.victim:
            self.victim_last_beat = now
        self._later(self.heartbeat - (time.monotonic() - now), self._beat, i)

    async def _watch_status(self) -> None:
        """After the drill begins, poll one-member pages of ``/status`` until it lists the victim dead."""
        victim = self.clients[self.victim].replica_id
        while time.monotonic() < self.end and self.dead_seen_at is None:
            await asyncio.sleep(0.05)
            if self.victim_stopped_at is None:
                continue
            try:
                async with self.session.get(self.url + "/status?limit=1", headers=self.headers) as resp:
                    status = await resp.json()
            except (TimeoutError, aiohttp.ClientError, ValueError) as e:
                self._error(f"status {type(e).__name__}")
                continue
            if any(d.get("replica_id") == victim for d in status.get("dead", [])):
                self.dead_seen_at = time.monotonic()


def traced_coordinator(trace_path: str) -> int:
    """``ftlm coordinator`` (arguments from ``sys.argv``) with timestamps of its lean path, written to
    ``trace_path`` as JSON lines when it exits: per quorum request (replica, step, when its bytes
    were received, when its handling returned) and per quorum answer (replica, step, when it was
    handed to the kernel), and per issued quorum (id, step, when the deciding request's bytes were
    received, before and after its answers were written). ``time.monotonic`` is the system's
    CLOCK_MONOTONIC, so these line up with the load generator's own times. Bench-only patches of
    the running classes: the served code is unchanged, each record costs a clock read and an
    append."""
    import atexit

    from ftlm.cli import main as cli_main
    from ftlm.ft import coordinator as coord_mod
    from ftlm.ft import hot_path
    from ftlm.ft.membership import Issued as _Issued

    clock = time.monotonic
    asks: list[tuple[str, int, float, float]] = []
    answers: list[tuple[str, int, float]] = []
    issues: list[tuple[int, int, float, float, float]] = []
    current = {"read": 0.0}

    received = hot_path.HotPathProtocol.data_received

    def data_received(self: hot_path.HotPathProtocol, data: bytes) -> None:
        current["read"] = clock()
        received(self, data)

    quorum_hot = coord_mod.Coordinator._quorum_hot

    def traced_quorum(self: coord_mod.Coordinator, body: Any, conn: Any) -> None:
        read = current["read"]
        quorum_hot(self, body, conn)
        asks.append((f"{body.group}:{body.incarnation}", body.step, read, clock()))

    apply = coord_mod.Coordinator._apply

    def traced_apply(self: coord_mod.Coordinator, outputs: list) -> None:
        issued = [o.quorum for o in outputs if isinstance(o, _Issued)]
        before = clock()
        apply(self, outputs)
        for q in issued:
            issues.append((q.quorum_id, q.step, current["read"], before, clock()))

    set_result = coord_mod.Waiter.set_result

    def traced_set_result(self: Any, answer: Any) -> None:
        set_result(self, answer)
        answers.append((self.req.replica_id, self.req.step, clock()))

    hot_path.HotPathProtocol.data_received = data_received  # type: ignore[method-assign]
    coord_mod.Coordinator._quorum_hot = traced_quorum  # type: ignore[method-assign]
    coord_mod.Coordinator._apply = traced_apply  # type: ignore[method-assign]
    coord_mod.Waiter.set_result = traced_set_result  # type: ignore[method-assign]

    def dump() -> None:
        with open(trace_path, "w") as f:
            json.dump({"asks": asks, "answers": answers, "issues": issues}, f)

    atexit.register(dump)
    return cli_main(sys.argv[1:])


def decompose(trace: Path, exchanges: list[tuple[int, int, float, float, float]], t0: float,
              t1: float) -> tuple[str, dict[str, float]]:
    """Where a quorum request's time goes, from the load generator's times (asked, answer read)
    and the traced coordinator's (ask received, answer written), for the exchanges answered
    in [t0, t1]: each latency is cut into (1) waiting for the step's last ask to be written by
    its group, (2) the last ask waiting in the coordinator's socket until it is read, (3) the
    coordinator from that read to this member's answer handed to the kernel (deciding the
    quorum, then the answers written before this one), (4) the answer on loopback until the load
    generator reads it (its own loop busy with other groups' answers and asks). Per step also: how
    late the load generator wrote the step's last ask (after the time it meant to; the others
    wait for it) and the spread of the asks and answers, and the coordinator's own time per quorum
    request (from its bytes received to its handling done). Returns the printed text and the
    medians and 99th percentiles that go into the decomposition table (milliseconds)."""
    data = json.loads(trace.read_text())
    handling = [done - read for _, _, read, done in data["asks"] if t0 <= read <= t1]
    written = {(rid, step): at for rid, step, at in data["answers"]}
    by_step: dict[int, list[tuple[int, float, float]]] = {}
    late: dict[int, tuple[float, float]] = {}  # step -> (last ask written, how late it was)
    for i, step, due, sent, read in exchanges:
        if t0 <= read <= t1:
            by_step.setdefault(step, []).append((i, sent, read))
            if sent > late.get(step, (float("-inf"), 0.0))[0]:
                late[step] = (sent, sent - due)
    parts: dict[str, list[float]] = {k: [] for k in ("total", "peers", "socket", "coordinator", "client")}
    steps: dict[str, list[float]] = {k: [] for k in ("ask spread", "last ask late", "last ask in socket", "decide",
                                                     "fan-out", "first answer read", "last answer read")}
    issues = {step: (read, before, after) for _, step, read, before, after in data["issues"]}
    for step, rows in sorted(by_step.items()):
        rid = {i: f"g{i:05d}:a" for i, _, _ in rows}
        sends = sorted(sent for _, sent, _ in rows)
        last_sent = sends[-1]
        if step not in issues:
            continue
        issue_read = issues[step][0]
        outs = sorted(written.get((rid[i], step), float("nan")) for i, _, _ in rows)
        reads = sorted(read for _, _, read in rows)
        steps["ask spread"].append(last_sent - sends[0])
        steps["last ask late"].append(late[step][1])
        steps["last ask in socket"].append(issue_read - last_sent)
        steps["decide"].append(outs[0] - issue_read)
        steps["fan-out"].append(outs[-1] - outs[0])
        steps["first answer read"].append(reads[0] - outs[0])
        steps["last answer read"].append(reads[-1] - outs[-1])
        for i, sent, read in rows:
            out = written.get((rid[i], step))
            if out is None:
                continue
            parts["total"].append(read - sent)
            parts["peers"].append(last_sent - sent)
            parts["socket"].append(issue_read - last_sent)
            parts["coordinator"].append(out - issue_read)
            parts["client"].append(read - out)
    ms = (lambda v, q: f"{_percentile(v, q) * 1000:.1f}")
    lines = [f"per exchange ({len(parts['total'])}), ms p50 / p99:"]
    lines += [f"  {k:12s} {ms(v, 0.5):>7s} / {ms(v, 0.99):>7s}" for k, v in parts.items()]
    lines.append(f"per step ({len(steps['fan-out'])}), ms p50 / max:")
    lines += [f"  {k:19s} {ms(v, 0.5):>7s} / {ms(v, 1.0):>7s}" for k, v in steps.items()]
    lines.append(f"a quorum request's handling in the coordinator: p50 {_percentile(handling, 0.5) * 1e6:.0f} us")
    summary = {f"{k} p{q:g}": _percentile(v, q / 100) * 1000 for k, v in parts.items() for q in (50, 99)}
    summary.update({f"{k} p50": _percentile(v, 0.5) * 1000 for k, v in steps.items()})
    summary["handling us"] = _percentile(handling, 0.5) * 1e6
    return "\n".join(lines), summary


def profile_summary(collapsed: Path, top: int = 15) -> str:
    """The functions the sampled coordinator spent its time in, from py-spy's collapsed stacks:
    self time (the innermost frame) and inclusive time, as shares of the samples."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [re.sub(r" \(/.*/(site-packages|src)/", " (", f) for f in stack.split(";")]
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for f in set(frames):
            inclusive[f] = inclusive.get(f, 0) + n
    if not total:
        return "no samples"
    lines = [f"{total} samples; self time:"]
    lines += [f"  {n / total:6.1%}  {f}" for f, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]]
    lines.append("inclusive time:")
    lines += [f"  {n / total:6.1%}  {f}" for f, n in sorted(inclusive.items(), key=lambda kv: -kv[1])[:top * 2]]
    return "\n".join(lines)


def _start_profiler(pid: int, seconds: float, out: Path) -> subprocess.Popen | None:
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        print("py-spy is not installed (python -m pip install py-spy): no profile", file=sys.stderr)
        return None
    return subprocess.Popen([str(spy), "record", "--pid", str(pid), "--duration", str(int(seconds)),
                             "--rate", "200", "--format", "raw", "--output", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(groups: int, seconds: float, workdir: Path, profile: bool = False,
            heartbeat: float = HEARTBEAT_SECONDS, trace: bool = False, floor: bool = False,
            pin: bool = False, hot_path: str = "built") -> Result:
    """One run of ``groups`` groups for ``seconds`` seconds against a fresh coordinator; with
    ``trace``, the coordinator records its own times and the latency is decomposed (printed); with
    ``pin``, the coordinator runs on the first CPU this process may use and the load generator on
    the others (as a coordinator on a host of its own, serving groups on other hosts)."""
    token = "load-test-token"
    trace_path = workdir / f"trace-{groups}.json" if trace else None
    if trace_path is not None and trace_path.exists():
        trace_path.unlink()
    allowed = os.sched_getaffinity(0)
    if pin and len(allowed) < 2:
        raise SystemExit("--pin needs two CPUs or more (one for the coordinator, the rest for the groups)")
    first = min(allowed)
    coordinator = CoordinatorUnderTest(groups, token, workdir / f"coordinator-{groups}.log", heartbeat,
                                       trace_path, floor, {first} if pin else None, hot_path)
    if pin:
        os.sched_setaffinity(0, allowed - {first})
    spy: subprocess.Popen | None = None
    profile_path = workdir / f"profile-{groups}.txt"
    marks: dict[str, tuple[float, float, float]] = {}

    async def main() -> None:
        async def sample(name: str, at: float) -> None:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            marks[name] = (time.monotonic(), coordinator.cpu_seconds(), time.process_time())

        runner = asyncio.create_task(test.run())
        await asyncio.sleep(0)
        # The steady window: from a few steps after the start to just before the failure drill.
        begin = time.monotonic() + groups / RAMP_RATE + min(seconds / 3, 5.0 + WARMUP_STEPS * STEP_SECONDS)
        await sample("begin", begin)
        nonlocal spy
        if profile:
            spy = _start_profiler(coordinator.proc.pid, test.end - DRILL_BEFORE_END - begin, profile_path)
        await sample("end", test.end - DRILL_BEFORE_END)
        await runner

    try:
        test = LoadTest(coordinator.url, groups, seconds, token, heartbeat)
        with asyncio.Runner(loop_factory=new_event_loop) as runner:  # uvloop's where installed
            runner.run(main())
        rss, peak = coordinator.memory_mib()
    finally:
        if spy is not None:
            spy.wait(30)
        coordinator.stop()
        os.sched_setaffinity(0, allowed)
    if spy is not None and profile_path.exists():
        print(f"coordinator profile ({profile_path}):\n{profile_summary(profile_path)}", flush=True)
    (t0, c0, p0), (t1, c1, p1) = marks["begin"], marks["end"]
    parts: dict[str, float] = {}
    if trace_path is not None:
        if trace_path.exists():
            text, parts = decompose(trace_path, test.exchanges, t0, t1)
            print(f"groups={groups}: where the time goes\n{text}", flush=True)
        else:
            print(f"groups={groups}: the coordinator wrote no trace ({trace_path})", file=sys.stderr, flush=True)
    result = Result(groups, seconds, errors=test.errors, answer_bytes=test.answer_bytes,
                    rss_mib=rss, peak_rss_mib=peak, heartbeat=heartbeat, parts=parts,
                    hot_path=coordinator.hot_path if not floor else "-")
    steady = [(t, lat, step) for t, lat, step in test.samples if t0 <= t <= t1]
    result.latencies = [lat for _, lat, _ in steady]
    # A retried step (answers 504, asks again) can ask after some answers: those are not counted.
    result.after_last = [t - test.last_ask[step] for t, _, step in steady
                         if step in test.last_ask and t >= test.last_ask[step]]
    steps = {step for _, _, step in steady}
    result.steps = max(len(steps) - 1, 0)
    result.steady_seconds = t1 - t0
    result.coord_cpu = (c1 - c0) / (t1 - t0)
    result.messages = sum(1 for t in test.answered if t0 <= t <= t1)
    result.client_cpu = (p1 - p0) / (t1 - t0)
    if test.victim_last_beat is not None and test.dead_seen_at is not None:
        result.detect_dead = test.dead_seen_at - test.victim_last_beat
    if test.victim_last_beat is not None and test.excluded_at is not None:
        result.detect_quorum = test.excluded_at - test.victim_last_beat
    if test.first_timeout:
        print(f"groups={groups}: first quorum timeout at {test.first_timeout}", flush=True)
    if test.first_quorum_at is not None:
        result.first_quorum_seconds = test.first_quorum_at - test.start
    return result


def side_by_side(results: list[Result]) -> str:
    """Per size and hot path, the runs' quorum p50 and p99 in the order they ran."""
    lines = []
    for key in dict.fromkeys((r.groups, r.heartbeat, r.hot_path) for r in results):
        runs = [r for r in results if (r.groups, r.heartbeat, r.hot_path) == key]
        p50 = " / ".join(f"{_percentile(r.latencies, 0.5) * 1000:.0f}" for r in runs)
        p99 = " / ".join(f"{_percentile(r.latencies, 0.99) * 1000:.0f}" for r in runs)
        cpu = " / ".join(f"{r.coord_cpu * 100:.0f}%" for r in runs)
        lines.append(f"{key[0]} groups, heartbeat {key[1]:g} s, hot path {key[2]}: quorum p50 {p50} ms, "
                     f"p99 {p99} ms, coordinator CPU {cpu}")
    return "\n".join(lines)


def _describe(r: Result) -> str:
    return (f"groups={r.groups}: quorum p50={_percentile(r.latencies, 0.5) * 1000:.0f} ms "
            f"p99={_percentile(r.latencies, 0.99) * 1000:.0f} ms over {len(r.latencies)} answers "
            f"(after the last ask p50={_percentile(r.after_last, 0.5) * 1000:.0f} "
            f"p99={_percentile(r.after_last, 0.99) * 1000:.0f} ms), "
            f"{r.steps / r.steady_seconds if r.steady_seconds else 0:.2f} steps/s, coordinator CPU "
            f"{r.coord_cpu * 100:.0f}%, RSS {r.rss_mib:.0f} MiB (peak {r.peak_rss_mib:.0f}), client CPU "
            f"{r.client_cpu * 100:.0f}%, {r.messages} messages, state machine {r.machine_us:.0f} us/message, detection {r.detect_dead} s / quorum without it {r.detect_quorum} s, "
            f"first quorum after {r.first_quorum_seconds:.1f} s, answer {r.answer_bytes} B, errors {r.errors}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.coordinator_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=2000, help="simulated groups (default 2000)")
    p.add_argument("--sweep", default="", help="comma-separated group counts, e.g. 100,500,1000,2000,4000, "
                   "each optionally @ a heartbeat interval (2000@1.5); rewrites the BENCHMARKS.md "
                   "section unless --no-write")
    p.add_argument("--heartbeat-seconds", type=float, default=HEARTBEAT_SECONDS,
                   help="the groups' heartbeat interval where a size names none (default 1)")
    p.add_argument("--seconds", type=float, default=30.0, help="seconds per size (default 30)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--workdir", default="runs/coordinator_load", help="where the coordinator logs go")
    p.add_argument("--profile", action="store_true", help="sample the coordinator with py-spy during the "
                   "steady window and print where its time goes")
    p.add_argument("--trace", action="store_true", help="timestamp each quorum request and answer in the "
                   "coordinator too and print where a request's latency goes (peers, socket, coordinator, "
                   "load generator)")
    p.add_argument("--pin", action="store_true", help="run the coordinator on one CPU and the load "
                   "generator on the others (default: both on every CPU, as the scheduler places them)")
    p.add_argument("--floor", action="store_true", help="serve the load with bench.coordinator_floor "
                   "instead of ftlm coordinator (no JSON, no checks, no state machine): what one Python "
                   "event loop can reach on this box; implies --no-write")
    p.add_argument("--hot-path", choices=[*HOT_PATH_ENV, "both"], default="built",
                   help="the coordinator's modules (ftlm.native): as `make setup` built them (default), "
                   "compiled, interpreted, or both (each size interpreted, then compiled)")
    p.add_argument("--repeat", type=int, default=1, help="run the whole sweep this many times, one after "
                   "the other (with --hot-path both: the two versions interleaved, for a side-by-side ratio)")
    args = p.parse_args(argv)
    if args.floor and (args.trace or args.profile):
        p.error("--floor measures the floor server: it takes neither --trace nor --profile")
    try:
        runs = [(int(n), float(hb) if hb else args.heartbeat_seconds)
                for n, _, hb in (s.strip().partition("@") for s in args.sweep.split(",") if s.strip())]
    except ValueError:
        p.error(f"--sweep {args.sweep!r}: give group counts, each optionally @seconds (e.g. 2000@1.5)")
    runs = runs if args.sweep else [(args.groups, args.heartbeat_seconds)]
    sizes = [n for n, _ in runs]
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    paths = ["interpreted", "compiled"] if args.hot_path == "both" else [args.hot_path]
    if any(n < 2 for n in sizes) or args.seconds < 15 or not all(0 < hb < HEARTBEAT_TIMEOUT for _, hb in runs):
        p.error("every group count must be >= 2, --seconds >= 15 (warm-up, steady window, drill) and "
                f"every heartbeat interval in (0, {HEARTBEAT_TIMEOUT:g})")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2 * max(sizes) + 512:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 2 * max(sizes) + 1024), hard))
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    quiet_collector()  # the load generator's own collector pauses would count as latency
    results = []
    for _ in range(args.repeat):
        for n, hb in runs:
            for path in paths:
                r = measure(n, args.seconds, workdir, args.profile, hb, args.trace, args.floor, args.pin, path)
                r.machine_us = state_machine_us(n, path)
                print(("floor server: " if args.floor else f"hot path {r.hot_path}: ") + _describe(r), flush=True)
                results.append(r)
    if len(paths) > 1 or args.repeat > 1:
        print(side_by_side(results), flush=True)
    if args.sweep and not args.no_write and not args.floor:
        write(results, args.seconds, args.trace)
    return 0


PARTS_CAPTION = """\
Where a quorum request's time goes (`--trace`: the coordinator process timestamps each quorum
request when its bytes are received and each answer when it is handed to the kernel; both
processes read the same CLOCK_MONOTONIC). Each exchange's latency (from its request written to the
socket to its answer read) = (1) waiting for the step's last ask to be written by its group + (2)
that ask waiting in the coordinator's socket until the coordinator reads it (the asks and
heartbeats it had not read yet) + (3) the coordinator from that read to this member's answer
handed to the kernel: (3a) deciding the quorum (to the first answer) and (3b) the answers written
before this one + (4) the answer on loopback until the load generator's loop reads it. p50 / p99
per exchange; the per-step columns are medians over the steps. *Of which the last ask late*:
how long after the time it meant to the load generator wrote the step's last ask (its own loop
busy; everyone waits for it). *Handled in*: the coordinator's own time per quorum request, from
its bytes received to its handling done (parse, checks, strict JSON, state machine)."""

READING = """\
How to read it. Each size runs a fresh `ftlm coordinator` process (`ft.heartbeat_timeout=3`,
heartbeats every *heartbeat s*, one step a second: a group asks for the quorum of its next step one
second after it got the last one; as the real client, a group skips a heartbeat when its quorum
request went out within the heartbeat interval). *Quorum p50/p99*: from a group's ask to the last
byte of its answer read, which includes waiting for the slowest group of the step (a quorum is
issued when the last one asks); *after the last ask*: from the step's last ask to each answer.
*Steps/s* below 1 means the quorum wait lengthened the steps. *Detected dead*: from the victim's
last answered heartbeat or quorum request until `/status` lists it dead; *quorum without it*:
until the first quorum that leaves it out (both about `ft.heartbeat_timeout`, 3 s: the victim stops
silently, no peer reports it). *Coordinator CPU*: its process's CPU seconds per wall second (100% =
one core: it serves from one event loop thread); *CPU ms/message*: the same divided by the
heartbeats and quorum requests it answered. *State machine us/message*: the sans-I/O `Membership`
alone in-process (no HTTP, no JSON). *Client CPU*: the load generator's process. *Quorum answer
KiB*: the largest answer a member got (a participant's is about 0.5 KB; a recovering member's also
lists the participants).

The simulated groups. Each has two keep-alive connections, as a real leader (its quorum thread's
and its heartbeat thread's), spoken over by `LeanConnection`, a minimal HTTP/1.1 client of the
benchmark that sends the header lines `http.client` sends and the bodies `CoordinatorClient` sends
(byte for byte: the body templates are checked against it at start). All 2,000 groups share one
asyncio process (uvloop) on the same 2 cores as the coordinator; since this pass each group is
driven by timer and protocol callbacks, not a task, and its request body is filled into a byte
template instead of being built and JSON-encoded. An answer's time is taken when its last byte is
read, in the protocol callback, and the answers read in one pass of its loop are all timed before
any is handled (parsed, the next ask scheduled): a real group parses its own answer in its own
process. Real groups are processes on other machines: the load generator's costs are not theirs,
and the decomposition below says how much of each latency they are.

How it was measured. The box has `sched_autogroup` on: every session gets an equal share of the 2
cores whatever its processes' nice values, so the benchmark runs in a session of its own at
autogroup nice -20 and nice -5 (`setsid sh -c 'echo -20 > /proc/self/autogroup; exec nice -n -5
python -m bench.coordinator_load --sweep ... --trace'`), one run at a time. In 30 s at 2,000 groups
the p99 is the worst step or two of 13 and moved by a factor of two between runs of the same code
on a quiet box (sixth pass: 99-232 ms, p50 64-123 ms), so the sweep above runs 60 s a size (41
steps at 2,000 groups); compare versions only interleaved, several runs each.

Target p99 < 100 ms at 2,000 groups: **met**, by the coordinator `make setup` builds (its hot
path compiled with mypyc, `ftlm.native`; the *hot path* column). Side by side, `--groups 2000
--seconds 45 --hot-path both --repeat 3` (each size interpreted, then compiled, three times), twice
on a quiet box (2026-12-02 11:04-11:10 and 11:23-11:29 UTC, load 0.0-0.8): compiled p50 38 / 37 /
39 and 40 / 38 / 40 ms, **p99 56 / 67 / 62 and 53 / 60 / 62 ms**; interpreted p50 45 / 45 / 44 and
42 / 43 / 46 ms, p99 68 / 98 / 64 and 63 / 67 / 69 ms; coordinator CPU 10% against 11-12%. Earlier
the same day (08:01-08:17 UTC, load 0.4-1.0, a slower hour of this shared box: the interpreted
coordinator's CPU was 16-18% for the same load) three pairs gave compiled p99 84 / 87 / 98 ms
against interpreted 94 / 103 / 149 ms: the interpreted coordinator meets the target only when the
box is quick, the compiled one in every run so far. The sweep above (with `--trace`, whose
timestamps cost the coordinator a little) has p99 85 ms at 2,000 groups (57 ms with 1.5 s
heartbeats) and 86 ms at 3,000. It breaks between 3,000 and 4,000 groups: 130 ms at 4,000. Side
by side there (`--sweep 3000,4000 --seconds 45 --hot-path both`, 11:57-12:04 UTC, one pair
each): compiled p50 59 and 82 ms, p99 93 and 108 ms, against interpreted 68 and 98 ms, p99 100 and
144 ms: what the compiled path saves grows with the groups.

Where the milliseconds go at 2,000 groups (the sweep's decomposition row, medians; p99 in
brackets). A member's 40 ms (85): (1) 16 ms (38) waiting for the other groups' asks: a step's
2,000 asks leave over 35 ms (median step), because each group asks 1 s (plus 0-10 ms) after its
own answer, so the asks inherit the spread of the previous step's answers (17 ms of fan-out, then
the load generator reading them, its last one 6 ms later). (2) 8 ms (25): the last ask waits in
the coordinator's socket while the coordinator handles the step's earlier asks (11 us each). (3)
14 ms (33) in the coordinator after it read the last ask: 4 ms deciding (2,000 requests leave the
index at once, the quorum is built and its answers queued), then this member's place among the
2,000 answers written over 17 ms (8.5 us each, most of it the kernel's loopback send). (4) 3 ms
(13) until the load generator reads the answer. The same decomposition of one interpreted and one
compiled 60 s run (11:32-11:35 UTC): a quorum request handled in 13 against 11 us, deciding 6.1
against 4.7 ms, the fan-out 19.2 against 18.2 ms, p50 48 against 43 ms (p99 83 and 85 ms: one
run each is within the spread). The state machine alone (in-process, no HTTP, no JSON) is twice as
fast compiled: 8 -> 4 us a message (the *state machine us/message* column; `ftlm sim check` runs
1,000 seeds in 32 s instead of 44 s, with the same outcome seed for seed).

The floor on this box (`--floor`: the same load against `bench.coordinator_floor`, a server on the
same event loop that parses nothing, checks nothing and keeps no state: heartbeats answered at
once with a fixed body, quorum requests held until all 2,000 asked and answered first asker
first): p50 25 ms, p99 54 ms, 5% CPU (2026-12-02 11:29 UTC; 35-42 and 55-78 ms on 2026-12-01
19:03, a slower hour). So one Python event loop sharing 2 cores with the load generator already
spends half of the 100 ms at p99 reading requests and writing answers, and what is left between
the floor and the compiled coordinator (about 15 ms at p50, 5-15 ms at p99) is its own work: the
lean HTTP path's checks, the body, the state machine, the quorum and each member's answer. What
bounds the latency now is the serial work per step, about 20 us a group (the ask, its share of
the decision, its answer and the kernel's loopback send), so it grows linearly with the groups:
past about 3,000 groups on this box a single event loop does not keep the p99 under 100 ms; the
next steps would be the answers' fan-out from more than one thread or process, or a server
written natively end to end (as torchft's Rust lighthouse). A core of its own does not help much:
with `--pin` (the coordinator's process on one CPU, the load generator on the other) two
interleaved 45 s runs of the interpreted coordinator gave p50 77 / 90 ms and p99 106 / 128 ms
against 76 / 82 and 104 / 148 ms unpinned (2026-12-01 21:13-21:17 UTC, load 0.3-1.2).

The compiled hot path (2026-12-02). The modules a quorum request and a heartbeat go through
(`history`, `quorum`, `membership`, `quorum_answer`, `coordinator_requests`, `hot_path`; not
`coordinator` itself, where aiohttp and the event loop do the work) are compiled by mypyc at `make
setup` into `src/ftlm/ft/_compiled/` (about 30 s), used only when its manifest matches the sources
and the interpreter (`python -m ftlm.native status`); without a C compiler the same modules run
interpreted. What the compiler needed from the source: a few variables reused with another type
renamed, `functools.cached_property` on `Quorum` replaced by fields derived on first use (a
compiled class has no `__dict__`: until then each of 2,000 answers rebuilt a quorum's member
index, p50 427 ms), the index's deep copy listing its attributes. The compiled modules check every
annotation at run time: the suite runs on them, the state machine's tests run once more
interpreted, and 1,000 seeded fault schedules of `ftlm sim check` and 200 of two bad links at once
in 6 groups give the same outcome, seed for seed, either way.

Sixth pass (2026-12-01 17:46-19:20 UTC, Intel Xeon, 2 cores, load 0.2-1.6). (1) The
bodies `CoordinatorClient` sends are cut by one compiled pattern (`ClientBodies`; anything else,
another key order or spacing, an escape, a value out of range, goes through the strict decoder
as before, and a fuzz test checks that every body gets the value or the error of the strict
path): a quorum request's body 9.1 -> 2.7 us, a heartbeat's 6.9 -> 2.6 us. (2) The deadline heaps
of the index (last heartbeat, last progress) hold one lower bound per replica, refreshed only when
it reaches the top looking overdue, instead of two entries pushed per message and popped later (a
profile of 7 steps counted 84,000 heap pops). In-process, a step of 2,000 asks through the lean
path over recording transports: 32 -> 20 us an ask, 33 -> 22 us a heartbeat; end to end, three
interleaved 30 s runs: p50 105 / 126 / 134 -> 90 / 94 / 64 ms, p99 232 / 203 / 181 -> 150 / 148 /
139 ms, coordinator CPU 25-27% -> 18-22%. (3) Heartbeats are answered after the quorum requests
read in the same pass of the loop and the decision they lead to, in slices of 2 ms a pass, none
waiting over 0.1 s (`Coordinator._queue_beat`): the last ask of a step no longer waits behind the
heartbeats that fall just before the asks. Modest: three interleaved 60 s runs, p99 141 / 139 /
215 ms answered inline against 133 / 115 / 151 ms queued, p50 about the same (70-79 ms). (4) A
message from a group's one incarnation with an unchanged claim skips the incarnation scan and the
claim counts; a quorum of every pending request clears them at once (a test compares the index
with one removal after another); a heartbeat's usual answer is one bytes formatting (a test
compares it with `json.dumps`): in-process 19 -> 15-16 us an ask, 21 -> 18 us a heartbeat. (5) The
load generator times every answer read in a pass of its loop before handling any: the last answer
of a step was read 22 ms after the coordinator wrote it (its loop parsing the ones before), 8-9 ms
since. Tried and not kept: re-evaluating at most every 2 ms (p50 124 / 120 / 120 against 130 / 131
/ 126 ms, p99 unchanged); answering heartbeats only in passes that read no quorum request (p99 153
/ 185 / 127 ms against 135 / 103 / 116 with the slices).

Deferred evaluation (fifth pass; 2026-12-01 10:36-10:40 UTC, Intel Xeon, 2 cores, load
0.5-0.8). The coordinator used to re-evaluate (expire, move the head, decide the quorum) after
every heartbeat and quorum request; a step's asks and the heartbeats around them arrive in
bursts of hundreds, so it now records each message and evaluates once after the pass of the
event loop that read them (`Coordinator._tick_soon`; the simulator and in-process callers still
evaluate per message). In-process at 2,000 groups, evaluating once per 10-50 messages instead
of after each cut the state machine's CPU time per message from 16-17 to 9-12 us (an ad-hoc
measurement at load ~2; the table's us/message column still evaluates per message). End to end, `python -m bench.coordinator_load --groups 2000 --seconds
30 --no-write`, each side in its own autogroup at nice -20/-5, the two code versions
interleaved three times: quorum p50 149 / 135 / 130 ms and p99 216 / 179 / 192 ms with it,
151 / 190 / 159 ms and 231 / 237 / 195 ms without; coordinator CPU 26-27% against 29-33%.
About 15% off the median and the p99: the target (p99 < 100 ms at 2,000 groups) is still not
met on this box.

Fourth pass: (1) `--trace`: the coordinator process is started with bench-only
patches that timestamp each quorum request and answer (the served code is unchanged) and the
latency is cut into the four parts above. (2) The load generator: callbacks instead of a task per
group, byte-template bodies (client CPU 12% at 2,000 groups, 16-17% before; the step's last ask
late by 46 ms in a run at 02:01 with the task-per-group generator, 1-24 ms median since). (3) The
coordinator writes a quorum's answers in the order its members asked (longest waiting first,
`Coordinator._answer_quorum`; before, in member order): the asks of the next step then leave over
41 ms instead of 76 ms, and the median at 2,000 groups fell from 132 ms (sweep at 02:11) to 107 ms,
p99 at 1,000 from 121 to 90 ms; p99 at 2,000 (188 vs 203 ms) is within the run-to-run spread. (4)
A plain participant's answer (three own fields) is formatted into a byte template instead of a
dict through `json.dumps` (`AnswerEncoder`; a test checks it gives the bytes of
`json.dumps(member_json(...))` for every kind of member), and an answer's HTTP framing is one bytes
formatting: in-process, deciding plus 2,000 answers 26 -> 19-20 ms of CPU. Earlier passes: the
lean HTTP/1.1 path for heartbeat and quorum (`ftlm.ft.hot_path`, every check of the aiohttp path
kept), uvloop, a collector that pauses less, the compact per-member answer.

At 4,000 groups a job needs more connections than `ftlm coordinator` admits by default
(`ft.coordinator_max_connections`, 4,096): real leaders hold two each (a quorum connection and a
heartbeat connection), so 4,000 groups need 8,000 and `--set ft.coordinator_max_connections=8192`.
The benchmark sets the cap to twice the groups (plus 64) at every size; before it did (sweeps of
2026-12-01), the 4,000-group row measured the groups that got connections while the others were
refused with 503 and retried.
"""


def write(results: list[Result], seconds: float, traced: bool = False) -> None:
    from bench.common import section_header, table, write_section
    sizes = ",".join(str(r.groups) + ("" if r.heartbeat == HEARTBEAT_SECONDS else f"@{r.heartbeat:g}")
                     for r in results)
    body = section_header("Coordinator at scale: simulated groups against `ftlm coordinator`",
                          "bench.coordinator_load", ["--sweep", sizes, "--seconds", f"{seconds:g}"]
                          + (["--trace"] if traced else []))
    body += "\n" + table(HEADERS, [r.row() for r in results]) + "\n\n"
    traced_rows = [r.parts_row() for r in results if r.parts]
    if traced_rows:
        body += PARTS_CAPTION + "\n\n" + table(PARTS_HEADERS, traced_rows) + "\n\n"
    body += READING
    write_section("coordinator_load", body)


if __name__ == "__main__":
    sys.exit(main())
