"""Fuzzing the transfer's wire decoder: whatever a peer sends, framing answers with a Header or a
FramingError, never another exception (MemoryError, TypeError, KeyError, RecursionError, ...).

Each test draws `FTLM_FUZZ_EXAMPLES` examples (default 2000; see the ``fuzz`` profile in
tests/conftest.py): five tests, at least 10,000 cases per default run, in about ten seconds on one
core. A release fuzzes longer with ``FTLM_FUZZ_EXAMPLES=200000 .venv/bin/python -m pytest -q
tests/ft/test_framing_fuzz.py``. A failure prints the smallest input that triggers it; keep it
as an explicit example (``@example``) once fixed.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ftlm.ft.framing import (
    DIGEST, DTYPES, MAX_CHUNKS, ExpectedLayout, FramingError, Header, LayoutMismatch,
    decode_header, expected_layout, layout, parse_header, tensors_from_buffer,
)

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(parent=settings.get_profile("fuzz"))

# -- strategies --------------------------------------------------------------------------------

SMALL_INTS = st.one_of(st.integers(-3, 70), st.sampled_from([2**31, 2**40, 2**48 + 1, 2**63,
                                                             2**64, -2**63, 10**30]))
JSON_SCALARS = st.one_of(st.none(), st.booleans(), SMALL_INTS,
                         st.floats(allow_nan=False, allow_infinity=False),
                         st.text(max_size=8),
                         st.sampled_from(list(DTYPES) + ["complex64", "float32", "7", "01", "{}"]))
HEADER_KEYS = ["__metadata__", "step", "meta", "chunk_bytes", "digest", "dtype", "shape",
               "data_offsets", "w", "b"]


def nest(inner: st.SearchStrategy, keys: st.SearchStrategy) -> st.SearchStrategy:
    """`inner`, or a short list or object of it: one level more of JSON nesting.

    Fixed depth rather than st.recursive, which costs several times more per example.
    """
    return st.one_of(inner, st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4))


JSON_VALUES = nest(nest(JSON_SCALARS, st.text(max_size=6)), st.text(max_size=6))
# JSON whose keys are the header's own, so the parser gets past its first checks more often.
HEADERISH = nest(nest(nest(JSON_SCALARS, st.sampled_from(HEADER_KEYS)),
                      st.sampled_from(HEADER_KEYS)), st.sampled_from(HEADER_KEYS))

# Drawn from fixed menus: a few sampled_from draws are several times cheaper than lists of ints.
SHAPES = st.sampled_from([(), (0,), (1,), (3,), (7,), (2, 3), (4, 0, 2), (1, 1, 1), (2, 2, 2)])
NAMES = st.sampled_from(["w", "b", "model.layers.0.attention.wq.weight", "optim.state.0.exp_avg",
                         "é", "step"])
STATES = st.lists(st.tuples(NAMES, st.sampled_from(list(DTYPES)), SHAPES), max_size=4).map(
    lambda entries: {name: (dtype, shape) for name, dtype, shape in entries})


def state_tensors(spec: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape, dtype=DTYPES[dtype]) for name, (dtype, shape) in spec.items()}


def valid_header(spec: dict, step: int, chunks: int) -> dict[str, Any]:
    """The header a SnapshotServer would send for a state of this spec (`chunks` chunks at most).

    Computed in plain Python (safetensors' layout: larger dtypes first, then by name, no holes)
    to keep each example cheap; the round-trip tests of test_transport.py cover the real layout
    and hashes, and its parity with safetensors' own writer.
    """
    order = sorted(spec, key=lambda name: (list(DTYPES).index(spec[name][0]), name))
    offsets, end = {}, 0
    for name in order:
        dtype, shape = spec[name]
        offsets[name] = end
        end += math.prod(shape) * DTYPES[dtype].itemsize
    header: dict[str, Any] = {"__metadata__": {
        "step": str(step), "meta": json.dumps({"step": step, "cursor": [step, 4]}),
        "chunk_bytes": str(max(1, -(-end // chunks))), "digest": DIGEST}}
    for name, (dtype, shape) in spec.items():
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offsets[name], offsets[name] + nbytes]}
    return header


def framed(body: bytes) -> bytes:
    """A header answer: the 8-byte little-endian length, then `body`."""
    return struct.pack("<Q", len(body)) + body


def spec_of(header: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (t["dtype"], tuple(t["shape"])) for name, t in header.items()
            if name != "__metadata__"}


VALID_HEADERS = st.builds(valid_header, STATES, st.integers(0, 2**40), st.integers(1, 4))


def paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place inside a JSON value (as a tuple of keys and indices)."""
    out = [prefix]
    if isinstance(obj, dict):
        for key, value in obj.items():
            out += paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            out += paths(value, prefix + (i,))
    return out


def mutate(header: dict, data: st.DataObject) -> dict:
    """Replace, delete or nudge one field of a valid header, or add a stray key."""
    where = data.draw(st.sampled_from(paths(header)[1:]))  # never the root itself
    parent = header
    for key in where[:-1]:
        parent = parent[key]
    key, old = where[-1], parent[where[-1]]
    action = data.draw(st.sampled_from(["replace", "delete", "nudge", "stray"]))
    if action == "delete" and isinstance(parent, dict):
        del parent[key]
    elif action == "nudge" and isinstance(old, int) and not isinstance(old, bool):
        parent[key] = old + data.draw(st.sampled_from([-1, 1, -old - 1, 2**40, 2**64, 8]))
    elif action == "stray" and isinstance(parent, dict):
        parent[data.draw(st.text(max_size=4))] = data.draw(JSON_VALUES)
    else:
        parent[key] = data.draw(st.one_of(JSON_VALUES, HEADERISH))
    return header


# -- checks ------------------------------------------------------------------------------------


def check_parsed(header: Header, expected: ExpectedLayout | None = None) -> None:
    """What a successful parse promises to the transport."""
    assert header.total_bytes >= 0 and 1 <= header.chunk_bytes
    chunks = header.chunks
    assert len(chunks) <= MAX_CHUNKS
    if len(chunks):  # contiguous from 0 to total_bytes, every chunk non-empty
        assert chunks[0].offset == 0 and chunks[-1].offset + chunks[-1].nbytes == header.total_bytes
        assert all(c.nbytes >= 1 for c in (chunks[0], chunks[-1]))
    else:
        assert header.total_bytes == 0
    end = 0
    for t in sorted(header.tensors, key=lambda t: (t.offset, t.nbytes)):  # no hole, no overlap
        assert t.offset == end
        assert t.nbytes == math.prod(t.shape) * DTYPES[t.dtype].itemsize
        end += t.nbytes
    assert end == header.total_bytes
    if expected is not None:  # the receiver allocates exactly its own state's size
        assert header.total_bytes == expected.nbytes
        assert {t.name: (t.dtype, t.shape) for t in header.tensors} == dict(expected.tensors)


def parse_or_framing_error(obj: Any, expected: ExpectedLayout | None = None) -> Header | None:
    try:
        header = parse_header(obj, max_total_bytes=1 << 30, expected=expected)
    except FramingError:
        return None
    check_parsed(header, expected)
    return header


def decode_or_framing_error(data: bytes, expected: ExpectedLayout | None = None) -> Header | None:
    try:
        header = decode_header(data, max_total_bytes=1 << 30, expected=expected)
    except FramingError:
        return None
    check_parsed(header, expected)
    return header


OWN = expected_layout({"w": torch.zeros(2, 3), "step": torch.zeros((), dtype=torch.int64)})


# -- fuzz tests --------------------------------------------------------------------------------


BIG = {"__metadata__": {"step": "1", "meta": "{}", "chunk_bytes": str(2**40), "digest": DIGEST},
       "w": {"dtype": "U8", "shape": [2**40], "data_offsets": [0, 2**40]}}


@FUZZ
@given(st.one_of(st.binary(max_size=300),
                 st.binary(max_size=300).map(framed),
                 JSON_VALUES.map(lambda v: framed(json.dumps(v).encode())),
                 st.integers(0, 100_000).map(lambda n: framed(b"[" * n + b"]" * n)),
                 st.sampled_from([b"NaN", b'{"step": Infinity}', b"1e999", b"\xff\xfe{}",
                                  b'{"a": "\xed\xa0\x80"}', b"9" * 5000, b'{"a":1,"a":2}',
                                  '{"é": 1}'.encode("utf-16")]).map(framed)))
@example(framed(json.dumps(BIG).encode()))
@example(framed(json.dumps({**BIG, "__metadata__": {**BIG["__metadata__"],
                                                     "chunk_bytes": "1"}}).encode()))
@example(struct.pack("<Q", 2**64 - 1) + b"{}")
def test_fuzz_arbitrary_bytes_decode_to_a_header_or_framing_error(data: bytes):
    decode_or_framing_error(data)
    decode_or_framing_error(data, OWN)


@FUZZ
@given(st.one_of(JSON_VALUES, HEADERISH))
def test_fuzz_arbitrary_json_parses_to_a_header_or_framing_error(obj: Any):
    parse_or_framing_error(obj)
    parse_or_framing_error(obj, OWN)


@FUZZ
@given(VALID_HEADERS, st.data())
def test_fuzz_mutated_valid_headers_parse_or_raise_framing_error(header: dict, data):
    own = ExpectedLayout(spec_of(header))
    assert parse_or_framing_error(header, own) is not None  # the unmutated header is accepted
    mutated = mutate(header, data)
    parse_or_framing_error(mutated)
    parse_or_framing_error(mutated, own)


# One edit per example: a list of edits doubles the cost of drawing, and 2000 examples of one
# edit at every position already reach every field of the encoded header.
EDIT = st.tuples(st.integers(0, 1 << 16), st.sampled_from(["flip", "insert", "delete", "truncate"]),
                 st.binary(min_size=1, max_size=4))


@FUZZ
@given(VALID_HEADERS, EDIT, st.booleans())
def test_fuzz_corrupted_encoded_headers_decode_or_raise_framing_error(header: dict, edit,
                                                                      reframe: bool):
    """An edit anywhere in the encoded header, length prefix included; with `reframe`, of the
    JSON only, the prefix then saying its new length (so the JSON decoder sees the damage)."""
    raw = bytearray(json.dumps(header).encode() if reframe else framed(json.dumps(header).encode()))
    position, action, piece = edit
    at = position % (len(raw) + 1)
    if action == "flip" and at < len(raw):
        raw[at] ^= piece[0] or 1
    elif action == "insert":
        raw[at:at] = piece
    elif action == "delete":
        del raw[at:at + len(piece)]
    else:
        del raw[at:]
    data = framed(bytes(raw)) if reframe else bytes(raw)
    decode_or_framing_error(data)
    decode_or_framing_error(data, expected_layout(state_tensors(spec_of(header))))


@FUZZ
@given(VALID_HEADERS, st.binary(max_size=600))
def test_fuzz_buffers_rebuild_tensors_or_raise_framing_error(header: dict, buffer: bytes):
    parsed = parse_header(header)
    try:
        tensors = tensors_from_buffer(bytearray(buffer), parsed.tensors)
    except FramingError:
        assert len(buffer) < max((t.offset + t.nbytes for t in parsed.tensors), default=0)
        return
    assert [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()] == [
        (t.name, DTYPES[t.dtype], t.shape) for t in parsed.tensors]
    assert list(tensors) == list(spec_of(header))  # in the sender's order


def test_layout_mismatch_is_a_framing_error():
    # The transport reports both as a bad header; the fuzz tests rely on the subclass relation.
    assert issubclass(LayoutMismatch, FramingError)


def test_the_fuzzers_valid_header_is_what_a_server_sends():
    spec = {"w": ("F32", (3, 2)), "m": ("BOOL", (3,)), "s": ("I64", ()), "h": ("F16", (2,))}
    entries, total = layout(state_tensors(spec))
    header = parse_header(valid_header(spec, step=5, chunks=3))
    assert header.tensors == entries and header.total_bytes == total
    assert len(header.chunks) == 3
    sent = Header(5, {"step": 5, "cursor": [5, 4]}, total, entries, header.chunk_bytes).encode()
    assert len(sent) % 8 == 0 and struct.unpack_from("<Q", sent)[0] == len(sent) - 8
    # What SnapshotServer encodes (the meta as canonical JSON, the key order kept).
    expected = valid_header(spec, step=5, chunks=3)
    expected["__metadata__"]["meta"] = '{"cursor":[5,4],"step":5}'
    assert list(json.loads(sent[8:])) == list(expected) and json.loads(sent[8:]) == expected
