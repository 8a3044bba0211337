"""Benchmark: what the state digest of ``ft.integrity_every`` costs a step.

For each model it builds a trainer's state (``Trainer.for_run``: model, AdamW moments, progress,
what ``TrainState.flat`` holds) and times, interleaved so that noise on the shared machine hits
all three alike: one training step (forward, loss, backward, AdamW step on a random batch),
``ftlm.ft.integrity.state_fingerprint`` over the whole state alone, and the step again with the
digest on a helper thread started before the forward and joined before the optimizer step (as
``Manager`` runs it). The cost per step at ``ft.integrity_every=N`` is given two ways: the
digest's time spread over N steps divided by the step time (the cost were it on the training
thread: an upper bound), and the measured slowdown of a step with the digest beside it, spread
over N steps.

    python -m bench.integrity [--quick] [--reps N] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import DEMO_SEQ_LEN, ensure_demo, median, publish, section_header, spread, table, usable_cores
from bench.train_throughput import Case, build_run_config
from ftlm.ft.integrity import state_fingerprint
from ftlm.train.trainer import Trainer

SECTION = "integrity"
EVERY = (10, 50, 100)
BATCH = 8


def measure(size: str, reps: int, threads: int) -> dict[str, object]:
    """Interleaved timings of a step, a digest, and a step with the digest beside it."""
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="ftlm-bench-") as tmp:
        with contextlib.redirect_stderr(io.StringIO()):
            trainer = Trainer.for_run(build_run_config(Case(size, BATCH, threads, 1, 0), Path(tmp) / "run"))
        state = trainer.state
        model, optimizer = state.model, state.optimizer
        vocab = model.tok_embeddings.weight.shape[0]
        tokens = torch.randint(0, vocab, (BATCH, DEMO_SEQ_LEN + 1))

        def step(beside: threading.Thread | None) -> float:
            t0 = time.perf_counter()
            if beside is not None:
                beside.start()
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
            loss.backward()
            if beside is not None:
                beside.join()  # the update waits for the digest (``Manager.commit``)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        step(None)  # warm up: allocator, optimizer state
        tensors = state.flat()[0]
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        alone, digests, beside = [], [], []
        for _ in range(reps):
            alone.append(step(None))
            t0 = time.perf_counter()
            state_fingerprint(tensors)
            digests.append(time.perf_counter() - t0)
            beside.append(step(threading.Thread(target=state_fingerprint, args=(tensors,))))
        return {"bytes": nbytes, "alone": alone, "digest": digests, "beside": beside}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model only, 3 repetitions")
    parser.add_argument("--reps", type=int, default=15, help="interleaved repetitions per model")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    args = parser.parse_args(argv)
    ensure_demo()
    threads = usable_cores()
    sizes, reps = (["tiny"], 3) if args.quick else (["tiny", "small"], args.reps)
    t0 = time.perf_counter()
    rows = []
    for size in sizes:
        m = measure(size, reps, threads)
        step_s, digest_s, beside_s = median(m["alone"]), median(m["digest"]), median(m["beside"])
        extra = max(0.0, beside_s - step_s)
        print(f"  {size}: step {step_s:.4f} s, digest {digest_s:.4f} s, step with digest {beside_s:.4f} s",
              flush=True)
        rows.append([size, f"{m['bytes'] / 2**20:.1f}", f"{step_s:.4f}", f"{digest_s:.4f}", spread(m["digest"]),
                     f"{m['bytes'] / digest_s / 2**30:.2f}", f"{beside_s:.4f}",
                     *(f"{100 * digest_s / every / step_s:.2f}% / {100 * extra / every / step_s:.2f}%"
                       for every in EVERY)])
    flags = ["--quick"] if args.quick else ([] if args.reps == 15 else ["--reps", str(args.reps)])
    body = "\n".join([
        section_header("State integrity: the cost of the state digest per step", "bench.integrity", flags),
        f"* Method: per model, {reps} interleaved repetitions in one process ({threads} torch threads, "
        f"batch {BATCH}, seq_len {DEMO_SEQ_LEN}, float32 on CPU) of one training step, one digest "
        "(xxh3-128, `ftlm.ft.integrity.state_fingerprint`) of the whole replicated state, and one step "
        "with the digest on a helper thread joined before the optimizer step (as the manager runs it); "
        "medians. *Cost at N*: the digest's seconds / N / the step's seconds (an upper bound: the cost "
        "were it on the training thread) / the measured slowdown of a step with the digest beside it, "
        f"/ N. Took {time.perf_counter() - t0:.0f} s.",
        "",
        table(["model", "state MiB", "step s", "digest s", "digests (min-max)", "digest GiB/s",
               "step with digest s", *(f"cost at integrity_every={every} (bound / measured)" for every in EVERY)],
              rows),
        "",
        "Reading: at the default `ft.integrity_every=100` the digest costs a step at most "
        + ", ".join(f"{r[0]} {r[-1].split(' / ')[0]}" for r in rows)
        + " (the bound); the step times are the machine's at the load above, which slows a step "
        "far more than a digest that streams memory once.",
    ])
    return publish(SECTION, body, not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
