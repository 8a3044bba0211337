"""Post-training data: files and the task suite -> fixed-shape int64 rows for the loader.

The trainer's loader hands rows out by global position (the exactly-once cursor); it only needs
``__len__`` and ``samples(indices)`` of fixed-shape rows (``ftlm.train.objective``). Three kinds:

* **SFT** rows ``[3, seq_len + 1]``: tokens, learn mask, document ids. Conversations (chat
  template, ``ftlm.data.chat``) are packed in file order into rows, next-fit: a conversation that
  does not fit in what is left of a row starts the next one; the rest is ``<|pad|>`` with mask 0
  and a document id of its own. Every conversation lies in exactly one row, so the cursor over
  rows is a cursor over examples.
* **Preference** rows ``[4, seq_len + 1]``: chosen tokens, chosen mask, rejected tokens, rejected
  mask; one pair per row, right-padded (causal attention never looks at the padding).
* **Prompt** rows ``[1]``: the index of a task in the run's task list (training tasks first, then
  the held-out ones), from which GRPO builds the prompt and checks the answer.

Files are ``.jsonl`` or ``.parquet``. Instruction records hold ``messages`` (a list of
``{role, content}``) or ``prompt`` and ``completion`` strings (what ``ftlm tasks write`` writes).
Preference records hold ``prompt``, ``chosen`` and ``rejected`` strings, or ``chosen`` and
``rejected`` message lists (whole conversations).

Not responsible for: tokenizer training, the objectives, sampling.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ftlm.data.corpus import require_utf8
from ftlm.data.tokenizer import Tokenizer
from ftlm.errors import DataError
from ftlm.data.chat import completion_ids, prompt_ids, render
from ftlm.tasks import Task, generate, read_tasks
from ftlm.tasks.files import task_record

SUFFIXES = (".jsonl", ".parquet")


class Rows:
    """A ``SampleSource`` over an in-memory array of rows ``[n, ...]``."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = np.ascontiguousarray(rows, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def samples(self, indices) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample indices must lie in [0, {len(self)})")
        return self.rows[idx]


MAX_LINE_BYTES = 16 << 20
"""Longest JSONL line read (16 MiB, far more text than any context holds): a longer one is
refused by its length, before it is parsed or tokenised."""
MESSAGE_LISTS = ("messages", "chosen", "rejected")
"""Fields that, when they are lists, hold ``{role, content}`` messages."""


def read_records(path: Path, what: str) -> list[dict]:
    """The records of a ``.jsonl`` or ``.parquet`` file, as dicts.

    Every record is checked as it is read, so a bad one is a one-line ``DataError`` naming
    ``file:line`` (Parquet: the row): bytes that are not UTF-8, JSON that is not an object,
    nests too deeply or holds a number Python will not read (over 4,300 digits), a line over
    ``MAX_LINE_BYTES``, a string with a lone surrogate (a ``\\ud800`` escape; the tokenizer
    cannot encode it), or a ``messages`` / ``chosen`` / ``rejected`` list whose items are not
    ``{role, content}`` objects with string values.
    """
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise DataError(f"{what} file {path} must end in .jsonl or .parquet")
    if not path.is_file():
        raise DataError(f"{what} file {path} not found; check post.data / post.heldout")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            records = pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a corrupt file
            raise DataError(f"{path}: not a readable Parquet file ({e})") from None
        for number, record in enumerate(records, 1):
            _check_record(record, f"{path} row {number}")
    else:
        records = list(_jsonl_records(path))
    if not records:
        raise DataError(f"{what} file {path} holds no records")
    return records


def _jsonl_records(path: Path):
    with open(path, "rb") as f:
        number = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            number += 1
            where = f"{path}:{number}"
            if len(raw) > MAX_LINE_BYTES:
                raise DataError(f"{where}: the line is longer than {MAX_LINE_BYTES} bytes; "
                                "one record per line, each shorter (split long documents)")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                f"{e.start + 1}); re-save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except RecursionError:
                raise DataError(f"{where}: the JSON nests too deeply; a record is an object of "
                                "strings and message lists") from None
            except ValueError as e:  # JSONDecodeError, and a number of over 4,300 digits
                raise DataError(f"{where}: not JSON ({' '.join(str(e).split())[:160]}); write "
                                "one JSON object per line") from None
            _check_record(record, where)
            yield record


def _check_record(record: object, where: str) -> None:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got "
                        f"{type(record).__name__}")
    _check_text(record, where, "")
    for name in MESSAGE_LISTS:
        value = record.get(name)
        if not isinstance(value, list):
            continue
        for i, m in enumerate(value):
            if (not isinstance(m, dict) or not isinstance(m.get("role"), str)
                    or not isinstance(m.get("content"), str)):
                raise DataError(f"{where}: {name}[{i}] must be an object {{\"role\": ..., "
                                f"\"content\": ...}} with string values, got "
                                f"{json.dumps(m)[:60]}")


