"""Turn a text corpus into packed token samples in Parquet shards (``ftlm data prepare``).

Packing: every document becomes ``BOS + tokens + EOS`` (BOS tells the model a document starts,
which is also how generation is prompted; EOS teaches it to stop). Documents are concatenated in
input order and the stream is cut into consecutive, non-overlapping samples of ``seq_len + 1``
tokens (the trainer uses ``inputs = s[:-1]``, ``targets = s[1:]``); the ragged tail shorter than
one sample is dropped. Samples therefore cross document boundaries, as in GPT-style pretraining.

Output folder::

    shard-00000.parquet ...   one column ``tokens``: fixed_size_list<int32>[seq_len + 1]
    tokenizer.json            copy of the tokenizer used
    manifest.json             written last and atomically; its presence means "complete"

The input is checked before anything is written (a missing path, an unsupported type or a folder
without ``.txt`` files creates no output folder), and a run that fails midway removes the folder
it created, or, in a folder that existed, the manifest and shards it was writing.

Tokenisation uses ``Tokenizer.encode_batch`` by default (``workers=0``): the Rust side already
runs on all cores and releases the GIL. ``workers > 1`` uses a pool of forked processes, each
encoding single-threaded, so that reading and packing in Python overlap with tokenisation. On a
shared 2-core machine the two were within noise of each other (8 MB stdlib corpus, seq_len 256:
median 6.3 s vs 6.0 s over three runs), so the default avoids the extra processes; the pool is for
many-core machines where the Python side becomes the bottleneck.

This module does not read training batches (``loader``), check manifests (``manifest``) or train
the tokenizer (``tokenizer``).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from ftlm.data.corpus import check_input, count_documents, iter_documents
from ftlm.data.manifest import FORMAT_VERSION, MANIFEST
from ftlm.data.tokenizer import Tokenizer
from ftlm.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
_DOCS_PER_BATCH = 256  # documents per encode_batch call: large enough to keep all cores busy


def prepare(input: Path, out_dir: Path, tokenizer: Path, seq_len: int, text_field: str = "text",
            column: str = "text", rows_per_shard: int = 8192, workers: int = 0,
            progress: bool = True) -> dict:
    """Tokenise and pack ``input`` into ``out_dir``; return the manifest (see module docstring)."""
    input, out_dir = Path(input), Path(out_dir)
    if not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"seq_len={seq_len!r} must be a positive integer")
    if not isinstance(rows_per_shard, int) or rows_per_shard < 1:
        raise DataError(f"rows_per_shard={rows_per_shard!r} must be a positive integer")
    check_input(input)  # before anything is created: an empty folder leaves no trace
    tok = Tokenizer.load(Path(tokenizer))
    created = not out_dir.exists()
    if not created and not out_dir.is_dir():
        raise DataError(f"output {out_dir} exists and is not a folder; choose a folder for --out")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create output folder {out_dir} ({e.strerror or e}); choose a "
                        "writable folder for --out") from None
    try:
        return _prepare(input, out_dir, tok, seq_len, text_field, column, rows_per_shard,
                        workers, progress)
    except BaseException:
        # A failed run leaves no half-written data: a folder it made goes, a folder that was
        # already there loses only what prepare writes (manifest, shards).
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        else:
            _clear_previous_output(out_dir)
        raise


def _prepare(input: Path, out_dir: Path, tok: Tokenizer, seq_len: int, text_field: str,
             column: str, rows_per_shard: int, workers: int, progress: bool) -> dict:
    width = seq_len + 1
    _clear_previous_output(out_dir)
    bar = tqdm(total=count_documents(input, column=column), unit="doc", file=sys.stderr,
               disable=not progress, desc=f"prepare {input.name}")
    docs = _counted(iter_documents(input, text_field=text_field, column=column), bar)
    writer = _ShardWriter(out_dir, width, rows_per_shard)
    pending = np.empty(0, dtype=np.int32)
    n_docs = n_tokens = 0
    try:
        for batch in _encoded_batches(docs, tok, workers):
            n_docs += len(batch)
            stream = [pending]
            for ids in batch:
                stream.append(np.array([tok.bos_id, *ids, tok.eos_id], dtype=np.int32))
            pending = np.concatenate(stream)
            n_tokens += len(pending) - len(stream[0])
            full = len(pending) // width * width
            writer.add(pending[:full].reshape(-1, width))
            pending = pending[full:]
        shards = writer.finish()
    finally:
        bar.close()
    if n_docs == 0:
        raise DataError(f"no documents found in {input}; it holds no non-empty text")
    if writer.rows == 0:
        raise DataError(f"corpus {input} is too small: its {n_docs} document(s) gave {n_tokens} "
                        f"tokens (with BOS/EOS), but one sample needs seq_len + 1 = {width}; "
                        f"add text or lower seq_len")

    tok_copy = out_dir / TOKENIZER_FILE
    if not (tok_copy.exists() and tok_copy.samefile(tok.path)):
        shutil.copyfile(tok.path, tok_copy)
    manifest = {
        "format_version": FORMAT_VERSION,
        "num_samples": writer.rows,
        "seq_len": seq_len,
        "tokenizer_fingerprint": tok.fingerprint,
        "vocab_size": tok.vocab_size,
        "source": str(input.resolve()),
        "documents": n_docs,
        "tokens": n_tokens,
        "packing": "bos+doc+eos",
        "shards": shards,
        "created_at": time.time(),
    }
    _write_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def _clear_previous_output(out_dir: Path) -> None:
    # The manifest goes first: from now until the new one is written the folder reads as
    # "not prepared", never as a valid manifest pointing at half-rewritten shards.
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for pattern in ("shard-*.parquet", "shard-*.parquet.tmp"):
        for old in out_dir.glob(pattern):
            old.unlink()


def _counted(docs: Iterator[str], bar: tqdm) -> Iterator[str]:
    for doc in docs:
        bar.update(1)
        yield doc


def _encoded_batches(docs: Iterator[str], tok: Tokenizer,
                     workers: int) -> Iterator[list[list[int]]]:
    """Token ids of the non-empty documents, in input order, a batch of documents at a time."""
    texts = _chunks((d for d in docs if d), _DOCS_PER_BATCH)
    if workers <= 1:
        for chunk in texts:
            yield tok.encode_batch(chunk)
        return
    # fork, not spawn: spawn re-imports __main__, which fails for `python -` and notebooks and
    # then restarts dying workers forever. The Rust thread pool is not inherited by forked
    # children; tokenizers detects the fork and encodes single-threaded there, which is what a
    # pool of processes wants anyway.
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(workers, initializer=_worker_init, initargs=(str(tok.path),)) as pool:
        yield from pool.imap(_worker_encode, texts)


def _chunks(items: Iterator[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


_worker_tok: Tokenizer | None = None


def _worker_init(path: str) -> None:
    global _worker_tok
    _worker_tok = Tokenizer.load(Path(path))


def _worker_encode(texts: list[str]) -> list[list[int]]:
    assert _worker_tok is not None, "pool initializer did not run"
    return _worker_tok.encode_batch(texts)


class _ShardWriter:
    """Accumulates packed rows and writes them as Parquet shards of ``rows_per_shard`` rows."""

    def __init__(self, out_dir: Path, width: int, rows_per_shard: int) -> None:
        self.out_dir, self.width, self.rows_per_shard = out_dir, width, rows_per_shard
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.rows = 0
        self.shards: list[dict] = []

    def add(self, rows: np.ndarray) -> None:
        if len(rows):
            self.buffer.append(rows)
            self.buffered += len(rows)
        while self.buffered >= self.rows_per_shard:
            block = np.concatenate(self.buffer)
            self._write(block[: self.rows_per_shard])
            rest = block[self.rows_per_shard:]
            self.buffer, self.buffered = ([rest], len(rest)) if len(rest) else ([], 0)

    def finish(self) -> list[dict]:
        if self.buffered:
            self._write(np.concatenate(self.buffer))
            self.buffer, self.buffered = [], 0
        return self.shards

    def _write(self, rows: np.ndarray) -> None:
        name = f"shard-{len(self.shards):05d}.parquet"
        values = pa.array(rows.reshape(-1), type=pa.int32())
        table = pa.table({"tokens": pa.FixedSizeListArray.from_arrays(values, self.width)})
        tmp = self.out_dir / (name + ".tmp")
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, self.out_dir / name)
        digest = sha256_file(self.out_dir / name)
        self.shards.append({"file": name, "rows": len(rows), "sha256": digest})
        self.rows += len(rows)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
