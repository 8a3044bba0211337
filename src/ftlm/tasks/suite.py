"""Tasks, splits, the completion format and the exact checker.

Responsible for: the ``Task`` record, the deterministic train/held-out split of every problem
(``split_of``: a hash of the family and canonical key, so the two splits are disjoint by
construction and independent of any seed), seeded generation of ``n`` distinct tasks of one
split (``generate``), the completion format (``format_completion``), reading the final answer
out of a model's text (``extract_answer``) and the exact check (``check``).

Not responsible for: what a family's problems look like (``ftlm.tasks.families``), files
(``ftlm.tasks.files``), chat templates or tokenisation (the post-training commands wrap
``Task.prompt`` in their own template).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from ftlm.errors import ConfigError
from ftlm.tasks.families import FAMILY_TABLE

FAMILIES: tuple[str, ...] = tuple(FAMILY_TABLE)
SPLITS: tuple[str, ...] = ("train", "test")
HELDOUT_PERCENT = 10
"""Share of every family's problem space, by hash of the canonical key, that is held out."""

THINK_OPEN, THINK_CLOSE, ANSWER_PREFIX = "<think>", "</think>", "Answer:"
_ANSWER = re.compile(r"Answer:[ \t]*([^\n]*)")


@dataclass(frozen=True)
class Task:
    """One verifiable problem with its reference solution."""

    family: str
    """Name of the family (one of ``FAMILIES``)."""
    prompt: str
    """The question, without any chat template."""
    answer: str
    """The exact final answer in canonical form."""
    solution: str
    """Reference completion: worked reasoning and the final answer (``format_completion``)."""
    key: str
    """Canonical identity of the problem within its family; decides the split."""

    @property
    def split(self) -> str:
        """``"train"`` or ``"test"`` (the held-out split), a pure function of family and key."""
        return split_of(self.family, self.key)

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict) -> "Task":
        """Rebuild a task written by ``to_dict`` (or ``ftlm.tasks.files``); validates it."""
        missing = [f for f in ("family", "prompt", "answer", "solution", "key") if f not in row]
        if missing:
            raise ConfigError(f"task record lacks field(s) {', '.join(missing)}; "
                              "write task files with `ftlm tasks write`")
        family = row["family"]
        if family not in FAMILY_TABLE:
            raise ConfigError(f"task family {family!r} is unknown; valid: {', '.join(FAMILIES)}")
        return cls(**{f: str(row[f]) for f in ("family", "prompt", "answer", "solution", "key")})


def format_completion(reasoning: str, answer: str) -> str:
    """The completion format: ``<think>\\nREASONING\\n</think>\\nAnswer: ANSWER``."""
    return f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n{ANSWER_PREFIX} {answer}"


def split_of(family: str, key: str) -> str:
    """The split of a problem: held out (``"test"``) for ``HELDOUT_PERCENT`` % of keys."""
    digest = hashlib.sha256(f"{family}\x00{key}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT else "train"


def _check_families(families: Sequence[str]) -> tuple[str, ...]:
    if isinstance(families, str):
        families = [f.strip() for f in families.split(",") if f.strip()]
    families = tuple(families)
    if not families:
        raise ConfigError(f"no task family given; valid: {', '.join(FAMILIES)}")
    unknown = [f for f in families if f not in FAMILY_TABLE]
    if unknown:
        raise ConfigError(f"unknown task family {', '.join(map(repr, unknown))}; "
                          f"valid: {', '.join(FAMILIES)}")
    return families


def generate(families: Sequence[str] | str, split: str, n: int, seed: int) -> list[Task]:
    """``n`` distinct tasks of ``split``, the families taking turns (task ``i`` is of family
    ``families[i % len(families)]``).

    Deterministic in ``(families, split, n, seed)``; a larger ``n`` with the same seed extends
    the list it gave for a smaller one. Tasks are distinct by canonical key within a call.
    ``families`` may be a comma-separated string.
    """
    families = _check_families(families)
    if split not in SPLITS:
        raise ConfigError(f"split={split!r} is not a split; valid: {', '.join(SPLITS)}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ConfigError(f"n={n!r} must be a non-negative integer")
    # One independent stream per family, so adding a family does not change another's tasks.
    rngs = {f: random.Random(f"ftlm.tasks:{seed}:{split}:{f}") for f in families}
    seen: set[tuple[str, str]] = set()
    tasks: list[Task] = []
    for i in range(n):
        family = FAMILY_TABLE[families[i % len(families)]]
        for _ in range(10_000):
            problem = family.draw(rngs[family.name])
            if (family.name, problem.key) in seen or split_of(family.name, problem.key) != split:
                continue
            seen.add((family.name, problem.key))
            tasks.append(Task(family=family.name, prompt=problem.prompt, answer=problem.answer,
                              solution=format_completion("\n".join(problem.steps), problem.answer),
                              key=problem.key))
            break
        else:
            raise ConfigError(f"could not draw {n} distinct {split} tasks of family "
                              f"{family.name!r} (its problem space is too small); lower n")
    return tasks


def extract_answer(text: str) -> str | None:
    """The final answer in ``text``: what follows the last ``Answer:`` on its line.

    When the text has a ``</think>``, only the part after the last one counts (an ``Answer:``
    inside the reasoning is not final). ``None`` when there is no (non-empty) answer.
    """
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        text = text[close + len(THINK_CLOSE):]
    matches = _ANSWER.findall(text)
    if not matches:
        return None
    answer = matches[-1].strip()
    return answer or None


def check(task: Task, completion: str) -> bool:
    """Whether ``completion`` ends with the exact answer of ``task`` (in canonical form)."""
    answer = extract_answer(completion)
    if answer is None:
        return False
    return FAMILY_TABLE[task.family].normalise(answer) == task.answer


def reasoning_lines(text: str) -> list[str] | None:
    """The non-empty lines between the first ``<think>`` and the last ``</think>`` of ``text``,
    stripped; ``None`` when it has no such block."""
    start, close = text.find(THINK_OPEN), text.rfind(THINK_CLOSE)
    if start < 0 or close < start:
        return None
    body = text[start + len(THINK_OPEN):close]
    return [line.strip() for line in body.splitlines() if line.strip()]


def check_trace(task: Task, completion: str) -> bool:
    """``check`` and, besides, the reasoning equals the reference solution's line by line (up to
    surrounding whitespace): a right answer reached by a wrong trace (a guess, e.g. a remainder
    below 12) does not count."""
    return check(task, completion) and \
        reasoning_lines(completion) == reasoning_lines(task.solution)


VERIFIERS = {"answer": check, "trace": check_trace}
"""What counts as a correct completion, by name (``post.verify``)."""


def accuracy(tasks: Iterable[Task], completions: Iterable[str]) -> float:
    """Share of ``completions`` that pass ``check`` against the paired ``tasks``."""
    results = [check(t, c) for t, c in zip(tasks, completions, strict=True)]
    return sum(results) / len(results) if results else 0.0
