"""Wire format of live state transfer: a flat byte buffer described by a JSON header.

Responsible for: the dtype vocabulary, laying tensors out in one buffer, the chunk table (fixed-size
byte ranges) and the per-chunk digest (`chunk_digest`), strict validation of a header that arrived
from the network, rebuilding tensors from raw bytes, and `state_digest` (the hash that proves two
replicas hold the same state).

Not responsible for: taking snapshots, sockets, HTTP or retries (see `ftlm.ft.transport`).

The format is safetensors-like: every tensor is `{name, dtype, shape, offset, nbytes}` into one
buffer, so nothing is ever unpickled; a header from a peer is validated field by field before any
number in it is used to allocate or slice memory. A receiver that describes its own state
(`ExpectedLayout`) refuses any header that describes other tensors or another size, so what a
peer can make it allocate is bounded by what it holds itself.

The header names the chunk size, not the chunks' digests: a source answers it at once, and each
chunk's digest travels with that chunk (computed by the source when it first serves the chunk), so
a receiver verifies chunk by chunk and nobody waits for a hash of the whole state. The digest is
XXH3-128 (about 10 GB/s on one core, against about 1.8 GB/s for sha256): it detects corruption in
transit or in memory, which is all a per-chunk checksum can do here, since the source that sends the
bytes also computes their digest. Who may send is decided by the job token, and the wire is
protected by TLS when configured; `state_digest` (sha256) stays the proof of equal replicas.

Every malformed input raises
FramingError (never MemoryError, TypeError, KeyError or RecursionError): the fuzz tests in
tests/ft/test_framing_fuzz.py hold that property over arbitrary bytes and JSON.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ftlm.ft.digest import DIGEST, chunk_digest

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
DIGEST_HEX = re.compile(r"[0-9a-f]{32}")
"""What a chunk digest looks like: 32 lowercase hex digits."""

MAX_HEADER_BYTES = 64 << 20
"""Largest encoded header accepted (a header grows with the number of tensors, ~100 B each)."""
DEFAULT_MAX_TOTAL_BYTES = 1 << 40
"""Hard cap on a snapshot's size when the caller gives none."""
MAX_NDIM = 64
"""Most dimensions a tensor may have on the wire."""
MAX_META_DEPTH = 64
"""Deepest nesting of lists and objects accepted in `meta` (a trainer's is below 10)."""
MAX_CHUNKS = 1 << 24
"""Most chunks a header may describe (a peer cannot make a receiver ask a billion times)."""
# Bound on the product of a shape's non-zero dimensions: torch cannot even describe (strides)
# an empty tensor whose other dimensions overflow int64.
_MAX_SHAPE_PRODUCT = 1 << 48


class FramingError(ValueError):
    """A header or buffer does not follow the wire format (the message says which field)."""


class LayoutMismatch(FramingError):
    """A well-formed header describes other tensors than the receiver expects to load."""


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
    """One transfer unit: a byte range of the flat buffer."""

    index: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ChunkTable:
    """The chunks of a `total_bytes` buffer cut every `chunk_bytes` (the last may be shorter).

    A sequence computed on demand, so a header of a large state costs no memory per chunk.
    """

    total_bytes: int
    chunk_bytes: int

    def __len__(self) -> int:
        return (self.total_bytes + self.chunk_bytes - 1) // self.chunk_bytes

    def __getitem__(self, index: int) -> ChunkEntry:
        count = len(self)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError(f"chunk {index} of {count}")
        offset = index * self.chunk_bytes
        return ChunkEntry(index, offset, min(self.chunk_bytes, self.total_bytes - offset))

    def __iter__(self) -> Iterator[ChunkEntry]:
        return (self[i] for i in range(len(self)))


@dataclass(frozen=True)
class Header:
    """Everything a receiver needs to fetch, verify and rebuild one snapshot."""

    step: int
    meta: dict[str, Any]
    total_bytes: int
    tensors: tuple[TensorEntry, ...]
    chunk_bytes: int

    @property
    def chunks(self) -> ChunkTable:
        return ChunkTable(self.total_bytes, self.chunk_bytes)

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
            "chunk_bytes": self.chunk_bytes,
            "digest": DIGEST,
        }


@dataclass(frozen=True)
class ExpectedLayout:
    """What a receiver is prepared to load, built from its own state: dtype and shape per name.

    Only names, wire dtypes and shapes: no tensor data. `parse_header(..., expected=)` refuses a
    header that describes anything else, before a byte of the snapshot is allocated.
    """

    tensors: Mapping[str, tuple[str, tuple[int, ...]]]  # name -> (wire dtype, shape)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data, without alignment padding."""
        return sum(math.prod(shape) * DTYPES[dtype].itemsize
                   for dtype, shape in self.tensors.values())

    @property
    def max_total_bytes(self) -> int:
        """Largest buffer these tensors can need in any order (data plus worst-case padding)."""
        return self.nbytes + (ALIGN - 1) * len(self.tensors)


