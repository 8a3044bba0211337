"""``ftlm demo``: the whole story on one machine in a few minutes.

Builds the demo corpus and tokenizer once (cached under ``data/demo``), then trains the tiny model
as several fault-tolerant replica groups with chaos on (random groups are killed and come back),
and ends with the report (ETT, failures, recoveries, identical replicas, exactly-once data, loss)
and a sample generation from the trained model. It exits non-zero unless every group ended with
the same state and every sample was trained exactly once.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

from ftlm.config import build_config
from ftlm.data.demo import ensure_demo_data
from ftlm.data.tokenizer import Tokenizer
from ftlm.launch.local import LocalLauncher
from ftlm.model import Transformer
from ftlm.model.generate import generate

SEQ_LEN = 128
BATCH = 8
PROMPT = "def "


def _demo_config(args: argparse.Namespace, data_dir: Path, steps: int):
    raw = {
        "run": {"name": "demo", "dir": args.run_dir, "seed": 0},
        "model": {"size": "tiny"},
        "data": {"dir": str(data_dir), "seq_len": SEQ_LEN},
        "train": {"steps": steps, "batch_size": BATCH, "lr": 3e-3, "warmup_steps": 20,
                  "threads": 1},
        # Chaos stops some groups while they start: their start-up beacon finds them in
        # ft.startup_stall_timeout (15 s); a group only slow to start (a loaded machine) keeps
        # the default ft.startup_timeout (the 30 s of earlier demos killed five such groups).
        "ft": {"groups": args.groups, "heartbeat_interval": 0.1, "heartbeat_timeout": 1.0,
               "allreduce_timeout": 10.0, "lr_policy": "sqrt", "quorum_timeout": 60.0},
    }
    return build_config(raw)


def _estimate_steps(args: argparse.Namespace) -> int:
    """Steps that fill about ``args.seconds`` on this machine (measured, not guessed)."""
    from ftlm.model.config import ModelConfig
    torch.set_num_threads(1)
    model = Transformer(ModelConfig(size="tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 4096, (BATCH, SEQ_LEN + 1))
    t0 = time.perf_counter()
    for _ in range(5):
        logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    per_step = (time.perf_counter() - t0) / 5
    # Each of the groups shares the machine's cores, plus the all-reduce and the quorum.
    cores = max(1, len(__import__("os").sched_getaffinity(0)))
    per_step = per_step * max(1.0, args.groups / cores) + 0.01
    return max(50, int(args.seconds / per_step))


def run_demo(args: argparse.Namespace) -> int:
    data_dir = ensure_demo_data(Path(args.data_dir), seq_len=SEQ_LEN, vocab_size=4096)
    steps = _estimate_steps(args)
    config = _demo_config(args, data_dir, steps)
    # Every demo starts over: an earlier demo's checkpoints (its final step is always saved)
    # would make this one resume where that one ended. Its record is set aside, not erased.
    shutil.rmtree(config.run.path / "checkpoints", ignore_errors=True)
    print(f"ftlm demo: {args.groups} replica groups of the tiny model, {steps} steps, "
          f"a failure every ~{args.chaos_mtbf:.0f} s (SIGKILL and SIGSTOP); run directory "
          f"{config.run.path}", file=sys.stderr)
    summary = LocalLauncher(config, groups=args.groups, chaos_mtbf=args.chaos_mtbf,
                            chaos_hang=True, chaos_seed=0, progress=True).run()
    weights = config.run.path / "model.safetensors"
    if weights.is_file():
        print("\nsample from the trained model:")
        print(sample_text(weights, data_dir / "tokenizer.json", PROMPT))
    print(f"\nreport: {config.run.path / 'report.md'}")
    for problem in summary.get("problems", []):
        print(f"ftlm demo: run failed its checks: {problem}", file=sys.stderr)
    return 1 if summary.get("problems") else 0


def sample_text(weights: Path, tokenizer_path: Path, prompt: str, max_new_tokens: int = 80) -> str:
    from safetensors.torch import load_model

    from ftlm.model.config import ModelConfig
    tokenizer = Tokenizer.load(tokenizer_path)
    model = Transformer(ModelConfig(size="tiny"))
    load_model(model, str(weights))
    ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long)
    out = generate(model, ids, max_new_tokens=max_new_tokens, temperature=0.8, top_k=40,
                   generator=torch.Generator().manual_seed(0), eos_id=tokenizer.eos_id)
    return tokenizer.decode(out[0].tolist())
