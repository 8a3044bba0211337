"""Load test of the real coordinator: N simulated groups heartbeating every second and asking for a
quorum every step at one step per second (issue 16, part 4).

``python -m bench.coordinator_load --groups 2000 --seconds 30`` measures one size;
``python -m bench.coordinator_load --sweep 100,500,1000,2000,4000 --seconds 20`` measures each and
rewrites this benchmark's section of BENCHMARKS.md (``--no-write`` leaves it alone).

What runs for real: ``ftlm coordinator`` in a process of its own (its CPU and memory are read from
/proc, apart from the clients'), over HTTP on 127.0.0.1, with the request bodies and headers of
``ftlm.ft.client.CoordinatorClient`` (which speaks through ``http.client``: the same header lines
are sent here). What is simulated: the groups, all in this one asyncio process, each with two
keep-alive connections as a real leader has (its quorum thread's and its heartbeat thread's),
spoken over by a lean HTTP/1.1 client of this module (``LeanConnection``: pre-built header bytes,
Content-Length answers; aiohttp's client cost ~0.2 ms a request, so 2,000 groups' clients alone
took most of a core on the 2-core box): a group "trains" by waiting for its next step time, commits the
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
another group names it dead, and the time until the first quorum without it is issued.

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
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from ftlm.ft.client import CoordinatorClient
from ftlm.ft.coordinator import new_event_loop, quiet_collector
from ftlm.ft.history import GENESIS

STEP_SECONDS = 1.0
HEARTBEAT_SECONDS = 1.0
HEARTBEAT_TIMEOUT = 3.0
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
    with a Content-Length body. ``request`` reconnects once when the server closed it while idle
    (as ``CoordinatorClient`` retries a kept-alive connection once)."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        lines = [f"Host: {host}:{port}", "Accept-Encoding: identity"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        self._head = ("\r\n".join(lines) + "\r\nContent-Length: ").encode()
        self.transport: asyncio.Transport | None = None
        self._buf = b""
        self._waiting: asyncio.Future[tuple[int, bytes, float]] | None = None
        self._length = -1  # the body length of the answer being read, -1 before its headers

    async def request(self, path: str, body: bytes) -> tuple[int, bytes, float]:
        """(status, body, when the answer's last byte was read): the time is taken in the
        protocol callback, not when the awaiting task runs again (2,000 tasks woken by one step's
        answers run one after another; that queue is the load generator's, not the server's)."""
        data = b"POST %s HTTP/1.1\r\n%s%d\r\n\r\n%s" % (path.encode(), self._head, len(body), body)
        for attempt in range(2):
            reused = self.transport is not None
            if self.transport is None or self.transport.is_closing():
                loop = asyncio.get_running_loop()
                await loop.create_connection(lambda: self, self.host, self.port)
            self._waiting = asyncio.get_running_loop().create_future()
            self.transport.write(data)  # type: ignore[union-attr]
            try:
                return await self._waiting
            except ConnectionResetError:
                if attempt == 0 and reused:
                    continue
                raise
        raise AssertionError("unreachable")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._buf, self._length = b"", -1

    def data_received(self, data: bytes) -> None:
        self._buf += data
        while True:
            if self._length < 0:
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = self._buf[:end]
                found = re.search(rb"\r\ncontent-length:\s*(\d+)", head, re.IGNORECASE)
                self._status = int(head[9:12])
                self._length = int(found.group(1)) if found else 0
                self._buf = self._buf[end + 4:]
            if len(self._buf) < self._length:
                return
            body, self._buf = self._buf[:self._length], self._buf[self._length:]
            self._length = -1
            waiting, self._waiting = self._waiting, None
            if waiting is not None and not waiting.done():
                waiting.set_result((self._status, body, time.monotonic()))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        waiting, self._waiting = self._waiting, None
        if waiting is not None and not waiting.done():
            waiting.set_exception(ConnectionResetError(f"connection closed: {exc}"))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank); NaN without values (printed as "-" in the table)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class CoordinatorUnderTest:
    """``ftlm coordinator --port 0`` in its own process; CPU and memory from /proc."""

    def __init__(self, groups: int, token: str, log_path: Path, heartbeat: float = HEARTBEAT_SECONDS) -> None:
        sets = [f"ft.groups={groups}", f"ft.heartbeat_interval={heartbeat}",
                f"ft.heartbeat_timeout={HEARTBEAT_TIMEOUT}", "ft.join_timeout=5.0", "ft.min_replicas=1"]
        cmd = [sys.executable, "-c", "import sys; from ftlm.cli import main; sys.exit(main())", "coordinator",
               "--port", "0"]
        for s in sets:
            cmd += ["--set", s]
        env = {**os.environ, "FTLM_TOKEN": token}
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, env=env, text=True)
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

    def row(self) -> list[str]:
        lat = self.latencies
        rate = self.steps / self.steady_seconds if self.steady_seconds else 0.0
        fmt = (lambda v: "-" if v is None else f"{v:.2f}")
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "0"
        per_message = self.coord_cpu * self.steady_seconds / self.messages * 1e3 if self.messages else float("nan")
        last = self.after_last
        ms = (lambda values, q: f"{_percentile(values, q) * 1000:.0f}" if values else "-")
        return [str(self.groups), f"{self.heartbeat:g}", ms(lat, 0.5), ms(lat, 0.99), ms(last, 0.5), ms(last, 0.99), f"{rate:.2f}", fmt(self.detect_dead), fmt(self.detect_quorum),
                f"{self.coord_cpu * 100:.0f}%", f"{self.messages / self.steady_seconds:.0f}" if self.steady_seconds else "-",
                f"{per_message:.2f}", f"{self.machine_us:.0f}",
                f"{self.rss_mib:.0f} ({self.peak_rss_mib:.0f})",
                f"{self.client_cpu * 100:.0f}%", f"{self.answer_bytes / 1024:.0f}", errors]


HEADERS = ["groups", "heartbeat s", "quorum p50 (ms)", "quorum p99 (ms)", "after the last ask p50 (ms)",
           "after the last ask p99 (ms)", "steps/s", "detected dead (s)",
           "quorum without it (s)", "coordinator CPU", "messages/s", "coordinator CPU ms/message",
           "state machine us/message", "coordinator RSS MiB (peak)", "client CPU", "quorum answer KiB",
           "errors"]


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
    """The simulated groups of one run: two ``LeanConnection`` s each; ``/status`` (the failure
    drill's watcher) through an aiohttp session."""

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
        self.conns = {(i, path): LeanConnection(self.host, self.port, self.headers)
                      for i in range(groups) for path in ("/v1/quorum", "/v1/heartbeat")}
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
            start = time.monotonic()
            self.start = start
            self.end = start + self.n / RAMP_RATE + self.seconds
            tasks = [asyncio.create_task(self._group(i, start)) for i in range(self.n)]
            tasks += [asyncio.create_task(self._heartbeats(i, start)) for i in range(self.n)]
            tasks.append(asyncio.create_task(self._watch_status()))
            await asyncio.gather(*tasks)
            for conn in self.conns.values():
                conn.close()

    async def _post(self, i: int, path: str, body: dict) -> tuple[int, bytes, float]:
        return await self.conns[(i, path)].request(path, json.dumps(body).encode())

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

    async def _heartbeats(self, i: int, start: float) -> None:
        client = self.clients[i]
        interval = self.heartbeat
        await asyncio.sleep(self.ramp(i) + random.random() * interval)  # spread over the interval
        while time.monotonic() < self.end and not self.stopped[i]:
            since = time.monotonic() - self.asked_at[i]
            if since < interval:  # as ftlm.ft.client.Heartbeater: the request was the beat
                await asyncio.sleep(interval - since)
                continue
            step, chain, qid = self.state[i]
            try:
                status, _, now = await self._post(i, "/v1/heartbeat", client.heartbeat_body(step, qid, chain))
            except OSError as e:
                self._error(f"heartbeat {type(e).__name__}", e)
                await asyncio.sleep(interval)
                continue
            self.answered.append(now)
            if status != 200:
                self._error(f"heartbeat HTTP {status}")
            elif i == self.victim:
                self.victim_last_beat = now
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - now)))

    async def _group(self, i: int, start: float) -> None:
        client = self.clients[i]
        drill = self.end - DRILL_BEFORE_END
        ask_at = start + self.ramp(i) + random.random() * 0.5
        while True:
            await asyncio.sleep(max(0.0, ask_at - time.monotonic()))
            if time.monotonic() >= self.end:
                return
            if i == self.victim and time.monotonic() >= drill:
                self.stopped[i] = True
                self.victim_stopped_at = time.monotonic()
                return
            step, chain, qid = self.state[i]
            asked = time.monotonic()
            self.last_ask[step] = asked
            self.asked_at[i] = asked
            try:
                status, raw, now = await self._post(
                    i, "/v1/quorum", client.quorum_body(step, qid, False, META, 30.0, chain))
            except OSError as e:
                self._error(f"quorum {type(e).__name__}", e)
                ask_at = time.monotonic() + 0.5
                continue
            self.answered.append(now)
            if status != 200:
                self._error(f"quorum HTTP {status}")
                if status == 504 and not self.first_timeout:
                    self.first_timeout = f"{now - self.start:.1f} s: {raw[:300].decode(errors='replace')}"
                ask_at = now + 0.1
                continue
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
            if i == self.victim:  # a quorum request is a heartbeat (the coordinator records it as one)
                self.victim_last_beat = now
            # Train the step until the next step time, then commit it: the next ask reports it.
            self.state[i] = (qstep + 1, new_chain, qid)
            ask_at = now + STEP_SECONDS + random.random() * 0.01


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
            heartbeat: float = HEARTBEAT_SECONDS) -> Result:
    """One run of ``groups`` groups for ``seconds`` seconds against a fresh coordinator."""
    token = "load-test-token"
    coordinator = CoordinatorUnderTest(groups, token, workdir / f"coordinator-{groups}.log", heartbeat)
    spy: subprocess.Popen | None = None
    profile_path = workdir / f"profile-{groups}.txt"
    test = LoadTest(coordinator.url, groups, seconds, token, heartbeat)
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
        with asyncio.Runner(loop_factory=new_event_loop) as runner:  # uvloop's where installed
            runner.run(main())
        rss, peak = coordinator.memory_mib()
    finally:
        if spy is not None:
            spy.wait(30)
        coordinator.stop()
    if spy is not None and profile_path.exists():
        print(f"coordinator profile ({profile_path}):\n{profile_summary(profile_path)}", flush=True)
    (t0, c0, p0), (t1, c1, p1) = marks["begin"], marks["end"]
    result = Result(groups, seconds, errors=test.errors, answer_bytes=test.answer_bytes,
                    rss_mib=rss, peak_rss_mib=peak, heartbeat=heartbeat)
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
    args = p.parse_args(argv)
    try:
        runs = [(int(n), float(hb) if hb else args.heartbeat_seconds)
                for n, _, hb in (s.strip().partition("@") for s in args.sweep.split(",") if s.strip())]
    except ValueError:
        p.error(f"--sweep {args.sweep!r}: give group counts, each optionally @seconds (e.g. 2000@1.5)")
    runs = runs if args.sweep else [(args.groups, args.heartbeat_seconds)]
    sizes = [n for n, _ in runs]
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
    for n, hb in runs:
        r = measure(n, args.seconds, workdir, args.profile, hb)
        r.machine_us = state_machine_seconds_per_message(n) * 1e6
        print(_describe(r), flush=True)
        results.append(r)
    if args.sweep and not args.no_write:
        write(results, args.seconds)
    return 0


