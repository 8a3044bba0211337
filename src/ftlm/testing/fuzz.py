"""Turn one fuzzer-provided byte string into structured choices (as libFuzzer's FuzzedDataProvider).

Property tests draw a single ``hypothesis`` binary per example and decode it here: a hypothesis
draw per choice costs several times more, and shrinking the bytes still shrinks the decoded input.
Reading past the end yields zeros, i.e. the first entry of every menu, so short inputs decode to
small, simple values.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Sequence

DEFAULT_ALPHABET: tuple[str, ...] = tuple("abcxyz019 .=,-+_/e:[]\"'\\") + (
    "\0", "\n", "\t", "\u00e9", "\udcff", "\ud800", "\U0001f642", "\u2028", "\x7f")
"""Characters that break parsers: separators, quotes, control characters, lone surrogates."""
DEFAULT_NUMBERS: tuple[int | float, ...] = (
    0, 1, -1, 2, 0.5, 1e-8, 2**31, 2**53, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**400, -(10**400),
    math.inf, -math.inf, math.nan, 1e308, 5e-324, -0.0)
"""Numbers at the edges of int64, float64 and JSON's exact integers."""


class Choices:
    """Reads choices from ``data``; ``alphabet`` and ``numbers`` are the menus of ``text``/``number``."""

    def __init__(self, data: bytes, alphabet: Sequence[str] = DEFAULT_ALPHABET,
                 numbers: Sequence[int | float] = DEFAULT_NUMBERS) -> None:
        self.data, self.pos = data, 0
        self.alphabet, self.numbers = alphabet, numbers

    def byte(self) -> int:
        value = self.data[self.pos] if self.pos < len(self.data) else 0
        self.pos += 1
        return value

    def below(self, n: int) -> int:
        """A number in ``[0, n)`` (two bytes for menus longer than 256)."""
        value = self.byte() if n <= 256 else (self.byte() << 8) | self.byte()
        return value % n

    def pick(self, menu: Sequence[Any]) -> Any:
        return menu[self.below(len(menu))]

    def raw(self, n: int) -> bytes:
        return bytes(self.byte() for _ in range(n))

    def text(self, max_size: int) -> str:
        return "".join(self.pick(self.alphabet) for _ in range(self.below(max_size + 1)))

    def number(self) -> int | float:
        """An edge number, a random int32, any float64 bit pattern (NaN and inf included), or a
        small ordinary fraction."""
        kind = self.below(4)
        if kind == 0:
            return self.pick(self.numbers)
        if kind == 1:
            return int.from_bytes(self.raw(4), "little", signed=True)
        if kind == 2:
            return struct.unpack("<d", self.raw(8))[0]
        return self.below(200) / 8
