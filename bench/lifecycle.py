"""Benchmark: the model lifecycle on a CPU. Pretrain -> SFT -> held-out accuracy; DPO and GRPO from SFT.

Stages (each one group of ``ftlm`` in-process, the same Trainer as under fault tolerance; the
chaos invariants of the post-training commands are tested in tests/post, not here):

1. **pretrain** the tiny model on the demo corpus (``configs/tiny.toml``), once (seed 0);
2. **SFT** from it on the task suite's training split (``ftlm sft``: chat template, loss on
   completions, packing with document masking), one run per seed;
3. **DPO** from each SFT model: preference pairs sampled from that SFT model and checked
   (``ftlm pairs``: correct vs incorrect sample, or the reference solution vs an incorrect sample
   when no sample is correct), then ``ftlm dpo`` with the SFT model as the frozen reference;
4. **GRPO** from each SFT model (``ftlm grpo``: G samples per prompt, checker reward, clipped
   ratio, KL to the SFT model).

Every model is scored on the same held-out tasks (the suite's test split, which shares no problem
with training) by greedy pass@1 (``ftlm eval``'s ``task_accuracy``), with a 95 % interval over
tasks (normal approximation). The table gives per stage the mean over seeds and each seed's value
with its interval, and the compute of the stage: wall seconds on this machine and the tokens it
processed (committed training tokens; for pairs and evaluation, the sampling time).

    python -m bench.lifecycle [--quick] [--seeds N] [--no-write]

It does not tune hyper-parameters (those below are fixed, stated in the section) and does not
measure fault tolerance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (
    REPO_ROOT,
    command_line,
    ensure_demo,
    section_header,
    table,
    write_section,
)

# sort has the longest completions (up to ~80 tokens): left out to keep sampling affordable here.
FAMILIES = "add,mod,count"

FULL = {"pretrain_steps": 200, "sft_steps": 150, "train_tasks": 1000, "heldout_tasks": 200,
        "pair_tasks": 150, "dpo_steps": 40, "grpo_steps": 12, "group_size": 6,
        "grpo_batch": 4, "max_new_tokens": 96}
QUICK = {"pretrain_steps": 20, "sft_steps": 10, "train_tasks": 100, "heldout_tasks": 20,
         "pair_tasks": 16, "dpo_steps": 4, "grpo_steps": 2, "group_size": 4, "grpo_batch": 2,
         "max_new_tokens": 48}


def _config(run_dir: Path, seed: int, **sections):
    from ftlm.config import build_config, load_config
    base = load_config(REPO_ROOT / "configs" / "tiny.toml").to_dict()
    base["run"].update({"dir": str(run_dir), "name": run_dir.name, "seed": seed})
    base["train"].update({"threads": 1, "eval_every": 0})
    base["observe"].update({"progress": False, "metrics": False})
    for name, body in sections.items():
        base.setdefault(name, {}).update(body)
    return build_config(base)


def _post_sections(sizes: dict, lr: float, steps: int, init_from: Path, **post) -> dict:
    return {"data": {"seq_len": 256, "eval_samples": 0},
            "train": {"steps": steps, "lr": lr, "warmup_steps": max(1, steps // 10),
                      "init_from": str(init_from), "batch_size": 8},
            "post": {"families": FAMILIES, "train_tasks": sizes["train_tasks"],
                     "heldout_tasks": 0, "max_new_tokens": sizes["max_new_tokens"], **post}}


def _accuracy(weights: Path, tasks, max_new_tokens: int) -> dict:
    from safetensors.torch import load_model

    from ftlm.data.tokenizer import Tokenizer
    from ftlm.evaluate_cli import task_accuracy
    from ftlm.model import Transformer
    from ftlm.model.config import ModelConfig
    model = Transformer(ModelConfig(size="tiny"))
    load_model(model, str(weights))
    tokenizer = Tokenizer.load(REPO_ROOT / "data" / "demo" / "tokenizer.json")
    result = task_accuracy(model, tokenizer, tasks, max_new_tokens=max_new_tokens)
    score = result["scores"]["all"]["pass@1"]
    per_family = {f: s["pass@1"]["mean"] for f, s in result["scores"].items() if f != "all"}
    return {"acc": score["mean"], "ci95": score["ci95"], "eval_seconds": result["seconds"],
            "families": per_family}


def _train(kind: str, config) -> dict:
    from ftlm.post import run as post_run
    from ftlm.train.trainer import Trainer
    t0 = time.perf_counter()
    summary = Trainer(config).train() if kind == "pretrain" else post_run.run(kind, config)
    return {"seconds": time.perf_counter() - t0, "tokens": summary["tokens_committed"],
            "steps": summary["steps_committed"], "final_loss": summary["final_loss"]}


def run_lifecycle(root: Path, sizes: dict, seeds: int) -> dict:
    from ftlm.post.pairs import make_pairs, write_pairs
    from ftlm.post.run import load_reference, load_tokenizer
    from ftlm.tasks import generate
    torch.set_num_threads(1)
    ensure_demo()
    heldout = generate(FAMILIES, "test", sizes["heldout_tasks"], 1234)
    out: dict = {"sizes": sizes, "stages": {}}

    def record(stage: str, seed: int, compute: dict, weights: Path) -> None:
        acc = _accuracy(weights, heldout, sizes["max_new_tokens"])
        entry = {**compute, **acc}
        out["stages"].setdefault(stage, {})[seed] = entry
        print(f"{stage} seed {seed}: acc {acc['acc']:.3f} +- {acc['ci95']:.3f} "
              f"({compute.get('seconds', 0):.0f} s) {acc['families']}", flush=True)

    pre = _config(root / "pretrain", 0, train={"steps": sizes["pretrain_steps"]})
    compute = _train("pretrain", pre)
    base_weights = pre.run.path / "model.safetensors"
    record("pretrained", 0, compute, base_weights)
    for seed in range(seeds):
        sft = _config(root / f"sft{seed}", seed, **_post_sections(
            sizes, 1e-3, sizes["sft_steps"], base_weights, task_seed=seed))
        record("SFT", seed, _train("sft", sft), sft.run.path / "model.safetensors")
        sft_weights = sft.run.path / "model.safetensors"
        # DPO: pairs sampled from this SFT model on training tasks it was trained on.
        t0 = time.perf_counter()
        pcfg = _config(root / f"pairs{seed}", seed, **_post_sections(
            sizes, 1e-4, 1, sft_weights, train_tasks=sizes["pair_tasks"], task_seed=100 + seed,
            pair_samples=4, temperature=1.0))
        tasks = generate(FAMILIES, "train", sizes["pair_tasks"], 100 + seed)
        records, counts = make_pairs(load_reference(pcfg, torch.device("cpu")),
                                     load_tokenizer(pcfg), tasks, samples=4,
                                     max_new_tokens=sizes["max_new_tokens"],
                                     temperature=1.0, top_k=0, seed=seed)
        pairs = write_pairs(records, root / f"pairs{seed}.jsonl")
        pair_seconds = time.perf_counter() - t0
        dpo = _config(root / f"dpo{seed}", seed, **_post_sections(
            sizes, 2e-4, sizes["dpo_steps"], sft_weights, data=str(pairs), beta=0.1))
        compute = _train("dpo", dpo)
        compute["pair_seconds"], compute["pairs"] = pair_seconds, counts
        record("DPO", seed, compute, dpo.run.path / "model.safetensors")
        grpo = _config(root / f"grpo{seed}", seed, **_post_sections(
            sizes, 2e-4, sizes["grpo_steps"], sft_weights, group_size=sizes["group_size"],
            kl_coef=0.04, clip=0.2, temperature=1.0, task_seed=200 + seed))
        grpo.train.batch_size = sizes["grpo_batch"]
        record("GRPO", seed, _train("grpo", grpo), grpo.run.path / "model.safetensors")
    return out


def verdict(result: dict) -> str:
    """The issue's targets, judged from the numbers: a stage beats another when its mean over seeds
    exceeds the other's by more than the larger mean 95 % interval of the two."""
    stages = result["stages"]

    def mean(stage: str, key: str = "acc") -> float:
        return statistics.fmean(e[key] for e in stages[stage].values())

    lines = []
    for better, worse in (("SFT", "pretrained"), ("DPO", "SFT"), ("GRPO", "SFT")):
        if better not in stages or worse not in stages:
            continue
        diff = mean(better) - mean(worse)
        interval = max(mean(better, "ci95"), mean(worse, "ci95"))
        met = "met" if diff > interval else "NOT met"
        lines.append(f"{better} - {worse}: {diff:+.3f} (interval {interval:.3f}): {met}")
    return "Targets of issue 12 (a stage above another by more than the interval): " + \
        "; ".join(lines) + "."


