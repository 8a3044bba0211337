"""Wire format of live state transfer: the safetensors format, cut in chunks.

Responsible for: the dtype vocabulary, laying tensors out in one buffer, the safetensors header
that describes it, the chunk table (fixed-size byte ranges of the buffer) and the per-chunk digest
(`chunk_digest`), strict validation of a header that arrived from the network, rebuilding tensors
from raw bytes, and `state_digest` (the hash that proves two replicas hold the same state).

Not responsible for: taking snapshots, sockets, HTTP or retries (see `ftlm.ft.transport`).

A snapshot is a safetensors file (https://huggingface.co/docs/safetensors): an 8-byte
little-endian header length, a JSON header ``{name: {"dtype", "shape", "data_offsets"}}`` with
``__metadata__``, then the tensors' bytes, packed without holes in safetensors' own order (larger
dtypes first, then by name, so each tensor is aligned to its item size). A source answers the
header first and then the byte buffer in chunks; the header answer followed by every chunk is,
byte for byte, a file that ``safetensors.torch.load`` reads. On top of the format, the metadata
carries the transfer's fields, all strings as safetensors requires: ``step``, ``meta`` (the
trainer's JSON data), ``chunk_bytes`` and ``digest``. Nothing is ever unpickled; a header from a
peer is validated field by field before any number in it is used to allocate or slice memory. A
receiver that describes its own state (`ExpectedLayout`) refuses any header that describes other
tensors or another size, so what a peer can make it allocate is bounded by what it holds itself.

The layout and header are written here rather than by ``safetensors.torch.save``: ``save``
returns the whole file as one new ``bytes`` (a second copy of the state, and only from CPU
tensors), and ``load`` takes only ``bytes`` and copies every tensor out of them, whereas a
snapshot is copied once, straight from the live tensors (CUDA included) into its buffer (pinned,
shared or prepared ahead), and a receiver reads chunks straight into the buffer its tensors then
view. Measured (``nice python -m bench.transfer --formats --sizes 64,512 --reps 3``, 2 shared
cores at load 25, medians): for a 512 MiB state, save/load took 5.0 s at the source and 8.8 s
at the receiver against 1.7 s and 3.0 s here, with peaks of 2.0x and 3.0x the state above what
was resident against 1.0x and 1.0x; the earlier hand-written format (JSON tensor list, 8-byte
alignment) took 2.6 s and 4.6 s in the same run with the same peaks as this one.

The header names the chunk size, not the chunks' digests: a source answers it at once, and each
chunk's digest travels with that chunk (computed by the source when it first serves the chunk), so
a receiver verifies chunk by chunk and nobody waits for a hash of the whole state. The digest is
XXH3-128 (about 10 GB/s on one core, against about 1.8 GB/s for sha256): it detects corruption in
transit or in memory, which is all a per-chunk checksum can do here, since the source that sends the
bytes also computes their digest. Who may send is decided by the job token, and the wire is
protected by TLS when configured; `state_digest` (sha256) stays the proof of equal replicas.

Every malformed input raises FramingError (never MemoryError, TypeError, KeyError or
RecursionError): the fuzz tests in tests/ft/test_framing_fuzz.py hold that property over arbitrary
bytes and JSON.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ftlm.ft.digest import DIGEST, chunk_digest

# safetensors' names, in its layout order: a larger item size first (I64 before F64 and F32
# before I32, as safetensors sorts them). Only the dtypes every backend can hold.
DTYPES: dict[str, torch.dtype] = {
    "I64": torch.int64,
    "F64": torch.float64,
    "F32": torch.float32,
    "I32": torch.int32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_RANK: dict[str, int] = {name: i for i, name in enumerate(DTYPES)}

DIGEST_HEX = re.compile(r"[0-9a-f]{32}")
"""What a chunk digest looks like: 32 lowercase hex digits."""

METADATA = "__metadata__"
"""The header's key for string metadata (safetensors' name)."""
LENGTH_BYTES = 8
"""The header's length prefix: an unsigned 64-bit little-endian integer (safetensors)."""
MAX_HEADER_BYTES = 64 << 20
"""Largest JSON header accepted (a header grows with the number of tensors, ~80 B each)."""
MAX_WIRE_HEADER_BYTES = LENGTH_BYTES + MAX_HEADER_BYTES
"""Largest header answer: the length prefix and the JSON."""
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
# An integer in a metadata string: decimal, no sign, no leading zero, at most 2^63 - 1.
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,18}")


