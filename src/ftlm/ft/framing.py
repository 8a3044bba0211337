"""Wire format of live state transfer: a flat byte buffer described by a JSON header.

Responsible for: the dtype vocabulary, laying tensors out in one buffer, the chunk table with its
sha256 per chunk, strict validation of a header that arrived from the network, rebuilding tensors
from raw bytes, and `state_digest` (the hash that proves two replicas hold the same state).

Not responsible for: taking snapshots, sockets, HTTP or retries (see `ftlm.ft.transport`).

The format is safetensors-like: every tensor is `{name, dtype, shape, offset, nbytes}` into one
buffer, so nothing is ever unpickled; a header from a peer is validated field by field before any
number in it is used to allocate or slice memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

# Names used on the wire. Only fixed-size, non-complex dtypes that every backend can hold.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

# Tensor offsets are multiples of this, so a receiver may view any tensor in place if it wants.
ALIGN = 8
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class FramingError(ValueError):
    """A header or buffer does not follow the wire format (the message says which field)."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in the flat buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ChunkEntry:
    """One transfer unit: a byte range of the flat buffer and the sha256 of its bytes."""

    index: int
    offset: int
    nbytes: int
    sha256: str


@dataclass(frozen=True)
class Header:
    """Everything a receiver needs to fetch, verify and rebuild one snapshot."""

    step: int
    meta: dict[str, Any]
    total_bytes: int
    tensors: tuple[TensorEntry, ...]
    chunks: tuple[ChunkEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "meta": self.meta,
            "total_bytes": self.total_bytes,
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                 "offset": t.offset, "nbytes": t.nbytes}
                for t in self.tensors
            ],
            "chunks": [
                {"index": c.index, "offset": c.offset, "nbytes": c.nbytes, "sha256": c.sha256}
                for c in self.chunks
            ],
        }


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype; raises FramingError for dtypes the format does not carry."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise FramingError(
            f"dtype {dtype} cannot be transferred; supported: {', '.join(DTYPES)}"
        ) from None


def canonical_json(meta: Mapping[str, Any]) -> bytes:
    """Deterministic JSON bytes of `meta`; raises FramingError if it is not plain JSON data."""
    try:
        return json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise FramingError(
            f"meta must be JSON data (dicts with str keys, lists, str, int, finite float, bool, "
            f"None): {e}"
        ) from None


