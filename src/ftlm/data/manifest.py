"""The manifest of a prepared data folder: parsing it, checking every field, confining shard paths.

``manifest.json`` (written last by ``prepare``) says what a folder holds: ``format_version``,
``seq_len``, ``num_samples``, ``tokenizer_fingerprint`` and ``shards``, a list of ``{file, rows,
sha256}``. :func:`parse_manifest` turns its bytes into a :class:`Manifest` or a
:class:`~ftlm.errors.DataError` that names the file, the field and the fix, whatever the bytes are;
:func:`shard_path` keeps a shard inside its folder (no absolute path, no ``..``, no symlink
leading out), so a manifest cannot make the trainer read ``/etc/passwd``.

This module does not read shards or check their sha256 (``loader``), compare the manifest with a
run's config (``loader``) or write manifests (``prepare``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ftlm.errors import DataError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
RERUN = "re-run `ftlm data prepare`"
MAX_COUNT = 1 << 53
"""Largest ``seq_len``, ``rows`` or ``num_samples`` accepted: far beyond any real corpus, small
enough that sums and int64 offsets of them never overflow."""

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ShardEntry:
    """One shard as the manifest lists it."""

    file: str
    """Path relative to the data folder (a plain name such as ``shard-00000.parquet``)."""
    rows: int
    """Samples in the shard."""
    sha256: str
    """Hex digest of the shard file's bytes (lowercase)."""


@dataclass(frozen=True)
class Manifest:
    """A checked manifest: every field the loader relies on is present and of the right type."""

    seq_len: int
    num_samples: int
    tokenizer_fingerprint: str | None
    shards: tuple[ShardEntry, ...]
    fields: dict[str, Any] = field(repr=False, compare=False)
    """The whole JSON object as read (also the informational fields: documents, source, ...)."""


def read_manifest(folder: Path) -> Manifest:
    """Read and check ``folder/manifest.json``."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path} not found; run `ftlm data prepare` first")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror or e}); check its permissions") from None
    return parse_manifest(data, str(path))


def parse_manifest(data: bytes | str, where: str) -> Manifest:
    """Check the manifest text ``data`` (of the file named ``where``); pure, no file access."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where} is not UTF-8 text (byte {e.start}); {RERUN}") from None
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as e:
        raise DataError(f"{where} is not valid JSON ({e.msg} at line {e.lineno}); {RERUN}") from None
    except (ValueError, RecursionError) as e:  # e.g. a number of more than 4300 digits
        raise DataError(f"{where} is not readable JSON ({_short(str(e))}); {RERUN}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where} must hold a JSON object, found a {_kind(obj)}; {RERUN}")
    version = obj.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise DataError(f"{where} has format_version {_short(version)}, this ftlm reads "
                        f"{FORMAT_VERSION}; {RERUN}")
    seq_len = _count(obj, "seq_len", where)
    num_samples = _count(obj, "num_samples", where)
    fingerprint = obj.get("tokenizer_fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise DataError(f"{where}: tokenizer_fingerprint={_short(fingerprint)} must be a string; "
                        f"{RERUN}")
    shards = _shards(obj.get("shards"), where)
    total = sum(s.rows for s in shards)
    if total != num_samples:
        raise DataError(f"{where}: shard rows add up to {total}, not num_samples={num_samples}; "
                        f"{RERUN}")
    return Manifest(seq_len=seq_len, num_samples=num_samples, tokenizer_fingerprint=fingerprint,
                    shards=shards, fields=obj)


def shard_path(folder: Path, file: str) -> Path:
    """The path of shard ``file`` of ``folder``, refused if it (or a symlink on the way) leads
    outside the folder."""
    folder = Path(folder)
    path = folder / file
    inside = folder.resolve()
    resolved = path.resolve()
    if not resolved.is_relative_to(inside):
        raise DataError(f"shard {path} leads outside the data folder {folder} (to {resolved}); "
                        f"shards must be files inside it: {RERUN}")
    return path


def _shards(value: Any, where: str) -> tuple[ShardEntry, ...]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: shards={_short(value)} must be a non-empty list of "
                        f"{{file, rows, sha256}} objects; {RERUN}")
    out, seen = [], set()
    for k, entry in enumerate(value):
        at = f"{where}: shards[{k}]"
        if not isinstance(entry, dict):
            raise DataError(f"{at} must be a {{file, rows, sha256}} object, found a "
                            f"{_kind(entry)}; {RERUN}")
        file = entry.get("file")
        if not _is_relative_name(file):
            raise DataError(f"{at}.file={_short(file)} must be a relative path inside the data "
                            f"folder (no absolute path, no '..'), e.g. shard-00000.parquet; "
                            f"{RERUN}")
        name = PurePosixPath(file).as_posix()
        if name in seen:
            raise DataError(f"{at}.file={file!r} is listed twice (its samples would be trained "
                            f"twice per epoch); {RERUN}")
        seen.add(name)
        rows = _count(entry, "rows", at, dotted=True)
        digest = entry.get("sha256")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise DataError(f"{at}.sha256={_short(digest)} must be 64 lowercase hex digits; "
                            f"{RERUN}")
        out.append(ShardEntry(file=name, rows=rows, sha256=digest))
    return tuple(out)


def _is_relative_name(file: Any) -> bool:
    if not isinstance(file, str) or not file or "\0" in file:
        return False
    try:
        file.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no file system can name it
        return False
    path = PurePosixPath(file)
    return not path.is_absolute() and ".." not in path.parts and path.name not in ("", ".")


def _count(obj: dict, name: str, where: str, dotted: bool = False) -> int:
    label = f"{where}.{name}" if dotted else f"{where}: {name}"
    if name not in obj:
        raise DataError(f"{label} is missing; {RERUN}")
    value = obj[name]
    if type(value) is not int or not 1 <= value <= MAX_COUNT:
        raise DataError(f"{label}={_short(value)} must be an integer in [1, 2**53]; {RERUN}")
    return value


def _kind(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