class FramingError(ValueError):
    """A header or buffer does not follow the wire format (the message says which field)."""


class LayoutMismatch(FramingError):
    """A well-formed header describes other tensors than the receiver expects to load."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in the buffer: bytes [offset, offset + nbytes) (`data_offsets`)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ChunkEntry:
    """One transfer unit: a byte range of the buffer."""

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
    """Everything a receiver needs to fetch, verify and rebuild one snapshot.

    `tensors` in the sender's order (the header's key order), which is not their order in the
    buffer.
    """

    step: int
    meta: dict[str, Any]
    total_bytes: int
    tensors: tuple[TensorEntry, ...]
    chunk_bytes: int

    @property
    def chunks(self) -> ChunkTable:
        return ChunkTable(self.total_bytes, self.chunk_bytes)

    def encode(self) -> bytes:
        """The safetensors header: length prefix, then JSON padded with spaces to a multiple of
        8 bytes (so the data that follows it in a file starts aligned, as safetensors does)."""
        metadata = {"step": str(self.step), "meta": canonical_json(self.meta).decode(),
                    "chunk_bytes": str(self.chunk_bytes), "digest": DIGEST}
        obj: dict[str, Any] = {METADATA: metadata}
        for t in self.tensors:
            obj[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                           "data_offsets": [t.offset, t.offset + t.nbytes]}
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
        text += b" " * (-(LENGTH_BYTES + len(text)) % 8)
        return struct.pack("<Q", len(text)) + text


@dataclass(frozen=True)
class ExpectedLayout:
    """What a receiver is prepared to load, built from its own state: dtype and shape per name.

    Only names, wire dtypes and shapes: no tensor data. `parse_header(..., expected=)` refuses a
    header that describes anything else, before a byte of the snapshot is allocated.
    """

    tensors: Mapping[str, tuple[str, tuple[int, ...]]]  # name -> (wire dtype, shape)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data: the size of the buffer (the layout has no padding)."""
        return sum(math.prod(shape) * DTYPES[dtype].itemsize
                   for dtype, shape in self.tensors.values())


