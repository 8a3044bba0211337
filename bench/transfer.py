"""Live state transfer on one machine: where a rejoin's time goes, and fetch vs raw loopback.

``python -m bench.transfer [--mb 1024] [--reps 3]``. For a flat state of ``--mb`` MiB (the size of
an 82M-parameter model's parameters plus AdamW moments is about 1 GiB) it measures, side by side
in one run and as the median of ``--reps`` interleaved repetitions:

* the source's snapshot copy (``snapshot_state``) into a fresh buffer, into fresh shared memory
  (``shared=True``, what the snapshot server process serves), into shared memory prepared ahead
  (``ft.snapshot_reserve``: what a job does, with the preparation timed on its own), and the same
  bytes copied into an already-touched buffer (the part of the copy that is page faults);
* the per-chunk digests a source computes as it first serves each chunk (XXH3-128), and what
  sha256, the digest used before XXH3-128, costs for the same chunks;
* ``fetch_snapshot`` of a freshly published snapshot (the source computes each chunk's digest as
  it serves it) with 4 connections, and of an already served one with 1 and 4 connections;
  the same two 4-connection pulls from the snapshot server process (``ft.snapshot_server =
  'process'``, the default; at nice 0 here) serving a snapshot taken into shared memory;
* a raw loopback socket moving the same bytes (the ceiling): ``sendall`` from the snapshot's
  buffer, ``recv_into`` a fresh buffer of the same kind the fetch allocates, no HTTP, no checks;
  also with 4 connections, and as this benchmark measured the ceiling before: from a
  never-written buffer (every page the kernel's one zero page, always in cache) into a
  ``bytearray(n)``, whose allocation writes every page before the clock starts. That left the
  receive buffer's page faults (about 0.5 s per GiB here) out of the ceiling but in the fetch.

Each row also gives the CPU seconds the whole process spent (both ends run in it; with the
server process, its CPU seconds are added), which says
where the time goes on a machine with few cores: the kernel's two copies of every byte (send and
receive), page faults of the fresh destination buffer, and the digests.

``python -m bench.transfer --formats [--sizes 64,512] [--reps 3] [--baseline-src DIR]`` measures
instead the wire format's cost: one whole transfer (the source's snapshot and publish, then the
receiver's fetch with 4 connections and its tensors ready) of a fresh state in a fresh process,
through the zero-copy path of ``ftlm.ft.framing`` (safetensors layout, written and read in place)
and through ``safetensors.torch.save`` / ``load`` of the whole file (``save`` makes the file as
one ``bytes``, which the source serves; the receiver fetches it and ``load`` s it). It gives the
seconds and the peak memory above the state on each side (``VmHWM``, reset before each side).
``--baseline-src`` runs the zero-copy path once more with another checkout's ``src`` (an earlier
wire format) in the same interleaved run.

Not measured here: the healthy groups' step time during a rejoin, which needs whole jobs
(``python -m bench.ft_vs_torchft --parts 3``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable

import torch

from bench.common import REPO_ROOT, publish, section_header, table
from ftlm.ft.framing import ChunkTable, chunk_digest, layout
from ftlm.ft.serve_process import ProcessSnapshotServer
from ftlm.ft.snapshot_reserve import SnapshotReserve
from ftlm.ft.transport import (
    Snapshot, SnapshotServer, expected_layout, fetch_snapshot, snapshot_state,
)

SECTION = "transfer"
CHUNK = 4 << 20


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _loopback(payload: memoryview, connections: int = 1, sink: memoryview | None = None) -> None:
    """Move ``payload`` through loopback TCP (sendall / recv_into), split in ``connections``
    contiguous parts that travel at once, each on its own connection and pair of threads, into
    ``sink`` or else a fresh buffer like fetch's."""
    nbytes = payload.nbytes
    if sink is None:
        sink = memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())  # like fetch's buffer
    bounds = [nbytes * i // connections for i in range(connections + 1)]
    server = socket.create_server(("127.0.0.1", 0), backlog=connections)

    def send() -> None:
        conn, _ = server.accept()
        with conn:
            part = int.from_bytes(conn.recv(1), "big")
            conn.sendall(payload[bounds[part]:bounds[part + 1]])

    def receive(part: int) -> None:
        got, end = bounds[part], bounds[part + 1]
        with socket.create_connection(server.getsockname()) as conn:
            conn.sendall(bytes([part]))
            while got < end:
                n = conn.recv_into(sink[got:end], min(CHUNK, end - got))
                if not n:
                    raise RuntimeError(f"loopback closed at byte {got} of [.., {end})")
                got += n

    threads = [threading.Thread(target=send, daemon=True) for _ in range(connections)]
    threads += [threading.Thread(target=receive, args=(i,), daemon=True)
                for i in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    server.close()


def _digests(view: memoryview, digest: Callable[[memoryview], object]) -> None:
    for chunk in ChunkTable(view.nbytes, CHUNK):
        digest(view[chunk.offset:chunk.offset + chunk.nbytes])


ROWS = ("copy_fresh", "copy_shared", "reserve_prepare", "copy_reserve", "copy_touched", "xxh3", "sha256", "fetch4_fresh", "fetch1", "fetch4",
        "process_fresh", "process4", "loopback4", "loopback_zero", "loopback")


def _process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has spent so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _one_rep(server: SnapshotServer, process: ProcessSnapshotServer,
             state: dict[str, torch.Tensor], step: int,
             timed: Callable[[str, Callable[[], object]], object]) -> None:
    snap = timed("copy_fresh", lambda: snapshot_state(state, {"step": step}, step))
    buf = snap.buffer

    def copy_again() -> None:
        for entry, t in zip(snap.tensors, state.values()):
            buf[entry.offset:entry.offset + entry.nbytes].copy_(t.reshape(-1).view(torch.uint8))

    timed("copy_touched", copy_again)
    timed("xxh3", lambda: _digests(snap.view(), chunk_digest))
    timed("sha256", lambda: _digests(snap.view(), lambda b: hashlib.sha256(b).digest()))
    server.publish(snap)  # fresh: no chunk digest computed yet
    for key, par in (("fetch4_fresh", 4), ("fetch1", 1), ("fetch4", 4)):
        timed(key, lambda par=par: fetch_snapshot(server.url, step, timeout=120, parallel=par))
    process.publish(timed("copy_shared", lambda: snapshot_state(state, {"step": step}, step,
                                                                shared=True)))
    process.sync()
    # The memory prepared ahead (ft.snapshot_reserve): its preparation runs on a background
    # thread in a job while no peer recovers; timed on its own here.
    reserve = SnapshotReserve()
    timed("reserve_prepare", lambda: (reserve.prepare(snap.total_bytes, shared=True, pinned=False),
                                      reserve.wait(600)))
    reserved = timed("copy_reserve", lambda: snapshot_state(state, {"step": step}, step,
                                                            shared=True, reserve=reserve))
    assert reserved.shared is not None and torch.equal(reserved.buffer, snap.buffer)
    del reserved
    for key in ("process_fresh", "process4"):
        timed(key, lambda: fetch_snapshot(process.url, step, timeout=120, parallel=4))
    timed("loopback", lambda: _loopback(snap.view()))
    timed("loopback4", lambda: _loopback(snap.view(), 4))
    # As this benchmark measured before: from a bytes object never written (its pages are
    # the kernel's one zero page, always in cache) into a bytearray(n), which wrote every page
    # of itself before the clock started (the receive buffer's page faults left out).
    zeros, prefaulted = memoryview(bytes(snap.total_bytes)), memoryview(bytearray(snap.total_bytes))
    timed("loopback_zero", lambda: _loopback(zeros, sink=prefaulted))


def measure(mb: int, reps: int) -> dict[str, list[tuple[float, float]]]:
    """(wall seconds, process CPU seconds) per repetition of each operation."""
    nbytes = mb << 20
    state = {"w": torch.randn(nbytes // 8), "m": torch.randn(nbytes // 8)}
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in ROWS}

    server = SnapshotServer(chunk_bytes=CHUNK, keep=1)
    server.start()
    process = ProcessSnapshotServer(chunk_bytes=CHUNK, keep=1, nice=0)
    process.start()

    def cpu() -> float:  # both ends, and the server process
        return _cpu() + _process_cpu(process.pid)

    def timed(key: str, fn: Callable[[], object]) -> object:
        c0, t0 = cpu(), time.perf_counter()
        result = fn()
        out[key].append((time.perf_counter() - t0, cpu() - c0))
        return result

    try:
        for rep in range(reps):
            _one_rep(server, process, state, rep + 1, timed)
            print(f"  rep {rep + 1}/{reps}: "
                  + ", ".join(f"{k} {v[-1][0]:.3f}s" for k, v in out.items()), flush=True)
    finally:
        server.stop()
        process.stop()
    return out


LABELS = {
    "copy_fresh": "snapshot copy, fresh buffer (source)",
    "copy_shared": "snapshot copy into fresh shared memory (for the server process)",
    "reserve_prepare": "preparing the reserve: shared memory allocated and mapped ahead (in a job: a background thread, before any rejoin)",
    "copy_reserve": "snapshot copy into the reserve (ft.snapshot_reserve = true)",
    "copy_touched": "same copy, touched buffer",
    "xxh3": "XXH3-128 of every 4 MiB chunk (source, as first served)",
    "sha256": "sha256 of every 4 MiB chunk (the digest used before XXH3-128)",
    "fetch4_fresh": "fetch_snapshot, 4 connections, first pull (digests computed while serving)",
    "fetch1": "fetch_snapshot, 1 connection",
    "fetch4": "fetch_snapshot, 4 connections",
    "process_fresh": "fetch_snapshot from the server process, 4 connections, first pull",
    "process4": "fetch_snapshot from the server process, 4 connections",
    "loopback4": "raw loopback, 4 connections at once",
    "loopback_zero": "raw loopback, zero-page source, pre-faulted sink (the earlier reference)",
    "loopback": "raw loopback socket (ceiling: the target's reference)",
}


def render(out: dict[str, list[tuple[float, float]]], mb: int, reps: int, flags: list[str]) -> str:
    gb = (mb << 20) / 1e9
    wall = {k: statistics.median(w for w, _ in v) for k, v in out.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in out.items()}
    rows = []
    for key in ROWS:
        # Each repetition's own ratio (its operations ran seconds apart), then the median:
        # steadier than a ratio of medians when the machine's load drifts during the run.
        share = (f"{statistics.median(l / w for (w, _), (l, _) in zip(out[key], out['loopback'])):.0%}"
                 if key.startswith(("fetch", "process", "loopback")) else "")
        rows.append([LABELS[key], f"{wall[key]:.3f}", f"{gb / wall[key]:.2f}", share,
                     f"{cpu[key]:.2f}"])
    return (section_header("Live state transfer: copy, digests, fetch vs loopback",
                           "bench.transfer", flags)
            + f"\nA flat state of {mb} MiB; median of {reps} interleaved repetitions. "
              "The snapshot copy runs on a helper thread during the step's forward and backward "
              "(only `commit` waits for it); the fetch runs on the joiner's background threads "
              "and returns views into its receive buffer (no second copy). \"of loopback\" is "
              "the median over repetitions of each one's loopback time over its fetch time. CPU "
              "seconds are the whole process's (source and receiver both run in it).\n\n"
            + table(["operation", "seconds", "GB/s", "of loopback", "CPU s"], rows) + "\n")


# -- wire formats ---------------------------------------------------------------------------------

FORMAT_PATHS = {
    "zero_copy": "ftlm.ft.framing: safetensors layout written and read in place",
    "save_load": "safetensors.torch.save, serve the bytes, fetch, safetensors.torch.load",
    "baseline": "zero-copy path of --baseline-src (an earlier wire format)",
}


def _memory(field: str) -> int:
    """Bytes of ``field`` (VmRSS, VmHWM) in /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise RuntimeError(f"{field} is not in /proc/self/status (needs Linux)")


def _reset_peak() -> int:
    """Reset this process's peak RSS (VmHWM) to its RSS now, and return that."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _memory("VmRSS")


def format_child(path: str, mb: int) -> dict[str, float]:
    """One transfer of a fresh ``mb`` MiB state through ``path`` (zero_copy or save_load), in
    this process: seconds and peak bytes above what was resident before, per side."""
    n = (mb << 20) // 8
    state = {"w": torch.randn(n), "m": torch.randn(n)}
    server = SnapshotServer(chunk_bytes=CHUNK, keep=1)
    server.start()
    try:
        base = _reset_peak()
        start = time.perf_counter()
        if path == "save_load":
            from safetensors.torch import load, save
            blob = save(state)
            with warnings.catch_warnings():  # bytes are read-only; nobody writes this view
                warnings.simplefilter("ignore")
                file = torch.frombuffer(blob, dtype=torch.uint8)
            entries, _ = layout({"file": file})
            server.publish(Snapshot(1, {}, entries, file))
        else:
            server.publish(snapshot_state(state, {"step": 1}, 1))
        source_s, source_peak = time.perf_counter() - start, _memory("VmHWM") - base
        base = _reset_peak()
        start = time.perf_counter()
        if path == "save_load":
            fetched, _ = fetch_snapshot(server.url, 1, parallel=4, timeout=120)
            tensors = load(fetched["file"].numpy().tobytes())
        else:
            tensors, _ = fetch_snapshot(server.url, 1, parallel=4, timeout=120,
                                        expected=expected_layout(state))
        receive_s, receive_peak = time.perf_counter() - start, _memory("VmHWM") - base
        assert all(torch.equal(tensors[k], state[k]) for k in state)
    finally:
        server.stop()
    return {"source_s": source_s, "receive_s": receive_s, "source_peak": source_peak,
            "receive_peak": receive_peak}


def measure_formats(sizes: list[int], reps: int, baseline_src: str | None
                    ) -> dict[tuple[str, int], list[dict[str, float]]]:
    """Each path at each size ``reps`` times, each in a fresh process, interleaved (the order of
    the paths rotates with each repetition)."""
    runs = [("zero_copy", str(REPO_ROOT / "src")), ("save_load", str(REPO_ROOT / "src"))]
    if baseline_src is not None:
        runs.append(("baseline", baseline_src))
    out: dict[tuple[str, int], list[dict[str, float]]] = {}
    for rep in range(reps):
        for mb in sizes:
            for key, src in runs[rep % len(runs):] + runs[:rep % len(runs)]:
                path = "zero_copy" if key == "baseline" else key
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(REPO_ROOT)])}
                done = subprocess.run(
                    [sys.executable, "-m", "bench.transfer", "--format-child", path, str(mb)],
                    cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    raise RuntimeError(f"{key} at {mb} MiB failed: {done.stderr[-2000:]}")
                result = json.loads(done.stdout.splitlines()[-1])
                out.setdefault((key, mb), []).append(result)
                print(f"  rep {rep + 1}/{reps} {mb} MiB {key}: {result}", flush=True)
    return out


def render_formats(out: dict[tuple[str, int], list[dict[str, float]]], reps: int,
                   flags: list[str]) -> str:
    rows = []
    for (key, mb), results in out.items():
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        state = 2 * ((mb << 20) // 8) * 4
        total = med["source_s"] + med["receive_s"]
        rows.append([FORMAT_PATHS[key], str(mb), f"{med['source_s']:.3f}",
                     f"{med['receive_s']:.3f}", f"{state / total / 1e9:.2f}",
                     f"{med['source_peak'] / state:.2f}", f"{med['receive_peak'] / state:.2f}"])
    return (section_header("Wire format: zero-copy safetensors layout vs safetensors.torch "
                           "save/load", "bench.transfer", flags)
            + f"\nOne transfer of a fresh float32 state (two tensors) in a fresh process, source "
              f"and receiver in it (fetch: 4 connections, {CHUNK >> 20} MiB chunks); median of "
              f"{reps} interleaved repetitions. GB/s: state bytes over source plus receive "
              "seconds. Peak: the most resident memory above what was resident before that "
              "side started (VmHWM), in multiples of the state's size.\n\n"
            + table(["path", "MiB", "source s", "receive s", "GB/s", "source peak x",
                     "receive peak x"], rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--quick", action="store_true", help="64 MiB, one repetition")
    p.add_argument("--no-write", action="store_true", help="print, leave BENCHMARKS.md alone")
    p.add_argument("--formats", action="store_true",
                   help="measure the wire format's cost instead (see above)")
    p.add_argument("--sizes", default="64,512", help="--formats: state sizes in MiB")
    p.add_argument("--baseline-src", help="--formats: another checkout's src/ to compare with")
    p.add_argument("--format-child", nargs=2, metavar=("PATH", "MB"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.format_child:
        print(json.dumps(format_child(args.format_child[0], int(args.format_child[1]))))
        return 0
    if args.formats:
        try:
            sizes = [int(x) for x in args.sizes.split(",")]
        except ValueError:
            p.error(f"--sizes={args.sizes!r} must be MiB counts separated by commas, e.g. 64,512")
        if min(sizes) < 1 or args.reps < 1:
            p.error(f"--sizes={args.sizes} and --reps={args.reps} must be at least 1")
        flags = ["--formats", f"--sizes {args.sizes}", f"--reps {args.reps}"]
        body = render_formats(measure_formats(sizes, args.reps, args.baseline_src), args.reps,
                              flags)
        return publish("transfer_formats", body, write=not args.no_write)
    mb, reps = (64, 1) if args.quick else (args.mb, args.reps)
    if mb < 1 or reps < 1:
        p.error(f"--mb={mb} and --reps={reps} must be at least 1")
    flags = [f"--mb {mb}", f"--reps {reps}"] if not args.quick else ["--quick"]
    body = render(measure(mb, reps), mb, reps, flags)
    return publish(SECTION, body, write=not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
