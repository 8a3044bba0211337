"""A source's training step time while it serves its snapshot to a recovering peer.

``python -m bench.serve_impact [--models small:4,large:1] [--steps 6] [--reps 2]
[--settings process:19,process:0,thread:19,thread:0]``.
One process trains a model (forward, backward, AdamW, one torch thread: a group of one rank) and
serves its state (parameters and AdamW moments) the way a source does; a second process, the
recovering peer, pulls that snapshot with ``fetch_snapshot`` (4 connections) over and over. Per
model it measures the median step time with nobody pulling (*idle*) and while the peer pulls
(*serving*), for each setting ``SERVER:NICE`` of ``--settings``: the server kind
(``ft.snapshot_server``: ``process``, a child process serving from shared memory at nice
``ft.serve_nice``; ``thread``, threads of the training process at ``ft.transfer_nice``) and its
CPU priority. The puller process runs at the same nice value. Repetitions go round all settings
(in reverse order every other round), each an idle/serving pair in alternating order, so drift
of the machine's load hits every setting alike. The issue's target: serving within 10% of idle.

This isolates what serving costs the source from the rest of a rejoin (the quorum, the process
group rebuild, the joiner's catch-up), which ``python -m bench.ft_vs_torchft --parts 3`` measures
in whole jobs. On a 2-core machine the serving threads, the puller and the training thread share
two cores, as a source host's cores are never shared with its peer on a cluster.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from bench.common import publish, section_header, table
from bench.ft_vs_torchft import model_of, params_of

SECTION = "serve_impact"
STEP = 0  # the snapshot's step number (any)
STARTS: list[float] = []  # seconds ProcessSnapshotServer.start() took on the calling thread
READY: list[float] = []  # seconds from start() until its process answered

# The recovering peer: pulls the snapshot until stdin closes, one line per completed pull. It
# stands for another host, so all of it runs at the setting's nice value, not only its pulling
# threads: its main thread allocates and frees a receive buffer per pull (at nice 0 that alone
# cost the small model's source +23-37% at process:19, and +6% with the whole puller at 19).
_PULLER = """
import os, sys, threading
from ftlm.ft.transport import fetch_snapshot
url, nice = sys.argv[1], int(sys.argv[2])
os.nice(nice)  # before any thread: they all inherit it
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.is_set():
    tensors, _ = fetch_snapshot(url, 0, parallel=4, timeout=60)
    print(sum(t.numel() * t.element_size() for t in tensors.values()), flush=True)
