"""Text out of generated tokens: cutting at stop strings and streaming safe deltas.

Responsible for: ``cut_at_stop`` (the completion text up to the first stop string) and
``TextStream``, which turns a growing list of token ids into text deltas that never need taking
back: it holds back a trailing partial UTF-8 character (decoded as U+FFFD) and any tail that could
still become a stop string.

Not responsible for: tokenisation (a ``detokenize`` callable is passed in) or deciding when a
sequence stops (``ftlm.infer.engine``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``(text before the earliest stop string, whether one was found)``."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return hold


class TextStream:
    """Incremental text of one completion, emitted only once it is final."""

    def __init__(self, detokenize: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self.detokenize = detokenize
        self.stops = tuple(stops)
        self.sent = ""

    def update(self, tokens: list[int], final: bool = False) -> str:
        """The new text since the last call (all remaining text when ``final``)."""
        text, stopped = cut_at_stop(self.detokenize(tokens), self.stops)
        if not final and not stopped:
            if text.endswith("\ufffd"):  # a multi-byte character still arriving
                text = text.rstrip("\ufffd")
            text = text[:len(text) - _held_back(text, self.stops)]
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta = text[len(self.sent):]
        self.sent = text
        return delta

    @property
    def text(self) -> str:
        return self.sent
