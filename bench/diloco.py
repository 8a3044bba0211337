"""Benchmark: DiLoCo against every-step synchronisation, at equal tokens, on a small Transformer.

Three replica groups are simulated in one process (the shared 2-core box cannot run 15 jobs of
three processes in its budget): each group is a copy of the model with its own AdamW, the
all-reduce is an in-process mean, and the outer step, the fragments and the int8 code are
``ftlm.train.diloco``'s own functions (``split_fragments``, ``int8_*``) with the outer Nesterov
SGD of the defaults. The arms, at the same tokens (the inner steps ``--sizes`` gives each model
size, of ``--batch`` sequences per group):

* ``sync``: the gradient averaged every step (one AdamW step on 3 x batch);
* ``diloco H=10``, ``H=50`` and ``H=100``: plain DiLoCo;
* ``streaming F=4 int8``: H=48 (a multiple of the fragments, as ``ft.diloco_fragments`` requires), 4 fragments, overlap 1 step (alpha 0.5), int8 outer gradient
  with error feedback.

The data is a seeded first-order Markov language (``--vocab`` tokens, each with 8 likely
successors), so the held-out loss has a floor and the run needs no corpus. Reported per arm:
held-out loss (mean and 95% interval over seeds, t with n-1 degrees of freedom) and the bytes a
group puts on the wire between groups per token it trains (counted from the payloads sent).

    python -m bench.diloco [--seeds 3] [--sizes tiny:2000,small:300] [--jobs 2] [--write] [--quick]

Not measured: speed (the simulation has no network), failures (tests/train/test_diloco_launch.py).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import publish, section_header, t_interval, table
from ftlm.model.config import ModelConfig
from ftlm.model.llama import Transformer
from ftlm.train.diloco import int8_decode, int8_encode, int8_levels, int8_rows, split_fragments

GROUPS = 3


def markov(vocab: int, seed: int) -> torch.Tensor:
    """Transition probabilities: each token has 8 likely successors."""
    g = torch.Generator().manual_seed(1000 + seed)
    logits = torch.full((vocab, vocab), -4.0)
    for t in range(vocab):
        logits[t, torch.randperm(vocab, generator=g)[:8]] = torch.randn(8, generator=g) + 3
    return logits.softmax(-1)


def sample(probs: torch.Tensor, n: int, seq: int, g: torch.Generator) -> torch.Tensor:
    out = torch.empty(n, seq, dtype=torch.long)
    out[:, 0] = torch.randint(probs.shape[0], (n,), generator=g)
    for i in range(1, seq):
        out[:, i] = torch.multinomial(probs[out[:, i - 1]], 1, generator=g).squeeze(1)
    return out


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def run(arm: dict, seed: int, args, size: str = "tiny", inner_steps: int | None = None) -> tuple[float, float]:
    """Held-out loss after the arm's training of ``inner_steps`` steps per group of a ``size``
    model, and wire bytes per token."""
    torch.set_num_threads(1)
    inner_steps = inner_steps or args.inner_steps
    torch.manual_seed(seed)
    cfg = ModelConfig(size=size, vocab_size=args.vocab, max_seq_len=args.seq)
    base = Transformer(cfg)
    probs = markov(args.vocab, seed)
    # The whole stream at once (one vectorised pass): the same for every arm of a seed.
    stream = sample(probs, inner_steps * GROUPS * args.batch, args.seq + 1,
                    torch.Generator().manual_seed(seed))
    stream = stream.view(inner_steps, GROUPS, args.batch, args.seq + 1)
    held_out = sample(probs, 64, args.seq + 1, torch.Generator().manual_seed(10_000 + seed))
    models = [copy.deepcopy(base) for _ in range(GROUPS)]
    inner = [torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0) for m in models]
    params = [list(m.parameters()) for m in models]
    outer = [p.detach().clone().requires_grad_(True) for p in base.parameters()]
    outer_opt = torch.optim.SGD(outer, lr=0.7, momentum=0.9, nesterov=True)
    h, frags, overlap, wire = arm["h"], arm.get("fragments", 1), arm.get("overlap", 0), arm.get("wire", "float32")
    per_sync = h // frags
    fragments = split_fragments([p.numel() for p in outer], frags, "strided")
    residual: dict[tuple[int, int], torch.Tensor] = {}
    sent = tokens = 0
    pending: dict | None = None
    for step in range(inner_steps):
        batches = stream[step]
        tokens += GROUPS * args.batch * args.seq
        for m, b in zip(models, batches):
            loss_of(m, b).backward()
        if arm["h"] == 1:  # every step: average the gradients, one step everywhere
            for i in range(len(outer)):
                avg = sum(ps[i].grad for ps in params) / GROUPS
                for ps in params:
                    ps[i].grad = avg.clone()
            sent += GROUPS * sum(p.numel() * 4 for p in outer)
        for opt in inner:
            torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if arm["h"] == 1:
            continue
        k = step % per_sync + 1
        if k == per_sync - overlap:  # take the fragment's pseudo-gradient, average it
            f = (step // per_sync) % frags
            idx = fragments[f]
            pseudo = [torch.cat([(outer[i] - ps[i]).detach().reshape(-1) for i in idx]) for ps in params]
            if wire == "int8":
                rows = [int8_rows(v + residual.get((g, f), 0)) for g, v in enumerate(pseudo)]
                range_sum = sum(r.abs().amax(dim=1) for r in rows)
                levels = int8_levels(GROUPS)
                codes = []
                for g, r in enumerate(rows):
                    c, err = int8_encode(r, range_sum, levels)
                    residual[(g, f)] = err.reshape(-1)[:pseudo[g].numel()]
                    codes.append(c)
                total = sum((c for c in codes), torch.zeros_like(codes[0]))
                avg = int8_decode(total, range_sum, levels, GROUPS).reshape(-1)[:pseudo[0].numel()]
                sent += GROUPS * (pseudo[0].numel() + 4 * rows[0].shape[0])
            else:
                avg = sum(pseudo) / GROUPS
                sent += GROUPS * pseudo[0].numel() * 4
            pending = {"idx": idx, "avg": avg}
        if k == per_sync and pending is not None:  # apply the outer step, merge into each group
            idx, avg = pending["idx"], pending["avg"]
            off = 0
            for i in idx:
                n = outer[i].numel()
                outer[i].grad = avg[off:off + n].view_as(outer[i]).clone()
                off += n
            outer_opt.step()
            outer_opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for ps in params:
                    for i in idx:
                        if overlap:
                            ps[i].lerp_(outer[i], 0.5)
                        else:
                            ps[i].copy_(outer[i])
            pending = None
    final = models[0]
    if arm["h"] != 1:
        with torch.no_grad():
            for p, o in zip(final.parameters(), outer):
                p.copy_(o)
    with torch.no_grad():
        held = float(loss_of(final, held_out))
    return held, sent / tokens


def counted_bytes(args, workdir: str) -> list[tuple[str, float, int]]:
    """``summary.json``'s ``bytes_between_groups_per_token`` of real ``ftlm.train.Session`` runs
    (one group alone: a group's payload per token is the same with any number of groups), and the
    largest payload one exchange put on the wire (``wire_bytes`` of the ``commit`` events): what
    the link must carry within the steps an exchange may take, so the peak bandwidth."""
    import os
    from pathlib import Path

    from ftlm.observe.events import read_events
    from ftlm.train import Session
    out = []
    modes = {"every step": ("every_step", {}, 10),
             "diloco H=100": ("diloco", {"diloco_inner_steps": 100}, 1),
             "streaming H=100 F=4 int8": ("diloco", {"diloco_inner_steps": 100, "diloco_fragments": 4,
                                                     "diloco_wire_dtype": '"int8"'}, 4)}
    probs = markov(args.vocab, 0)
    for name, (sync, fields, steps) in modes.items():
        run_dir = Path(workdir) / name.replace(" ", "_")
        lines = "\n".join(f"{k} = {v}" for k, v in fields.items())
        config = Path(workdir) / f"{run_dir.name}.toml"
        config.write_text(f'[run]\ndir = "{run_dir}"\n[train]\nsteps = {steps}\nbatch_size = {args.batch}\n'
                          f'[checkpoint]\nevery = 0\n[ft]\nsync = "{sync}"\n{lines}\n')
        os.environ["FTLM_CONFIG"] = str(config)
        torch.manual_seed(0)
        model = Transformer(ModelConfig(size="tiny", vocab_size=args.vocab, max_seq_len=args.seq))
        data = sample(probs, 200 * args.batch, args.seq + 1, torch.Generator().manual_seed(0))
        session = Session(model, torch.optim.AdamW(model.parameters(), lr=args.lr), lr=args.lr,
                          tokens_per_sample=args.seq)
        for step in session:
            loss = loss_of(model, data[[p % len(data) for p in step.samples]])
            loss.backward()
            session.commit(loss)
        per_token = session.close()["bytes_between_groups_per_token"]
        largest = max(e.get("wire_bytes", 0) for e in read_events(run_dir / "events.jsonl")
                      if e["kind"] == "commit")
        out.append((name, per_token, largest))
    del os.environ["FTLM_CONFIG"]
    return out


ARMS = {"sync (every step)": {"h": 1}, "diloco H=10": {"h": 10}, "diloco H=50": {"h": 50},
        "diloco H=100": {"h": 100},
        "streaming H=48 F=4 int8 overlap 1": {"h": 48, "fragments": 4, "overlap": 1, "wire": "int8"}}


def parse_sizes(text: str) -> list[tuple[str, int]]:
    """``tiny:1000,small:300`` -> [("tiny", 1000), ("small", 300)]."""
    out = []
    for part in text.split(","):
        size, _, steps = part.partition(":")
        if size not in ("tiny", "small", "base") or not steps.isdigit() or int(steps) < 100:
            raise SystemExit(f"--sizes: {part!r} is not SIZE:INNER_STEPS with SIZE tiny|small|base "
                             "and at least 100 inner steps (H=100 needs one outer step); "
                             "for example --sizes tiny:1000,small:300")
        out.append((size, int(steps)))
    return out


def _job(job: tuple) -> tuple:
    size, steps, name, seed, args = job
    t0 = time.time()
    loss, bpt = run(ARMS[name], seed, args, size, steps)
    return size, name, seed, loss, bpt, time.time() - t0


def quality_rows(size: str, results: dict) -> list[tuple]:
    """One row per arm: loss over seeds, the gap to sync paired by seed (percent), bytes."""
    sync = results[(size, "sync (every step)")]
    seeds = sorted(sync)
    sync_bpt = statistics.fmean(b for _, b in sync.values())
    rows = []
    for name in ARMS:
        got = results[(size, name)]
        losses = [got[s][0] for s in seeds]
        mean, half = t_interval(losses)
        gaps = [100 * (got[s][0] - sync[s][0]) / sync[s][0] for s in seeds]
        gap, gap_half = t_interval(gaps)
        bpt = statistics.fmean(got[s][1] for s in seeds)
        rows.append((name, f"{mean:.4f} ± {half:.4f}", " ".join(f"{x:.4f}" for x in losses),
                     "-" if name.startswith("sync") else f"{gap:+.2f}% ± {gap_half:.2f}",
                     f"{bpt:.2f}", f"{sync_bpt / bpt:.0f}x"))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sizes", default="tiny:2000,small:300",
                    help="model sizes and inner steps per group, SIZE:STEPS,... (default %(default)s)")
    ap.add_argument("--inner-steps", type=int, default=200, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    ap.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's section")
    ap.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone (wins over --write)")
    ap.add_argument("--quick", action="store_true", help="smoke size: 2 seeds of the tiny model, 100 inner steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.sizes = 2, "tiny:100"
    if args.seeds < 1 or args.jobs < 1:
        ap.error("--seeds and --jobs at least 1")
    sizes = parse_sizes(args.sizes)
    # The largest jobs first, so that the pool's last minutes are not one long run alone.
    jobs = [(size, steps, name, seed, args) for size, steps in sizes for name in ARMS
            for seed in range(args.seeds)]
    jobs.sort(key=lambda j: -(j[1] * (1 if j[0] == "tiny" else 8)))
    results: dict = {}
    t0 = time.time()
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(args.jobs) as pool:
        for done, (size, name, seed, loss, bpt, secs) in enumerate(pool.map(_job, jobs), 1):
            results.setdefault((size, name), {})[seed] = (loss, bpt)
            print(f"[{done}/{len(jobs)}, {time.time() - t0:.0f} s] {size} {name} seed {seed}: "
                  f"held-out {loss:.4f}, {bpt:.1f} B/token ({secs:.0f} s)", flush=True)
    flags = [f"--seeds {args.seeds}", f"--sizes {args.sizes}", f"--batch {args.batch}",
             f"--seq {args.seq}", f"--vocab {args.vocab}"]
    import tempfile
    with tempfile.TemporaryDirectory() as workdir:
        counted = counted_bytes(args, workdir)
    base = counted[0][1]
    plain = dict((name, largest) for name, _, largest in counted)["diloco H=100"]
    counted_rows = [(name, f"{b:.2f}", f"{base / b:.0f}x", f"{largest:,}", f"{largest / plain:.2f}")
                    for name, b, largest in counted]
    body = (section_header("DiLoCo: held-out loss at equal tokens, bytes between groups", "bench.diloco", flags)
            + f"\n{GROUPS} groups simulated in one process (vocab {args.vocab}, seq {args.seq}, batch "
            f"{args.batch} per group); {time.time() - t0:.0f} s on this box. Intervals: 95% over "
            f"{args.seeds} seeds (t); the gap to sync is paired by seed (the same data and initial "
            "weights).\n")
    for size, steps in sizes:
        body += (f"\n{size} model, {steps} inner steps per group:\n\n"
                 + table(["arm", "held-out loss", "per seed", "gap to sync", "bytes/token per group",
                          "less than sync"], quality_rows(size, results)) + "\n")
    body += ("\nBytes between groups per token counted by `ftlm.train.Session` itself (`summary.json` "
             f"`bytes_between_groups_per_token`, one group alone, {args.batch} x {args.seq} tokens a step):\n\n"
             + table(["mode", "bytes/token per group", "less than every step",
                      "largest exchange, bytes per group", "largest / plain DiLoCo's"], counted_rows)
             + "\n\nThe largest exchange is what the link between groups must carry within the steps "
             "an exchange may take (plain DiLoCo: its outer step, blocking; streaming: one "
             "fragment, overlapped with the next inner step), so it sets the peak bandwidth.\n")
    return publish("diloco", body, args.write and not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
