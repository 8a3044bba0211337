"""The offline demo dataset: corpus, tokenizer and packed samples built once and cached.

``ensure_demo_data(root)`` leaves in ``root``::

    corpus/            Python standard-library sources as .txt (``corpus.build_demo_corpus``)
    tokenizer.json     byte-level BPE trained on that corpus
    shard-*.parquet    packed samples, manifest.json (``prepare.prepare``)
    demo.json          the parameters it was built with (the cache key)

A second call with the same parameters returns at once. Concurrent callers (several groups
starting together) are serialised by a lock file, so the data is built exactly once.
This module does not decide where the demo lives (the CLI / config does).
"""

from __future__ import annotations

import fcntl
import json
import sys
import time
from pathlib import Path

from ftlm.data.corpus import build_demo_corpus
from ftlm.data.prepare import MANIFEST, TOKENIZER_FILE, prepare
from ftlm.data.tokenizer import train_tokenizer
from ftlm.errors import DataError

_PARAMS_FILE = "demo.json"
_LOCK_TIMEOUT_S = 600.0  # a build takes about a minute; a holder past this is presumed stuck


def ensure_demo_data(root: Path, seq_len: int = 256, vocab_size: int = 4096,
                     max_bytes: int = 8_000_000, progress: bool = True) -> Path:
    """Build the demo dataset in ``root`` unless an identical one is there; return ``root``."""
    root = Path(root)
    params = {"seq_len": seq_len, "vocab_size": vocab_size, "max_bytes": max_bytes}
    if _is_built(root, params):
        return root
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        _acquire(lock, root)
        try:
            if _is_built(root, params):  # another process built it while we waited
                return root
            _build(root, params, progress)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return root


def _is_built(root: Path, params: dict) -> bool:
    try:
        manifest = json.loads((root / MANIFEST).read_text())
        built = json.loads((root / _PARAMS_FILE).read_text())
    except (OSError, ValueError):
        return False
    return built == params and manifest.get("seq_len") == params["seq_len"]


def _acquire(lock, root: Path) -> None:
    deadline = time.monotonic() + _LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise DataError(f"{root}/.lock has been held for {_LOCK_TIMEOUT_S:.0f} s by "
                                f"another build; stop it or delete {root} and retry") from None
            time.sleep(0.2)  # polling a file lock; no event to wait on


def _build(root: Path, params: dict, progress: bool) -> None:
    def say(msg: str) -> None:
        if progress:
            print(f"[demo data] {msg}", file=sys.stderr, flush=True)

    (root / _PARAMS_FILE).unlink(missing_ok=True)
    t0 = time.perf_counter()
    corpus = build_demo_corpus(root / "corpus", max_bytes=params["max_bytes"])
    say(f"corpus: Python stdlib sources, {params['max_bytes'] / 1e6:.1f} MB cap -> {corpus}")
    tok = train_tokenizer([corpus], root / TOKENIZER_FILE, vocab_size=params["vocab_size"])
    say(f"tokenizer: byte-level BPE, vocab {tok.vocab_size} ({time.perf_counter() - t0:.1f} s)")
    manifest = prepare(corpus, root, root / TOKENIZER_FILE, params["seq_len"], progress=progress)
    say(f"prepared {manifest['num_samples']} samples of {params['seq_len'] + 1} tokens "
        f"({manifest['tokens']} tokens) in {time.perf_counter() - t0:.1f} s")
    (root / _PARAMS_FILE).write_text(json.dumps(params) + "\n")
