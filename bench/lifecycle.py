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

    python -m bench.lifecycle [--quick] [--seeds N] [--no-write] [--set KEY=VALUE ...]

It does not tune hyper-parameters by itself: ``--eval-split val`` scores every model on a
validation set instead (training-split problems that no stage of any seed trains on), which is
where settings are compared; the test split is for the table only. ``--workdir``/``--reuse``
keep the runs and take back the models, pairs and scores found there, and ``--only-seeds`` with
``--merge`` let seeds (or the DPO and GRPO stages, via ``--stages``) run as separate processes.
It does not measure fault tolerance.
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

# sort has the longest completions (up to ~80 tokens) and add stays at 0 at this model size and
# budget (see FINDINGS): both left out.
FAMILIES = "count,mod"

FULL = {
    "families": FAMILIES, "pretrain_steps": 200, "heldout_tasks": 400, "max_new_tokens": 96,
    "train_tasks": 1000, "sft_steps": 150, "sft_lr": 3e-3,
    "pair_tasks": 300, "pair_samples": 4, "pair_temperature": 1.0,
    "dpo_steps": 40, "dpo_lr": 2e-4, "dpo_beta": 0.1, "dpo_nll": 0.0,
    "grpo_steps": 20, "grpo_batch": 8, "group_size": 8, "grpo_lr": 2e-4, "grpo_kl": 0.04,
    "grpo_clip": 0.2, "grpo_temperature": 1.0, "grpo_tasks": 1000,
}
"""Sizes and hyper-parameters of the full run (``--set KEY=VALUE`` overrides one)."""
QUICK = {**FULL, "pretrain_steps": 20, "sft_steps": 10, "train_tasks": 100, "heldout_tasks": 20,
         "pair_tasks": 16, "dpo_steps": 4, "grpo_steps": 2, "group_size": 4, "grpo_batch": 2,
         "grpo_tasks": 100, "max_new_tokens": 48}
VAL_SEED = 4321
"""Seed of the validation draw (training split, problems of every training stage removed)."""


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
            "post": {"families": sizes["families"], "train_tasks": sizes["train_tasks"],
                     "heldout_tasks": 0, "max_new_tokens": sizes["max_new_tokens"], **post}}


def _accuracy(weights: Path, tasks, max_new_tokens: int) -> dict:
    """Greedy pass@1 of a model on ``tasks``: mean, 95 % interval, per family, per task."""
    from safetensors.torch import load_model

    from ftlm.data.tokenizer import Tokenizer
    from ftlm.evaluate_cli import sample_tasks
    from ftlm.model import Transformer
    from ftlm.model.config import ModelConfig
    from ftlm.tasks import check
    from ftlm.tasks.scoring import summarise
    model = Transformer(ModelConfig(size="tiny"))
    load_model(model, str(weights))
    tokenizer = Tokenizer.load(REPO_ROOT / "data" / "demo" / "tokenizer.json")
    t0 = time.perf_counter()
    completions = sample_tasks(model, tokenizer, tasks, 1, 0.0, 0, max_new_tokens, 0)
    correct = [int(check(t, c[0])) for t, c in zip(tasks, completions)]
    scores = summarise([t.family for t in tasks], correct, 1, [1])
    score = scores["all"]["pass@1"]
    per_family = {f: s["pass@1"]["mean"] for f, s in scores.items() if f != "all"}
    return {"acc": score["mean"], "ci95": score["ci95"], "eval_seconds": time.perf_counter() - t0,
            "families": per_family, "correct": correct}


def _train(kind: str, config) -> dict:
    from ftlm.post import run as post_run
    from ftlm.train.trainer import Trainer
    t0 = time.perf_counter()
    summary = Trainer.for_run(config).train() if kind == "pretrain" else post_run.run(kind, config)
    return {"seconds": time.perf_counter() - t0, "tokens": summary["tokens_committed"],
            "steps": summary["steps_committed"], "final_loss": summary["final_loss"]}