def expected_layout(tensors: Mapping[str, torch.Tensor]) -> ExpectedLayout:
    """The `ExpectedLayout` of `tensors` (reads dtypes and shapes only, never the data)."""
    entries, _ = layout(tensors)
    return ExpectedLayout({e.name: (e.dtype, e.shape) for e in entries})


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


def _int(obj: Mapping[str, Any], key: str, where: str, minimum: int = 0) -> int:
    value = obj.get(key)
    # bool is an int subclass in Python; on the wire it is a different type.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise FramingError(f"{where}.{key} must be an integer >= {minimum}, got {value!r:.80}")
    return value


def _shape(raw: Any, where: str) -> tuple[int, ...]:
    if not isinstance(raw, (list, tuple)) or len(raw) > MAX_NDIM or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= _MAX_SHAPE_PRODUCT
        for d in raw
    ) or math.prod(max(d, 1) for d in raw) > _MAX_SHAPE_PRODUCT:
        raise FramingError(f"{where}.shape must be a list of at most {MAX_NDIM} integers >= 0 "
                           f"whose non-zero product is <= 2^48, got {raw!r:.80}")
    return tuple(raw)


def _check_meta(meta: Any) -> None:
    """Refuse meta nested deeper than MAX_META_DEPTH or holding a non-finite float.

    Iterative, so that no depth a JSON decoder accepted can exhaust the Python stack here or
    in whoever walks the meta later (canonical_json, the trainer).
    """
    stack = [(meta, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise FramingError(f"header.meta holds the non-finite number {value}; meta is JSON "
                               f"data with finite numbers")
        if isinstance(value, (dict, list)):
            if depth > MAX_META_DEPTH:
                raise FramingError(f"header.meta is nested deeper than {MAX_META_DEPTH} levels")
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)


def _dense_size(tensors: list[TensorEntry]) -> int:
    """Bytes that `layout` needs for these tensors in this order."""
    end = 0
    for t in tensors:
        end = -(-end // ALIGN) * ALIGN + t.nbytes
    return end


def _describe_tensor(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{dtype} {list(shape)}"


def parse_header(obj: Any, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
                 expected: ExpectedLayout | None = None) -> Header:
    """Validate a header decoded from JSON and return it; raise FramingError naming the field.

    Checks: types; known dtypes; unique names; nbytes == prod(shape) * itemsize; tensors inside
    the buffer and not overlapping; chunk_bytes >= 1 cutting at most MAX_CHUNKS chunks; the
    digest named is `DIGEST`; total_bytes at most `max_total_bytes`; meta is finite JSON data
    nested at most MAX_META_DEPTH deep. With `expected`, also (LayoutMismatch): the same tensor
    names with the same dtypes and shapes, and total_bytes equal to their dense layout; the
    total is checked first, before anything proportional to the header's claims is built.
    """
    if not isinstance(obj, dict):
        raise FramingError(f"header must be a JSON object, got {type(obj).__name__}")
    step = _int(obj, "step", "header")
    total = _int(obj, "total_bytes", "header")
    if expected is not None and total > expected.max_total_bytes:
        raise LayoutMismatch(
            f"header.total_bytes={total} but this receiver expects at most "
            f"{expected.max_total_bytes} bytes ({len(expected.tensors)} tensors of its own state)")
    if total > max_total_bytes:
        raise FramingError(f"header.total_bytes={total} exceeds the limit {max_total_bytes}")
    meta = obj.get("meta")
    if not isinstance(meta, dict):
        raise FramingError(f"header.meta must be a JSON object, got {type(meta).__name__}")
    _check_meta(meta)
    chunk_bytes = _int(obj, "chunk_bytes", "header", minimum=1)
    if -(-total // chunk_bytes) > MAX_CHUNKS:
        raise FramingError(f"header.chunk_bytes={chunk_bytes} cuts total_bytes={total} into more "
                           f"than {MAX_CHUNKS} chunks")
    if obj.get("digest") != DIGEST:
        raise FramingError(f"header.digest must be {DIGEST!r}, got {obj.get('digest')!r:.40}")
    raw_tensors = obj.get("tensors")
    if not isinstance(raw_tensors, list):
        raise FramingError("header.tensors must be a list")
    if expected is not None and len(raw_tensors) != len(expected.tensors):
        raise LayoutMismatch(f"the header describes {len(raw_tensors)} tensors but this "
                             f"receiver expects {len(expected.tensors)}")

    tensors, names = [], set()
    for i, t in enumerate(raw_tensors):
        where = f"tensors[{i}]"
        if not isinstance(t, dict):
            raise FramingError(f"{where} must be an object")
        name, dtype = t.get("name"), t.get("dtype")
        if not isinstance(name, str) or not name or name in names:
            raise FramingError(f"{where}.name must be a non-empty unique string, "
                               f"got {name!r:.80}")
        names.add(name)
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise FramingError(f"{where}.dtype {dtype!r:.40} unknown; "
                               f"supported: {', '.join(DTYPES)}")
        shape = _shape(t.get("shape"), where)
        if expected is not None:
            if name not in expected.tensors:
                raise LayoutMismatch(f"{where}: tensor {name!r:.80} is not part of this "
                                     f"receiver's state")
            if (dtype, shape) != expected.tensors[name]:
                raise LayoutMismatch(
                    f"{where}: tensor {name!r:.80} is {_describe_tensor(dtype, shape)} in the "
                    f"header but {_describe_tensor(*expected.tensors[name])} in this receiver")
        offset, nbytes = _int(t, "offset", where), _int(t, "nbytes", where)
        size = math.prod(shape) * DTYPES[dtype].itemsize
        if nbytes != size:
            raise FramingError(
                f"{where} ({name}): nbytes={nbytes} but shape {list(shape)} of {dtype} needs "
                f"{size}")
        if offset + nbytes > total:
            raise FramingError(f"{where} ({name}): bytes [{offset}, {offset + nbytes}) "
                               f"lie outside the buffer of {total} bytes")
        tensors.append(TensorEntry(name, dtype, shape, offset, nbytes))
    if expected is not None and total != _dense_size(tensors):
        raise LayoutMismatch(f"header.total_bytes={total} but its tensors need "
                             f"{_dense_size(tensors)} bytes (this receiver expects a dense "
                             f"layout)")
    end = 0
    for t in sorted((t for t in tensors if t.nbytes), key=lambda t: t.offset):
        if t.offset < end:
            raise FramingError(f"tensor {t.name!r:.80} overlaps the tensor before it")
        end = t.offset + t.nbytes
    return Header(step, meta, total, tuple(tensors), chunk_bytes)


def _reject_constant(name: str) -> Any:
    raise FramingError(f"header holds {name}, which is not JSON")


def decode_header(data: bytes, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
                  expected: ExpectedLayout | None = None) -> Header:
    """Decode the encoded header `data` (JSON, UTF-8) and validate it with `parse_header`.

    Any malformed input, whatever its bytes, raises FramingError: oversized (MAX_HEADER_BYTES),
    not UTF-8, not JSON, NaN or Infinity, nesting deeper than the decoder allows, or a header
    that `parse_header` refuses.
    """
    if len(data) > MAX_HEADER_BYTES:
        raise FramingError(f"header is {len(data)} bytes; the limit is {MAX_HEADER_BYTES}")
    try:
        obj = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        if isinstance(e, FramingError):
            raise
        # (the first clause: Python's advice on its own int limit is no advice to a receiver)
        reason = str(e).split(";")[0][:200]
        raise FramingError(f"header is not valid UTF-8 JSON: {reason}") from None
    return parse_header(obj, max_total_bytes, expected)


def tensors_from_buffer(
    buffer: bytes | bytearray | memoryview, entries: tuple[TensorEntry, ...], copy: bool = True
) -> dict[str, torch.Tensor]:
    """Rebuild tensors from `buffer`: each result owns its memory with ``copy``; without, the
    tensors are views into `buffer` (for a buffer nobody else holds or writes: no second copy).

    Raises FramingError if an entry does not describe bytes inside `buffer`; `entries` from
    `parse_header` over a buffer of its `total_bytes` always do.
    """
    size = memoryview(buffer).nbytes
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        dtype = DTYPES.get(e.dtype)
        shape = _shape(e.shape, e.name)
        if (dtype is None or e.offset < 0 or e.offset + e.nbytes > size
                or e.nbytes != math.prod(shape) * dtype.itemsize):
            raise FramingError(f"tensor {e.name!r:.80} ({e.dtype} {list(e.shape)} at "
                               f"[{e.offset}, {e.offset + e.nbytes})) does not fit the "
                               f"{size}-byte buffer")
        if e.nbytes == 0:  # torch.frombuffer rejects count=0
            out[e.name] = torch.empty(e.shape, dtype=dtype)
            continue
        flat = torch.frombuffer(buffer, dtype=dtype, count=e.nbytes // dtype.itemsize,
                                offset=e.offset)
        out[e.name] = flat.reshape(e.shape).clone() if copy else flat.reshape(e.shape)
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
