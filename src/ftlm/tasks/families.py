"""The task families: how each draws a problem, words it, solves it with a worked trace, and reads
an answer back.

Responsible for: per family, a ``draw(rng)`` that returns a ``Problem`` (its canonical key, the
question, the exact answer and the reasoning steps of a reference solution) and a ``normalise``
that maps an answer string to its canonical form (``None`` when it does not parse), so checking
is an exact comparison of canonical forms.

Not responsible for: splits, de-duplication, the completion format or files (``ftlm.tasks.suite``
and ``ftlm.tasks.files``). Problems are kept small on purpose (a few digits, short lists, short
words) so that a tiny model trained on a CPU can learn them.

The canonical key identifies a problem up to the symmetries that leave its answer unchanged
(``3 + 5`` and ``5 + 3``; every ordering of the same list to sort), so that the split, which the
key decides, never puts one form in training and the other in the held-out set.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

_INT = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class Problem:
    """One drawn problem, before it is turned into a ``Task``."""

    key: str
    """Canonical identity of the problem (decides its split)."""
    prompt: str
    """The question as the model sees it."""
    answer: str
    """The exact answer in canonical form."""
    steps: tuple[str, ...]
    """Lines of the reference reasoning, in order."""


def normalise_int(text: str) -> str | None:
    """Canonical form of an integer answer (``"042"`` -> ``"42"``), ``None`` if it is not one."""
    text = text.strip().rstrip(".")
    if not _INT.fullmatch(text):
        return None
    return str(int(text))


def normalise_int_list(text: str) -> str | None:
    """Canonical form of a list of integers separated by commas and/or spaces, else ``None``."""
    text = text.strip().rstrip(".").strip("[]")
    parts = [p for p in re.split(r"[,\s]+", text) if p]
    if not parts or not all(_INT.fullmatch(p) for p in parts):
        return None
    return ", ".join(str(int(p)) for p in parts)


def draw_add(rng: random.Random) -> Problem:
    """Multi-digit addition of two numbers of 2-3 digits, solved column by column with carries."""
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    total = a + b
    steps = []
    carry = 0
    da, db = str(a)[::-1], str(b)[::-1]
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}+{carry}={s}, write {s % 10}, carry {s // 10}")
        carry = s // 10
    if carry:
        steps.append(f"write {carry}")
    return Problem(key=f"{min(a, b)}+{max(a, b)}", prompt=f"What is {a} + {b}?",
                   answer=str(total), steps=tuple(steps))


def draw_mod(rng: random.Random) -> Problem:
    """Remainder of a number of 2-3 digits divided by 2..12, via the quotient and a product."""
    a, m = rng.randint(10, 999), rng.randint(2, 12)
    q = a // m
    steps = (f"{a} // {m} = {q}", f"{q} * {m} = {q * m}", f"{a} - {q * m} = {a - q * m}")
    return Problem(key=f"{a}%{m}", prompt=f"What is {a} mod {m}?", answer=str(a % m), steps=steps)


def draw_sort(rng: random.Random) -> Problem:
    """Sort 3-5 numbers below 100 ascending, by repeatedly taking the smallest."""
    values = [rng.randint(0, 99) for _ in range(rng.randint(3, 5))]
    remaining = list(values)
    steps = []
    while len(remaining) > 1:
        smallest = min(remaining)
        steps.append(f"smallest of {', '.join(map(str, remaining))} is {smallest}")
        remaining.remove(smallest)
    steps.append(f"last is {remaining[0]}")
    answer = ", ".join(map(str, sorted(values)))
    return Problem(key=answer, prompt=f"Sort ascending: {', '.join(map(str, values))}",
                   answer=answer, steps=tuple(steps))


_LETTERS = "abcdefgh"


def draw_count(rng: random.Random) -> Problem:
    """Count one letter in a word of 4-8 letters from a-h (spelled out), keeping a running count."""
    word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(4, 8)))
    # Mostly a letter that occurs (so counts above zero are common), sometimes any letter.
    letter = rng.choice(word) if rng.random() < 0.8 else rng.choice(_LETTERS)
    count = 0
    running = []
    for ch in word:
        count += ch == letter
        running.append(f"{ch}:{count}")
    # The word is spelled with spaces: a BPE tokenizer then gives one token per letter, as in the
    # trace (written together, "chgbaeff" becomes " ch", "g", "b", "ae", "ff", and a small model
    # cannot see the letters it must count).
    return Problem(key=f"{letter}@{word}", prompt=f"How many {letter} in {' '.join(word)}?",
                   answer=str(count), steps=(" ".join(running),))


@dataclass(frozen=True)
class Family:
    """A task family: how to draw a problem and how to read its answers."""

    name: str
    """Short name used in files, configs and reports."""
    draw: Callable[[random.Random], Problem]
    """Draws one problem from a seeded ``random.Random``."""
    normalise: Callable[[str], str | None]
    """Canonical form of an answer string, ``None`` when it does not parse."""
    description: str
    """One line for ``ftlm tasks list``."""


FAMILY_TABLE: dict[str, Family] = {
    f.name: f for f in (
        Family("add", draw_add, normalise_int, "a + b, 2-3 digit numbers, column addition trace"),
        Family("mod", draw_mod, normalise_int, "a mod m, a of 2-3 digits, m in 2..12"),
        Family("sort", draw_sort, normalise_int_list, "sort 3-5 numbers below 100 ascending"),
        Family("count", draw_count, normalise_int, "count a letter in a 4-8 letter word over a-h"),
    )
}
