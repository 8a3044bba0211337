"""Load test of the real coordinator: N simulated groups heartbeating every second and asking for a
quorum every step at one step per second (issue 16, part 4).

``python -m bench.coordinator_load --groups 2000 --seconds 30`` measures one size;
``python -m bench.coordinator_load --sweep 100,500,1000,2000,4000 --seconds 20`` measures each and
rewrites this benchmark's section of BENCHMARKS.md (``--no-write`` leaves it alone).

What runs for real: ``ftlm coordinator`` in a process of its own (its CPU and memory are read from
/proc, apart from the clients'), over HTTP on 127.0.0.1, with the request bodies and headers of
``ftlm.ft.client.CoordinatorClient``. What is simulated: the groups, all in this one asyncio process
(aiohttp, one pooled connector): a group "trains" by waiting for its next step time, commits the
quorum's step (``Quorum.next_chain``) and asks again with the new state; heartbeats report the
committed state. To keep the clients from being the bottleneck, a quorum answer is read whole but
parsed once per distinct quorum (its id and step are read from the first bytes, which the
coordinator writes first); every member adopts the quorum's next state, as participants do.

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
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from ftlm.ft.client import CoordinatorClient
from ftlm.ft.history import GENESIS
from ftlm.ft.quorum import Quorum

STEP_SECONDS = 1.0
HEARTBEAT_SECONDS = 1.0
HEARTBEAT_TIMEOUT = 3.0
"""The coordinator's ``ft.heartbeat_timeout`` here: three missed heartbeats at one per second."""
WARMUP_STEPS = 3
DRILL_BEFORE_END = 8.0
"""Seconds before the end at which one group stops (its detection is then measured)."""
META = {"store": "10.0.0.1:29500", "transfer": ["http://10.0.0.1:29600"], "recover_request": 0}
"""What a real manager puts in ``meta`` (sizes the quorum answers like a real job's)."""
_HEAD = re.compile(rb'\{"quorum_id": (\d+), "step": (\d+),')
SWEEP = (100, 500, 1000, 2000, 4000)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class CoordinatorUnderTest:
    """``ftlm coordinator --port 0`` in its own process; CPU and memory from /proc."""

    def __init__(self, groups: int, token: str, log_path: Path) -> None:
        sets = [f"ft.groups={groups}", f"ft.heartbeat_interval={HEARTBEAT_SECONDS}",
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

    def row(self) -> list[str]:
        lat = self.latencies
        rate = self.steps / self.steady_seconds if self.steady_seconds else 0.0
        fmt = (lambda v: "-" if v is None else f"{v:.2f}")
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "0"
        return [str(self.groups), f"{_percentile(lat, 0.5) * 1000:.0f}", f"{_percentile(lat, 0.99) * 1000:.0f}",
                f"{rate:.2f}", fmt(self.detect_dead), fmt(self.detect_quorum),
                f"{self.coord_cpu * 100:.0f}%", f"{self.rss_mib:.0f} ({self.peak_rss_mib:.0f})",
                f"{self.client_cpu * 100:.0f}%", f"{self.answer_bytes / 1024:.0f}", errors]


HEADERS = ["groups", "quorum p50 (ms)", "quorum p99 (ms)", "steps/s", "detected dead (s)",
           "quorum without it (s)", "coordinator CPU", "coordinator RSS MiB (peak)", "client CPU",
           "quorum answer KiB", "errors"]


class LoadTest:
    """The simulated groups of one run, sharing one aiohttp session."""

    def __init__(self, url: str, groups: int, seconds: float, token: str) -> None:
        self.url = url
        self.n = groups
        self.seconds = seconds
        self.clients = [CoordinatorClient(url, f"g{i:05d}", "a", token=token) for i in range(groups)]
        self.headers = self.clients[0].headers
        self.state = [(0, GENESIS, -1) for _ in range(groups)]  # (step, chain, last quorum id)
        self.stopped = [False] * groups
        self.next_chain: dict[tuple[int, int], tuple[str, int]] = {}  # (qid, step) -> (chain, members)
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

    def _error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.n + 256, limit_per_host=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=60.0)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                         json_serialize=json.dumps) as self.session:
            start = time.monotonic()
            self.start = start
            self.end = start + self.seconds
            tasks = [asyncio.create_task(self._group(i, start)) for i in range(self.n)]
            tasks += [asyncio.create_task(self._heartbeats(i, start)) for i in range(self.n)]
            tasks.append(asyncio.create_task(self._watch_status()))
            await asyncio.gather(*tasks)

    async def _post(self, path: str, body: dict) -> tuple[int, bytes]:
        async with self.session.post(self.url + path, data=json.dumps(body).encode(),
                                     headers=self.headers) as resp:
            return resp.status, await resp.read()

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
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                self._error(f"status {type(e).__name__}")
                continue
            if any(d.get("replica_id") == victim for d in status.get("dead", [])):
                self.dead_seen_at = time.monotonic()

    async def _heartbeats(self, i: int, start: float) -> None:
        client = self.clients[i]
        await asyncio.sleep(random.random() * HEARTBEAT_SECONDS)  # spread over the interval
        while time.monotonic() < self.end and not self.stopped[i]:
            step, chain, qid = self.state[i]
            try:
                status, raw = await self._post("/v1/heartbeat", client.heartbeat_body(step, qid, chain))
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self._error(f"heartbeat {type(e).__name__}")
                await asyncio.sleep(HEARTBEAT_SECONDS)
                continue
            now = time.monotonic()
            if status != 200:
                self._error(f"heartbeat HTTP {status}")
            elif i == self.victim:
                self.victim_last_beat = now
            await asyncio.sleep(max(0.0, HEARTBEAT_SECONDS - (time.monotonic() - now)))

    async def _group(self, i: int, start: float) -> None:
        client = self.clients[i]
        drill = self.end - DRILL_BEFORE_END
        ask_at = start + random.random() * 0.5  # groups start within half a second
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
            try:
                status, raw = await self._post(
                    "/v1/quorum", client.quorum_body(step, qid, False, META, 30.0, chain))
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self._error(f"quorum {type(e).__name__}")
                ask_at = time.monotonic() + 0.5
                continue
            now = time.monotonic()
            if status != 200:
                self._error(f"quorum HTTP {status}")
                ask_at = now + 0.1
                continue
            head = _HEAD.match(raw[:200])
            if head is None:
                self._error("quorum answer unreadable")
                return
            key = (int(head.group(1)), int(head.group(2)))
            if key not in self.next_chain:  # the first member to see this quorum parses it for all
                quorum = Quorum.from_json(raw)
                self.next_chain[key] = (quorum.next_chain(), len(quorum.members))
                self.answer_bytes = max(self.answer_bytes, len(raw))
                if self.first_quorum_at is None:
                    self.first_quorum_at = now
                if (self.victim_stopped_at is not None and self.excluded_at is None
                        and client.replica_id and self.clients[self.victim].replica_id not in quorum.replica_ids()):
                    self.excluded_at = now
            new_chain, _ = self.next_chain[key]
            self.samples.append((now, now - asked, key[1]))
            # Train the step until the next step time, then commit it: the next ask reports it.
            self.state[i] = (key[1] + 1, new_chain, key[0])
            ask_at = now + STEP_SECONDS + random.random() * 0.01


