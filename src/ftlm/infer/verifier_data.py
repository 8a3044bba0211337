"""Verifier training data from the policy's own samples, labelled by the exact task checkers.

Responsible for:

* ``label_samples``: the (pure) labelling of sampled completions of training tasks: each distinct
  completion of a task is a conversation "task + proposed solution -> ``yes``/``no``", the label
  being ``ftlm.tasks.check`` of that completion (an outcome label), and, with ``prefixes``, every
  line-prefix of its reasoning labelled with the same final outcome (the value of the partial
  solution under the policy, as an outcome-supervised value model is trained), which is what lets
  one verifier serve both as an outcome scorer (best-of-N) and as a process scorer (step-level
  beam search, ``ftlm.infer.search``);
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
from ftlm.infer.verifier import NO, YES, verification_messages, write_records  # noqa: F401 - re-exported
from ftlm.tasks import Task, check


def check_train_split(tasks: Sequence[Task]) -> None:
    """Refuse any held-out task: verifier data comes from the train split only."""
    held = [t for t in tasks if t.split != "train"]
    if held:
        raise ConfigError(f"task {held[0].prompt!r} ({held[0].family}) is in the held-out split; "
                          "verifier training data must come from the train split only "
                          "(ftlm.tasks.generate(..., 'train', ...))")


def line_prefixes(completion: str) -> list[str]:
    """The proper prefixes of ``completion`` that end at a line break (the reasoning steps)."""
    cuts = [i + 1 for i, ch in enumerate(completion) if ch == "\n" and i + 1 < len(completion)]
    return [completion[:i] for i in cuts]


def _record(task: Task, completion: str, correct: bool, kind: str) -> dict:
    label = YES if correct else NO
    return {"messages": verification_messages(task.prompt, completion)
            + [{"role": "assistant", "content": label}],
            "family": task.family, "label": label, "kind": kind}


def label_samples(tasks: Sequence[Task], samples: Sequence[Sequence[str]],
                  prefixes: bool = True, seed: int = 0) -> list[dict]:
    """Labelled conversations of ``samples[i]`` (completion texts) of ``tasks[i]``, shuffled.

    The order is shuffled with ``seed`` (``ftlm sft`` reads a file in order). Duplicate
    completions of one task count once (a policy repeats its likely answers; the verifier should
    not learn their frequency). A prefix shared by several completions of a task is kept once
    per label it received: once when they all end alike, twice (yes and no) when they do not.
    """
    if len(tasks) != len(samples):
        raise ConfigError(f"{len(samples)} sample lists for {len(tasks)} tasks")
    check_train_split(tasks)
    records: list[dict] = []
    for task, texts in zip(tasks, samples):
        seen: set[tuple[str, bool]] = set()
        for text in dict.fromkeys(texts):
            correct = check(task, text)
            records.append(_record(task, text, correct, "outcome"))
            if not prefixes:
                continue
            for prefix in line_prefixes(text):
                if (prefix, correct) not in seen:
                    seen.add((prefix, correct))
                    records.append(_record(task, prefix, correct, "prefix"))
    random.Random(seed).shuffle(records)
    return records


def sampled_records(engine, codec, tasks: Sequence[Task], samples: int, params,
                    prefixes: bool = True, seed: int = 0) -> tuple[list[dict], dict[str, int]]:
    """Sample ``samples`` completions per task from ``engine``'s policy and label them.

    ``codec`` is the policy's tokenizer (the chat template of ``ftlm.post.chat`` is applied);
    returns the records and counts (tasks, samples, correct samples, records by kind).
    """
    from ftlm.infer.chat import render_chat
    from ftlm.infer.strategies import sample_candidates
    check_train_split(tasks)
    prompts = [render_chat([{"role": "user", "content": t.prompt}], codec) for t in tasks]
    pools: list[list[Candidate]] = sample_candidates(engine, codec, prompts, samples, params)
    texts = [[c.text for c in pool] for pool in pools]
    records = label_samples(tasks, texts, prefixes, seed)
    counts = {"tasks": len(tasks), "samples": len(tasks) * samples,
              "correct_samples": sum(check(t, x) for t, row in zip(tasks, texts) for x in row),
              "outcome_records": sum(r["kind"] == "outcome" for r in records),
              "prefix_records": sum(r["kind"] == "prefix" for r in records),
              "yes_records": sum(r["label"] == YES for r in records)}
    return records, counts
