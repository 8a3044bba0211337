"""Preference pairs from the task suite: verified-correct vs incorrect samples of a model.

For each training task, ``post.pair_samples`` completions are sampled from the model with the
KV-cache engine (``ftlm.infer``; seeded by ``(run.seed, task index, sample)``: the same model and
tasks give the same file) and checked. A task
whose samples include a correct and an incorrect one gives the pair (first correct, first
incorrect). A task with no correct sample gives (reference solution, first incorrect sample) when
``solution_fallback`` is on: the reference solution is correct by construction (it is checked
too). Tasks whose samples are all correct teach DPO nothing and are skipped.

Records are ``{prompt, chosen, rejected, family, answer, key, source}`` (``ftlm.post.data``'s
preference format; ``source`` is ``sample`` or ``solution``), written as JSONL.

Not responsible for: training on them (``ftlm dpo``), the tasks themselves (``ftlm.tasks``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import nn

from ftlm.data.tokenizer import Tokenizer
from ftlm.data.chat import completion_text, prompt_ids
from ftlm.post.rollout import sample_seed
from ftlm.tasks import Task, check


def sample_completions(model: nn.Module, tokenizer: Tokenizer, tasks: Sequence[Task], samples: int,
                       max_new_tokens: int, temperature: float, top_k: int, seed: int,
                       max_batch: int = 32) -> list[list[str]]:
    """``samples`` completion texts per task from the KV-cache engine, seeded per (task, sample)."""
    from ftlm.infer import Engine, SamplingParams
    end = tokenizer.token_id("<|end|>")
    prompts, params = [], []
    for i, task in enumerate(tasks):
        ids = prompt_ids(tokenizer, task.prompt)
        budget = min(max_new_tokens, model.cfg.max_seq_len - len(ids))
        for j in range(samples):
            prompts.append(ids)
            params.append(SamplingParams(max_new_tokens=budget, temperature=temperature,
                                         top_k=top_k, stop_ids=(end,),
                                         seed=sample_seed(seed, "pairs", i, j)))
    engine = Engine(model, max_batch=max(1, min(max_batch, len(prompts))), eos_id=tokenizer.eos_id)
    texts = [completion_text(tokenizer, s.tokens) for s in engine.generate(prompts, params)]
    return [texts[i * samples:(i + 1) * samples] for i in range(len(tasks))]


def make_pairs(model: nn.Module, tokenizer: Tokenizer, tasks: Sequence[Task], *, samples: int,
               max_new_tokens: int, temperature: float, top_k: int, seed: int,
               solution_fallback: bool = True, verify: Callable[[Task, str], bool] = check
               ) -> tuple[list[dict], dict[str, int]]:
    """Preference records for ``tasks`` and counts (tasks, sampled pairs, fallback pairs, skipped);
    a sample is correct when ``verify`` accepts it (``check``, or ``check_trace``)."""
    records, counts = [], {"tasks": len(tasks), "sample": 0, "solution": 0, "all_correct": 0,
                           "correct_samples": 0}
    completions = sample_completions(model, tokenizer, tasks, samples, max_new_tokens,
                                     temperature, top_k, seed)
    for task, texts in zip(tasks, completions):
        ok = [verify(task, t) for t in texts]
        counts["correct_samples"] += sum(ok)
        wrong = [t for t, good in zip(texts, ok) if not good]
        if not wrong:
            counts["all_correct"] += 1
            continue
        right = [t for t, good in zip(texts, ok) if good]
        if right:
            chosen, source = right[0], "sample"
        elif solution_fallback and check(task, task.solution):
            chosen, source = task.solution, "solution"
        else:
            continue
        counts[source] += 1
        records.append({"prompt": task.prompt, "chosen": chosen, "rejected": wrong[0],
                        "family": task.family, "answer": task.answer, "key": task.key,
                        "source": source})
    return records, counts


def write_pairs(records: Sequence[dict], path: Path) -> Path:
    """Write preference records as JSONL, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    os.replace(tmp, path)
    return path
