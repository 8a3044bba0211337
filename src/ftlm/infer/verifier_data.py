"""Verifier training data from the policy's own samples, labelled line by line by exact checks.

Responsible for:

* ``line_labels``: the (pure) labels of the lines of one completion of a task. A reasoning line
  is right when it is the reference solution's line at the same place: the suite's families have
  one deterministic worked solution, so a line that differs from it is a wrong step (a miscopied
  digit, a wrong sum, a wrong quotient). The answer line is right when ``ftlm.tasks.check``
  accepts the completion (the outcome). These are process labels: each says whether *its* line
  is right, which a small model can learn from the line and the prompt alone, where the outcome
  of a whole sample (one bit per sample) gave it nothing to learn from (BENCHMARKS.md);
* ``label_samples``: each distinct sampled completion of a training task as one conversation of
  ``ftlm.infer.verifier.verification_messages`` with those labels as its verdicts; with
  ``process=False`` every line carries the completion's outcome instead (outcome supervision of
  every prefix, the value of the partial solution under the policy: the ablation);
* ``sampled_records``: sampling those completions from a policy through the engine (the same
  chat prompt ``ftlm generate --chat`` uses) and labelling them;
* the split rule: every task must be of the suite's ``train`` split (a held-out task raises), so a
  verifier never sees a problem the scaling study is measured on;
* ``write_records`` (from ``ftlm.infer.verifier``): JSONL for ``ftlm sft`` (atomically).

Not responsible for: training (``ftlm verifier train`` runs ``ftlm sft`` on the file), scoring
(``ftlm.infer.verifier.Verifier``) or the synthetic changed-answer data of
``ftlm.infer.verifier.verifier_records`` (labels without a policy).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ftlm.errors import ConfigError
from ftlm.infer.strategies import Candidate
from ftlm.infer.verifier import (  # noqa: F401 - write_records is re-exported
    NO,
    YES,
    solution_lines,
    verification_messages,
    write_records,
)
from ftlm.tasks import Task, check

ANSWER = "Answer:"


def check_train_split(tasks: Sequence[Task]) -> None:
    """Refuse any held-out task: verifier data comes from the train split only."""
    held = [t for t in tasks if t.split != "train"]
    if held:
        raise ConfigError(f"task {held[0].prompt!r} ({held[0].family}) is in the held-out split; "
                          "verifier training data must come from the train split only "
                          "(ftlm.tasks.generate(..., 'train', ...))")


def line_labels(task: Task, completion: str) -> list[bool]:
    """Whether each line of ``solution_lines(completion)`` is right (see the module docstring)."""
    reference = [line.strip() for line in solution_lines(task.solution)]
    correct = check(task, completion)
    return [correct if line.strip().startswith(ANSWER)
            else i < len(reference) and line.strip() == reference[i]
            for i, line in enumerate(solution_lines(completion))]


def _record(task: Task, completion: str, correct: bool, verdicts: list[bool]) -> dict:
    return {"messages": verification_messages(task.prompt, completion,
                                              [YES if v else NO for v in verdicts]),
            "family": task.family, "label": YES if correct else NO}


def label_samples(tasks: Sequence[Task], samples: Sequence[Sequence[str]],
                  process: bool = True, seed: int = 0) -> list[dict]:
    """Labelled conversations of ``samples[i]`` (completion texts) of ``tasks[i]``, shuffled.

    The order is shuffled with ``seed`` (``ftlm sft`` reads a file in order). Duplicate
    completions of one task count once (a policy repeats its likely answers; the verifier should
    not learn their frequency). ``label`` is the outcome (``check``); the verdicts are
    ``line_labels`` (``process=False``: the outcome on every line).
    """
    if len(tasks) != len(samples):
        raise ConfigError(f"{len(samples)} sample lists for {len(tasks)} tasks")
    check_train_split(tasks)
    records = []
    for task, texts in zip(tasks, samples):
        for text in dict.fromkeys(texts):
            correct = check(task, text)
            verdicts = (line_labels(task, text) if process
                        else [correct] * len(solution_lines(text)))
            records.append(_record(task, text, correct, verdicts))
    random.Random(seed).shuffle(records)
    return records


def sampled_records(engine, codec, tasks: Sequence[Task], samples: int, params,
                    process: bool = True, seed: int = 0) -> tuple[list[dict], dict[str, int]]:
    """Sample ``samples`` completions per task from ``engine``'s policy and label them.

    ``codec`` is the policy's tokenizer (the chat template of ``ftlm.data.chat`` is applied);
    returns the records and counts (tasks, samples, correct samples, distinct completions,
    labelled lines, lines labelled yes).
    """
    from ftlm.infer.chat import render_chat
    from ftlm.infer.strategies import sample_candidates
    check_train_split(tasks)
    prompts = [render_chat([{"role": "user", "content": t.prompt}], codec) for t in tasks]
    pools: list[list[Candidate]] = sample_candidates(engine, codec, prompts, samples, params)
    texts = [[c.text for c in pool] for pool in pools]
    records = label_samples(tasks, texts, process, seed)
    verdicts = [m["content"] for r in records for m in r["messages"] if m["role"] == "assistant"]
    counts = {"tasks": len(tasks), "samples": len(tasks) * samples,
              "correct_samples": sum(check(t, x) for t, row in zip(tasks, texts) for x in row),
              "completions": len(records), "lines": len(verdicts),
              "yes_lines": verdicts.count(YES)}
    return records, counts