def format_section(result: dict, flags: list[str]) -> str:
    sizes = result["sizes"]
    rows = []
    for stage, by_seed in result["stages"].items():
        accs = [e["acc"] for e in by_seed.values()]
        mean = statistics.fmean(accs)
        sd = statistics.stdev(accs) if len(accs) > 1 else float("nan")
        seeds = "; ".join(f"{e['acc']:.3f} ± {e['ci95']:.3f}" for e in by_seed.values())
        secs = statistics.fmean(e["seconds"] for e in by_seed.values())
        tokens = statistics.fmean(e["tokens"] for e in by_seed.values())
        extra = ""
        if stage == "DPO":
            extra = f" + {statistics.fmean(e['pair_seconds'] for e in by_seed.values()):.0f} s pairs"
        rows.append([stage, f"{mean:.3f}" + ("" if len(accs) < 2 else f" (sd {sd:.3f})"), seeds,
                     f"{secs:.0f} s{extra}", f"{tokens:,.0f}"])
    body = section_header("Lifecycle on CPU: pretrain -> SFT -> DPO / GRPO (issue 12)",
                          "bench.lifecycle", flags)
    if "--from-json" in command_line():
        body += f"* Trained by `{result.get('command', '?')}`; this text formatted from its JSON\n"
    body += (f"* Model: tiny (configs/tiny.toml), one group, 1 thread. Tasks: {FAMILIES}; "
             f"held-out: {sizes['heldout_tasks']} tasks of the test split (no problem shared "
             "with training), greedy pass@1 with completions of up to "
             f"{sizes['max_new_tokens']} tokens, ± = 95 % interval over tasks\n"
             f"* Pretrain {sizes['pretrain_steps']} steps (seed 0, shared by the seeds); SFT "
             f"{sizes['sft_steps']} steps on {sizes['train_tasks']} tasks (lr 1e-3, batch 8 rows "
             f"of 256 packed tokens); DPO {sizes['dpo_steps']} steps on pairs from "
             f"{sizes['pair_tasks']} tasks x 4 samples (beta 0.1, lr 2e-4); GRPO "
             f"{sizes['grpo_steps']} steps of {sizes['grpo_batch']} prompts x G="
             f"{sizes['group_size']} (clip 0.2, KL 0.04, lr 2e-4)\n"
             "* Compute: mean wall seconds per run on this shared machine (evaluation not "
             "included), tokens = committed training tokens (row budget: GRPO counts G x 256 per "
             "prompt)\n\n")
    body += table(["stage", "held-out pass@1, mean over seeds", "per seed (± 95 % CI)",
                   "compute (wall)", "tokens"], rows)
    pairs = [e["pairs"] for e in result["stages"].get("DPO", {}).values()]
    if pairs:
        body += "\n\nPairs per seed (sampled correct vs incorrect / solution vs incorrect / all " \
                "correct, skipped): " + "; ".join(
                    f"{p['sample']} / {p['solution']} / {p['all_correct']}" for p in pairs)
    body += "\n\n" + verdict(result)
    fams = {stage: {f: statistics.fmean(e["families"][f] for e in by_seed.values())
                    for f in next(iter(by_seed.values()))["families"]}
            for stage, by_seed in result["stages"].items()}
    names = sorted(next(iter(fams.values())))
    body += "\n\nPer family (mean over seeds):\n\n" + table(
        ["stage", *names], [[s, *(f"{v[n]:.3f}" for n in names)] for s, v in fams.items()])
    return body + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lifecycle", description=__doc__)
    p.add_argument("--quick", action="store_true", help="smoke-test sizes (a few minutes)")
    p.add_argument("--seeds", type=int, default=3, help="seeds of SFT, DPO and GRPO (default 3)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--json", default="", help="also write the raw results here")
    p.add_argument("--from-json", default="", help="do not train: format (and write) the section "
                   "from results saved by an earlier --json run")
    args = p.parse_args(argv)
    flags = [f for f, on in (("--quick", args.quick), ("--no-write", args.no_write)) if on]
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        args.json = ""
    else:
        with tempfile.TemporaryDirectory(prefix="ftlm-lifecycle-") as tmp:
            result = run_lifecycle(Path(tmp), QUICK if args.quick else FULL, args.seeds)
        result["command"] = command_line()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    section = format_section(result, flags)
    print(section)
    if not args.no_write and not args.quick:
        write_section("lifecycle", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