def measure(groups: int, seconds: float, workdir: Path) -> Result:
    """One run of ``groups`` groups for ``seconds`` seconds against a fresh coordinator."""
    token = "load-test-token"
    coordinator = CoordinatorUnderTest(groups, token, workdir / f"coordinator-{groups}.log")
    test = LoadTest(coordinator.url, groups, seconds, token)
    marks: dict[str, tuple[float, float, float]] = {}

    async def main() -> None:
        async def sample(name: str, at: float) -> None:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            marks[name] = (time.monotonic(), coordinator.cpu_seconds(), time.process_time())

        runner = asyncio.create_task(test.run())
        await asyncio.sleep(0)
        # The steady window: from a few steps after the start to just before the failure drill.
        begin = time.monotonic() + min(seconds / 3, 5.0 + WARMUP_STEPS * STEP_SECONDS)
        await sample("begin", begin)
        await sample("end", test.end - DRILL_BEFORE_END)
        await runner

    try:
        asyncio.run(main())
        rss, peak = coordinator.memory_mib()
    finally:
        coordinator.stop()
    (t0, c0, p0), (t1, c1, p1) = marks["begin"], marks["end"]
    result = Result(groups, seconds, errors=test.errors, answer_bytes=test.answer_bytes,
                    rss_mib=rss, peak_rss_mib=peak)
    steady = [(t, lat, step) for t, lat, step in test.samples if t0 <= t <= t1]
    result.latencies = [lat for _, lat, _ in steady]
    steps = {step for _, _, step in steady}
    result.steps = max(len(steps) - 1, 0)
    result.steady_seconds = t1 - t0
    result.coord_cpu = (c1 - c0) / (t1 - t0)
    result.client_cpu = (p1 - p0) / (t1 - t0)
    if test.victim_last_beat is not None and test.dead_seen_at is not None:
        result.detect_dead = test.dead_seen_at - test.victim_last_beat
    if test.victim_last_beat is not None and test.excluded_at is not None:
        result.detect_quorum = test.excluded_at - test.victim_last_beat
    if test.first_quorum_at is not None:
        result.first_quorum_seconds = test.first_quorum_at - test.start
    return result


