"""Does a low-priority transfer thread stall the other threads of its process?

``python -m bench.transfer_priority [--mb 256] [--pulls 3] [--reps 2] [--hogs 3]
[--settings pull:19,pull:0,thread:19,process:19]``.

A group process pulls (or serves) a snapshot on threads of its own while its heartbeat thread
and its training thread run beside them. ``ft.transfer_nice`` lowers the transfer threads' CPU
priority so that, where cores are short, training goes first. But the threads share one Python
interpreter lock: a low-priority thread that the scheduler preempts while it holds the lock
holds up every other thread of the process until it runs again, and where cores are short that
can take seconds (a priority inversion). This measures it: a thread of the measured process
ticks every 50 ms, as the heartbeat thread does every ``ft.heartbeat_interval``, while
``--hogs`` busy processes at normal priority keep the cores short, and a 4-connection transfer
runs ``--pulls`` times. Each setting ``SIDE:NICE`` of ``--settings`` says what the measured
process does: ``pull``, it pulls (``fetch_snapshot``) from a server process, its pulling threads
at NICE; ``thread``, it serves from its own threads at NICE (``ft.snapshot_server = 'thread'``)
to a puller process; ``process``, it serves through its snapshot server process at NICE
(``ft.snapshot_server = 'process'``, ``ft.serve_nice``) to a puller process; ``reserve``, it
prepares the next snapshot's memory ``--pulls`` times (``ft.snapshot_reserve``, on a thread at the
training thread's priority: NICE is not used). It reports how late
the ticks were (a heartbeat later than ``ft.heartbeat_timeout``, 1 s by default, declares the
group dead) and how long the pulls took, settings interleaved.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from bench.common import publish, section_header, table

SECTION = "transfer_priority"
TICK_S = 0.05

_SERVER = """
import sys, time, torch
from ftlm.ft.transport import SnapshotServer, snapshot_state
server = SnapshotServer(keep=1)
server.start()
server.publish(snapshot_state({"w": torch.randn(int(sys.argv[1]) << 18)}, {"step": 1}, 1))
print(server.url, flush=True)
sys.stdin.read()  # until the bench closes it
server.stop()
"""

_PULLER = """
import sys
from ftlm.ft.transport import fetch_snapshot
for _ in range(int(sys.argv[2])):
    fetch_snapshot(sys.argv[1], 1, parallel=4, timeout=300, wait_available=120)
