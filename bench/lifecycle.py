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
   ratio, KL to the SFT model, optionally an NLL anchor on the correct samples);
5. optionally (``--stages ...,grpo_dpo``) **GRPO from DPO**: the same GRPO from each seed's DPO
   model (its reference), a row of its own, compared with DPO.

Each seed is an independent chain: its own SFT run (``sft_seeds`` = ``--seeds``, 5 by default),
then its DPO and GRPO from that SFT model. Every model is scored on the same held-out tasks (the
suite's test split, which shares no problem with training) by greedy pass@1 (``ftlm eval``'s
``task_accuracy``). The table gives per stage the mean over chains with its 95 % interval over
chains (Student t on the chains' values: the chain, not the task, is the unit, since what varies
from one training run to the next is what a recipe's result depends on), each chain's value with
its interval over tasks, and the compute of the stage: wall seconds on this machine and the
tokens it processed (committed training tokens; for pairs and evaluation, the sampling time). A
stage is above the one it started from when the mean over chains of each chain's difference
(``chain_differences``) is above its interval over chains; with one chain, or chains that share
the lower stage's model, the paired per-task difference and its interval over tasks decide.

    python -m bench.lifecycle [--quick] [--seeds N] [--no-write] [--set KEY=VALUE ...]

It does not tune hyper-parameters by itself: ``--eval-split val`` scores every model on a
validation set instead (training-split problems that no stage of any seed trains on), which is
where settings are compared; the test split is for the table only (``--set test_seed=N``: a
fresh draw of it that leaves out the problems of the draws fixed before it, ``TEST_DRAWS``).
``--workdir``/``--reuse`` keep the runs and take back the models, pairs and scores found there
(refused when they were made with other settings), ``--only-seeds`` with ``--merge`` let seeds
(or the DPO and GRPO stages, via ``--stages``) run as separate processes, and ``--label`` names
a variant's rows ("DPO, LABEL") so that rows of several settings merge into one table. It does
not measure fault tolerance.
"""

from __future__ import annotations

import argparse
import functools
import re
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
    publish,
    section_header,
    t_interval,
    table,
)

# The families of the 800-step SFT recipe that reads its prompt (the test-time scaling policy's);
# sort has the longest completions (up to ~80 tokens), count was tried at 150 SFT steps (the
# readings of the earlier tables, in git).
SFT_FAMILIES = "add,mod"
# The families DPO and GRPO train on and the table scores: add, whose correct answers come from
# correct work (a right mod remainder is mostly a guess after a wrong division: an earlier reading).
FAMILIES = "add"

FULL = {
    "families": FAMILIES, "sft_families": SFT_FAMILIES, "pretrain_steps": 200,
    "heldout_tasks": 1600, "test_seed": 20261204, "max_new_tokens": 96,
    "train_tasks": 4000, "sft_steps": 800, "sft_lr": 3e-3, "sft_batch": 16, "sft_seq_len": 128,
    "sft_seeds": 5,
    "pair_tasks": 600, "pair_samples": 8, "pair_temperature": 0.7,
    "dpo_steps": 120, "dpo_lr": 1e-5, "dpo_beta": 0.1, "dpo_nll": 0.0, "dpo_loss": "sigmoid",
    "pair_fallback": False, "dpo_precompute": True, "chaos_mtbf": 60.0,
    "grpo_steps": 80, "grpo_batch": 32, "group_size": 8, "grpo_lr": 2e-4, "grpo_kl": 0.04,
    "grpo_clip": 0.2, "grpo_temperature": 0.7, "grpo_tasks": 1000, "grpo_nll": 0.0,
    "grpo_loss": "dapo", "ppo_epochs": 2, "grpo_filter": True, "grpo_mask_truncated": False,
    "verify": "answer",
}
"""Sizes and hyper-parameters of the full run (``--set KEY=VALUE`` overrides one): those of the
pre-registered five-chain run (bench/results/lifecycle/fresh20261204/): five independent chains
(``sft_seeds`` 5 with ``--seeds 5``), each with its own SFT run, scored on the draw of seed
20261204. DPO is plain DPO (no NLL term) on sampled pairs only (600 tasks x 8 samples; no
reference solution as the chosen side), lr 1e-5, its reference log-probs precomputed; GRPO 80
steps at lr 2e-4 with two passes per rollout, the token-level (dapo) loss and groups of equal
rewards left out. Both were the best on validation (chain 0) of those tried on 2026-12-04.
``RPO`` holds the DPO settings of the earlier tables (NLL weight 10, reference solutions as
the chosen side), run as the labelled row "DPO, RPO" (``make lifecycle``). The three-chain run of
2026-12-02 (bench/results/lifecycle/fresh20261202/) used test_seed 20261202, RPO's DPO settings,
GRPO 40 steps at lr 5e-5 with one pass and the grpo loss; the tables before it test_seed 1234,
sft_seeds 1, pair temperature 1.0, DPO 40 steps and GRPO 10 steps at lr 2e-4 (``--set`` them to
rerun one)."""
RPO = {"pair_tasks": 300, "pair_samples": 4, "pair_fallback": True, "dpo_lr": 5e-5,
       "dpo_nll": 10.0, "dpo_precompute": False}
"""The DPO settings of the tables up to 2026-12-02 (RPO: DPO plus an NLL term of weight 10 on
the chosen side, mostly reference solutions), the labelled row "DPO, RPO"."""
QUICK = {**FULL, "pretrain_steps": 20, "sft_steps": 10, "train_tasks": 100, "heldout_tasks": 20,
         "pair_tasks": 16, "dpo_steps": 4, "grpo_steps": 2, "group_size": 4, "grpo_batch": 2,
         "grpo_tasks": 100, "max_new_tokens": 48,
         "pair_fallback": True}  # (a model of 10 SFT steps answers nothing right: no sampled pair)
VAL_SEED = 4321
"""Seed of the validation draw (training split, problems of every training stage removed)."""
TEST_DRAWS = ((1234, 1600), (20261201, 1600), (20261202, 1600), (20261204, 1600))
"""The draws of the test split (``test_seed``, tasks; families add) in the order they were fixed:
1234 the tables up to 2026-12-01 05:19 UTC scored (a second setting was scored on it); 20261201
the fresh draw of the 08:18 table (fixed in e0cb123); 20261202 the pre-registered run whose
seeds vary the SFT run (fixed before any score: bench/results/lifecycle/fresh20261202/);
20261204 the pre-registered five-chain run (bench/results/lifecycle/fresh20261204/). A draw
leaves out the problems of every draw before it; a seed not listed leaves out all of them."""
FIRST_TEST = TEST_DRAWS[0]
"""The default draw, which leaves nothing out (the earlier tables' tasks)."""
CHAINS = 5
"""Independent chains (seeds, each with its own SFT run) of the default run."""

def interval_over_chains(values: list[float]) -> tuple[float, float] | None:
    """Mean of per-chain ``values`` and its 95 % interval over chains (Student t, n - 1 degrees
    of freedom); None for fewer than two chains."""
    return t_interval(values) if len(values) >= 2 else None


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
    t0, c0 = time.perf_counter(), time.process_time()
    completions = sample_tasks(model, tokenizer, tasks, 1, 0.0, 0, max_new_tokens, 0)
    correct = [int(check(t, c[0])) for t, c in zip(tasks, completions)]
    scores = summarise([t.family for t in tasks], correct, 1, [1])
    score = scores["all"]["pass@1"]
    per_family = {f: s["pass@1"]["mean"] for f, s in scores.items() if f != "all"}
    return {"acc": score["mean"], "ci95": score["ci95"], "eval_seconds": time.perf_counter() - t0,
            "eval_cpu_seconds": time.process_time() - c0,
            "families": per_family, "correct": correct}


def _train(kind: str, config) -> dict:
    from ftlm.post import run as post_run
    from ftlm.train.trainer import Trainer
    t0, c0 = time.perf_counter(), time.process_time()
    summary = Trainer.for_run(config).train() if kind == "pretrain" else post_run.run(kind, config)
    stopped = summary["steps_committed"] < config.train.steps
    if stopped:  # SIGTERM or Ctrl-C stops a trainer gracefully: stop here, not at the next stage
        raise SystemExit(f"{kind} {config.run.path} stopped at step {summary['steps_committed']} "
                         f"of {config.train.steps}; a rerun with --reuse trains it again")
    # CPU seconds of this process (every thread): what the stage cost, whatever else ran.
    out = {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
           "tokens": summary["tokens_committed"],
           "steps": summary["steps_committed"], "final_loss": summary["final_loss"]}
    if kind == "grpo":  # the training reward at the start and at the end (objective events)
        from ftlm.observe.events import read_events
        rewards = [e["reward"] for e in read_events(config.run.path / "events.jsonl")
                   if e["kind"] == "objective" and "reward" in e]
        if rewards:
            k = max(1, min(5, len(rewards) // 4))
            out["reward_first"] = sum(rewards[:k]) / k
            out["reward_last"] = sum(rewards[-k:]) / k
    return out


CHAOS_GROUPS = 2
"""Replica groups of a chain trained again under chaos (``--stages ...,chaos``): each trains half
of the table's batch, so that the job's batch is the table's whenever both are up."""


def _train_chaos(kind: str, config, mtbf: float, seed: int) -> dict:
    """``kind`` as a local job of ``CHAOS_GROUPS`` groups (``config``'s batch each) with SIGKILLs
    every ``mtbf`` seconds on average; what it cost, and what the job's checks found."""
    import resource

    from ftlm.post_cli import launch
    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    summary = launch(kind, config, groups=CHAOS_GROUPS, chaos_mtbf=mtbf, chaos_seed=seed)
    if summary.get("problems"):
        raise SystemExit(f"{kind} under chaos ({config.run.path}) failed its checks: "
                         + "; ".join(summary["problems"]))
    return {"seconds": time.perf_counter() - t0,
            "cpu_seconds": resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - c0,
            "tokens": summary["tokens_committed"], "steps": summary["steps_committed"],
            "final_loss": summary["final_loss"], "groups": CHAOS_GROUPS,
            "failures": summary["failures_injected"],
            "replicas_identical": summary["replicas_identical"],
            "hashes": len(summary["state_hashes"]),
            "duplicates": summary["data"]["duplicates"], "gaps": summary["data"]["gaps"]}


def training_problems(sizes: dict, seeds: int) -> set[tuple[str, str]]:
    """(family, key) of every task a training stage (SFT, preference pairs, GRPO) of any of
    ``seeds`` draws."""
    from ftlm.tasks import generate
    families, used = sizes["families"], set()
    for seed in range(seeds):
        for count, task_seed in ((sizes["train_tasks"], seed % sizes["sft_seeds"]),
                                 (sizes["pair_tasks"], 100 + seed),
                                 (sizes["grpo_tasks"], 200 + seed)):
            used |= {(t.family, t.key) for t in generate(families, "train", count, task_seed)}
        # SFT's own draw (its families' streams are independent, so for a family of both lists
        # the draw above, of more tasks of that family, already holds these).
        sft = generate(sizes.get("sft_families", families), "train", sizes["train_tasks"],
                       seed % sizes["sft_seeds"])
        used |= {(t.family, t.key) for t in sft}
    return used


def earlier_draws(test_seed: int) -> tuple[tuple[int, int], ...]:
    """The test draws (seed, tasks) that the draw of ``test_seed`` leaves out: those of
    ``TEST_DRAWS`` fixed before it, or all of them for a seed not listed."""
    seeds = [seed for seed, _ in TEST_DRAWS]
    return TEST_DRAWS[:seeds.index(test_seed)] if test_seed in seeds else TEST_DRAWS


@functools.lru_cache(maxsize=16)  # a later draw draws every earlier one again
def heldout_draw(families: str, n: int, test_seed: int) -> tuple:
    """``n`` test-split tasks of ``families`` drawn with ``test_seed``, none of which an earlier
    draw (``earlier_draws``, each of ``max(n, its tasks)`` tasks of the same families) holds.
    The first draw is the plain ``generate`` list, so every listed draw stays what it was."""
    from ftlm.tasks import generate
    seen: set[tuple[str, str]] = set()
    for seed, size in earlier_draws(test_seed):
        seen |= {(t.family, t.key) for t in heldout_draw(families, max(n, size), seed)}
    pool = generate(families, "test", n + len(seen), test_seed)
    return tuple([t for t in pool if (t.family, t.key) not in seen][:n])


def evaluation_tasks(sizes: dict, split: str, seeds: int) -> list:
    """The tasks every model is scored on: the suite's held-out split (``test``, what the table
    reports: the ``heldout_draw`` of ``test_seed``), or a validation set for choosing
    hyper-parameters (``val``): training-split problems that no training stage of any seed sees."""
    from ftlm.tasks import generate
    families, n = sizes["families"], sizes["heldout_tasks"]
    if split == "test":
        return list(heldout_draw(families, n, sizes.get("test_seed", FIRST_TEST[0])))
    used = training_problems(sizes, seeds)
    pool = generate(families, "train", 2 * n + len(used) // 4, VAL_SEED)
    return [t for t in pool if (t.family, t.key) not in used][:n]


def _saved_settings_differ(run_dir: Path, config) -> list[str]:
    """The settings (``model``, ``train``, ``post``) in which the run that left ``run_dir`` differs
    from ``config`` (a setting only one of them has, from an older version, is not compared;
    files are compared by the path they resolve to: a workdir may link to another's models)."""
    import os
    import tomllib
    saved = tomllib.loads((run_dir / "config.toml").read_text())
    now = config.to_dict()
    same = lambda key, a, b: a == b or (key in ("init_from", "data", "reference") and
                                        os.path.realpath(a) == os.path.realpath(b))
    return [f"{section}.{key}: {saved[section][key]!r} there, {value!r} now"
            for section in ("model", "train", "post") for key, value in now[section].items()
            if key in saved.get(section, {}) and not same(key, saved[section][key], value)]


def _unfinished(run_dir: Path, config) -> str:
    """Why the run that left ``run_dir`` is not a finished run of ``config`` ("" when it is): a
    run stopped early (SIGTERM, Ctrl-C) still writes its summary and weights, at the step it
    reached, and taking those back would score a partly trained model."""
    committed = json.loads((run_dir / "summary.json").read_text()).get("steps_committed", 0)
    if committed < config.train.steps:
        return f"it stopped at step {committed} of {config.train.steps}"
    return ""


def reusable(run_dir: Path, config) -> bool:
    """Whether ``run_dir`` holds a finished run of ``config``'s settings, to take back instead of
    training (False: nothing there, or a run that stopped early, which is trained again); a run
    of other settings is refused."""
    if not ((run_dir / "summary.json").is_file() and (run_dir / "model.safetensors").is_file()):
        return False
    differ = _saved_settings_differ(run_dir, config)
    if differ:
        raise SystemExit(f"{run_dir} was trained with other settings (" + "; ".join(differ)
                         + "); remove it or use another --workdir")
    stopped = _unfinished(run_dir, config)
    print(f"training {run_dir} again: {stopped}" if stopped else f"reusing {run_dir}", flush=True)
    return not stopped


def base_stage(stage: str) -> str:
    """The stage a row is of (``"DPO"`` for ``"DPO, chosen"``: ``--label`` names a variant)."""
    return stage.split(", ", 1)[0]


def run_lifecycle(root: Path, sizes: dict, seeds: int, split: str = "test",
                  stages: tuple[str, ...] = ("dpo", "grpo"), reuse: bool = False,
                  only: list[int] | None = None, label: str = "") -> dict:
    """Pretrain once, then SFT, DPO and GRPO for each seed (``only``: these seeds of
    ``range(seeds)``; the validation set still leaves out every seed's training tasks). With
    ``label``, the DPO and GRPO rows are named "DPO, <label>" etc. (a variant's row, to be
    merged beside the plain one); the result records each of these rows' own settings."""
    from ftlm.post.pairs import make_pairs, write_pairs
    from ftlm.post.run import load_reference, load_tokenizer
    from ftlm.tasks import VERIFIERS, generate
    torch.set_num_threads(1)
    ensure_demo()
    heldout = evaluation_tasks(sizes, split, seeds)
    test_seed = sizes.get("test_seed", FIRST_TEST[0])
    out: dict = {"sizes": sizes, "split": split, "stages": {}, "stage_sizes": {}}
    named = lambda stage: f"{stage}, {label}" if label else stage
    # A labelled variant's own folders and pairs (dpo0-LABEL, pairs0-LABEL.jsonl): variants share
    # the workdir's pretrained and SFT models without clashing on their own.
    tag = "-" + "".join(c if c.isalnum() else "_" for c in label) if label else ""

    def record(stage: str, seed: int, compute: dict, weights: Path, trained: bool) -> None:
        # With reuse, the score of a reused model on these very tasks is read back, not computed
        # again (a model trained just now is always scored: its folder may hold an old score).
        draw = split if split != "test" or test_seed == FIRST_TEST[0] else f"test{test_seed}"
        cache = weights.parent / (f"eval_{draw}_{sizes['families'].replace(',', '-')}_"
                                  f"{len(heldout)}_{sizes['max_new_tokens']}.json")
        if reuse and not trained and cache.is_file():
            acc = json.loads(cache.read_text())
        else:
            acc = _accuracy(weights, heldout, sizes["max_new_tokens"])
            cache.write_text(json.dumps(acc))
        entry = {**compute, **acc}
        out["stages"].setdefault(stage, {})[seed] = entry
        if base_stage(stage) in STAGE_SIZES:
            out["stage_sizes"][stage] = {k: sizes[k] for k in STAGE_SIZES[base_stage(stage)]}
        reward = (f" training reward {compute['reward_first']:.3f} -> {compute['reward_last']:.3f}"
                  if "reward_last" in compute else "")
        print(f"{stage} seed {seed}: acc {acc['acc']:.3f} +- {acc['ci95']:.3f} "
              f"({compute.get('seconds', 0):.0f} s) {acc['families']}{reward}", flush=True)

    def train(kind: str, config, chaos_seed: int | None = None) -> tuple[dict, bool]:
        """Train (with ``chaos_seed``: as a job of ``CHAOS_GROUPS`` groups under chaos), or with
        ``reuse`` take the model an earlier run with the same settings left in the same folder;
        whether it trained."""
        done = config.run.path / "summary.json"
        if reuse and reusable(config.run.path, config):
            kept = config.run.path / "lifecycle_compute.json"  # what the run that trained it cost
            if kept.is_file():
                return json.loads(kept.read_text()), False
            s = json.loads(done.read_text())
            return {"seconds": s.get("wall_seconds", float("nan")),
                    "tokens": s.get("tokens_committed", 0),
                    "steps": s.get("steps_committed", 0),
                    "final_loss": s.get("final_loss")}, False
        compute = (_train(kind, config) if chaos_seed is None else
                   _train_chaos(kind, config, sizes["chaos_mtbf"], chaos_seed))
        (config.run.path / "lifecycle_compute.json").write_text(json.dumps(compute))
        return compute, True

    def grpo(stage: str, name: str, start: Path, seed: int, chaos: bool = False) -> None:
        """GRPO from the model ``start`` (also its frozen reference), as row ``stage`` (with
        ``chaos``: as ``CHAOS_GROUPS`` groups under chaos, each half the batch)."""
        config = _config(root / name, seed, **_post_sections(
            sizes, sizes["grpo_lr"], sizes["grpo_steps"], start,
            group_size=sizes["group_size"], kl_coef=sizes["grpo_kl"],
            clip=sizes["grpo_clip"], temperature=sizes["grpo_temperature"],
            grpo_nll=sizes["grpo_nll"], grpo_loss=sizes.get("grpo_loss", "grpo"),
            ppo_epochs=sizes.get("ppo_epochs", 1),
            filter_zero_variance=sizes.get("grpo_filter", False),
            mask_truncated=sizes.get("grpo_mask_truncated", False),
            train_tasks=sizes["grpo_tasks"], task_seed=200 + seed,
            verify=sizes.get("verify", "answer")))
        config.train.batch_size = sizes["grpo_batch"] // (CHAOS_GROUPS if chaos else 1)
        compute, trained = train("grpo", config, seed if chaos else None)
        record(stage, seed, compute, config.run.path / "model.safetensors", trained)

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
        sections["post"]["families"] = sizes.get("sft_families", sizes["families"])
        sft = _config(root / f"sft{sft_seed}", sft_seed, **sections)
        compute, trained = train("sft", sft)
        record("SFT", sft_seed, compute, sft.run.path / "model.safetensors", trained)
        sft_weights = sft.run.path / "model.safetensors"
        if "dpo" in stages:
            # DPO: pairs sampled from this SFT model on training tasks, checked.
            t0 = time.perf_counter()
            pairs = root / f"pairs{seed}{tag}.jsonl"
            counts_file = root / f"pairs{seed}{tag}.counts.json"
            settings = {"sft_model": str(sft_weights.resolve()), "seed": seed,
                        **{k: sizes.get(k) for k in ("families", "pair_tasks", "pair_samples",
                                                     "pair_temperature", "max_new_tokens",
                                                     "verify")}}
            if not sizes.get("pair_fallback", True):  # (recorded only when not the default)
                settings["pair_fallback"] = False
            if reuse and pairs.is_file() and counts_file.is_file():
                counts = json.loads(counts_file.read_text())
                pair_seconds = counts.pop("seconds")
                if counts.pop("settings", None) != settings:
                    raise SystemExit(f"--reuse: {pairs} was sampled with other settings than "
                                     f"{settings} (or before they were recorded in "
                                     f"{counts_file.name}); use another --workdir")
                print(f"reusing {pairs}", flush=True)
            else:
                pcfg = _config(root / f"pairs{seed}{tag}", seed, **_post_sections(
                    sizes, 1e-4, 1, sft_weights))
                tasks = generate(sizes["families"], "train", sizes["pair_tasks"], 100 + seed)
                records, counts = make_pairs(load_reference(pcfg, torch.device("cpu")),
                                             load_tokenizer(pcfg), tasks,
                                             samples=sizes["pair_samples"],
                                             max_new_tokens=sizes["max_new_tokens"],
                                             temperature=sizes["pair_temperature"], top_k=0,
                                             seed=seed,
                                             solution_fallback=sizes.get("pair_fallback", True),
                                             verify=VERIFIERS[sizes.get("verify", "answer")])
                write_pairs(records, pairs)
                pair_seconds = time.perf_counter() - t0
                counts_file.write_text(json.dumps({**counts, "seconds": pair_seconds,
                                                   "settings": settings}))
            dpo = _config(root / f"dpo{seed}{tag}", seed, **_post_sections(
                sizes, sizes["dpo_lr"], sizes["dpo_steps"], sft_weights, data=str(pairs),
                beta=sizes["dpo_beta"], dpo_nll=sizes["dpo_nll"],
                dpo_loss=sizes.get("dpo_loss", "sigmoid"),
                dpo_precompute=sizes.get("dpo_precompute", False)))
            compute, trained = train("dpo", dpo)
            compute["pair_seconds"], compute["pairs"] = pair_seconds, counts
            record(named("DPO"), seed, compute, dpo.run.path / "model.safetensors", trained)
        if "grpo" in stages:
            grpo(named("GRPO"), f"grpo{seed}{tag}", sft_weights, seed)
        if "grpo_dpo" in stages:
            # GRPO from this seed's DPO model (trained above, or by an earlier run in root).
            dpo_weights = root / f"dpo{seed}{tag}" / "model.safetensors"
            if not dpo_weights.is_file():
                raise SystemExit(f"--stages grpo_dpo: no DPO model {dpo_weights}; add dpo to "
                                 "--stages (or run it first in the same --workdir)")
            grpo(named("GRPO from DPO"), f"grpo_dpo{seed}{tag}", dpo_weights, seed)
        if "chaos" in stages:
            # The chain's SFT and GRPO again, each as a fault-tolerant job under SIGKILLs: the
            # same global batch while every group is up (each group half of it).
            sections["train"]["batch_size"] = sizes["sft_batch"] // CHAOS_GROUPS
            sft_chaos = _config(root / f"sft{sft_seed}-chaos", sft_seed, **sections)
            compute, trained = train("sft", sft_chaos, chaos_seed=sft_seed)
            record("SFT, chaos", sft_seed, compute, sft_chaos.run.path / "model.safetensors",
                   trained)
            grpo("GRPO, chaos", f"grpo{seed}{tag}-chaos",
                 sft_chaos.run.path / "model.safetensors", seed, chaos=True)
    return out


def paired(result: dict, better: str, worse: str) -> tuple[float, float] | None:
    """Mean per-task difference ``better - worse``, with its 95 % interval over tasks: each
    task's difference is averaged over the seeds first (every seed answers the same tasks, and
    seeds may share the lower stage's model, so a task's differences across seeds are not
    independent; the task is the unit), then a normal approximation over the tasks. Both
    stages answer the same tasks, so the pairing removes the tasks' shared difficulty."""
    stages = result["stages"]
    low = stages.get(worse, {})
    # The pretrained model is one (seed 0): every seed's SFT is compared with it.
    base = lambda seed: low.get(seed, next(iter(low.values())) if len(low) == 1 else None)
    per_seed = [[a - b for a, b in zip(e["correct"], base(seed)["correct"])]
                for seed, e in stages.get(better, {}).items()
                if base(seed) is not None and "correct" in e and "correct" in base(seed)]
    if not per_seed or len(per_seed[0]) < 2:
        return None
    diffs = [statistics.fmean(task) for task in zip(*per_seed)]
    return statistics.fmean(diffs), 1.96 * statistics.stdev(diffs) / len(diffs) ** 0.5


def chain_differences(result: dict, better: str, worse: str) -> list[float] | None:
    """Each chain's accuracy difference ``better - worse`` when the chains are independent:
    every seed of ``better`` has its own ``worse`` model (the same seed), or ``worse`` is one
    model shared by all, the starting point (the pretrained model); else None."""
    stages = result["stages"]
    high, low = stages.get(better, {}), stages.get(worse, {})
    if not high or not low:
        return None
    if len(low) == 1 and worse == "pretrained":
        start = next(iter(low.values()))["acc"]
        return [e["acc"] - start for e in high.values()]
    if not all(seed in low for seed in high):
        return None
    return [e["acc"] - low[seed]["acc"] for seed, e in high.items()]


def verdict(result: dict) -> str:
    """The targets, judged from the numbers: a stage is above another when the paired
    per-task difference over the same tasks and seeds (``paired``) exceeds its 95 % interval
    (the pairing removes the tasks' shared difficulty; without pairs, e.g. one task, the
    difference of the means against the larger mean per-stage interval). The unpaired
    comparison is given with it."""
    stages = result["stages"]

    def mean(stage: str, key: str = "acc") -> float:
        return statistics.fmean(e[key] for e in stages[stage].values())

    # Each row against the model it started from: a labelled GRPO from DPO against the DPO row
    # of the same label.
    below = {"SFT": "pretrained", "DPO": "SFT", "GRPO": "SFT", "GRPO from DPO": "DPO"}
    lines = []
    for better in stages:
        base = base_stage(better)
        if base not in below:
            continue
        # A labelled row against the row of the same label it started from, if there is one
        # (GRPO from DPO, LABEL against DPO, LABEL; GRPO, chaos against SFT, chaos).
        worse = below[base] + better[len(base):]
        if worse not in stages:
            worse = below[base]
        if worse not in stages or worse == better or (better.endswith(", chaos")
                                                       and worse == "pretrained"):
            continue
        diff = mean(better) - mean(worse)
        interval = max(mean(better, "ci95"), mean(worse, "ci95"))
        pair = paired(result, better, worse)
        chains = chain_differences(result, better, worse)
        over = interval_over_chains(chains) if chains else None
        line = f"{better} - {worse}: "
        if over is not None:
            met = "met" if over[0] > over[1] else "NOT met"
            line += (f"over {len(chains)} chains {over[0]:+.3f} ± {over[1]:.3f}: {met} [per chain "
                     + ", ".join(f"{d:+.3f}" for d in chains)
                     + ("" if pair is None else
                        f"; paired per task {pair[0]:+.3f} ± {pair[1]:.3f} over tasks") + "]")
            lines.append(line)
            continue
        met = "met" if (pair[0] > pair[1] if pair is not None else diff > interval) else "NOT met"
        if pair is not None:
            low = stages[worse]
            per_seed = [e["acc"] - low.get(seed, next(iter(low.values())))["acc"]
                        for seed, e in stages[better].items()]
            line += (f"paired per task {pair[0]:+.3f} ± {pair[1]:.3f}: {met} [per seed "
                     + ", ".join(f"{d:+.3f}" for d in per_seed) + "; unpaired: difference of "
                     f"the means {diff:+.3f} against the larger interval {interval:.3f}]")
        else:
            line += f"{diff:+.3f} (interval {interval:.3f}): {met}"
        lines.append(line)
    return "Targets (a stage above another by more than the interval; the statistic is the " \
        "mean over independent chains of each chain's difference, with its interval over " \
        "chains, else the paired per-task difference, averaged over seeds per task): " + \
        "; ".join(lines) + "."


def chaos_lines(result: dict) -> str:
    """Each stage trained again under chaos (``"SFT, chaos"``) against the same recipe without
    (``"SFT"``). The question is whether a run with failures ends where runs of the recipe end:
    its accuracy against the recipe's interval over chains (inside it: the same accuracy), and
    for a stage after SFT its gain over the chaos run's own start against the recipe's gain over
    chains. Also the difference to the same chain without failures (paired per task: a few
    half-batch steps change the trajectory of a training run as much as another seed does, so
    this one is expected to differ), the failures the jobs survived, and whether every group of
    each job ended with the same state."""
    stages, lines = result["stages"], []
    below = {"GRPO": "SFT", "DPO": "SFT"}
    for stage in [s for s in stages if s.endswith(", chaos")]:
        plain = stage[:-len(", chaos")]
        if plain not in stages:
            continue
        runs = stages[stage]
        accs = [e["acc"] for e in runs.values()]
        over = interval_over_chains([e["acc"] for e in stages[plain].values()])
        line = f"{stage} {', '.join(f'{a:.3f}' for a in accs)}"
        if over is not None:
            inside = all(abs(a - over[0]) <= over[1] for a in accs)
            line += (f" against {plain} over chains {over[0]:.3f} ± {over[1]:.3f}: "
                     + ("inside (the same accuracy)" if inside else "OUTSIDE"))
        start = below.get(plain)
        if start and f"{start}, chaos" in stages:
            gains = chain_differences(result, stage, f"{start}, chaos") or []
            plain_gain = interval_over_chains(chain_differences(result, plain, start) or [])
            if gains and plain_gain is not None:
                inside = all(abs(g - plain_gain[0]) <= plain_gain[1] for g in gains)
                line += (f"; its gain over {start}, chaos {', '.join(f'{g:+.3f}' for g in gains)} "
                         f"against {plain}'s gain over chains {plain_gain[0]:+.3f} ± "
                         f"{plain_gain[1]:.3f}: " + ("inside" if inside else "OUTSIDE"))
        pair = paired(result, stage, plain)
        if pair is not None:
            line += (f"; against the same chain without failures {pair[0]:+.3f} ± {pair[1]:.3f} "
                     "(paired per task)")
        failures = sum(e.get("failures", 0) for e in runs.values())
        same = sum(1 for e in runs.values() if e.get("replicas_identical"))
        hashes = sorted({e.get("hashes", 0) for e in runs.values()})
        line += (f"; {failures} SIGKILLs survived in {len(runs)} job(s) of "
                 f"{runs[next(iter(runs))].get('groups', '?')} groups, identical replicas in "
                 f"{same} of {len(runs)} ({'/'.join(map(str, hashes))} hashes each)")
        lines.append(line)
    return ("Under chaos (a chain's SFT and GRPO again as fault-tolerant jobs, failures "
            "injected by SIGKILL): " + "; ".join(lines) + ".") if lines else ""


FINDINGS = """\
Reading. In this pre-registered run (draw, settings, chains and statistic fixed in e7710f1
before any model was scored on the draw; `bench/results/lifecycle/fresh20261204/README.md`),
over five independent chains, each with its own SFT run:

* **GRPO is above SFT by +0.120 ± 0.048 over chains** (95 % interval [+0.072, +0.168]: it
  excludes zero; its mean is above the 10-point target, its lower end is not). Every chain
  gains: +0.054 from the weakest SFT model (0.168) to +0.150. The chosen settings (80 steps at lr
  2e-4, two passes per rollout, so the clip acts; the token-level loss; groups of equal rewards
  left out) were the best of four on validation (chain 0: +0.076; the 40-step version +0.016,
  lr 5e-4 and 1e-3 below SFT). The training reward (sampled at temperature 0.7) rose in every
  chain, e.g. chain 0 from 0.080 to 0.172 and chain 4 from 0.236 to 0.452. Room for it:
  chain 0's SFT model has pass@1 0.094 and pass@16 0.490 at temperature 0.7 on training tasks.
* **Plain DPO is above SFT by +0.018 ± 0.017**: barely above its interval, a small gain. It
  uses no NLL term and only pairs the SFT model sampled (223-367 per chain); the best of four
  plain settings on validation (+0.012 there); a larger learning rate (3e-5) fell below SFT.
* **DPO, RPO (the earlier tables' DPO) is above SFT by +0.046 ± 0.028**, more than plain DPO in
  every chain. Its NLL term on the chosen side (mostly reference solutions: 143-216 of its ~300
  pairs per chain) is an SFT step on solutions; ablated earlier on validation, the NLL term
  alone (beta 0.001) gained as much as with the preference term.
* **SFT is above the pretrained model by +0.296 ± 0.118**, and the SFT runs of one command vary
  from 0.168 to 0.422 with the seed: the chain, not the task, is what the interval must cover.
* **Under chaos, the pre-registered test is not met, and it was the wrong test.** Chain 0's SFT
  and then GRPO as 2-group jobs survived 2 and 5 SIGKILLs; in each job both groups ended with
  the same state (2 identical hashes) and every row was trained once. They ended higher than the
  same chain trained as one group: SFT 0.231 against 0.168, GRPO 0.370 against 0.222, so the
  registered statistic (the paired per-task difference within its interval) says they differ.
  The failures did not make the difference (a control added after the chaos rows were scored,
  not pre-registered): the same 2-group jobs without failures ended at SFT 0.241 and GRPO
  0.390. A 2-group step computes the one-group step to 1e-6 (the same loss and gradient
  norm at steps 0-10), and rounding alone moves the trajectory from there on (step 100's loss
  0.8376 against 0.8372), as far as another seed does. One chain's per-task interval cannot say
  "the same accuracy" for a recipe whose runs range from 0.168 to 0.422; the recipe's interval
  over chains can: the chaos runs lie inside it (SFT 0.296 ± 0.118, GRPO 0.416 ± 0.155), and
  the chaos chain's GRPO gain (+0.139) lies inside GRPO's gain over chains (+0.120 ± 0.048).
* **Compute** (CPU seconds of one run on 1 thread): pretraining 25 s; SFT 209-236 s; plain DPO
  21-24 s + 45-53 s of sampling pairs (600 tasks x 8); RPO's DPO 26-29 s + 11-14 s of pairs;
  GRPO 797-948 s (80 steps, each rollout trained twice); scoring a model 13-17 s. Two processes
  ran at a time on 2 cores (`run.sh`).
* The earlier three-chain table (2026-12-02, draw 20261202: RPO's DPO +0.039, GRPO at 40 steps
  +0.026, intervals over tasks) and its reading are in git. Results of this run:
  `bench/results/lifecycle/fresh20261204/` (`main_024.json`, `main_13.json`,
  `rpo.json`, `chaos.json`, merged by `--merge`; `run.sh`, the runs as they were started)."""


FINDINGS_RUN = Path(__file__).parent / "results/lifecycle/fresh20261204/main_024.json"
"""The run ``FINDINGS`` reads (its families, test draw and chains)."""


def _fmt(value: float) -> str:
    return f"{value:g}"


def format_section(result: dict, flags: list[str]) -> str:
    sizes = result["sizes"]
    rows = []
    for stage, by_seed in result["stages"].items():
        accs = [e["acc"] for e in by_seed.values()]
        mean = statistics.fmean(accs)
        sd = statistics.stdev(accs) if len(accs) > 1 else float("nan")
        over = interval_over_chains(accs)
        seeds = "; ".join(f"{e['acc']:.3f} ± {e['ci95']:.3f}" for e in by_seed.values())
        secs = statistics.fmean(e["seconds"] for e in by_seed.values())
        tokens = statistics.fmean(e["tokens"] for e in by_seed.values())
        extra = ""
        cpu = [e["cpu_seconds"] for e in by_seed.values() if "cpu_seconds" in e]
        if len(cpu) == len(by_seed):  # newer runs (a reused model has no CPU time)
            extra += f" ({statistics.fmean(cpu):.0f} s CPU)"
        if base_stage(stage) == "DPO":
            extra += f" + {statistics.fmean(e['pair_seconds'] for e in by_seed.values()):.0f} s pairs"
        rows.append([stage, f"{mean:.3f}" + ("" if over is None else
                                             f" ± {over[1]:.3f} (sd {sd:.3f})"), seeds,
                     f"{secs:.0f} s{extra}", f"{tokens:,.0f}"])
    body = section_header("Lifecycle on CPU: pretrain -> SFT -> DPO / GRPO",
                          "bench.lifecycle", flags)
    if "--from-json" in command_line() or "--merge" in command_line():
        runs = result.get("command", "?").split("; ")
        body += ("* Trained by " + "; ".join(f"`{c}`" for c in runs) +
                 " (one process each); this text formatted from their JSON\n")
    z = {k: _fmt(v) if isinstance(v, float) else v for k, v in sizes.items()}
    test_seed = sizes.get("test_seed", FIRST_TEST[0])
    left_out = " or ".join(f"the {size:,} tasks of seed {seed}"
                           for seed, size in earlier_draws(test_seed))
    where = ("held-out: {n} tasks of the test split (no problem shared with training; seed "
             f"{test_seed}" + (f", none of {left_out}" if left_out else "") + ")"
             if result.get("split", "test") == "test" else
             "VALIDATION: {n} training-split tasks no stage trains on")
    body += (f"* Model: tiny (configs/tiny.toml), one group, 1 thread. Tasks: {z['families']} "
             f"(SFT: {z.get('sft_families', z['families'])}); "
             + where.format(n=z["heldout_tasks"]) + ", greedy pass@1 with completions of up to "
             f"{z['max_new_tokens']} tokens; ± = 95 % interval over chains for a mean over "
             "chains, over tasks for one chain's value\n"
             f"* Pretrain {z['pretrain_steps']} steps (seed 0, shared by the seeds); SFT "
             f"{z['sft_steps']} steps on {z['train_tasks']} tasks (lr {z['sft_lr']}, batch "
             f"{z['sft_batch']} rows of {z['sft_seq_len']} packed tokens; "
             + ("one SFT model (seed 0) shared by the seeds, which vary the pairs, the GRPO "
                "samples and the DPO/GRPO task draws and data order" if sizes["sft_seeds"] == 1
                else f"seed s starts from the SFT model of seed s mod {z['sft_seeds']}") +
             f"); DPO {z['dpo_steps']} steps (batch 8 pairs) on pairs "
             f"from {z['pair_tasks']} training tasks x {z['pair_samples']} samples at "
             f"temperature {z['pair_temperature']} ("
             + ("a reference solution as the chosen side when no sample is correct"
                if sizes.get("pair_fallback", True) else "sampled pairs only") +
             f"; {z.get('dpo_loss', 'sigmoid')} loss, beta "
             f"{z['dpo_beta']}, NLL weight {z['dpo_nll']}, lr {z['dpo_lr']}"
             + (", reference log-probs precomputed" if sizes.get("dpo_precompute") else "") +
             f"); GRPO {z['grpo_steps']} steps of "
             f"{z['grpo_batch']} prompts x G={z['group_size']} at temperature "
             f"{z['grpo_temperature']} from {z['grpo_tasks']} training tasks (loss "
             f"{z.get('grpo_loss', 'grpo')}, {z.get('ppo_epochs', 1)} pass(es) per rollout, "
             + ("groups of equal rewards left out, " if sizes.get("grpo_filter") else "")
             + ("truncated completions masked, " if sizes.get("grpo_mask_truncated") else "")
             + f"clip {z['grpo_clip']}, KL {z['grpo_kl']}, lr {z['grpo_lr']}, NLL weight on the "
             f"correct samples {z.get('grpo_nll', 0)}); rewards and pairs "
             f"verified on the {sizes.get('verify', 'answer')}\n"
             "* Compute: mean wall seconds per run on this shared machine (evaluation not "
             "included; in brackets the CPU seconds of the process, which the load does not "
             "inflate), tokens = committed training tokens (row budget: GRPO counts G x 256 per "
             "prompt). Wall seconds depend on the machine's load: a reused model keeps the time "
             "of the run that trained it\n")
    if "GRPO from DPO" in result["stages"]:
        body += ("* GRPO from DPO: the GRPO settings above, started from each seed's DPO model "
                 "(also its KL reference) instead of the SFT model\n")
    if "SFT, chaos" in result["stages"]:
        body += (f"* SFT, chaos and GRPO, chaos: each chain's SFT and then GRPO (from that SFT "
                 f"model) again with the same settings as a local fault-tolerant job of "
                 f"{CHAOS_GROUPS} replica groups, each training half of the batch, with a SIGKILL "
                 f"every {z.get('chaos_mtbf', '?')} s on average (the chain's seed draws the "
                 "schedule); a step with a group down trains the other half only\n")
    for stage in result["stages"]:
        own = result.get("stage_sizes", {}).get(stage)
        if own and stage != base_stage(stage) and not stage.endswith(", chaos"):  # a labelled variant: how its settings differ
            differ = [f"{k} {_fmt(v) if isinstance(v, float) else v}" for k, v in own.items()
                      if sizes.get(k) != v]
            body += (f"* {stage}: the {base_stage(stage)} settings above"
                     + (", but " + ", ".join(differ) if differ else "") + "\n")
    body += "\n"
    body += table(["stage", "pass@1, mean over chains (± 95 % CI over chains)",
                   "per chain (± 95 % CI over tasks)",
                   "compute (wall)", "tokens"], rows)
    pair_counts = [f"{stage}: " + "; ".join(
        f"{p['sample']} / {p['solution']} / {p['all_correct']}" for p in pairs)
        for stage, pairs in ((stage, [e["pairs"] for e in by_seed.values() if "pairs" in e])
                             for stage, by_seed in result["stages"].items())
        if base_stage(stage) == "DPO" and pairs]
    if pair_counts:
        body += ("\n\nPairs per seed (sampled correct vs incorrect / solution vs incorrect / all "
                 "correct, skipped): " + ". ".join(pair_counts))
    body += "\n\n" + verdict(result)
    chaos = chaos_lines(result)
    if chaos:
        body += "\n\n" + chaos
    registered = json.loads(FINDINGS_RUN.read_text())["sizes"] if FINDINGS_RUN.is_file() else None
    if (registered is not None and result.get("split", "test") == "test"
            and all(sizes.get(k) == registered[k] for k in (
                "families", "test_seed", "sft_seeds", "sft_steps", "grpo_steps", "heldout_tasks"))
            and len(result["stages"].get("SFT", {})) == registered["sft_seeds"]):
        # The reading of that run, not of another; one line per paragraph or item (the
        # document's line budget counts lines, Markdown joins them the same).
        body += "\n\n" + re.sub(r"\n(?=[^*\n])\s*", " ", FINDINGS)
    fams = {stage: {f: statistics.fmean(e["families"][f] for e in by_seed.values())
                    for f in next(iter(by_seed.values()))["families"]}
            for stage, by_seed in result["stages"].items()}
    names = sorted(next(iter(fams.values())))
    if len(names) > 1:
        body += "\n\nPer family (mean over seeds):\n\n" + table(
            ["stage", *names], [[s, *(f"{v[n]:.3f}" for n in names)] for s, v in fams.items()])
    return body + "\n"


STAGE_SIZES = {
    "DPO": ("pair_tasks", "pair_samples", "pair_temperature", "dpo_steps", "dpo_lr", "dpo_beta",
            "dpo_nll", "dpo_loss", "pair_fallback", "dpo_precompute"),
    "GRPO": ("grpo_steps", "grpo_batch", "group_size", "grpo_lr", "grpo_kl", "grpo_clip",
             "grpo_temperature", "grpo_tasks", "grpo_nll", "grpo_loss", "ppo_epochs",
             "grpo_filter", "grpo_mask_truncated"),
}
STAGE_SIZES["GRPO from DPO"] = STAGE_SIZES["DPO"] + STAGE_SIZES["GRPO"]
"""The sizes that only one post-SFT stage reads (every other size is shared by the stages)."""


def merge(results: list[dict]) -> dict:
    """One result from runs over disjoint seeds or stages, scored on the same tasks (the
    pretrained model's entry is taken from the first run; a seed present twice is refused). The
    runs after the first must agree on every size their stages read (a DPO run and a GRPO run
    may differ in each other's settings, and so may the runs of a labelled variant row and of
    the plain one; the merged sizes take each plain stage's from a run of it, ``stage_sizes``
    holds every row's own); the first (e.g. ``--only-seeds none``, the pretraining alone) on the
    pretraining and the evaluation. A size one run does not record (an older run) is not a
    disagreement."""
    first, rest = results[0], results[1:] or results
    shared = ("families", "pretrain_steps", "heldout_tasks", "test_seed", "max_new_tokens")
    own = {k for keys in STAGE_SIZES.values() for k in keys}
    out = {"sizes": dict(rest[0]["sizes"]), "split": first.get("split", "test"), "stages": {}}

    def agree(a: dict, b: dict, keys) -> bool:
        return all(a[k] == b[k] for k in keys if k in a and k in b)

    taken: dict[str, dict] = {}  # stage -> its own sizes, from the first run that trained it
    for r in results:
        sizes = r["sizes"]
        same = agree(sizes, out["sizes"], shared if r is first else
                     (set(sizes) | set(out["sizes"])) - own)
        for stage in r["stages"]:
            keys = STAGE_SIZES.get(base_stage(stage))
            if keys:
                mine = r.get("stage_sizes", {}).get(stage) or \
                    {k: sizes[k] for k in keys if k in sizes}
                same = same and agree(mine, taken.setdefault(stage, mine), keys)
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
    for stage, sizes in taken.items():
        if stage == base_stage(stage):
            out["sizes"].update(sizes)
    out["stage_sizes"] = taken
    for key in ("sft_families",):  # recorded by newer runs only
        found = [r["sizes"][key] for r in results if key in r["sizes"]]
        if found and key not in out["sizes"]:
            out["sizes"][key] = found[0]
    order = ["pretrained", "SFT", "DPO", "GRPO", "GRPO from DPO"]
    out["stages"] = {stage: dict(sorted(by_seed.items(), key=lambda kv: int(kv[0])))
                     for stage, by_seed in sorted(out["stages"].items(), key=lambda kv: (
                         order.index(base_stage(kv[0])), kv[0]))}
    return out


def _override(sizes: dict, assignments: list[str]) -> dict:
    sizes = dict(sizes)
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or key not in sizes:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(sorted(sizes))}")
        kind = type(sizes[key])
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise SystemExit(f"--set {item!r}: {key} is true or false")
            sizes[key] = value.lower() in ("true", "1")
        else:
            sizes[key] = (value if kind is str else kind(float(value)) if kind is int
                          else kind(value))
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lifecycle", description=__doc__)
    p.add_argument("--quick", action="store_true", help="smoke-test sizes (a few minutes)")
    p.add_argument("--seeds", type=int, default=CHAINS, help="chains: seeds of SFT, DPO and "
                   f"GRPO (default {CHAINS}; each its own SFT run while sft_seeds >= seeds)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a size or hyper-parameter of FULL (repeatable)")
    p.add_argument("--eval-split", choices=("test", "val"), default="test",
                   help="score on the held-out test split (the table) or on a validation set "
                   "of unseen training-split tasks (for choosing hyper-parameters; not written)")
    p.add_argument("--stages", default="dpo,grpo", help="post-SFT stages to run (dpo,grpo; "
                   "grpo_dpo: GRPO from each seed's DPO model, a row of its own)")
    p.add_argument("--workdir", default="", help="keep the runs here (default: a temporary "
                   "folder, removed at the end)")
    p.add_argument("--reuse", action="store_true", help="with --workdir: take the models, "
                   "pairs and scores an earlier run left there instead of making them again "
                   "(refused when made with other settings)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--only-seeds", default="", help="run only these seeds (comma list) of "
                   "--seeds: with --workdir and --reuse, seeds can run as separate processes "
                   "that share the pretrained model (`none`: pretrain only); --merge joins "
                   "their JSON files")
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="do not train: join the results of runs over disjoint seeds")
    p.add_argument("--label", default="", help="name this run's DPO/GRPO rows \"DPO, LABEL\" "
                   "etc.: a variant's rows, merged (--merge) beside the plain ones, each row "
                   "with its own settings")
    p.add_argument("--rpo", action="store_true", help="the DPO settings of the earlier tables "
                   "(RPO: NLL weight 10, reference solutions as the chosen side; RPO) as the "
                   "labelled row \"DPO, RPO\" (with --stages dpo)")
    p.add_argument("--table", action="store_true", help="the whole table, as `make lifecycle` "
                   "makes it: the chains' DPO and GRPO, the RPO row (--rpo) and chain 0 under "
                   "chaos, in --workdir (default runs/lifecycle; what is there is taken back, "
                   "as with --reuse), merged into one section")
    p.add_argument("--json", default="", help="also write the raw results here")
    p.add_argument("--from-json", default="", help="do not train: format (and write) the section "
                   "from results saved by an earlier --json run")
    args = p.parse_args(argv)
    if args.rpo and args.label:
        raise SystemExit("--rpo names its rows itself (\"DPO, RPO\"); drop --label")
    if args.rpo:
        args.label = "RPO"
    sizes = _override({**(QUICK if args.quick else FULL), **(RPO if args.rpo else {})}, args.set)
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    # The section alone, as BENCHMARKS.md holds it, is --table's (every row).
    flags = [f for f, on in (("--table", not args.quick), ("--quick", args.quick),
                             ("--no-write", args.no_write)) if on]
    only = (None if not args.only_seeds else [] if args.only_seeds == "none" else
            [int(x) for x in args.only_seeds.split(",") if x.strip()])
    if args.merge:
        result = merge([json.loads(Path(f).read_text()) for f in args.merge])
        result["command"] = "; ".join(r.get("command", "?") for r in
                                      (json.loads(Path(f).read_text()) for f in args.merge))
    elif args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        args.json = ""
    elif args.table:
        if args.rpo or args.label or only is not None or args.eval_split != "test":
            raise SystemExit("--table runs every stage of every chain on the test split; drop "
                             "--rpo, --label, --only-seeds and --eval-split")
        root = Path(args.workdir) if args.workdir else REPO_ROOT / "runs" / "lifecycle"
        result = merge([
            run_lifecycle(root, sizes, args.seeds, "test", ("dpo", "grpo"), True),
            run_lifecycle(root, {**sizes, **RPO}, args.seeds, "test", ("dpo",), True,
                          label="RPO"),
            run_lifecycle(root, sizes, args.seeds, "test", ("chaos",), True, only=[0])])
        result["command"] = command_line()
    elif args.workdir:
        result = run_lifecycle(Path(args.workdir), sizes, args.seeds, args.eval_split, stages,
                               args.reuse, only, args.label)
        result["command"] = command_line()
    else:
        with tempfile.TemporaryDirectory(prefix="ftlm-lifecycle-") as tmp:
            result = run_lifecycle(Path(tmp), sizes, args.seeds, args.eval_split, stages,
                                   label=args.label)
        result["command"] = command_line()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return publish("lifecycle", format_section(result, flags),
                   not args.no_write and not args.quick and result.get("split", "test") == "test")


if __name__ == "__main__":
    sys.exit(main())