def _check_text(value: object, where: str, field: str) -> None:
    """Refuse a lone surrogate anywhere in ``value`` (depth is bounded by the JSON parser)."""
    if isinstance(value, str):
        require_utf8(value, f"{where}: {field or 'a string'}")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, where, "a field name")
            _check_text(item, where, f"{field}.{key}" if field else str(key)[:40])
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, where, f"{field}[{i}]")


def conversation(record: dict, where: str) -> list[dict]:
    """The messages of an instruction record (``messages``, or ``prompt`` + ``completion``)."""
    if isinstance(record.get("messages"), list):
        return record["messages"]
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return [{"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["completion"]}]
    raise DataError(f"{where}: an instruction record needs 'messages' (a list of {{role, "
                    f"content}}) or 'prompt' and 'completion' strings")


def pack(documents: Sequence[tuple[list[int], list[int]]], seq_len: int,
         pad_id: int) -> np.ndarray:
    """Pack ``(ids, mask)`` documents into rows ``[n, 3, seq_len + 1]`` (tokens, mask, doc ids)."""
    width = seq_len + 1
    rows: list[np.ndarray] = []
    current: list[tuple[list[int], list[int]]] = []
    used = 0

    def flush() -> None:
        row = np.zeros((3, width), dtype=np.int64)
        row[0].fill(pad_id)
        at = 0
        for doc, (ids, mask) in enumerate(current):
            row[0, at:at + len(ids)], row[1, at:at + len(ids)] = ids, mask
            row[2, at:at + len(ids)] = doc
            at += len(ids)
        row[2, at:] = len(current)  # the padding is a document of its own
        rows.append(row)

    for number, (ids, mask) in enumerate(documents):
        if len(ids) > width:
            raise DataError(f"example {number} is {len(ids)} tokens, longer than a row "
                            f"(data.seq_len + 1 = {width}); raise data.seq_len (and "
                            "model.max_seq_len) or shorten the example")
        if used + len(ids) > width:
            flush()
            current, used = [], 0
        current.append((ids, mask))
        used += len(ids)
    if current:
        flush()
    if not rows:
        raise DataError("no examples to train on")
    return np.stack(rows)


def sft_rows(records: Sequence[dict], tokenizer: Tokenizer, seq_len: int, where: str) -> np.ndarray:
    """SFT rows of instruction ``records`` (chat template, packing with document ids)."""
    docs = []
    for i, record in enumerate(records):
        ids, mask = render(tokenizer, conversation(record, f"{where} record {i}"))
        if not any(mask):
            raise DataError(f"{where} record {i} has no assistant turn: nothing to learn from it")
        docs.append((ids, mask))
    return pack(docs, seq_len, tokenizer.pad_id)


def _side(record: dict, name: str, tokenizer: Tokenizer, where: str) -> tuple[list[int], list[int]]:
    value = record.get(name)
    if isinstance(value, list):
        return render(tokenizer, value)
    prompt = record.get("prompt")
    if isinstance(value, str) and isinstance(prompt, str):
        head, tail = prompt_ids(tokenizer, prompt), completion_ids(tokenizer, value)
        return head + tail, [0] * len(head) + [1] * len(tail)
    raise DataError(f"{where}: a preference record needs 'prompt', 'chosen' and 'rejected' "
                    "strings, or 'chosen' and 'rejected' message lists")


def pair_rows(records: Sequence[dict], tokenizer: Tokenizer, seq_len: int,
              where: str) -> np.ndarray:
    """Preference rows ``[n, 4, seq_len + 1]`` of ``records`` (right-padded)."""
    width = seq_len + 1
    out = np.zeros((len(records), 4, width), dtype=np.int64)
    out[:, 0::2] = tokenizer.pad_id
    for i, record in enumerate(records):
        for k, name in enumerate(("chosen", "rejected")):
            ids, mask = _side(record, name, tokenizer, f"{where} record {i}")
            if len(ids) > width:
                raise DataError(f"{where} record {i}: the {name} side is {len(ids)} tokens, "
                                f"longer than data.seq_len + 1 = {width}; raise data.seq_len")
            if not any(mask):
                raise DataError(f"{where} record {i}: the {name} side has no completion tokens")
            out[i, 2 * k, :len(ids)], out[i, 2 * k + 1, :len(ids)] = ids, mask
    if not len(out):
        raise DataError(f"{where}: no preference pairs")
    return out


def suite_tasks(post, split: str) -> list[Task]:
    """Tasks of the suite for ``split`` ("train" or "test") as ``[post]`` asks."""
    n = post.train_tasks if split == "train" else post.heldout_tasks
    return generate(post.family_list, split, n, post.task_seed)


def training_tasks(post) -> tuple[list[Task], list[Task]]:
    """(training, held-out) tasks: from post.data / post.heldout task files, else the suite."""
    train = read_tasks(Path(post.data)) if post.data else suite_tasks(post, "train")
    heldout = read_tasks(Path(post.heldout)) if post.heldout else suite_tasks(post, "test")
    if not train:
        raise DataError("no training tasks; set post.train_tasks > 0 or post.data to a task file")
    return train, heldout


def task_records(tasks: Sequence[Task]) -> list[dict]:
    """Instruction records (messages) of tasks with their reference solutions."""
    return [task_record(t, "messages") for t in tasks]