def expected_layout(tensors: Mapping[str, torch.Tensor]) -> ExpectedLayout:
    """The `ExpectedLayout` of `tensors` (reads dtypes and shapes only, never the data)."""
    entries, _ = layout(tensors)
    return ExpectedLayout({e.name: (e.dtype, e.shape) for e in entries})


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype; raises FramingError for dtypes the format does not carry."""
    try:
        return _NAMES[dtype]
    except KeyError:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPES.values())
        raise FramingError(f"dtype {dtype} cannot be transferred; supported: {supported}") from None


def canonical_json(meta: Mapping[str, Any]) -> bytes:
    """Deterministic JSON bytes of `meta`; raises FramingError if it is not plain JSON data."""
    try:
        return json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise FramingError(
            f"meta must be JSON data (dicts with str keys, lists, str, int, finite float, bool, "
            f"None): {e}"
        ) from None


def _encodable(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def layout(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[TensorEntry, ...], int]:
    """Place tensors in one buffer as safetensors does (by dtype, larger first, then by name; no
    holes); return the entries in `tensors`' order and the buffer's size."""
    entries = {}
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == METADATA or not _encodable(name):
            raise FramingError(f"tensor names must be non-empty UTF-8 strings other than "
                               f"{METADATA!r}, got {name!r}")
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise FramingError(f"{name!r}: only dense torch.Tensor values can be transferred")
        entries[name] = (dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
    offsets, end = {}, 0
    for name in sorted(entries, key=lambda n: (_RANK[entries[n][0]], n)):
        offsets[name] = end
        end += entries[name][2]
    return tuple(TensorEntry(name, dtype, shape, offsets[name], nbytes)
                 for name, (dtype, shape, nbytes) in entries.items()), end


def _decimal(metadata: Mapping[str, str], key: str, minimum: int = 0) -> int:
    value = metadata.get(key)
    if not isinstance(value, str) or not _DECIMAL.fullmatch(value) or int(value) < minimum \
            or int(value) >= 1 << 63:
        raise FramingError(f"{METADATA}.{key} must be a decimal integer >= {minimum} in a "
                           f"string, got {value!r:.80}")
    return int(value)


def _offsets(raw: Any, where: str) -> tuple[int, int]:
    if (not isinstance(raw, list) or len(raw) != 2
            or not all(type(v) is int and 0 <= v < 1 << 63 for v in raw) or raw[0] > raw[1]):
        raise FramingError(f"{where}.data_offsets must be [begin, end] with integers "
                           f"0 <= begin <= end, got {raw!r:.80}")
    return raw[0], raw[1]


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
            raise FramingError(f"the header's meta holds the non-finite number {value}; meta is "
                               f"JSON data with finite numbers")
        if isinstance(value, (dict, list)):
            if depth > MAX_META_DEPTH:
                raise FramingError(f"the header's meta is nested deeper than {MAX_META_DEPTH} "
                                   f"levels")
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)


def _describe_tensor(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{dtype} {list(shape)}"


def _reject_constant(name: str) -> Any:
    raise FramingError(f"header holds {name}, which is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:  # json.loads would keep the last one silently
            raise FramingError(f"the header names {key!r:.80} twice in one object")
        obj[key] = value
    return obj


def _json(text: bytes | bytearray | memoryview | str, what: str) -> Any:
    """Decode strict JSON (UTF-8, no NaN or Infinity, no duplicate keys) or raise FramingError."""
    try:
        if not isinstance(text, str):
            text = bytes(text).decode("utf-8")
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        if isinstance(e, FramingError):
            raise
        # (the first clause: Python's advice on its own int limit is no advice to a receiver)
        reason = str(e).split(";")[0][:200]
        raise FramingError(f"{what} is not valid UTF-8 JSON: {reason}") from None


def _parse_metadata(obj: dict[str, Any]) -> tuple[int, dict[str, Any], int]:
    metadata = obj.get(METADATA)
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FramingError(f"header.{METADATA} must be an object of strings (safetensors), got "
                           f"{metadata!r:.80}")
    step = _decimal(metadata, "step")
    chunk_bytes = _decimal(metadata, "chunk_bytes", minimum=1)
    if metadata.get("digest") != DIGEST:
        raise FramingError(f"{METADATA}.digest must be {DIGEST!r}, got "
                           f"{metadata.get('digest')!r:.40}")
    if "meta" not in metadata:
        raise FramingError(f"header.{METADATA} has no meta (the trainer's JSON data)")
    meta = _json(metadata["meta"], f"{METADATA}.meta")
    if not isinstance(meta, dict):
        raise FramingError(f"{METADATA}.meta must hold a JSON object, got {type(meta).__name__}")
    _check_meta(meta)
    return step, meta, chunk_bytes


def parse_header(obj: Any, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
                 expected: ExpectedLayout | None = None) -> Header:
    """Validate a safetensors header decoded from JSON and return it; raise FramingError naming
    the field.

    Checks: types; ``__metadata__`` holds strings with step, chunk_bytes >= 1, the digest
    `DIGEST` and meta (finite JSON data nested at most MAX_META_DEPTH deep); known dtypes;
    data_offsets span prod(shape) * itemsize bytes; the tensors cover the buffer from 0 without
    a hole or an overlap (safetensors' rule), at most `max_total_bytes` bytes, cut in at most
    MAX_CHUNKS chunks. With `expected`, also (LayoutMismatch): the same tensor names with the
    same dtypes and shapes, checked tensor by tensor before anything else is built from the
    header's numbers, so the buffer is exactly the receiver's own size.
    """
    if not isinstance(obj, dict):
        raise FramingError(f"header must be a JSON object, got {type(obj).__name__}")
    step, meta, chunk_bytes = _parse_metadata(obj)
    count = len(obj) - 1
    if expected is not None and count != len(expected.tensors):
        raise LayoutMismatch(f"the header describes {count} tensors but this "
                             f"receiver expects {len(expected.tensors)}")
    tensors = []
    for name, t in obj.items():
        if name == METADATA:
            continue
        where = f"header[{name!r:.80}]"
        if not isinstance(t, dict):
            raise FramingError(f"{where} must be an object")
        if not name:
            raise FramingError("a tensor's name must not be empty")
        dtype = t.get("dtype")
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
        begin, end = _offsets(t.get("data_offsets"), where)
        size = math.prod(shape) * DTYPES[dtype].itemsize
        if end - begin != size:
            raise FramingError(f"{where}: data_offsets [{begin}, {end}) hold {end - begin} bytes "
                               f"but shape {list(shape)} of {dtype} needs {size}")
        if end > max_total_bytes:
            raise FramingError(f"{where}: data_offsets end at {end}, beyond the limit "
                               f"{max_total_bytes}")
        tensors.append(TensorEntry(name, dtype, shape, begin, size))
    total = 0
    for t in sorted(tensors, key=lambda t: (t.offset, t.nbytes)):
        if t.offset != total:
            problem = "overlaps the tensor before it" if t.offset < total else \
                f"leaves a hole: bytes [{total}, {t.offset}) belong to no tensor"
            raise FramingError(f"tensor {t.name!r:.80} at [{t.offset}, {t.offset + t.nbytes}) "
                               f"{problem}")
        total += t.nbytes
    if -(-total // chunk_bytes) > MAX_CHUNKS:
        raise FramingError(f"{METADATA}.chunk_bytes={chunk_bytes} cuts the {total}-byte buffer "
                           f"into more than {MAX_CHUNKS} chunks")
    return Header(step, meta, total, tuple(tensors), chunk_bytes)


def decode_header(data: bytes, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
                  expected: ExpectedLayout | None = None) -> Header:
    """Decode a header answer (the 8-byte length, then that many bytes of UTF-8 JSON) and
    validate it with `parse_header`.

    Any malformed input, whatever its bytes, raises FramingError: a length that disagrees with
    the bytes, oversized (MAX_HEADER_BYTES), not UTF-8, not JSON, NaN or Infinity, a key twice,
    nesting deeper than the decoder allows, or a header that `parse_header` refuses.
    """
    if len(data) < LENGTH_BYTES:
        raise FramingError(f"header is {len(data)} bytes, shorter than its {LENGTH_BYTES}-byte "
                           f"length prefix")
    (length,) = struct.unpack_from("<Q", data)
    if length > MAX_HEADER_BYTES:
        raise FramingError(f"header length {length} exceeds the limit {MAX_HEADER_BYTES}")
    if length != len(data) - LENGTH_BYTES:
        raise FramingError(f"header length prefix says {length} bytes but "
                           f"{len(data) - LENGTH_BYTES} follow it")
    return parse_header(_json(data[LENGTH_BYTES:], "header"), max_total_bytes, expected)


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
    The dtype is torch's name ("float32"), not the wire's, so digests do not depend on the
    wire format.
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        dtype_name(t.dtype)  # refuses a dtype the transfer could not carry either
        # The descriptor line fixes the length of the bytes that follow, so the stream is
        # unambiguous without separators.
        descriptor = [name, str(t.dtype).removeprefix("torch."), list(t.shape)]
        h.update(json.dumps(descriptor).encode() + b"\n")
        h.update(tensor_bytes(t))
    h.update(canonical_json(meta))
    return h.hexdigest()