"""


class _Training:
    """One group's training step on random tokens: forward, backward, AdamW."""

    def __init__(self, name: str, batch: int, seq: int = 128) -> None:
        from ftlm.config import build_config
        from ftlm.model import Transformer
        from ftlm.train.optim import build_optimizer
        config = build_config({"model": model_of(name), "train": {"batch_size": batch}})
        self.model = Transformer(config.model)
        self.model.init_weights(0)
        self.optimizer = build_optimizer(self.model, config.train)
        self.tokens = torch.randint(0, config.model.vocab_size, (batch, seq + 1),
                                    generator=torch.Generator().manual_seed(0))
        self.step()  # AdamW's moments exist from the first step on

    def step(self) -> float:
        t0 = time.perf_counter()
        logits = self.model(self.tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 self.tokens[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def state(self) -> dict[str, torch.Tensor]:
        out = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        for i, s in enumerate(self.optimizer.state.values()):
            out.update({f"optim.{i}.{k}": v for k, v in s.items() if torch.is_tensor(v) and v.dim()})
        return out


def _phase(training: _Training, steps: int, url: str | None, nice: int) -> tuple[list[float], float]:
    """Step times of ``steps`` steps, with a puller at ``url`` when given; and GB/s it pulled."""
    puller = None
    if url is not None:
        puller = subprocess.Popen([sys.executable, "-c", _PULLER, url, str(nice)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = puller.stdout.readline()  # its first pull: the transfer is in full swing
        if not first:
            raise RuntimeError("the puller exited before its first pull")
    times, pulled, t0 = [], 0, time.perf_counter()
    try:
        for _ in range(steps):
            times.append(training.step())
    finally:
        if puller is not None:
            # Closing its stdin stops it: it finishes the pull in flight, then exits.
            out, _ = puller.communicate(input="", timeout=300)
            pulled = sum(int(line) for line in out.split())
    return times, pulled / max(time.perf_counter() - t0, 1e-9) / 1e9


def _server(kind: str, nice: int) -> Any:
    from ftlm.ft.serve_process import ProcessSnapshotServer
    from ftlm.ft.transport import SnapshotServer
    if kind == "process":
        return ProcessSnapshotServer(nice=nice)
    if kind == "thread":
        return SnapshotServer(thread_nice=nice)
    raise SystemExit(f"--settings: server {kind!r} is neither 'process' nor 'thread'")


def measure(models: list[tuple[str, int]], steps: int, reps: int,
            settings: list[tuple[str, int]]) -> list[list]:
    from ftlm.ft.transport import snapshot_state
    rows = []
    torch.set_num_threads(1)
    for name, batch in models:
        training = _Training(name, batch)
        state = training.state()
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        idle: dict[tuple[str, int], list[float]] = {s: [] for s in settings}
        serving: dict[tuple[str, int], list[float]] = {s: [] for s in settings}
        rates: dict[tuple[str, int], list[float]] = {s: [] for s in settings}
        for rep in range(reps):
            for kind, nice in (settings if rep % 2 == 0 else settings[::-1]):
                server = _server(kind, nice)
                t0 = time.perf_counter()
                url = server.start()
                if kind == "process":  # what starting it costs a group, and until it answers
                    STARTS.append(time.perf_counter() - t0)
                    server.sync()
                    READY.append(time.perf_counter() - t0)
                server.publish(snapshot_state(state, {"step": STEP}, STEP,
                                              shared=server.shared_memory))
                try:
                    # ABAB across repetitions: the machine's drift hits both alike.
                    for pulling in ((False, True) if rep % 2 == 0 else (True, False)):
                        times, rate = _phase(training, steps, url if pulling else None, nice)
                        # A phase's first step is left out: it straddles the phase change.
                        (serving if pulling else idle)[kind, nice].extend(times[1:])
                        if pulling:
                            rates[kind, nice].append(rate)
                finally:
                    server.stop()
                print(f"  {name} rep {rep + 1}/{reps} {kind}:{nice}: idle "
                      f"{statistics.median(idle[kind, nice]):.3f} s, serving "
                      f"{statistics.median(serving[kind, nice]):.3f} s", flush=True)
        for kind, nice in settings:
            a, b = statistics.median(idle[kind, nice]), statistics.median(serving[kind, nice])
            row = [name, f"{params_of(model_of(name)) / 1e6:.1f}M", f"{nbytes / 2**30:.2f}",
                   kind, nice, f"{a:.3f}", f"{b:.3f}", f"{100 * (b / a - 1):+.1f}%",
                   f"{statistics.median(rates[kind, nice]):.2f}"]
            print("  " + " | ".join(map(str, row)), flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="small:4,large:1",
                   help="NAME:BATCH,... (names as in bench.ft_vs_torchft; default small:4,large:1)")
    p.add_argument("--steps", type=int, default=6, help="steps per phase (default 6)")
    p.add_argument("--reps", type=int, default=2, help="idle/serving pairs per setting (default 2)")
    p.add_argument("--settings", default="process:19,process:0,thread:19,thread:0",
                   help="SERVER:NICE,... server kinds (process, thread) and CPU priorities to "
                        "compare (default process:19,process:0,thread:19,thread:0)")
    p.add_argument("--quick", action="store_true", help="smoke-test size: tiny model, 3 steps, 1 pair")
    p.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.steps, args.reps = "tiny:8", 3, 1
    models = [(m.partition(":")[0], int(m.partition(":")[2] or 1)) for m in args.models.split(",")]
    settings = [(s.partition(":")[0], int(s.partition(":")[2] or 0))
                for s in args.settings.split(",")]
    t0 = time.time()
    rows = measure(models, args.steps, args.reps, settings)
    flags = [f"--models {args.models}", f"--steps {args.steps}", f"--reps {args.reps}",
             f"--settings {args.settings}"]
    body = (section_header("A source's step time while it serves its snapshot",
                           "bench.serve_impact", flags)
            + f"* Method: see `bench/serve_impact.py`; one torch thread, sequences of 128 tokens, "
              f"{args.reps} idle/serving pair(s) of {args.steps} steps per setting, settings "
              f"interleaved and pairs ABAB, medians (a phase's first step left out); the "
              f"puller process at the server's nice value. Took {time.time() - t0:.0f} s."
              + (f" Starting a server process took {1000 * statistics.median(STARTS):.1f} ms "
                 f"(median of {len(STARTS)}, max {1000 * max(STARTS):.1f}) on the calling "
                 f"thread, and it answered {1000 * statistics.median(READY):.0f} ms (max "
                 f"{1000 * max(READY):.0f}) after start() began." if STARTS else "")
              + "\n\n"
            + table(["model", "params", "state GiB", "server", "nice", "idle step s",
                     "serving step s", "serving vs idle", "pulled GB/s"], rows) + "\n")
    return publish(SECTION, body, write=not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