def evaluation_tasks(sizes: dict, split: str, seeds: int) -> list:
    """The tasks every model is scored on: the suite's held-out split (``test``, what the table
    reports), or a validation set for choosing hyper-parameters (``val``): training-split
    problems that no training stage of any seed sees."""
    from ftlm.tasks import generate
    families, n = sizes["families"], sizes["heldout_tasks"]
    if split == "test":
        return generate(families, "test", n, 1234)
    used = set()
    for seed in range(seeds):
        for count, task_seed in ((sizes["train_tasks"], seed), (sizes["pair_tasks"], 100 + seed),
                                 (sizes["grpo_tasks"], 200 + seed)):
            used |= {(t.family, t.key) for t in generate(families, "train", count, task_seed)}
    pool = generate(families, "train", 2 * n + len(used) // 4, VAL_SEED)
    return [t for t in pool if (t.family, t.key) not in used][:n]


def run_lifecycle(root: Path, sizes: dict, seeds: int, split: str = "test",
                  stages: tuple[str, ...] = ("dpo", "grpo"), reuse: bool = False,
                  only: list[int] | None = None) -> dict:
    """Pretrain once, then SFT, DPO and GRPO for each seed (``only``: these seeds of
    ``range(seeds)``; the validation set still leaves out every seed's training tasks)."""
    from ftlm.post.pairs import make_pairs, write_pairs
    from ftlm.post.run import load_reference, load_tokenizer
    from ftlm.tasks import generate
    torch.set_num_threads(1)
    ensure_demo()
    heldout = evaluation_tasks(sizes, split, seeds)
    out: dict = {"sizes": sizes, "split": split, "stages": {}}

    def record(stage: str, seed: int, compute: dict, weights: Path) -> None:
        # With reuse, a model's score on these very tasks is read back, not computed again.
        cache = weights.parent / f"eval_{split}_{len(heldout)}_{sizes['max_new_tokens']}.json"
        if reuse and cache.is_file():
            acc = json.loads(cache.read_text())
        else:
            acc = _accuracy(weights, heldout, sizes["max_new_tokens"])
            cache.write_text(json.dumps(acc))
        entry = {**compute, **acc}
        out["stages"].setdefault(stage, {})[seed] = entry
        print(f"{stage} seed {seed}: acc {acc['acc']:.3f} +- {acc['ci95']:.3f} "
              f"({compute.get('seconds', 0):.0f} s) {acc['families']}", flush=True)

    def train(kind: str, config) -> dict:
        """Train, or with ``reuse`` take the model an earlier run left in the same folder."""
        done = config.run.path / "summary.json"
        if reuse and done.is_file() and (config.run.path / "model.safetensors").is_file():
            s = json.loads(done.read_text())
            print(f"reusing {config.run.path}", flush=True)
            return {"seconds": s.get("wall_seconds", float("nan")),
                    "tokens": s.get("tokens_committed", 0),
                    "steps": s.get("steps_committed", 0), "final_loss": s.get("final_loss")}
        return _train(kind, config)

    pre = _config(root / "pretrain", 0, train={"steps": sizes["pretrain_steps"]})
    compute = train("pretrain", pre)
    base_weights = pre.run.path / "model.safetensors"
    record("pretrained", 0, compute, base_weights)
    for seed in (range(seeds) if only is None else only):
        sft = _config(root / f"sft{seed}", seed, **_post_sections(
            sizes, sizes["sft_lr"], sizes["sft_steps"], base_weights, task_seed=seed))
        record("SFT", seed, train("sft", sft), sft.run.path / "model.safetensors")
        sft_weights = sft.run.path / "model.safetensors"
        if "dpo" in stages:
            # DPO: pairs sampled from this SFT model on training tasks, checked.
            t0 = time.perf_counter()
            pairs, counts_file = root / f"pairs{seed}.jsonl", root / f"pairs{seed}.counts.json"
            if reuse and pairs.is_file() and counts_file.is_file():
                counts = json.loads(counts_file.read_text())
                pair_seconds = counts.pop("seconds")
                print(f"reusing {pairs}", flush=True)
            else:
                pcfg = _config(root / f"pairs{seed}", seed, **_post_sections(
                    sizes, 1e-4, 1, sft_weights))
                tasks = generate(sizes["families"], "train", sizes["pair_tasks"], 100 + seed)
                records, counts = make_pairs(load_reference(pcfg, torch.device("cpu")),
                                             load_tokenizer(pcfg), tasks,
                                             samples=sizes["pair_samples"],
                                             max_new_tokens=sizes["max_new_tokens"],
                                             temperature=sizes["pair_temperature"], top_k=0,
                                             seed=seed)
                write_pairs(records, pairs)
                pair_seconds = time.perf_counter() - t0
                counts_file.write_text(json.dumps({**counts, "seconds": pair_seconds}))
            dpo = _config(root / f"dpo{seed}", seed, **_post_sections(
                sizes, sizes["dpo_lr"], sizes["dpo_steps"], sft_weights, data=str(pairs),
                beta=sizes["dpo_beta"], dpo_nll=sizes["dpo_nll"]))
            compute = _train("dpo", dpo)
            compute["pair_seconds"], compute["pairs"] = pair_seconds, counts
            record("DPO", seed, compute, dpo.run.path / "model.safetensors")
        if "grpo" in stages:
            grpo = _config(root / f"grpo{seed}", seed, **_post_sections(
                sizes, sizes["grpo_lr"], sizes["grpo_steps"], sft_weights,
                group_size=sizes["group_size"], kl_coef=sizes["grpo_kl"],
                clip=sizes["grpo_clip"], temperature=sizes["grpo_temperature"],
                train_tasks=sizes["grpo_tasks"], task_seed=200 + seed))
            grpo.train.batch_size = sizes["grpo_batch"]
            record("GRPO", seed, _train("grpo", grpo), grpo.run.path / "model.safetensors")
    return out


def paired(result: dict, better: str, worse: str) -> tuple[float, float] | None:
    """Mean per-task difference ``better - worse`` over every (seed, task), with its 95 %
    interval (normal approximation over the paired differences): both stages answer the same
    tasks, so the pairing removes the tasks' shared difficulty from the interval."""
    stages = result["stages"]
    low = stages.get(worse, {})
    # The pretrained model is one (seed 0): every seed's SFT is compared with it.
    base = lambda seed: low.get(seed, next(iter(low.values())) if len(low) == 1 else None)
    diffs = [a - b for seed, e in stages.get(better, {}).items()
             if base(seed) is not None and "correct" in e and "correct" in base(seed)
             for a, b in zip(e["correct"], base(seed)["correct"])]
    if len(diffs) < 2:
        return None
    return statistics.fmean(diffs), 1.96 * statistics.stdev(diffs) / len(diffs) ** 0.5


def verdict(result: dict) -> str:
    """The issue's targets, judged from the numbers: a stage beats another when its mean over seeds
    exceeds the other's by more than the larger mean 95 % interval of the two; the paired
    difference over the same tasks (``paired``) is given with it."""
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
        line = f"{better} - {worse}: {diff:+.3f} (interval {interval:.3f}): {met}"
        pair = paired(result, better, worse)
        if pair is not None:
            line += f" [paired per task: {pair[0]:+.3f} ± {pair[1]:.3f}"
            low = stages[worse]
            per_seed = [e["acc"] - low.get(seed, next(iter(low.values())))["acc"]
                        for seed, e in stages[better].items()]
            line += "; per seed " + ", ".join(f"{d:+.3f}" for d in per_seed) + "]"
        lines.append(line)
    return "Targets of issue 12 (a stage above another by more than the interval): " + \
        "; ".join(lines) + "."


FINDINGS = """\
Why DPO and GRPO did not improve on SFT before (the 17:28 table: add,mod,count, SFT 0.243, DPO
0.210, GRPO 0.217), and what changed (diagnosis on the SFT model of seed 0, 2026-11-30):

* **The SFT model did not read the prompt.** Its greedy answers were a constant per family: `1`
  for every count and mod task, `177` for every addition, after reasoning that copies nothing
  from the question (`What is 564 mod 7?` -> `77 // 7 = 17 ... Answer: 1`). Its 0.243 was the
  answer prior (`1` is the most common count and a common remainder); `add` was 0 at every
  stage. A policy that ignores its input gives DPO and GRPO nothing to sharpen: both can only
  move the prior. Part of the cause is the tokenizer: the count word was one BPE string
  (`chgbaeff` -> ` ch`, `g`, `b`, `ae`, `ff`) while the trace goes letter by letter; `count`
  now spells the word with spaces (one token per letter). `add` is left out here (0.000 at every
  stage: nothing to measure at this size and budget); SFT runs at lr 3e-3 (chosen by training
  loss: 0.64 after 150 steps on count,mod; the earlier run, lr 1e-3 on three families, ended at
  0.77). The model still mostly guesses (count answers 0 or 1, the trace does
  not copy the word): at 150 SFT steps a 1.3M-parameter model has not learned to copy.
* **DPO pairs were mostly off-policy.** 107 of 150 pairs had the reference solution as the
  chosen side (no sample of the SFT model was correct); at temperature 1 the SFT model was right
  in 8 % of samples against 20 % greedy. Now 300 pair tasks (about half the pairs sampled
  correct vs incorrect).
* **DPO lowers the chosen answers too**, the common failure: on its 293 training pairs, plain
  DPO moved the chosen log-prob by -9.2 nats and the rejected by -13.1 (margin right on 73 %).
  RPO's NLL term (`post.dpo_nll` 1.0) kept the chosen log-prob (-0.2 vs -2.5) but scored lower on
  the validation set: 0.307 (and 0.317 at lr 5e-4) against 0.360 for plain DPO, from 0.280 for
  SFT (300 validation tasks: training-split problems no stage trains on). Plain DPO
  (`dpo_nll` 0) is what the table runs.
* **GRPO had almost no signal per step**: 4 prompts x G=6 per step, 12 steps; `add` groups were
  all-wrong (zero advantage), mod groups mixed in 30 %, count in 72 %; Adam turns such a noisy
  gradient into steps of full size. Now 8 prompts x G=8 per step, 20 steps, sampled by the
  KV-cache engine (the in-loop sampler re-ran the whole context per token), with log-probs at
  the sampling temperature (tested equal to the sampler's). GRPO's hyper-parameters were not
  chosen on validation (a validation run at this machine's load did not finish in time); they
  are fixed a priori.
* **What the gains in this table are.** The three SFT models still answer almost
  prompt-independently, each with its own constant (greedy answers on 60 held-out tasks: seed 0
  says `0` to 27 of 30 count tasks, seeds 1 and 2 say `1` to all 30; the true counts are mostly 1
  and 2). The SFT seeds therefore differ by 0.22 (0.138 against 0.36), and most of DPO's and
  GRPO's gain is seed 0 moving from the wrong prior to the better one (DPO's seed 0 answers `1`
  to 22 of 30 count tasks); on seeds 1 and 2 both stay within about 0.02 of SFT. So the table
  shows preference and RL training correcting a bad answer prior, measurably on the paired test
  (the interval of the difference excludes 0), not below the issue's bar (the difference of the
  means over seeds does not exceed the larger per-stage interval) and not a skill learned: the
  reasoning traces still do not copy the question. A model that reads its prompt needs more SFT
  than this benchmark's budget on two shared cores (the 800-step policy of the test-time scaling
  section is the next step to try).
* Checked and right: the reference is the SFT model; advantages are per group; the objectives
  equal independent formulas on fixed batches, and ftlm's DPO loss and gradients equal
  `trl.DPOTrainer`'s (TRL 1.16.0, `tests/post/test_trl_parity.py`).

Run time of this table: the pretrained model was reused from a run at 19:29 (86 s at load
about 3); the three seeds then ran as six processes at `nice 10` (SFT 19:59-20:22, then DPO and
GRPO side by side 20:23-20:46) while the machine's load average was 15-28: 47 minutes of wall
time, over the 25 minutes aimed at. The tokens column is the load-independent measure.

The paired difference compares two stages task by task on the same held-out tasks, pooled
over seeds (± 95 %, normal approximation over the per-task differences)."""


def _fmt(value: float) -> str:
    return f"{value:g}"


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
    if "--from-json" in command_line() or "--merge" in command_line():
        runs = result.get("command", "?").split("; ")
        body += ("* Trained by " + "; ".join(f"`{c}`" for c in runs) +
                 " (at the same time, one process each); this text formatted from their JSON\n")
    z = {k: _fmt(v) if isinstance(v, float) else v for k, v in sizes.items()}
    where = ("held-out: {n} tasks of the test split (no problem shared with training)"
             if result.get("split", "test") == "test" else
             "VALIDATION: {n} training-split tasks no stage trains on")
    body += (f"* Model: tiny (configs/tiny.toml), one group, 1 thread. Tasks: {z['families']}; "
             + where.format(n=z["heldout_tasks"]) + ", greedy pass@1 with completions of up to "
             f"{z['max_new_tokens']} tokens, ± = 95 % interval over tasks\n"
             f"* Pretrain {z['pretrain_steps']} steps (seed 0, shared by the seeds); SFT "
             f"{z['sft_steps']} steps on {z['train_tasks']} tasks (lr {z['sft_lr']}, batch 8 "
             f"rows of 256 packed tokens); DPO {z['dpo_steps']} steps (batch 8 pairs) on pairs "
             f"from {z['pair_tasks']} training tasks x {z['pair_samples']} samples at "
             f"temperature {z['pair_temperature']} (beta {z['dpo_beta']}, NLL weight "
             f"{z['dpo_nll']}, lr {z['dpo_lr']}); GRPO {z['grpo_steps']} steps of "
             f"{z['grpo_batch']} prompts x G={z['group_size']} at temperature "
             f"{z['grpo_temperature']} from {z['grpo_tasks']} training tasks (clip "
             f"{z['grpo_clip']}, KL {z['grpo_kl']}, lr {z['grpo_lr']})\n"
             "* Compute: mean wall seconds per run on this shared machine (evaluation not "
             "included), tokens = committed training tokens (row budget: GRPO counts G x 256 per "
             "prompt). Wall seconds depend on the machine's load: a reused model keeps the time "
             "of the run that trained it\n\n")
    body += table(["stage", "pass@1, mean over seeds", "per seed (± 95 % CI)",
                   "compute (wall)", "tokens"], rows)
    pairs = [e["pairs"] for e in result["stages"].get("DPO", {}).values()]
    if pairs:
        body += "\n\nPairs per seed (sampled correct vs incorrect / solution vs incorrect / all " \
                "correct, skipped): " + "; ".join(
                    f"{p['sample']} / {p['solution']} / {p['all_correct']}" for p in pairs)
    body += "\n\n" + verdict(result)
    if result.get("split", "test") == "test" and sizes["families"] == "count,mod":
        body += "\n\n" + FINDINGS
    fams = {stage: {f: statistics.fmean(e["families"][f] for e in by_seed.values())
                    for f in next(iter(by_seed.values()))["families"]}
            for stage, by_seed in result["stages"].items()}
    names = sorted(next(iter(fams.values())))
    body += "\n\nPer family (mean over seeds):\n\n" + table(
        ["stage", *names], [[s, *(f"{v[n]:.3f}" for n in names)] for s, v in fams.items()])
    return body + "\n"


def merge(results: list[dict]) -> dict:
    """One result from runs over disjoint seeds, scored on the same tasks (the pretrained
    model's entry is taken from the first run; a seed present twice is refused). The runs after
    the first must agree on every size; the first (e.g. ``--only-seeds none``, the pretraining
    alone) on the pretraining and the evaluation."""
    first, rest = results[0], results[1:] or results
    shared = ("families", "pretrain_steps", "heldout_tasks", "max_new_tokens")
    out = {"sizes": rest[0]["sizes"], "split": first.get("split", "test"), "stages": {}}
    for r in results:
        same = r["sizes"] == out["sizes"] if r is not first else all(
            r["sizes"][k] == out["sizes"][k] for k in shared)
        if not same or r.get("split", "test") != out["split"]:
            raise SystemExit("--merge: the runs differ in sizes or split")
        for stage, by_seed in r["stages"].items():
            into = out["stages"].setdefault(stage, {})
            if stage == "pretrained":
                into.update({k: v for k, v in by_seed.items() if not into})
                continue
            # A stage two runs share (the SFT model both the DPO and the GRPO run started
            # from) must have scored the same.
            twice = {k for k in set(into) & set(by_seed) if into[k]["acc"] != by_seed[k]["acc"]}
            if twice:
                raise SystemExit(f"--merge: seed(s) {sorted(twice)} of {stage} in two runs")
            into.update(by_seed)
    for stage in out["stages"]:
        out["stages"][stage] = dict(sorted(out["stages"][stage].items(), key=lambda kv: int(kv[0])))
    return out


def _override(sizes: dict, assignments: list[str]) -> dict:
    sizes = dict(sizes)
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or key not in sizes:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(sorted(sizes))}")
        kind = type(sizes[key])
        sizes[key] = value if kind is str else kind(float(value)) if kind is int else kind(value)
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lifecycle", description=__doc__)
    p.add_argument("--quick", action="store_true", help="smoke-test sizes (a few minutes)")
    p.add_argument("--seeds", type=int, default=3, help="seeds of SFT, DPO and GRPO (default 3)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a size or hyper-parameter of FULL (repeatable)")
    p.add_argument("--eval-split", choices=("test", "val"), default="test",
                   help="score on the held-out test split (the table) or on a validation set "
                   "of unseen training-split tasks (for choosing hyper-parameters; not written)")
    p.add_argument("--stages", default="dpo,grpo", help="post-SFT stages to run (dpo,grpo)")
    p.add_argument("--workdir", default="", help="keep the runs here (default: a temporary "
                   "folder, removed at the end)")
    p.add_argument("--reuse", action="store_true", help="with --workdir: take the pretrained "
                   "and SFT models an earlier run left there instead of training them again")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--only-seeds", default="", help="run only these seeds (comma list) of "
                   "--seeds: with --workdir and --reuse, seeds can run as separate processes "
                   "that share the pretrained model (`none`: pretrain only); --merge joins "
                   "their JSON files")
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="do not train: join the results of runs over disjoint seeds")
    p.add_argument("--json", default="", help="also write the raw results here")
    p.add_argument("--from-json", default="", help="do not train: format (and write) the section "
                   "from results saved by an earlier --json run")
    args = p.parse_args(argv)
    sizes = _override(QUICK if args.quick else FULL, args.set)
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    flags = [f for f, on in (("--quick", args.quick), ("--no-write", args.no_write)) if on]
    only = (None if not args.only_seeds else [] if args.only_seeds == "none" else
            [int(x) for x in args.only_seeds.split(",") if x.strip()])
    if args.merge:
        result = merge([json.loads(Path(f).read_text()) for f in args.merge])
        result["command"] = "; ".join(r.get("command", "?") for r in
                                      (json.loads(Path(f).read_text()) for f in args.merge))
    elif args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        args.json = ""
    elif args.workdir:
        result = run_lifecycle(Path(args.workdir), sizes, args.seeds, args.eval_split, stages,
                               args.reuse, only)
        result["command"] = command_line()
    else:
        with tempfile.TemporaryDirectory(prefix="ftlm-lifecycle-") as tmp:
            result = run_lifecycle(Path(tmp), sizes, args.seeds, args.eval_split, stages)
        result["command"] = command_line()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    section = format_section(result, flags)
    print(section)
    if not args.no_write and not args.quick and result.get("split", "test") == "test":
        write_section("lifecycle", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