READING = """\
How to read it. Each size runs a fresh `ftlm coordinator` process (`ft.heartbeat_timeout=3`,
heartbeats every *heartbeat s*, one step a second: a group asks for the quorum of its next step one
second after it got the last one; as the real client, a group skips a heartbeat when its quorum
request went out within the heartbeat interval). *Quorum p50/p99*: from a group's ask to its
answer, which includes waiting for the slowest group of the step (a quorum is issued when the
last one asks); *after the last ask*: from the step's last ask to each answer, the coordinator's
own share. *Steps/s* below 1 means the quorum wait lengthened the steps. *Detected dead*: from the
victim's last answered heartbeat or quorum request until `/status` lists it dead; *quorum without
it*: until the first quorum that leaves it out (both about `ft.heartbeat_timeout`, 3 s: the victim
stops silently, no peer reports it). *Coordinator CPU*: its process's CPU seconds per wall second
(100% = one core: it serves from one event loop thread); *CPU ms/message*: the same divided by the
heartbeats and quorum requests it answered. *State machine us/message*: the sans-I/O `Membership`
alone in-process (no HTTP, no JSON). *Client CPU*: all simulated groups share one asyncio process.
*Quorum answer KiB*: the largest answer a member got (a participant's is about 0.5 KB; a recovering
member's also lists the participants).

The simulated groups (this pass): each has two keep-alive connections, as a real leader (its
quorum thread's and its heartbeat thread's), spoken over by `LeanConnection`, a minimal HTTP/1.1
client of the benchmark that sends the header lines `http.client` sends (aiohttp's client cost
about 0.2 ms a request: 2,000 groups' clients took most of a core before); an answer's time is
taken when its last byte is read, not when the group's task runs again; the client process uses
uvloop and the same collector settings as the coordinator. Real groups are processes on other
machines: none of this is their cost.

How it was measured. The box has `sched_autogroup` on: every session gets an equal share of the 2
cores whatever its processes' nice values, so other sessions' `nice 19` jobs (load average 16-20
all evening) took the benchmark's CPU and its latencies were those of the scheduler (2,000 groups
at 23:10: coordinator 18% and clients 14% of a core, p50 554 ms). The table was made with the
benchmark's session at autogroup nice -20 (`setsid sh -c 'echo -20 > /proc/self/autogroup; exec
python -m bench.coordinator_load --sweep ...'`): about the share a quiet box would give, at load
16-18. Latencies still move by tens of ms between runs (2,000 groups: p99 182-276 ms in the
runs of this code); the per-message costs hold.

This pass (issue 16, third): (1) *A lean HTTP/1.1 path for the two hot endpoints*
(`ftlm.ft.hot_path`): a heartbeat or quorum request that is well formed and passes every check of
the aiohttp path (Host, Origin, Sec-Fetch-Site, bearer token, content type, body size, the same
strict JSON and field validation) is answered from the connection's protocol; a long-poll waits as
a plain callback whose deadline sits in one heap checked every tick (no task, future or timer per
request), and the state machine's answer is one `transport.write`. Anything else (a refusal, an
unusual header, another endpoint) is handed whole, from its first byte, to aiohttp, which keeps
that connection and answers exactly as before; a body sent apart from its headers (`http.client`
does that) is awaited with the same 408 deadline. A connection's admitted header block is not
parsed again. (2) uvloop's event loop where installed (a new dependency). (3) The coordinator
process moves its start-up objects out of the cyclic collector's sight and collects less often
(p99 at 2,000 groups 274-403 ms with the default thresholds, 202-213 ms without, in ABAB runs).
Same-window comparison at 2,000 groups with these clients (both at autogroup nice -10, 23:12 and
23:13): the code before this pass p50 870 ms, p99 1,088 ms, 71% of a core; the lean path alone
(before (2) and (3)) p50 219, p99 314 ms, 28%.

Target p99 < 100 ms at 2,000 groups: **not met on this box; p99 206 ms (p50 130 ms)**, down from
1,694 ms; met at 500 groups (p99 51 ms), not at 1,000 (p99 156 ms; 130 ms with heartbeats every
1.5 s). The coordinator's CPU
per message fell from 0.24-0.33 ms to 0.07-0.10 ms (a third of a core at 2,000 groups, 3,400
messages a second). Where the rest of the time goes, per step at 2,000 groups (a run with the
answers' and asks' times per step): the 2,000 asks leave the clients over 50-95 ms (each group
asks 1 s plus up to 10 ms after its answer, so the asks inherit the spread of the previous step's
answers); the coordinator's first answer comes 40-120 ms after the last ask (the asks it had not
yet read when the last one was sent, then issuing the quorum); its 2,000 answers leave over
35-80 ms. So a group that asks first waits about the sum: 130-250 ms. In-process, without sockets
(the same coordinator objects fed from memory), an ask costs 35 us of CPU, a heartbeat 27 us (its
state machine 12-15 us, the strict JSON 8-10 us, headers and checks 2-6 us) and an answer 15 us;
on the 2-core VM each message also costs a recv or send on loopback TCP and an event-loop pass,
which makes it about 70 us. p99 < 100 ms at 2,000 groups needs about half of that: a state machine
and JSON decoding below Python's (or a quorum request that reuses the last decoded body when the
bytes match except the step), or the asks and answers spread over several processes with cores of
their own, which a 2-core box shared with the clients does not have (the GPU machine was not lent
to this session).

At 4,000 groups the coordinator is no longer what breaks: `ftlm coordinator` admits at most
4,096 connections (`CoordinatorConfig.max_connections`, not settable from `ft.*`), and 4,000
real leaders need 8,000 (a quorum connection and a heartbeat connection each). The groups that got
connections stepped at 0.79 steps/s (p99 196 ms); the others were refused with 503 and retried
(the errors column). A 4,000-group job needs the cap raised (reported to the lead).
"""


def write(results: list[Result], seconds: float) -> None:
    from bench.common import section_header, table, write_section
    body = section_header("Coordinator at scale: simulated groups against `ftlm coordinator` (issue 16)",
                          "bench.coordinator_load", ["--sweep", ",".join(
                              str(r.groups) + ("" if r.heartbeat == HEARTBEAT_SECONDS else f"@{r.heartbeat:g}")
                              for r in results),
                                                     "--seconds", f"{seconds:g}"])
    body += "\n" + table(HEADERS, [r.row() for r in results]) + "\n\n" + READING
    write_section("coordinator_load", body)


if __name__ == "__main__":
    sys.exit(main())
