"""Fuzzing data manifests (docs/design.md, 'Testing'): any manifest is valid or a one-line
DataError.

``manifest.json`` comes from disk, so it can hold anything: other JSON, wrong types, missing
fields, paths that leave the data folder, bytes that are not JSON at all. Properties: parsing
raises nothing but a one-line ``DataError``; an accepted manifest is consistent (its shards' rows
add up to ``num_samples``, counts are positive integers, digests are hex, files are listed once);
and a shard path the loader would open never resolves outside the data folder.

Each example is one hypothesis ``binary`` draw that :class:`Choices` turns into a manifest (as
libFuzzer's FuzzedDataProvider does: a draw per choice would cost several times more, and
shrinking the bytes still shrinks the manifest). Three tests of ``FTLM_FUZZ_EXAMPLES`` examples
each (default 2000, the ``fuzz`` profile of tests/conftest.py); a failure prints the manifest.
"""

from __future__ import annotations

import copy
import json
import math
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from ftlm.data.manifest import Manifest, parse_manifest, shard_path
from ftlm.errors import DataError
from ftlm.testing import fuzz

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(parent=settings.get_profile("fuzz"))
BYTES = st.binary(min_size=1, max_size=120)

SHA = "ab" * 32
VALID = {
    "format_version": 1, "num_samples": 30, "seq_len": 64, "tokenizer_fingerprint": "f" * 64,
    "vocab_size": 1024, "source": "/data/corpus", "documents": 12, "tokens": 1950,
    "packing": "bos+doc+eos", "created_at": 1.7e9,
    "shards": [{"file": "shard-00000.parquet", "rows": 16, "sha256": SHA},
               {"file": "shard-00001.parquet", "rows": 8, "sha256": "0" * 64},
               {"file": "shard-00002.parquet", "rows": 6, "sha256": "9" * 64}],
}
"""A manifest as ``prepare`` writes it."""
KEYS = ["format_version", "num_samples", "seq_len", "tokenizer_fingerprint", "shards", "file",
        "rows", "sha256", "vocab_size", "", "x"]
FILES = ["shard-00000.parquet", "../../etc/passwd", "/etc/passwd", "sub/../../x.parquet",
         "link/shard.parquet", "link", "sub/shard.parquet", "./shard-00000.parquet", ".", "..",
         "", "\0", "a\0b", "a//b", "~/x", "C:\\x", "\\\\server\\x", "shard-00001.parquet",
         "sub/./../shard-00002.parquet", "\udcff", "\u00e9.parquet", "a\nb"]
"""Shard file names: fine, escaping the folder (by ``..``, absolute, through a symlink), odd."""
TEXTS = [SHA, "AB" * 32, "ab" * 31, "g" * 64, "", "1", "NaN", "shard-00000.parquet", "\udcff",
         "\0", "1" * 64] + FILES
NUMBERS = [0, 1, -1, 2, 6, 8, 16, 30, 64, True, False, 1.0, 30.0, 2**53, 2**53 + 1, 2**63,
           2**64, -(2**63), 10**400, math.inf, -math.inf, math.nan, 1e308, -0.0]


class Choices(fuzz.Choices):
    """``ftlm.testing.fuzz.Choices`` with JSON values for manifests."""

    def number(self):
        kind = self.below(3)
        if kind == 0:
            return int.from_bytes(self.raw(2), "little", signed=True)
        if kind == 1:
            return struct.unpack("<d", self.raw(8))[0]
        return self.pick(NUMBERS)

    def json_value(self, depth: int = 0):
        kind = self.below(8)
        if kind == 0:
            return None
        if kind in (1, 2):
            return self.number()
        if kind in (3, 4) or depth >= 3:
            return self.pick(TEXTS)
        if kind == 5:
            return [self.json_value(depth + 1) for _ in range(self.below(4))]
        return {self.pick(KEYS): self.json_value(depth + 1) for _ in range(self.below(5))}


def mutated_manifest(c: Choices) -> dict:
    """``VALID`` with 1 to 4 edits: a field dropped, retyped or set to an odd value; a shard
    entry edited, duplicated, dropped or replaced; the shard list replaced."""
    m = copy.deepcopy(VALID)
    for _ in range(1 + c.below(4)):
        shards = m.get("shards")
        action = c.below(8)
        if action == 0:
            m.pop(c.pick(KEYS), None)
        elif action == 1:
            m[c.pick(KEYS)] = c.json_value()
        elif action == 2:
            m[c.pick(["num_samples", "seq_len", "format_version"])] = c.number()
        elif isinstance(shards, list) and shards and action in (3, 4, 5):
            k = c.below(len(shards))
            entry = shards[k]
            if not isinstance(entry, dict):
                shards[k] = c.json_value()
            elif action == 3:
                entry["file"] = c.pick(FILES)
            elif action == 4:
                entry[c.pick(["rows", "sha256", "file"])] = c.json_value()
            else:
                entry.pop(c.pick(["rows", "sha256", "file"]), None)
        elif isinstance(shards, list) and action == 6:
            if shards and c.below(2):
                shards.append(copy.deepcopy(shards[c.below(len(shards))]))
            elif shards:
                shards.pop(c.below(len(shards)))
        else:
            m["shards"] = c.json_value()
    return m


