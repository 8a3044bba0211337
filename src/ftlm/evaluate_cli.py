"""``ftlm eval MODEL``: held-out loss and perplexity, and task accuracy (pass@1, pass@k).

* **Loss** (``--data DIR``): the mean next-token cross-entropy of the model on the held-out
  samples of a prepared data folder, chosen as training chooses them (``data.eval_samples`` and
  ``data.eval_seed``: ``--eval-samples``, ``--eval-seed``), so the number is comparable with a
  run's eval loss; perplexity is its exponential.
* **Tasks** (``--tasks FILE`` written by ``ftlm tasks write``, or generated: ``--families``,
  ``--split`` (default the held-out ``test``), ``--n``, ``--seed``): each prompt is rendered with
  the post-training chat template (``ftlm.data.chat``, the one ``ftlm sft`` trains on), ``--samples``
  completions are drawn with the KV-cache engine (``ftlm.infer``; greedy at ``--temperature 0``,
  else seeded per task and sample), checked exactly (``ftlm.tasks.check``), and scored with the
  unbiased pass@k estimator (``ftlm.tasks.scoring``) for each ``--k``, overall and per family,
  with a 95 % interval over tasks.

The result is printed as a table and, with ``--out FILE.json``, written as JSON (and the table
next to it as ``FILE.md``). MODEL is anything ``ftlm convert`` reads: a run directory, a
checkpoint, a ``model.safetensors`` or an HF Llama folder (``ftlm.convert_cli.load_model_source``).

Not responsible for: training, or comparing runs (BENCHMARKS scripts read the JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from ftlm.errors import ConfigError, DataError


def heldout_loss(model, data_dir: Path, eval_samples: int = 256, eval_seed: int = 0,
                 samples: int = 0, batch_size: int = 16) -> dict:
    """Mean held-out cross-entropy of ``model`` on the prepared folder ``data_dir``: over the first
    ``samples`` (0: all ``eval_samples``) of the held-out set training uses, which is what a run's
    eval loss reads (its first ``train.eval_batches x train.batch_size``)."""
    from ftlm.data.loader import PackedDataset
    from ftlm.data.manifest import read_manifest
    from ftlm.data.split import split_heldout
    from ftlm.train.evaluate import Evaluator
    if eval_samples < 1:
        raise ConfigError(f"--eval-samples={eval_samples} must be at least 1")
    if not 0 <= samples <= eval_samples:
        raise ConfigError(f"--loss-samples={samples} must lie in 0..--eval-samples={eval_samples}")
    seq_len = read_manifest(Path(data_dir)).seq_len
    if seq_len > model.cfg.max_seq_len:
        raise ConfigError(f"data in {data_dir} has samples of {seq_len} tokens, more than the "
                          f"model's max_seq_len={model.cfg.max_seq_len}")
    heldout = split_heldout(PackedDataset(Path(data_dir), seq_len), eval_samples, eval_seed).heldout
    samples = samples or eval_samples
    batch = min(batch_size, samples)
    batches = samples // batch
    top = int(heldout.samples(range(batches * batch)).max())
    if top >= model.cfg.vocab_size:
        raise DataError(f"data in {data_dir} holds token id {top}, beyond the model's vocabulary "
                        f"({model.cfg.vocab_size}): it was prepared with another tokenizer")
    result = Evaluator(model, heldout, every=1, batches=batches, batch_size=batch,
                       micro_batch=batch, last_step=1).evaluate()
    return {"data": str(data_dir), "samples": batches * batch, "tokens": result.eval_tokens,
            "loss": result.loss, "perplexity": math.exp(min(result.loss, 700.0))}


def sample_tasks(model, tokenizer, tasks, samples: int, temperature: float, top_k: int,
                 max_new_tokens: int, seed: int, max_batch: int = 32) -> list[list[str]]:
    """``samples`` completions (text, chat template stripped) of every task, in task order."""
    from ftlm.infer import Engine, SamplingParams
    from ftlm.data.chat import completion_text, prompt_ids
    from ftlm.post.rollout import sample_seed
    end_id = tokenizer.token_id("<|end|>")
    prompts, params = [], []
    for i, task in enumerate(tasks):
        ids = prompt_ids(tokenizer, task.prompt)
        budget = min(max_new_tokens, model.cfg.max_seq_len - len(ids))
        if budget < 1:
            raise ConfigError(f"the prompt of task {i} ({len(ids)} tokens) leaves no room under "
                              f"max_seq_len={model.cfg.max_seq_len}")
        for j in range(samples):
            prompts.append(ids)
            params.append(SamplingParams(max_new_tokens=budget, temperature=temperature,
                                         top_k=top_k, stop_ids=(end_id,),
                                         seed=sample_seed("eval", seed, i, j)))
    engine = Engine(model, max_batch=max(1, min(max_batch, len(prompts))), eos_id=tokenizer.eos_id)
    seqs = engine.generate(prompts, params)
    texts = [completion_text(tokenizer, s.tokens) for s in seqs]
    return [texts[i * samples:(i + 1) * samples] for i in range(len(tasks))]


def task_accuracy(model, tokenizer, tasks, samples: int = 1, ks: list[int] | None = None,
                  temperature: float = 0.0, top_k: int = 0, max_new_tokens: int = 96,
                  seed: int = 0, examples: int = 3) -> dict:
    """pass@k of ``model`` on ``tasks`` (see the module docstring) and a few example outputs."""
    from ftlm.tasks import check
    from ftlm.tasks.scoring import summarise
    ks = sorted(set(ks or [1]))
    if samples < 1:
        raise ConfigError(f"--samples={samples} must be at least 1")
    if any(k < 1 or k > samples for k in ks):
        raise ConfigError(f"--k {','.join(map(str, ks))}: every k must lie in 1..--samples={samples}")
    if temperature == 0 and samples > 1:
        raise ConfigError(f"--samples={samples} with --temperature 0 draws the same greedy "
                          "completion each time; set --temperature > 0 (e.g. 0.8) or --samples 1")
    if not tasks:
        raise ConfigError("no tasks to evaluate; give --n >= 1 or a non-empty --tasks file")
    t0 = time.perf_counter()
    completions = sample_tasks(model, tokenizer, tasks, samples, temperature, top_k,
                               max_new_tokens, seed)
    correct = [sum(check(t, c) for c in cs) for t, cs in zip(tasks, completions)]
    return {
        "tasks": len(tasks), "samples": samples, "temperature": temperature, "top_k": top_k,
        "max_new_tokens": max_new_tokens, "seed": seed, "seconds": time.perf_counter() - t0,
        "scores": summarise([t.family for t in tasks], correct, samples, ks),
        "examples": [{"prompt": t.prompt, "answer": t.answer, "completion": cs[0],
                      "correct": bool(check(t, cs[0]))}
                     for t, cs in list(zip(tasks, completions))[:examples]],
    }


def format_table(result: dict) -> str:
    """A markdown table of an eval result."""
    lines = [f"model: {result['model']}"]
    if "loss" in result:
        loss = result["loss"]
        lines += ["", "| held-out data | samples | tokens | loss | perplexity |",
                  "|---|---:|---:|---:|---:|",
                  f"| {loss['data']} | {loss['samples']} | {loss['tokens']} | {loss['loss']:.4f} | "
                  f"{loss['perplexity']:.2f} |"]
    if "tasks" in result:
        tasks = result["tasks"]
        scores = tasks["scores"]
        ks = [key for key in scores["all"] if key.startswith("pass@")]
        lines += ["", f"tasks: {tasks['source']}, {tasks['samples']} sample(s) per task at "
                      f"temperature {tasks['temperature']:g}", "",
                  "| family | tasks | " + " | ".join(ks) + " |",
                  "|---|---:|" + "---:|" * len(ks)]
        for name, row in scores.items():
            cells = [f"{row[k]['mean']:.3f} ± {row[k]['ci95']:.3f}"
                     if not math.isnan(row[k]["ci95"]) else f"{row[k]['mean']:.3f}" for k in ks]
            lines.append(f"| {name} | {row['tasks']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _tasks_from_args(args: argparse.Namespace):
    from ftlm.tasks import generate, read_tasks
    if args.tasks:
        return read_tasks(Path(args.tasks)), args.tasks
    tasks = generate(args.families, args.split, args.n, args.seed)
    return tasks, f"{args.split} split of {args.families} (n={args.n}, seed {args.seed})"


def cmd_eval(args: argparse.Namespace) -> int:
    import torch
    from ftlm.convert_cli import load_model_source
    from ftlm.data.tokenizer import Tokenizer
    if args.threads:
        torch.set_num_threads(args.threads)
    source = load_model_source(Path(args.model), Path(args.config) if args.config else None,
                               Path(args.tokenizer) if args.tokenizer else None)
    result: dict = {"model": str(args.model)}
    if args.data:
        result["loss"] = heldout_loss(source.model, Path(args.data), args.eval_samples,
                                      args.eval_seed, args.loss_samples)
    if not args.no_tasks:
        if source.tokenizer is None:
            raise DataError(f"no tokenizer found for {args.model}; pass --tokenizer tokenizer.json "
                            "(the one the model was trained with)")
        tokenizer = Tokenizer.load(source.tokenizer)
        tasks, where = _tasks_from_args(args)
        ks = [int(k) for k in str(args.k).split(",") if k.strip()] if args.k else [1]
        result["tasks"] = {"source": where, **task_accuracy(
            source.model, tokenizer, tasks, samples=args.samples, ks=ks,
            temperature=args.temperature, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
            seed=args.seed)}
    if "loss" not in result and "tasks" not in result:
        raise ConfigError("nothing to evaluate: give --data DIR for the loss, or drop --no-tasks")
    table = format_table(result)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        os.replace(tmp, out)
        out.with_suffix(".md").write_text(table + "\n")
        print(f"\nwritten to {out} and {out.with_suffix('.md')}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ftlm eval``."""
    from ftlm.tasks.suite import FAMILIES, SPLITS
    p = sub.add_parser("eval", help="held-out loss/perplexity and task accuracy (pass@1, pass@k)",
                       description="Evaluate MODEL (a run directory, checkpoint, model.safetensors "
                                   "or HF folder): held-out loss on --data, and pass@k on the "
                                   "verifiable task suite.")
    p.add_argument("model", help="run directory, checkpoint, model.safetensors or HF Llama folder")
    p.add_argument("--config", default="", help="run config describing MODEL's shape (default: "
                                                "the config.toml found with it)")
    p.add_argument("--tokenizer", default="", help="tokenizer.json (default: the run's)")
    p.add_argument("--data", default="", help="prepared data folder for the held-out loss")
    p.add_argument("--eval-samples", type=int, default=256,
                   help="held-out samples for the loss (default 256, as data.eval_samples)")
    p.add_argument("--eval-seed", type=int, default=0, help="seed of the held-out choice "
                                                            "(default 0, as data.eval_seed)")
    p.add_argument("--loss-samples", type=int, default=0,
                   help="evaluate the first this many held-out samples (default 0: all)")
    p.add_argument("--no-tasks", action="store_true", help="skip the task accuracy")
    p.add_argument("--tasks", default="", help="task file (.jsonl/.parquet from `ftlm tasks "
                                               "write`) instead of generated tasks")
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"families of generated tasks (default all: {','.join(FAMILIES)})")
    p.add_argument("--split", default="test", choices=SPLITS,
                   help="split of generated tasks (default test: held out of training)")
    p.add_argument("--n", type=int, default=100, help="generated tasks (default 100)")
    p.add_argument("--seed", type=int, default=0, help="seed of generated tasks and of sampling")
    p.add_argument("--samples", type=int, default=1, help="completions per task (default 1)")
    p.add_argument("--k", default="", help="comma-separated k of pass@k (default 1)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="top-k filter (default 0: none)")
    p.add_argument("--max-new-tokens", type=int, default=96,
                   help="completion budget in tokens (default 96)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="", help="write the result as JSON here (and the table as .md)")
    p.set_defaults(fn=cmd_eval)
