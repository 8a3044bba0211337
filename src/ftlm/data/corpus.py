"""Where raw text documents come from: reading corpora and building the offline demo corpus.

A *document* is one string. Three input kinds are read, always as a stream (one document at a
time, never the whole corpus in memory):

* a folder of ``.txt`` files (searched recursively, sorted by relative path): one document per file;
  a single ``.txt`` file is one document;
* a ``.jsonl`` file: one JSON object per line, the document in field ``text_field``;
* a ``.parquet`` file: the document in string column ``column``.

Text must be UTF-8 (a ``.jsonl`` may start with a byte-order mark); a string with no UTF-8 form
(a lone surrogate from a ``\\ud800`` JSON escape) is refused rather than passed to the tokenizer.

This module does not tokenise, pack or write training data (see ``prepare``); it only yields text
and reports malformed input as :class:`~ftlm.errors.DataError` naming the file and the line, row
or column.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ftlm.errors import DataError

SUPPORTED = "a folder of .txt files, a .txt file, a .jsonl file or a .parquet file"

# Standard-library folders left out of the demo corpus: test suites carry deliberately odd
# encodings and generated data, site-packages differs from machine to machine.
_EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
_CORPUS_MARKER = "corpus.json"


def check_input(path: Path) -> None:
    """Refuse an input that cannot yield documents, before anything reads or writes: a missing
    path, an unsupported file type or a folder without ``.txt`` files."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"input {path} does not exist; pass {SUPPORTED}")
    if path.is_dir():
        if not _txt_files(path):
            raise DataError(f"no .txt files found in {path}; add some, or pass {SUPPORTED}")
    elif path.suffix not in (".txt", ".jsonl", ".parquet"):
        raise DataError(f"unsupported input file type {path.suffix!r} ({path}); pass {SUPPORTED}")


def iter_documents(path: Path, text_field: str = "text", column: str = "text") -> Iterator[str]:
    """Yield the documents of one input (see the module docstring), in a deterministic order."""
    path = Path(path)
    check_input(path)
    if path.is_dir():
        for file in _txt_files(path):
            yield _read_txt(file)
    elif path.suffix == ".txt":
        yield _read_txt(path)
    elif path.suffix == ".jsonl":
        yield from _iter_jsonl(path, text_field)
    else:
        yield from _iter_parquet(path, column)


def count_documents(path: Path, column: str = "text") -> int | None:
    """Number of documents when it is known without reading the text (for progress bars)."""
    path = Path(path)
    if path.is_dir():
        return len(_txt_files(path))
    if path.suffix == ".txt":
        return 1
    if path.suffix == ".parquet":
        try:
            return pq.ParquetFile(path).metadata.num_rows
        except (OSError, pa.ArrowException):
            return None
    return None


def _txt_files(folder: Path) -> list[Path]:
    return sorted((p for p in folder.rglob("*.txt") if p.is_file()),
                  key=lambda p: p.relative_to(folder).as_posix())


def _read_txt(file: Path) -> str:
    try:
        data = file.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {file} ({e.strerror or e}); check that it is a readable "
                        "file") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{file}: not valid UTF-8 (byte 0x{data[e.start]:02x} on line {line}); "
                        "re-encode the file as UTF-8") from None


