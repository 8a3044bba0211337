"""Verifiable tasks, generated offline: problems with exact answers, worked solutions and checkers.

The same suite feeds SFT data, DPO pairs, RL rewards, evaluation and test-time compute. It is
pure Python (no torch); ``ftlm tasks`` (``ftlm.tasks.cli``) writes it to files.

Interface (stable; other packages rely on it)::

    Task(family, prompt, answer, solution, key)   # frozen; task.split -> "train" | "test"
    FAMILIES                                     # ("add", "mod", "sort", "count")
    generate(families, split, n, seed) -> list[Task]
    check(task, completion) -> bool              # exact, on the canonical answer
    check_trace(task, completion) -> bool        # check, and the reasoning equals the reference's
    VERIFIERS                                    # {"answer": check, "trace": check_trace}
    extract_answer(text) -> str | None           # after the last </think>, the last "Answer: ..."
    format_completion(reasoning, answer) -> str  # "<think>\\n...\\n</think>\\nAnswer: 42"
    write_tasks(tasks, path, style) / read_tasks(path)   # .jsonl or .parquet;
                                                         # style "messages" | "prompt_completion"
    pass_at_k(n, c, k) / summarise(families, correct, n, ks)   # unbiased pass@k, per family

* ``Task.prompt`` is the bare question (``"What is 47 + 85?"``); ``Task.solution`` is the
  reference completion, a reasoning trace and the final answer::

      <think>
      7+5+0=12, write 2, carry 1
      4+8+1=13, write 3, carry 1
      write 1
      </think>
      Answer: 132

  A chat template, if any, is the caller's (the post-training commands add theirs).
* Splits: a problem is held out (``"test"``) when a hash of its family and canonical key falls
  in the lowest ``HELDOUT_PERCENT`` (10) of 100 buckets; the canonical key identifies a problem
  up to answer-preserving symmetries (``3 + 5`` = ``5 + 3``). So train and test never share a
  problem, whatever the seeds, and ``generate`` only returns tasks of the split asked for.
* ``generate`` is deterministic in its arguments; families take turns; tasks are distinct by
  key within one call.

Not responsible for: tokenisation, chat templates or sampling from a model (``ftlm eval`` samples
and scores with ``pass_at_k``).
"""

from ftlm.tasks.families import FAMILY_TABLE
from ftlm.tasks.files import STYLES, read_tasks, write_tasks
from ftlm.tasks.scoring import pass_at_k, summarise
from ftlm.tasks.suite import (FAMILIES, HELDOUT_PERCENT, SPLITS, VERIFIERS, Task, accuracy, check,
                              check_trace, extract_answer, format_completion, generate, split_of)

__all__ = ["Task", "FAMILIES", "FAMILY_TABLE", "SPLITS", "HELDOUT_PERCENT", "STYLES", "generate",
           "check", "check_trace", "VERIFIERS", "accuracy", "extract_answer", "format_completion", "split_of", "write_tasks",
           "read_tasks", "pass_at_k", "summarise"]
