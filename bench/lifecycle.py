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

# The families of the 800-step SFT recipe that reads its prompt (the test-time scaling policy's);
# sort has the longest completions (up to ~80 tokens), count was tried at 150 SFT steps (FINDINGS).
FAMILIES = "add,mod"

FULL = {
    "families": FAMILIES, "pretrain_steps": 200, "heldout_tasks": 400, "max_new_tokens": 96,
    "train_tasks": 4000, "sft_steps": 800, "sft_lr": 3e-3, "sft_batch": 16, "sft_seq_len": 128,
    "sft_seeds": 1,
    "pair_tasks": 300, "pair_samples": 4, "pair_temperature": 1.0,
    "dpo_steps": 40, "dpo_lr": 2e-4, "dpo_beta": 0.1, "dpo_nll": 1.0,
    "grpo_steps": 20, "grpo_batch": 8, "group_size": 8, "grpo_lr": 2e-4, "grpo_kl": 0.04,
    "grpo_clip": 0.2, "grpo_temperature": 0.7, "grpo_tasks": 1000, "verify": "answer",
}
"""Sizes and hyper-parameters of the full run (``--set KEY=VALUE`` overrides one)."""
QUICK = {**FULL, "pretrain_steps": 20, "sft_steps": 10, "train_tasks": 100, "sft_seeds": 3, "heldout_tasks": 20,
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
        for count, task_seed in ((sizes["train_tasks"], seed % sizes["sft_seeds"]),
                                 (sizes["pair_tasks"], 100 + seed),
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
    from ftlm.tasks import VERIFIERS, generate
    torch.set_num_threads(1)
    ensure_demo()
    heldout = evaluation_tasks(sizes, split, seeds)
    out: dict = {"sizes": sizes, "split": split, "stages": {}}

    def record(stage: str, seed: int, compute: dict, weights: Path, trained: bool) -> None:
        # With reuse, the score of a reused model on these very tasks is read back, not computed
        # again (a model trained just now is always scored: its folder may hold an old score).
        cache = weights.parent / (f"eval_{split}_{sizes['families'].replace(',', '-')}_"
                                  f"{len(heldout)}_{sizes['max_new_tokens']}.json")
        if reuse and not trained and cache.is_file():
            acc = json.loads(cache.read_text())
        else:
            acc = _accuracy(weights, heldout, sizes["max_new_tokens"])
            cache.write_text(json.dumps(acc))
        entry = {**compute, **acc}
        out["stages"].setdefault(stage, {})[seed] = entry
        print(f"{stage} seed {seed}: acc {acc['acc']:.3f} +- {acc['ci95']:.3f} "
              f"({compute.get('seconds', 0):.0f} s) {acc['families']}", flush=True)

    def train(kind: str, config) -> tuple[dict, bool]:
        """Train, or with ``reuse`` take the model an earlier run left in the same folder;
        whether it trained."""
        done = config.run.path / "summary.json"
        if reuse and done.is_file() and (config.run.path / "model.safetensors").is_file():
            s = json.loads(done.read_text())
            print(f"reusing {config.run.path}", flush=True)
            return {"seconds": s.get("wall_seconds", float("nan")),
                    "tokens": s.get("tokens_committed", 0),
                    "steps": s.get("steps_committed", 0),
                    "final_loss": s.get("final_loss")}, False
        return _train(kind, config), True

    pre = _config(root / "pretrain", 0, train={"steps": sizes["pretrain_steps"]})
    compute, trained = train("pretrain", pre)
    base_weights = pre.run.path / "model.safetensors"
    record("pretrained", 0, compute, base_weights, trained)
    for seed in (range(seeds) if only is None else only):
        # sft_seeds < seeds: seed s starts DPO and GRPO from SFT model s % sft_seeds (one SFT
        # model shared by the seeds when 1: the seeds then vary the pairs, the GRPO samples and
        # the task draws of DPO/GRPO, not the SFT run).
        sft_seed = seed % sizes["sft_seeds"]
        sections = _post_sections(sizes, sizes["sft_lr"], sizes["sft_steps"], base_weights,
                                  task_seed=sft_seed)
        sections["data"]["seq_len"] = sizes["sft_seq_len"]
        sections["train"]["batch_size"] = sizes["sft_batch"]
        sft = _config(root / f"sft{sft_seed}", sft_seed, **sections)
        compute, trained = train("sft", sft)
        record("SFT", sft_seed, compute, sft.run.path / "model.safetensors", trained)
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
                                             seed=seed,
                                             verify=VERIFIERS[sizes.get("verify", "answer")])
                write_pairs(records, pairs)
                pair_seconds = time.perf_counter() - t0
                counts_file.write_text(json.dumps({**counts, "seconds": pair_seconds}))
            dpo = _config(root / f"dpo{seed}", seed, **_post_sections(
                sizes, sizes["dpo_lr"], sizes["dpo_steps"], sft_weights, data=str(pairs),
                beta=sizes["dpo_beta"], dpo_nll=sizes["dpo_nll"]))
            compute = _train("dpo", dpo)
            compute["pair_seconds"], compute["pairs"] = pair_seconds, counts
            record("DPO", seed, compute, dpo.run.path / "model.safetensors", True)
        if "grpo" in stages:
            grpo = _config(root / f"grpo{seed}", seed, **_post_sections(
                sizes, sizes["grpo_lr"], sizes["grpo_steps"], sft_weights,
                group_size=sizes["group_size"], kl_coef=sizes["grpo_kl"],
                clip=sizes["grpo_clip"], temperature=sizes["grpo_temperature"],
                train_tasks=sizes["grpo_tasks"], task_seed=200 + seed,
                verify=sizes.get("verify", "answer")))
            grpo.train.batch_size = sizes["grpo_batch"]
            record("GRPO", seed, _train("grpo", grpo), grpo.run.path / "model.safetensors", True)
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
The target is not met: SFT is far above the pretrained model, but DPO is below SFT and GRPO
level with it. What changed since the 20:47 table (count,mod, 150 SFT steps: SFT 0.280, DPO
0.312, GRPO 0.325, gains that were one seed's SFT model moving off a wrong constant answer),
and why (2026-11-30; every setting was compared on the validation split, the test split was
scored once, for this table):

* **The SFT model now reads its prompt.** SFT is the test-time scaling section's recipe (800
  steps of 16 rows of 128 tokens, lr 3e-3, 4,000 tasks of add,mod), from the pretrained model:
  its traces copy the question's digits, with slips (`What is 275 + 294?` -> `5+8+0=13, write 3,
  carry 1 ...`). It cost 39 min of wall time at load 14-20, so one SFT model is shared by the
  three seeds: a seed varies the DPO pairs, the GRPO samples and the DPO/GRPO task draws and
  data order, not SFT (the SFT row is one model; the paired differences compare each seed's
  DPO and GRPO model with it).
* **Validation** (400 training-split tasks no stage trains on, seed 0). On a stand-in SFT model
  (the test-time scaling section's `/tmp/tts/policy`: the same recipe from a random init, the
  same 4,000 tasks; 0.247 on validation), with the earlier settings as the start: GRPO at
  sampling temperature 1 0.212, at 0.7 0.247 (chosen); plain DPO 0.130, with RPO's NLL term
  (`dpo_nll` 1) 0.205 (chosen), the same with pairs at temperature 0.7 and lr 1e-4 0.203. On this
  table's SFT model (0.190 on validation), with rewards and pairs verified on the whole trace
  (`verify=trace`, below): DPO 0.145, GRPO 0.188; GRPO at lr 1e-3: 0.105 (verified on the
  answer) and 0.085 (on the trace). No candidate was above SFT on validation; the table runs
  the best of each (GRPO level, DPO least below).
* **Why: mod is at chance and its "correct" samples are guesses.** A remainder is below the
  divisor (2 to 12), so answering uniformly below it is right 19 % of the time; the SFT model
  scores 0.23 on mod, and none of the 216 mod samples that the pairs of this table took as
  "correct" has the reference trace (the division is wrong and the remainder happens to match;
  add: 55 of 69). So on mod, DPO's chosen samples and GRPO's rewards reinforce a guess after a
  wrong trace: no signal, only noise. `post.verify=trace` (new) counts a sample correct only
  when its reasoning equals the reference solution's too; then only 31 of 1,200 samples are
  correct (274 of 300 pairs fall back to the reference solution) and GRPO's mod groups are
  almost all zero: neither improved on validation (above).
* **DPO lowers add** (0.140 -> 0.065-0.095 on the test split) by making more digit-copy slips in
  the trace (`7+9+0=16` becomes `7+4+0=11` for 275 + 294). Likely (not measured): pushing down
  a rejected completion after its first wrong digit also pushes down the same copy steps in
  correct traces, which a 1.3M-parameter model does not tell apart, and RPO's NLL term on the
  chosen side (mostly the reference solution: 2 pairs in 3) does not hold them at this lr.
* **GRPO's signal is too thin to move the policy the right way**: at lr 2e-4, 20 steps of 8
  prompts x G=8 (1,280 samples, 28 min of wall time per seed here) change few greedy answers
  (per seed -0.020 to +0.010 on the test split; the paired interval, ± 0.020, covers 0); at lr
  1e-3 (validation) the traces degrade (`5+4+0=10`, blank lines) and add falls from 0.18 to
  0.01-0.02. Per step, many groups are all wrong (zero advantage: 10-12 % of the samples at
  temperature 1 were right, over both families) and the mod rewards are guesses.
* **GRPO does improve add with more prompts per step** (found after the table, on validation:
  400 add tasks, the same SFT model, 0.170 there). On add alone with the table's 8 prompts per
  step it still falls (0.138 at lr 2e-4, 0.050 at 5e-4): Adam turns a gradient carried by the
  one or two groups of a step that have mixed rewards into a full-size step on every weight.
  With 32 prompts per step (10 steps: 2,560 samples, twice the table's) it rises: 0.212 at lr
  2e-4, 0.198 at lr 5e-5. On the test split (400 add tasks, 3 seeds, the same SFT model:
  `--set families=add --set grpo_batch=32 --set grpo_steps=10 --stages grpo`, results in
  `bench/results/lifecycle/add_grpo_seed*.json`, 00:23-00:36 at load about 5) the gain is
  smaller: SFT 0.195, GRPO 0.223 / 0.198 / 0.203 (mean 0.208), paired +0.013 ± 0.020 (per seed
  +0.027, +0.003, +0.008): above SFT on every seed, not by the interval. DPO was not tried on
  add alone.
* Checked and right: the reference is the SFT model; advantages are per group; the objectives
  equal independent formulas on fixed batches, and ftlm's DPO loss and gradients equal
  `trl.DPOTrainer`'s (TRL 1.16.0, `tests/post/test_trl_parity.py`).

Run time of this table: the pretrained model was reused from a run at 19:29 (86 s at load
about 3); SFT 22:36-23:19 (one process, load 11-20), then the DPO and the GRPO stage of the
three seeds as six processes at `nice 19` 23:21-23:53 (load 13-21). The tokens column is the
load-independent measure.

The paired difference compares two stages task by task on the same held-out tasks, pooled
over seeds (± 95 %, normal approximation over the per-task differences); the issue's target is
judged on the difference of the means against the larger per-stage interval, and the paired
interval is the statistic for "above SFT" (it removes the tasks' shared difficulty)."""


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
             f"{z['sft_steps']} steps on {z['train_tasks']} tasks (lr {z['sft_lr']}, batch "
             f"{z['sft_batch']} rows of {z['sft_seq_len']} packed tokens; "
             + ("one SFT model (seed 0) shared by the seeds, which vary the pairs, the GRPO "
                "samples and the DPO/GRPO task draws and data order" if sizes["sft_seeds"] == 1
                else f"seed s starts from the SFT model of seed s mod {z['sft_seeds']}") +
             f"); DPO {z['dpo_steps']} steps (batch 8 pairs) on pairs "
             f"from {z['pair_tasks']} training tasks x {z['pair_samples']} samples at "
             f"temperature {z['pair_temperature']} (beta {z['dpo_beta']}, NLL weight "
             f"{z['dpo_nll']}, lr {z['dpo_lr']}); GRPO {z['grpo_steps']} steps of "
             f"{z['grpo_batch']} prompts x G={z['group_size']} at temperature "
             f"{z['grpo_temperature']} from {z['grpo_tasks']} training tasks (clip "
             f"{z['grpo_clip']}, KL {z['grpo_kl']}, lr {z['grpo_lr']}); rewards and pairs "
             f"verified on the {sizes.get('verify', 'answer')}\n"
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
    if result.get("split", "test") == "test" and sizes["families"] == FAMILIES:
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
