"""A line-by-line verifier: a (small) ftlm model that answers "is this line right? yes/no".

Responsible for:

* the verification conversation (``verification_messages``): the task and the first line of a
  proposed completion in the first user turn, each later line in a user turn of its own, and after
  every line an assistant turn holding its verdict (``yes``/``no``), in the chat template of
  ``ftlm.data.chat``. ``ftlm sft`` learns only the assistant turns, so one conversation carries a
  label for every line (a process label) and its last line's label is the outcome: dense labels,
  each read right after the line it judges;
* training data for it from the task suite (``verifier_records`` / ``write_verifier_data``): for
  each task its reference solution (every line ``yes``) and solutions whose final answer was
  changed to a wrong one (checked wrong with ``ftlm.tasks.check``: the answer line ``no``), as
  ``messages`` JSONL that ``ftlm sft`` trains on (``ftlm verifier data`` without ``--policy``);
* scoring (``Verifier``): one forward pass over the conversation with every verdict ``yes``
  (teacher forcing), reading ``P(yes) / (P(yes) + P(no))`` before each verdict; a completion's
  score is the smallest of them (``REDUCE``: or their product, or the answer line's). A partial
  solution is scored the same way, which is how step-level beam search (``ftlm.infer.search``)
  uses a verifier as its process scorer.

Labelled samples of a policy (the data ``ftlm verifier train`` uses) are
``ftlm.infer.verifier_data``.

Not responsible for: training (``ftlm verifier train`` runs ``ftlm sft``), beam search, or the
scaling study (``bench/test_time_scaling.py``).
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from ftlm.data.tokenizer import Tokenizer
from ftlm.errors import ConfigError
from ftlm.infer.strategies import Candidate
from ftlm.model.llama import Transformer
from ftlm.data.chat import render
from ftlm.tasks import Task, check, format_completion

INTRO = "Check the proposed solution line by line: is each line right? Reply yes or no."
YES, NO = "yes", "no"
REDUCE = {"min": min, "product": math.prod, "last": lambda lines: lines[-1]}
"""How a completion's score is made of its lines' ``P(yes)``: its weakest line (the default:
one wrong step sinks it, and a short reply gains nothing from having fewer lines, which it does
under the product), the probability that every line is right, or the answer line's alone."""


def solution_lines(completion: str) -> list[str]:
    """The lines a verifier judges: the non-blank lines of ``completion`` (at least one)."""
    return [line for line in completion.split("\n") if line.strip()] or [""]


def verification_messages(prompt: str, completion: str,
                          verdicts: Sequence[str] | None = None) -> list[dict[str, str]]:
    """The conversation that asks about every line of ``completion`` of ``prompt``.

    ``verdicts`` (one ``yes``/``no`` per line of ``solution_lines``) fill the assistant turns;
    ``None`` fills them with ``yes`` (how the ``Verifier`` reads a completion).
    """
    lines = solution_lines(completion)
    verdicts = [YES] * len(lines) if verdicts is None else list(verdicts)
    if len(verdicts) != len(lines) or not set(verdicts) <= {YES, NO}:
        raise ConfigError(f"{len(verdicts)} verdicts {verdicts[:4]} for {len(lines)} lines: give "
                          f"one '{YES}' or '{NO}' per non-blank line")
    messages = []
    for i, (line, verdict) in enumerate(zip(lines, verdicts)):
        content = f"{prompt}\n\n{INTRO}\n{line}" if i == 0 else line
        messages += [{"role": "user", "content": content},
                     {"role": "assistant", "content": verdict}]
    return messages


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
    """Labelled conversations: each reference solution, and ``wrong_per_task`` wrong ones.

    A wrong solution keeps the reference reasoning (its lines ``yes``) and changes the final
    answer (that line ``no``), so the verifier must read the answer against the work.
    """
    if not isinstance(wrong_per_task, int) or wrong_per_task < 1:
        raise ConfigError(f"wrong_per_task={wrong_per_task!r} must be an integer >= 1")
    rng = random.Random(seed)
    records = []
    for task in tasks:
        reasoning = task.solution.rsplit("Answer:", 1)[0]
        n = len(solution_lines(task.solution))
        labelled = [(task.solution, [YES] * n, YES)]
        labelled += [(reasoning + "Answer: " + _wrong_answer(task, rng), [YES] * (n - 1) + [NO], NO)
                     for _ in range(wrong_per_task)]
        for completion, verdicts, label in labelled:
            records.append({"messages": verification_messages(task.prompt, completion, verdicts),
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


class MemoScorer:
    """A ``Scorer`` over a batched ``probabilities(pairs)``, memoised by ``(prompt, text)``.

    Subclasses give ``probabilities``; the strategies call the scorer one candidate at a time,
    ``score_all`` fills the memo for a prompt's candidates in batches first.
    """

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str], float] = {}
        self.cache_limit = 100_000
        """Memoised scores kept; the memo is emptied beyond it (a server runs for long)."""

    def probabilities(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        raise NotImplementedError

    def __call__(self, prompt: str, candidate: Candidate) -> float:
        """A ``Scorer`` for ``ftlm.infer.strategies``: the score of one candidate (memoised)."""
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


class Verifier(MemoScorer):
    """Scores candidates with a verifier model: its per-line ``P(yes)`` reduced, in [0, 1]."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, batch: int = 16,
                 reduce: str = "min") -> None:
        if reduce not in REDUCE:
            raise ConfigError(f"reduce={reduce!r}: a verifier reduces its per-line P(yes) by one "
                              f"of {', '.join(REDUCE)}")
        self.reduce = REDUCE[reduce]
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch = batch
        # The first token of a verdict decides it (one token each in ftlm's tokenizers).
        self.yes, self.no = tokenizer.encode(YES)[0], tokenizer.encode(NO)[0]
        if self.yes == self.no:
            raise ConfigError(f"the tokenizer starts '{YES}' and '{NO}' with the same token")
        self._cue = tokenizer.token_id("<|assistant|>")
        super().__init__()

    def token_ids(self, prompt: str, completion: str) -> list[int]:
        """The tokens the verifier reads for ``completion`` (its cost), cut to its context."""
        ids, _ = render(self.tokenizer, verification_messages(prompt, completion))
        return ids[-self.model.cfg.max_seq_len:]

    @torch.no_grad()
    def line_probabilities(self, pairs: Sequence[tuple[str, str]]) -> list[list[float]]:
        """``P(yes)`` of every line (``solution_lines``) of each ``(prompt, completion)``.

        A conversation longer than the model's context keeps its end: the verdicts of the lines
        cut off are left out.
        """
        out: list[list[float]] = []
        device = self.model.tok_embeddings.weight.device
        for start in range(0, len(pairs), self.batch):
            ids = [self.token_ids(p, c) for p, c in pairs[start:start + self.batch]]
            tokens = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.long)
            for row, i in enumerate(ids):
                tokens[row, :len(i)] = torch.tensor(i)
            # Causal attention: the right padding never reaches a real position's logits.
            logits = self.model(tokens.to(device))
            for row, i in enumerate(ids):
                # The verdict follows each <|assistant|> cue; the cue's logits predict it.
                cues = [t for t in range(len(i) - 1) if i[t] == self._cue]
                two = logits[row, cues][:, [self.yes, self.no]].float().softmax(dim=-1)[:, 0]
                out.append(two.tolist())
        return out

    def probabilities(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """The score of each ``(prompt, completion)``: its lines' ``P(yes)`` reduced (``REDUCE``)."""
        return [self.reduce(lines) for lines in self.line_probabilities(pairs)]