def require_utf8(text: str, where: str) -> None:
    """Refuse a string that has no UTF-8 form: JSON's ``\\ud800`` escapes can produce lone
    surrogates, which the tokenizer cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where} holds a lone surrogate (\\u{ord(text[e.start]):04x}) at "
                        f"character {e.start}, which is not valid UTF-8 text; fix the program "
                        "that wrote the file or drop the line") from None


def _iter_jsonl(file: Path, field: str) -> Iterator[str]:
    try:
        f = file.open("rb")
    except OSError as e:
        raise DataError(f"cannot read {file} ({e.strerror or e}); check that it is a readable "
                        "file") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                bom = 3 if lineno == 1 and raw.startswith(b"\xef\xbb\xbf") else 0
                raise DataError(f"{file}:{lineno}: not valid UTF-8 (byte 0x{raw[bom + e.start]:02x} "
                                f"at column {bom + e.start + 1}); re-encode the file as UTF-8"
                                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{file}:{lineno}: not valid JSON ({e.msg}); each line must be a "
                                f"JSON object with a {field!r} field") from None
            except RecursionError:
                raise DataError(f"{file}:{lineno}: JSON nested too deeply to read; each line must "
                                f"be a JSON object with a {field!r} field") from None
            except ValueError as e:  # a number of more than 4,300 digits
                raise DataError(f"{file}:{lineno}: not readable JSON ({' '.join(str(e).split())[:120]}); "
                                f"each line must be a JSON object with a {field!r} field") from None
            if not isinstance(obj, dict) or field not in obj:
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                raise DataError(f"{file}:{lineno}: no field {field!r} (found {keys}); set the "
                                f"text field (--field of `ftlm data prepare` / `ftlm tokenizer train`) to the right name")
            value = obj[field]
            if not isinstance(value, str):
                raise DataError(f"{file}:{lineno}: field {field!r} is a {type(value).__name__}, "
                                f"expected a string")
            require_utf8(value, f"{file}:{lineno}: field {field!r}")
            yield value


def _iter_parquet(file: Path, column: str) -> Iterator[str]:
    try:
        pf = pq.ParquetFile(file)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read Parquet file {file} ({e}); is it a valid .parquet?") from e
    schema = pf.schema_arrow
    if column not in schema.names:
        raise DataError(f"{file} has no column {column!r}; its columns are {schema.names}; set "
                        f"the column (column= / --column) to one of them")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"column {column!r} of {file} has type {kind}, expected string")
    row = 0
    for batch in pf.iter_batches(columns=[column], batch_size=1024):
        values = batch.column(0)
        try:
            texts = values.to_pylist()
        except UnicodeDecodeError:  # Parquet does not check UTF-8 on write: find the row
            bad = next(i for i in range(len(values)) if not _decodes(values, i))
            raise DataError(f"{file}: row {row + bad} of column {column!r} is not valid UTF-8; "
                            "re-write the column as UTF-8 strings") from None
        for value in texts:
            if value is not None:  # a null row is an absent document, not an error
                yield value
        row += len(values)


def _decodes(values: pa.Array, i: int) -> bool:
    try:
        values[i].as_py()
        return True
    except UnicodeDecodeError:
        return False


def build_demo_corpus(out_dir: Path, max_bytes: int = 8_000_000) -> Path:
    """Write a folder of .txt files from the Python standard library's sources; return it.

    The text exists on every machine with Python, so the demo needs no download. The result is
    deterministic for a given Python installation: files are taken in sorted order until
    ``max_bytes`` of UTF-8 text, the last one cut at a line boundary. An existing ``out_dir`` is
    replaced only if an earlier call built it (it holds ``corpus.json``); anything else is refused
    rather than deleted.
    """
    out_dir = Path(out_dir)
    if max_bytes < 1:
        raise DataError(f"max_bytes={max_bytes} must be positive")
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / _CORPUS_MARKER).exists():
        raise DataError(f"{out_dir} exists and was not built by build_demo_corpus; "
                        f"choose an empty or new folder")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted((p for p in stdlib.rglob("*.py")
                      if not _EXCLUDED_DIRS.intersection(p.relative_to(stdlib).parts[:-1])),
                     key=lambda p: p.relative_to(stdlib).as_posix())
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    total, written = 0, 0
    for src in sources:
        if total >= max_bytes:
            break
        try:
            text = src.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few sources use legacy encodings; skipping keeps the corpus pure UTF-8
        data = text.encode("utf-8")
        if not data.strip():
            continue  # empty __init__.py files carry no text
        if total + len(data) > max_bytes:
            data = data[: max_bytes - total]
            data = data[: data.rfind(b"\n") + 1]  # whole lines only, so no split code point
            if not data:
                break
        name = src.relative_to(stdlib).as_posix().replace("/", "__")
        (tmp / f"{written:05d}-{name}.txt").write_bytes(data)
        total += len(data)
        written += 1
    if written == 0:
        raise DataError(f"no readable .py sources under {stdlib}; pass your own corpus instead")
    (tmp / _CORPUS_MARKER).write_text(json.dumps({"source": str(stdlib), "files": written,
                                                  "bytes": total, "max_bytes": max_bytes}))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