def _describe(r: Result) -> str:
    return (f"groups={r.groups}: quorum p50={_percentile(r.latencies, 0.5) * 1000:.0f} ms "
            f"p99={_percentile(r.latencies, 0.99) * 1000:.0f} ms over {len(r.latencies)} answers, "
            f"{r.steps / r.steady_seconds if r.steady_seconds else 0:.2f} steps/s, coordinator CPU "
            f"{r.coord_cpu * 100:.0f}%, RSS {r.rss_mib:.0f} MiB (peak {r.peak_rss_mib:.0f}), client CPU "
            f"{r.client_cpu * 100:.0f}%, detection {r.detect_dead} s / quorum without it {r.detect_quorum} s, "
            f"first quorum after {r.first_quorum_seconds:.1f} s, answer {r.answer_bytes} B, errors {r.errors}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.coordinator_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=2000, help="simulated groups (default 2000)")
    p.add_argument("--sweep", default="", help="comma-separated group counts, e.g. 100,500,1000,2000,4000; "
                   "rewrites the BENCHMARKS.md section unless --no-write")
    p.add_argument("--seconds", type=float, default=30.0, help="seconds per size (default 30)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--workdir", default="runs/coordinator_load", help="where the coordinator logs go")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sweep.split(",") if s.strip()] if args.sweep else [args.groups]
    if any(n < 2 for n in sizes) or args.seconds < 15:
        p.error("every group count must be >= 2 and --seconds >= 15 (warm-up, steady window, drill)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2 * max(sizes) + 512:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 2 * max(sizes) + 1024), hard))
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for n in sizes:
        r = measure(n, args.seconds, workdir)
        print(_describe(r), flush=True)
        results.append(r)
    if args.sweep and not args.no_write:
        write(results, args.seconds)
    return 0


def write(results: list[Result], seconds: float) -> None:
    from bench.common import section_header, table, write_section
    body = section_header("Coordinator at scale: simulated groups against `ftlm coordinator` (issue 16)",
                          "bench.coordinator_load", ["--sweep", ",".join(str(r.groups) for r in results),
                                                     "--seconds", f"{seconds:g}"])
    body += "\n" + table(HEADERS, [r.row() for r in results]) + "\n"
    write_section("coordinator_load", body)


if __name__ == "__main__":
    sys.exit(main())