def _dump(value) -> bytes:
    # JSON as any writer might produce it: NaN and Infinity included, lone surrogates escaped.
    return json.dumps(value, allow_nan=True).encode("utf-8")


def _check(data: bytes) -> Manifest | None:
    """Parse; an error must be a one-line DataError, an accepted manifest must be consistent."""
    try:
        manifest = parse_manifest(data, "fuzz/manifest.json")
    except DataError as e:
        assert str(e).startswith("fuzz/manifest.json") and "\n" not in str(e), repr(str(e))
        return None
    assert manifest.num_samples == sum(s.rows for s in manifest.shards) >= 1
    assert type(manifest.seq_len) is int and manifest.seq_len >= 1
    assert len({s.file for s in manifest.shards}) == len(manifest.shards) >= 1
    for s in manifest.shards:
        assert type(s.rows) is int and s.rows >= 1
        assert len(s.sha256) == 64 and set(s.sha256) <= set("0123456789abcdef")
        assert not s.file.startswith("/") and ".." not in s.file.split("/")
    return manifest


@pytest.fixture(scope="module")
def data_folder():
    """A data folder with a subfolder and a symlink ``link`` that leads out of it."""
    with tempfile.TemporaryDirectory(prefix="ftlm-manifest-fuzz-") as root:
        folder = Path(root) / "data"
        (folder / "sub").mkdir(parents=True)
        (Path(root) / "outside").mkdir()
        (folder / "link").symlink_to(Path(root) / "outside")
        yield folder


@FUZZ
@given(BYTES)
def test_fuzz_any_json_is_a_manifest_or_a_data_error(data: bytes) -> None:
    c = Choices(data)
    if c.below(2):
        value = c.json_value()
    else:  # past the format_version check: random fields, shards of random entries
        value = {"format_version": 1}
        for _ in range(c.below(6)):
            value[c.pick(KEYS)] = c.json_value(1)
    note(f"manifest={value!r}")
    _check(_dump(value))


@FUZZ
@given(data=BYTES)
def test_fuzz_edited_manifests_never_reach_outside_the_folder(data_folder: Path,
                                                             data: bytes) -> None:
    value = mutated_manifest(Choices(data))
    note(f"manifest={value!r}")
    manifest = _check(_dump(value))
    if manifest is None:
        return
    inside = data_folder.resolve()
    for s in manifest.shards:
        try:
            path = shard_path(data_folder, s.file)
        except DataError as e:
            assert "leads outside the data folder" in str(e) and "\n" not in str(e)
            continue
        assert path.resolve().is_relative_to(inside), (s.file, path.resolve())


MANIFEST_CHUNKS = [b"NaN", b"Infinity", b"-1", b"1e999", b"9" * 30, b"\xe9", b"\xff", b"\\ud800",
                   b'"', b"{", b"}", b"[", b",", b":", b"null", b"true", b'"../x"', b"\x00"]


@FUZZ
@given(BYTES)
def test_fuzz_manifest_bytes_are_a_manifest_or_a_data_error(data: bytes) -> None:
    c = Choices(data)
    text = bytearray(_dump(VALID))
    for _ in range(1 + c.below(4)):
        at = c.below(len(text) + 1)
        chunk = c.pick(MANIFEST_CHUNKS) if c.below(2) else c.raw(1 + c.below(3))
        action = c.below(3)
        if action == 0:
            text[at:at + len(chunk)] = chunk
        elif action == 1:
            text[at:at] = chunk
        else:
            del text[at:at + len(chunk)]
    note(f"bytes={bytes(text)!r}")
    _check(bytes(text))


def test_a_shard_name_with_a_lone_surrogate_is_a_one_line_error() -> None:
    from ftlm.data.manifest import FORMAT_VERSION
    text = json.dumps({"format_version": FORMAT_VERSION, "seq_len": 8, "num_samples": 1,
                       "shards": [{"file": "shard\ud800.parquet", "rows": 1, "sha256": "0" * 64}]})
    with pytest.raises(DataError, match=r"shards\[0\]\.file=.* must be a relative path") as caught:
        parse_manifest(text.encode(), "manifest.json")
    assert "\n" not in str(caught.value)
