"""Byte-level BPE tokenizer: training it and using it.

Byte-level means the text is first mapped to its UTF-8 bytes, and every one of the 256 bytes is in
the base vocabulary, so any string (emoji, combining marks, NUL, CJK, lone newlines) encodes
without an unknown token and ``decode(encode(s)) == s`` exactly. No normaliser is applied.

Special tokens have fixed ids 0..6 in the order of :data:`SPECIAL_TOKENS`. ``encode`` never adds
them and never produces them from text: a document that happens to contain the string
``"<|eos|>"`` is encoded as ordinary bytes, so user text cannot forge document or role boundaries.
Callers insert special tokens by id (:meth:`Tokenizer.token_id`).

This module does not read corpora (``corpus``) or pack token streams (``prepare``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from ftlm.data.corpus import iter_documents
from ftlm.errors import ConfigError, DataError

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>",
                  "<|end|>"]
_MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


class Tokenizer:
    """A trained byte-level BPE tokenizer (wraps ``tokenizers.Tokenizer``)."""

    def __init__(self, inner: tokenizers.Tokenizer, path: Path | None = None) -> None:
        self._inner = inner
        self.path = path
        # Text is never matched against special tokens (see the module docstring).
        self._inner.encode_special_tokens = True
        missing = [t for t in SPECIAL_TOKENS if inner.token_to_id(t) is None]
        if missing:
            where = f"tokenizer {path}" if path else "tokenizer"
            raise DataError(f"{where} lacks the special tokens {missing}; train one with "
                            f"`ftlm tokenizer train`")
        self._special = {t: inner.token_to_id(t) for t in SPECIAL_TOKENS}
        self._fingerprint: str | None = None

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        """Load a ``tokenizer.json`` written by :meth:`save` or :func:`train_tokenizer`."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer file {path} does not exist; train one with "
                            f"`ftlm tokenizer train` or point data.tokenizer at tokenizer.json")
        try:
            inner = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for any parse error
            raise DataError(f"cannot read tokenizer file {path} ({e}); re-train it with "
                            f"`ftlm tokenizer train`") from e
        return cls(inner, path)

    def save(self, path: Path) -> None:
        """Write ``tokenizer.json`` atomically (a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        self._inner.save(str(tmp))
        os.replace(tmp, path)
        self.path = path

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens are added."""
        return self._inner.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many texts; runs in parallel on Rust threads (releases the GIL)."""
        return [e.ids for e in self._inner.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens come out as their literal strings, or not at all with
        ``skip_special_tokens``."""
        return self._inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._inner.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int:
        return self._special["<|bos|>"]

    @property
    def eos_id(self) -> int:
        return self._special["<|eos|>"]

    @property
    def pad_id(self) -> int:
        return self._special["<|pad|>"]

    def token_id(self, special: str) -> int:
        """Id of one of :data:`SPECIAL_TOKENS`."""
        if special not in self._special:
            raise KeyError(f"{special!r} is not a special token; known: {SPECIAL_TOKENS}")
        return self._special[special]

    @property
    def fingerprint(self) -> str:
        """sha256 of a canonical JSON form: equal for equal tokenizers, across save/load."""
        if self._fingerprint is None:
            canonical = json.dumps(json.loads(self._inner.to_str()), sort_keys=True,
                                   separators=(",", ":"), ensure_ascii=True)
            self._fingerprint = hashlib.sha256(canonical.encode("ascii")).hexdigest()
        return self._fingerprint


def train_tokenizer(inputs: list[Path], out: Path, vocab_size: int = 4096,
                    text_field: str = "text", column: str = "text",
                    min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``inputs`` and save it to ``out`` (tokenizer.json).

    Each input is anything :func:`ftlm.data.corpus.iter_documents` reads; documents are streamed
    to the trainer. ``out`` may be a folder, in which case ``out/tokenizer.json`` is written. The
    vocabulary can come out smaller than ``vocab_size`` when the corpus has too few distinct pairs.
    """
    if not isinstance(vocab_size, int) or vocab_size < _MIN_VOCAB:
        raise ConfigError(f"vocab_size={vocab_size!r} must be an integer >= {_MIN_VOCAB} "
                          f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    if not inputs:
        raise DataError("no tokenizer training input given; pass at least one corpus path")
    out = Path(out)
    if out.is_dir():
        out = out / "tokenizer.json"
    seen = {"documents": 0}

    def documents() -> Iterator[str]:
        for path in inputs:
            for doc in iter_documents(Path(path), text_field=text_field, column=column):
                if doc:
                    seen["documents"] += 1
                    yield doc

    inner = tokenizers.Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    inner.train_from_iterator(documents(), trainer=trainer)
    if seen["documents"] == 0:
        raise DataError(f"no text found in {[str(p) for p in inputs]}; the tokenizer needs a "
                        f"non-empty corpus")
    tok = Tokenizer(inner)
    tok.save(out)
    return tok
