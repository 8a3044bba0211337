"""An outcome verifier: a (small) ftlm model that answers "is this solution correct? yes/no".

Responsible for:

* the verification prompt (``verification_messages``): the task, the proposed completion, and
  the question, in the chat template of ``ftlm.post.chat``;
* training data for it from the task suite (``verifier_records`` / ``write_verifier_data``): for
  each task its reference solution labelled ``yes`` and solutions whose final answer was changed
  to a wrong one labelled ``no`` (checked wrong with ``ftlm.tasks.check``), as ``messages``
  JSONL that ``ftlm sft`` trains on (``ftlm generate --write-verifier-data``);
* scoring (``Verifier``): ``P(yes) / (P(yes) + P(no))`` of the verifier's first reply token,
  one batched prefill over the candidates (no decoding), usable as a ``Scorer`` of
  ``ftlm.infer.strategies`` (best-of-N, weighted best-of-N).

Labelled samples of a policy (the data ``ftlm verifier train`` uses) are
``ftlm.infer.verifier_data``; a partial solution is scored like a whole one, which is how step-level
beam search (``ftlm.infer.search``) uses a verifier as its process scorer.

Not responsible for: training (``ftlm verifier train`` runs ``ftlm sft``), beam search, or the
scaling study (``bench/test_time_scaling.py``).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from ftlm.data.tokenizer import Tokenizer
from ftlm.errors import ConfigError
from ftlm.infer import kv
from ftlm.infer.chat import render_chat
from ftlm.infer.strategies import Candidate
from ftlm.model.llama import Transformer
from ftlm.tasks import Task, check, format_completion

QUESTION = "Is the final answer correct? Reply yes or no."
YES, NO = "yes", "no"


def verification_messages(prompt: str, completion: str) -> list[dict[str, str]]:
    """The user turn that asks the verifier about ``completion`` of ``prompt``."""
    return [{"role": "user",
             "content": f"{prompt}\n\nProposed solution:\n{completion}\n\n{QUESTION}"}]


def _wrong_answer(task: Task, rng: random.Random) -> str:
    """An answer of the same shape as ``task.answer`` that ``check`` rejects."""
    for _ in range(50):
        parts = task.answer.split(", ")
        i = rng.randrange(len(parts))
        try:
            parts[i] = str(int(parts[i]) + rng.choice([-10, -2, -1, 1, 2, 10]))
        except ValueError:
            parts[i] = parts[i] + "0"
        if rng.random() < 0.3 and len(parts) > 1:
            rng.shuffle(parts)
        wrong = ", ".join(parts)
        if not check(task, format_completion("", wrong)):
            return wrong
    raise ConfigError(f"could not draw a wrong answer for task {task.key!r}")


def verifier_records(tasks: Sequence[Task], wrong_per_task: int = 1, seed: int = 0
                     ) -> list[dict]:
    """Labelled conversations: each reference solution ``yes``, ``wrong_per_task`` wrong ``no``.

    A wrong solution keeps the reference reasoning and changes the final answer, so the verifier
    must read the answer against the work, not the style.
    """
    if not isinstance(wrong_per_task, int) or wrong_per_task < 1:
        raise ConfigError(f"wrong_per_task={wrong_per_task!r} must be an integer >= 1")
    rng = random.Random(seed)
    records = []
    for task in tasks:
        reasoning = task.solution.rsplit("Answer:", 1)[0]
        labelled = [(task.solution, YES)]
        labelled += [(reasoning + "Answer: " + _wrong_answer(task, rng), NO)
                     for _ in range(wrong_per_task)]
        for completion, label in labelled:
            records.append({"messages": verification_messages(task.prompt, completion)
                            + [{"role": "assistant", "content": label}],
                            "family": task.family, "label": label})
    rng.shuffle(records)
    return records


def write_verifier_data(tasks: Sequence[Task], path: Path, wrong_per_task: int = 1,
                        seed: int = 0) -> Path:
    """Write ``verifier_records`` as JSONL (atomically) for ``ftlm sft``; returns ``path``."""
    return write_records(verifier_records(tasks, wrong_per_task, seed), path)


def write_records(records: Sequence[dict], path: Path) -> Path:
    """Write ``records`` as JSONL (atomically: a reader never sees half a file); returns ``path``."""
    path = Path(path)
    if path.suffix != ".jsonl":
        raise ConfigError(f"{path}: verifier data is written as .jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
    os.replace(tmp, path)
    return path


class Verifier:
    """Scores candidates with a verifier model: ``P(yes)`` against ``P(no)``, in [0, 1]."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, batch: int = 16) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch = batch
        self.yes, self.no = tokenizer.encode(YES)[0], tokenizer.encode(NO)[0]
        if self.yes == self.no:
            raise ConfigError("the tokenizer starts 'yes' and 'no' with the same token")
        self._cache: dict[tuple[str, str], float] = {}
        self.cache_limit = 100_000
        """Memoised scores kept; the memo is emptied beyond it (a server runs for long)."""

    @torch.no_grad()
    def probabilities(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """``P(yes | prompt, completion)`` for each ``(prompt, completion)``."""
        limit = self.model.cfg.max_seq_len
        out = []
        device = self.model.tok_embeddings.weight.device
        for start in range(0, len(pairs), self.batch):
            chunk = pairs[start:start + self.batch]
            ids = [render_chat(verification_messages(p, c), self.tokenizer)[-limit:]
                   for p, c in chunk]
            longest = max(len(i) for i in ids)
            tokens = torch.zeros(len(ids), longest, dtype=torch.long)
            for row, i in enumerate(ids):
                tokens[row, :len(i)] = torch.tensor(i)
            cache = kv.KVCache.allocate(self.model, len(ids), longest)
            logits = kv.prefill(self.model, cache, tokens.to(device),
                                torch.tensor([len(i) for i in ids], device=device),
                                torch.arange(len(ids), device=device))
            two = logits[:, [self.yes, self.no]].float().softmax(dim=-1)[:, 0]
            out.extend(two.tolist())
        return out

    def __call__(self, prompt: str, candidate: Candidate) -> float:
        """A ``Scorer`` for ``ftlm.infer.strategies``: ``P(yes)`` of one candidate (memoised)."""
        key = (prompt, candidate.text)
        score = self._cache.get(key)
        if score is None:
            score = self.probabilities([key])[0]
            self._remember([(key, score)])
        return score

    def score_all(self, prompt: str, candidates: Sequence[Candidate]) -> None:
        """Score many candidates of one prompt in batches (fills the memo ``__call__`` reads)."""
        todo = list(dict.fromkeys((prompt, c.text) for c in candidates
                                  if (prompt, c.text) not in self._cache))
        self._remember(list(zip(todo, self.probabilities(todo))))

    def _remember(self, scored: list[tuple[tuple[str, str], float]]) -> None:
        if len(self._cache) + len(scored) > self.cache_limit:
            self._cache = {}
        self._cache.update(scored)
