"""Live state transfer on one machine: where a rejoin's time goes, and fetch vs raw loopback.

``python -m bench.transfer [--mb 1024] [--reps 3]``. For a flat state of ``--mb`` MiB (the size of
an 82M-parameter model's parameters plus AdamW moments is about 1 GiB) it measures, side by side
in one run and as the median of ``--reps`` interleaved repetitions:

* the source's snapshot copy (``snapshot_state``) into a fresh buffer, and the same bytes copied
  into an already-touched buffer (the part of the copy that is page faults);
* the per-chunk sha256 table a source computes before it serves the header;
* ``fetch_snapshot`` with 1 and 4 connections, and a raw loopback socket moving the same bytes
  (the ceiling), as GB/s and as a fraction of loopback (issue 11's target: >= 70%).

Not measured here: the healthy groups' step time during a rejoin, which needs whole jobs
(``python -m bench.ft_vs_torchft --parts 3``).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import torch

from bench.common import section_header, table, write_section
from ftlm.ft.framing import chunk_table
from ftlm.ft.transport import SnapshotServer, fetch_snapshot, snapshot_state

SECTION = "transfer"


def _loopback(nbytes: int) -> float:
    """Seconds to move ``nbytes`` through one loopback TCP connection (sendall / recv_into)."""
    server = socket.create_server(("127.0.0.1", 0))
    payload = memoryview(bytearray(nbytes))

    def send() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(payload)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sink = memoryview(bytearray(nbytes))
    got = 0
    with socket.create_connection(server.getsockname()) as conn:
        t0 = time.perf_counter()
        while got < nbytes:
            n = conn.recv_into(sink[got:], min(1 << 20, nbytes - got))
            if not n:
                raise RuntimeError(f"loopback closed after {got} of {nbytes} bytes")
            got += n
        seconds = time.perf_counter() - t0
    sender.join(30)
    server.close()
    return seconds


def measure(mb: int, reps: int) -> dict[str, list[float]]:
    nbytes = mb << 20
    state = {"w": torch.randn(nbytes // 8), "m": torch.randn(nbytes // 8)}
    meta = {"step": 1}
    out: dict[str, list[float]] = {k: [] for k in (
        "copy_fresh", "copy_touched", "hash", "fetch1", "fetch4", "loopback")}
    server = SnapshotServer(chunk_bytes=4 << 20, keep=1)
    server.start()
    try:
        for rep in range(reps):
            t0 = time.perf_counter()
            snap = snapshot_state(state, meta, rep + 1)
            out["copy_fresh"].append(time.perf_counter() - t0)
            buf = snap.buffer
            t0 = time.perf_counter()
            for entry, t in zip(snap.tensors, state.values()):
                buf[entry.offset:entry.offset + entry.nbytes].copy_(t.reshape(-1).view(torch.uint8))
            out["copy_touched"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            chunk_table(snap.view(), 4 << 20, lambda: False)
            out["hash"].append(time.perf_counter() - t0)
            server.publish(snap)
            fetch_snapshot(server.url, rep + 1, timeout=120, parallel=1)  # header hashed: warm
            for par in (1, 4):
                t0 = time.perf_counter()
                fetch_snapshot(server.url, rep + 1, timeout=120, parallel=par)
                out[f"fetch{par}"].append(time.perf_counter() - t0)
            out["loopback"].append(_loopback(snap.total_bytes))
            print(f"  rep {rep + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in out.items()),
                  flush=True)
    finally:
        server.stop()
    return out


def render(out: dict[str, list[float]], mb: int, reps: int, flags: list[str]) -> str:
    gb = (mb << 20) / 1e9
    med = {k: statistics.median(v) for k, v in out.items()}
    loop = gb / med["loopback"]
    rows = [
        ["snapshot copy, fresh buffer (source)", f"{med['copy_fresh']:.3f}", f"{gb / med['copy_fresh']:.2f}", ""],
        ["same copy, touched buffer", f"{med['copy_touched']:.3f}", f"{gb / med['copy_touched']:.2f}", ""],
        ["sha256 chunk table (source, before the header)", f"{med['hash']:.3f}", f"{gb / med['hash']:.2f}", ""],
        ["fetch_snapshot, 1 connection", f"{med['fetch1']:.3f}", f"{gb / med['fetch1']:.2f}",
         f"{gb / med['fetch1'] / loop:.0%}"],
        ["fetch_snapshot, 4 connections", f"{med['fetch4']:.3f}", f"{gb / med['fetch4']:.2f}",
         f"{gb / med['fetch4'] / loop:.0%}"],
        ["raw loopback socket (ceiling)", f"{med['loopback']:.3f}", f"{loop:.2f}", "100%"],
    ]
    return (section_header("Live state transfer: copy, hash, fetch vs loopback (issue 11)",
                           "bench.transfer", flags)
            + f"\nA flat state of {mb} MiB; median of {reps} interleaved repetitions. "
              "The snapshot copy runs on a helper thread during the step's forward and backward "
              "(only `commit` waits for it); the fetch runs on the joiner's background threads "
              "and returns views into its receive buffer (no second copy).\n\n"
            + table(["operation", "seconds", "GB/s", "of loopback"], rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--quick", action="store_true", help="64 MiB, one repetition")
    p.add_argument("--no-write", action="store_true", help="print, leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    mb, reps = (64, 1) if args.quick else (args.mb, args.reps)
    if mb < 1 or reps < 1:
        p.error(f"--mb={mb} and --reps={reps} must be at least 1")
    flags = [f"--mb {mb}", f"--reps {reps}"] if not args.quick else ["--quick"]
    body = render(measure(mb, reps), mb, reps, flags)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