def layout(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[TensorEntry, ...], int]:
    """Place tensors one after another (in dict order, ALIGN-aligned); return entries and size."""
    entries, offset = [], 0
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise FramingError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise FramingError(f"{name!r}: only dense torch.Tensor values can be transferred")
        offset = -(-offset // ALIGN) * ALIGN
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
        offset += nbytes
    return tuple(entries), offset


def chunk_table(
    buffer: memoryview, chunk_bytes: int, should_stop: Callable[[], bool] = lambda: False
) -> tuple[ChunkEntry, ...]:
    """Split `buffer` into chunks of `chunk_bytes` (the last may be shorter) and hash each.

    `should_stop` is polled between chunks so that an owner shutting down never waits for a
    whole multi-gigabyte hash; it raises InterruptedError when it returns True.
    """
    if chunk_bytes < 1:
        raise FramingError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    chunks = []
    for index, offset in enumerate(range(0, len(buffer), chunk_bytes)):
        if should_stop():
            raise InterruptedError("chunk hashing stopped by its owner")
        piece = buffer[offset:offset + chunk_bytes]
        # hashlib releases the GIL on large inputs, so this runs beside the training thread.
        chunks.append(ChunkEntry(index, offset, len(piece), hashlib.sha256(piece).hexdigest()))
    return tuple(chunks)


def _int(obj: Mapping[str, Any], key: str, where: str, minimum: int = 0) -> int:
    value = obj.get(key)
    # bool is an int subclass in Python; on the wire it is a different type.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise FramingError(f"{where}.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_header(obj: Any, max_total_bytes: int = 1 << 40) -> Header:
    """Validate a header decoded from JSON and return it; raise FramingError naming the field.

    Checks: types; known dtypes; unique names; nbytes == prod(shape) * itemsize; tensors inside
    the buffer and not overlapping; chunks contiguous from 0 to total_bytes in index order with a
    well-formed sha256 each; total_bytes below `max_total_bytes`.
    """
    if not isinstance(obj, dict):
        raise FramingError(f"header must be a JSON object, got {type(obj).__name__}")
    step = _int(obj, "step", "header")
    total = _int(obj, "total_bytes", "header")
    if total > max_total_bytes:
        raise FramingError(f"header.total_bytes={total} exceeds the limit {max_total_bytes}")
    meta = obj.get("meta")
    if not isinstance(meta, dict):
        raise FramingError(f"header.meta must be a JSON object, got {type(meta).__name__}")
    raw_tensors, raw_chunks = obj.get("tensors"), obj.get("chunks")
    if not isinstance(raw_tensors, list) or not isinstance(raw_chunks, list):
        raise FramingError("header.tensors and header.chunks must be lists")

    tensors, names = [], set()
    for i, t in enumerate(raw_tensors):
        where = f"tensors[{i}]"
        if not isinstance(t, dict):
            raise FramingError(f"{where} must be an object")
        name, dtype, shape = t.get("name"), t.get("dtype"), t.get("shape")
        if not isinstance(name, str) or not name or name in names:
            raise FramingError(f"{where}.name must be a non-empty unique string, got {name!r}")
        names.add(name)
        if dtype not in DTYPES:
            raise FramingError(f"{where}.dtype {dtype!r} unknown; supported: {', '.join(DTYPES)}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise FramingError(f"{where}.shape must be a list of integers >= 0, got {shape!r}")
        offset, nbytes = _int(t, "offset", where), _int(t, "nbytes", where)
        expected = math.prod(shape) * DTYPES[dtype].itemsize
        if nbytes != expected:
            raise FramingError(
                f"{where} ({name}): nbytes={nbytes} but shape {shape} of {dtype} needs {expected}"
            )
        if offset + nbytes > total:
            raise FramingError(f"{where} ({name}): bytes [{offset}, {offset + nbytes}) "
                               f"lie outside the buffer of {total} bytes")
        tensors.append(TensorEntry(name, dtype, tuple(shape), offset, nbytes))
    end = 0
    for t in sorted((t for t in tensors if t.nbytes), key=lambda t: t.offset):
        if t.offset < end:
            raise FramingError(f"tensor {t.name!r} overlaps the tensor before it")
        end = t.offset + t.nbytes

    chunks, expected_offset = [], 0
    for i, c in enumerate(raw_chunks):
        where = f"chunks[{i}]"
        if not isinstance(c, dict):
            raise FramingError(f"{where} must be an object")
        index, offset = _int(c, "index", where), _int(c, "offset", where)
        nbytes, sha = _int(c, "nbytes", where, minimum=1), c.get("sha256")
        if index != i or offset != expected_offset:
            raise FramingError(f"{where}: chunks must be in order and contiguous; expected "
                               f"index {i} at offset {expected_offset}, got {index} at {offset}")
        if not isinstance(sha, str) or not _SHA256_HEX.fullmatch(sha):
            raise FramingError(f"{where}.sha256 must be 64 lowercase hex digits, got {sha!r}")
        chunks.append(ChunkEntry(index, offset, nbytes, sha))
        expected_offset += nbytes
    if expected_offset != total:
        raise FramingError(f"chunks cover {expected_offset} bytes but total_bytes is {total}")
    return Header(step, meta, total, tuple(tensors), tuple(chunks))


def tensors_from_buffer(
    buffer: bytes | bytearray | memoryview, entries: tuple[TensorEntry, ...]
) -> dict[str, torch.Tensor]:
    """Rebuild tensors from `buffer`; each result owns its memory (no view into `buffer`)."""
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        dtype = DTYPES[e.dtype]
        if e.nbytes == 0:  # torch.frombuffer rejects count=0
            out[e.name] = torch.empty(e.shape, dtype=dtype)
            continue
        flat = torch.frombuffer(buffer, dtype=dtype, count=e.nbytes // dtype.itemsize,
                                offset=e.offset)
        out[e.name] = flat.reshape(e.shape).clone()
    return out


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of `t` in C order (copied to CPU / made contiguous when it is not already)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def state_digest(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor sorted by name, then canonical meta.

    Equal digests mean bitwise-equal replicated state; used for summary.json `state_hashes`.
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        # The descriptor line fixes the length of the bytes that follow, so the stream is
        # unambiguous without separators.
        h.update(json.dumps([name, dtype_name(t.dtype), list(t.shape)]).encode() + b"\n")
        h.update(tensor_bytes(t))
    h.update(canonical_json(meta))
    return h.hexdigest()