"""

SIDES = ("pull", "thread", "process", "reserve")


def _ticks_during(work: Callable[[], None]) -> tuple[float, list[float]]:
    """Seconds ``work`` took and the lateness of every tick of a thread of this process
    meanwhile."""
    late: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        due = time.monotonic()
        while not stop.is_set():
            due += TICK_S
            time.sleep(max(0.0, due - time.monotonic()))
            late.append(time.monotonic() - due)

    ticker = threading.Thread(target=tick, name="ticks")
    ticker.start()
    t0 = time.monotonic()
    try:
        work()
    finally:
        seconds = time.monotonic() - t0
        stop.set()
        ticker.join()
    return seconds, late


def _pulls(url: str, pulls: int, nice: int) -> tuple[float, list[float]]:
    """This process pulls ``pulls`` times from ``url``, its pulling threads at ``nice``."""
    from ftlm.ft.transport import fetch_snapshot
    return _ticks_during(lambda: [fetch_snapshot(url, 1, parallel=4, timeout=300,
                                                 thread_nice=nice) for _ in range(pulls)])


def _serves(kind: str, mb: int, pulls: int, nice: int) -> tuple[float, list[float]]:
    """This process serves a snapshot (``kind`` of server at ``nice``) to a puller process."""
    import torch

    from ftlm.ft.serve_process import ProcessSnapshotServer
    from ftlm.ft.transport import SnapshotServer, snapshot_state
    server = (ProcessSnapshotServer(keep=1, nice=nice) if kind == "process"
              else SnapshotServer(keep=1, thread_nice=nice))
    url = server.start()
    try:
        server.publish(snapshot_state({"w": torch.randn(mb << 18)}, {"step": 1}, 1,
                                      shared=server.shared_memory))
        return _ticks_during(lambda: subprocess.run([sys.executable, "-c", _PULLER, url,
                                                     str(pulls)], check=True, timeout=900))
    finally:
        server.stop()


def _reserves(mb: int, times: int) -> tuple[float, list[float]]:
    """This process prepares the next snapshot's memory (``ft.snapshot_reserve``) ``times`` times,
    as a source does on a background thread while no peer recovers (its priority is the
    training thread's: the setting's NICE is not used)."""
    from ftlm.ft.snapshot_reserve import SnapshotReserve

    def work() -> None:
        for _ in range(times):
            reserve = SnapshotReserve()
            reserve.prepare(mb << 20, shared=True, pinned=False)
            if not reserve.wait(900):
                raise RuntimeError("the snapshot reserve was not made within 900 s")
            reserve.close()
    return _ticks_during(work)


def measure(mb: int, pulls: int, reps: int, hogs: int,
            settings: list[tuple[str, int]]) -> list[list]:
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(mb)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    results: dict[tuple[str, int], list[tuple[float, list[float]]]] = {s: [] for s in settings}
    try:
        url = server.stdout.readline().strip()
        if not url:
            raise RuntimeError("the snapshot server did not start")
        for rep in range(reps):
            for side, nice in settings:  # interleaved
                seconds, late = (_pulls(url, pulls, nice) if side == "pull"
                                 else _reserves(mb, pulls) if side == "reserve"
                                 else _serves(side, mb, pulls, nice))
                results[side, nice].append((seconds, late))
                print(f"  rep {rep + 1}/{reps} {side}:{nice}: {pulls} pulls {seconds:.1f} s, "
                      f"latest tick {1000 * max(late):.0f} ms", flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
        server.stdin.close()
        server.wait(timeout=30)
    labels = {"pull": "pulls (its own threads)", "thread": "serves (its own threads)",
              "process": "serves (server process)",
              "reserve": "prepares the snapshot reserve (its own thread; seconds and GB/s: preparing)"}
    rows = []
    for side, nice in settings:
        late = sorted(x for _, ls in results[side, nice] for x in ls)
        gbps = [pulls * mb / 1024 / s for s, _ in results[side, nice]]
        rows.append([labels[side], nice, ", ".join(f"{s:.1f}" for s, _ in results[side, nice]),
                     f"{min(gbps):.2f}-{max(gbps):.2f}", f"{1000 * late[len(late) // 2]:.0f}",
                     f"{1000 * late[int(0.99 * (len(late) - 1))]:.0f}", f"{1000 * late[-1]:.0f}",
                     sum(1 for x in late if x > 1.0)])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256, help="snapshot size in MiB (default 256)")
    p.add_argument("--pulls", type=int, default=3, help="pulls per measurement (default 3)")
    p.add_argument("--reps", type=int, default=2, help="repetitions per nice value (default 2)")
    p.add_argument("--hogs", type=int, default=3, help="busy processes (default 3)")
    p.add_argument("--settings", default="pull:19,pull:0,thread:19,process:19",
                   help="SIDE:NICE,... what the measured process does (pull, thread, process, "
                        "reserve) "
                        "and the transfer's nice value (default pull:19,pull:0,thread:19,"
                        "process:19)")
    p.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    settings = [(s.partition(":")[0], int(s.partition(":")[2] or 0))
                for s in args.settings.split(",")]
    if any(side not in SIDES for side, _ in settings):
        p.error(f"--settings {args.settings}: each side must be one of {', '.join(SIDES)}")
    t0 = time.time()
    rows = measure(args.mb, args.pulls, args.reps, args.hogs, settings)
    flags = [f"--mb {args.mb}", f"--pulls {args.pulls}", f"--reps {args.reps}",
             f"--hogs {args.hogs}", f"--settings {args.settings}"]
    body = (section_header("A low-priority transfer thread and the other threads of its process",
                           "bench.transfer_priority", flags)
            + f"* Method: see `bench/transfer_priority.py`: a {args.mb} MiB snapshot pulled "
              f"{args.pulls} times (4 connections) while a thread of the measured process (the "
              f"puller, or the source) ticks every {1000 * TICK_S:.0f} ms and {args.hogs} busy "
              f"processes keep the cores short; {args.reps} repetitions per setting, "
              f"interleaved. Took {time.time() - t0:.0f} s.\n\n"
            + table(["the ticking process", "transfer nice", "pull seconds (each rep)", "GB/s",
                     "tick late p50 ms", "p99 ms", "max ms", "ticks over 1 s late"], rows)
            + "\n")
    return publish(SECTION, body, write=not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
