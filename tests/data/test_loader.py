"""Loader: manifest checks, global order, exactly-once slicing, exact resume, prefetch."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ftlm.data.loader import GlobalOrder, Loader, PackedDataset
from ftlm.data.tokenizer import Tokenizer
from ftlm.errors import DataError

SEQ = 64


class IndexDataset:
    """Sample i is the row [i, i]: a batch reveals which samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def samples(self, indices) -> np.ndarray:
        self.calls += 1
        idx = np.asarray(indices, dtype=np.int64)
        return np.stack([idx, idx], axis=1)


@pytest.fixture(scope="module")
def ds(demo_data: Path) -> PackedDataset:
    return PackedDataset(demo_data, SEQ)


@pytest.fixture
def copy(demo_data: Path, tmp_path: Path) -> Path:
    """A private copy of the demo data that a test may damage."""
    dst = tmp_path / "data"
    shutil.copytree(demo_data, dst, ignore=shutil.ignore_patterns("corpus"))
    return dst


# --- PackedDataset -------------------------------------------------------------------------

def test_dataset_random_access(ds: PackedDataset) -> None:
    assert len(ds) > 1000
    n = len(ds)
    idx = [0, n - 1, 17, 17, n // 2]
    rows = ds.samples(idx)
    assert rows.dtype == np.int64 and rows.shape == (5, SEQ + 1)
    for row, i in zip(rows, idx):
        np.testing.assert_array_equal(ds[i], row)
    np.testing.assert_array_equal(ds[-1], ds[n - 1])
    tok = Tokenizer.load(ds.tokenizer_path)
    assert rows.max() < tok.vocab_size
    with pytest.raises(IndexError):
        ds[n]
    with pytest.raises(IndexError):
        ds.samples([0, n])


def test_many_small_shards_and_tiny_cache_read_the_same_samples(ds, demo_data, tmp_path) -> None:
    from ftlm.data.prepare import prepare

    out = tmp_path / "sharded"
    prepare(demo_data / "corpus", out, demo_data / "tokenizer.json", SEQ, rows_per_shard=97,
            progress=False)
    small = PackedDataset(out, SEQ, cache_bytes=1)  # keeps one shard: evicts on every switch
    assert len(small.manifest["shards"]) > 10 and len(small) == len(ds)
    idx = np.random.default_rng(0).permutation(len(ds))[:500]
    np.testing.assert_array_equal(small.samples(idx), ds.samples(idx))
    assert len(small._cache) == 1


def test_missing_manifest_says_run_prepare(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="run `ftlm data prepare` first"):
        PackedDataset(tmp_path, SEQ)


def test_seq_len_mismatch_names_both_values(demo_data: Path) -> None:
    with pytest.raises(DataError, match=r"seq_len=64.*seq_len=128"):
        PackedDataset(demo_data, 128)


def test_other_tokenizer_is_refused(demo_data: Path) -> None:
    fp = Tokenizer.load(demo_data / "tokenizer.json").fingerprint
    PackedDataset(demo_data, SEQ, tokenizer_fingerprint=fp)
    with pytest.raises(DataError, match="prepared with another tokenizer"):
        PackedDataset(demo_data, SEQ, tokenizer_fingerprint="0" * 64)


def test_corrupt_shard_is_detected(copy: Path) -> None:
    shard = copy / "shard-00000.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"shard-00000\.parquet is corrupt.*ftlm data prepare"):
        PackedDataset(copy, SEQ)


def test_missing_shard_is_detected(copy: Path) -> None:
    (copy / "shard-00000.parquet").unlink()
    with pytest.raises(DataError, match=r"shard-00000\.parquet is missing.*re-run"):
        PackedDataset(copy, SEQ)


def test_manifest_rows_must_match_num_samples(copy: Path) -> None:
    m = json.loads((copy / "manifest.json").read_text())
    m["num_samples"] += 1
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="add up to"):
        PackedDataset(copy, SEQ)


# --- GlobalOrder ---------------------------------------------------------------------------

def test_order_is_a_seeded_permutation_per_epoch() -> None:
    a, b, c = GlobalOrder(50, seed=1), GlobalOrder(50, seed=1), GlobalOrder(50, seed=2)
    np.testing.assert_array_equal(a.indices(0, 200), b.indices(0, 200))
    assert not np.array_equal(a.indices(0, 50), c.indices(0, 50))
    for e in range(4):
        assert sorted(a.indices(e * 50, (e + 1) * 50)) == list(range(50))
    assert not np.array_equal(a.indices(0, 50), a.indices(50, 100))  # reshuffled each epoch
    assert [a.index(p) for p in range(37, 163)] == list(a.indices(37, 163))
    assert (a.epoch(49), a.epoch(50), a.epoch(149)) == (0, 1, 2)
    assert len(a.indices(5, 5)) == 0


# --- Loader: exactly once, resume, prefetch ------------------------------------------------

def _positions_of(batch: torch.Tensor, order: GlobalOrder, start: int) -> list[int]:
    ids = batch[:, 0].tolist()
    assert ids == list(order.indices(start, start + len(ids)))
    return ids


@pytest.mark.parametrize("participants", [1, 2, 3, 5])
@pytest.mark.parametrize("batch_size", [1, 4, 7])
def test_every_sample_once_per_epoch_for_any_split(participants: int, batch_size: int) -> None:
    n = 23  # prime: epoch boundaries fall inside batches
    with Loader(IndexDataset(n), seed=5, prefetch=2) as loader:
        seen: list[int] = []
        cursor = 0
        while cursor < 3 * n:
            for i in range(participants):
                seen += loader.batch(cursor, i, participants, batch_size)[:, 0].tolist()
            cursor += participants * batch_size
    assert seen == list(loader.order.indices(0, cursor))
    for e in range(3):
        assert sorted(seen[e * n:(e + 1) * n]) == list(range(n))


def test_changing_participants_between_steps_keeps_exactly_once() -> None:
    n, rng = 31, random.Random(0)
    with Loader(IndexDataset(n), seed=9, prefetch=3) as loader:
        seen, cursor = [], 0
        while cursor < 4 * n:
            p, b = rng.randint(1, 4), rng.randint(1, 6)
            if rng.random() < 0.2:  # a failed step: the same slice is fetched again, not advanced
                [loader.batch(cursor, i, p, b) for i in range(p)]
            for i in range(p):
                seen += loader.batch(cursor, i, p, b)[:, 0].tolist()
            cursor += p * b
    assert seen == list(loader.order.indices(0, cursor))
    for e in range(4):
        assert sorted(seen[e * n:(e + 1) * n]) == list(range(n))


def test_positions_follow_the_design() -> None:
    assert Loader.positions(100, 0, 3, 8) == (100, 108)
    assert Loader.positions(100, 2, 3, 8) == (116, 124)
    for bad in [(-1, 0, 1, 1), (0, 3, 3, 1), (0, 0, 1, 0), (0, -1, 2, 1)]:
        with pytest.raises(ValueError):
            Loader.positions(*bad)


def test_fresh_loader_at_a_cursor_resumes_exactly(ds: PackedDataset) -> None:
    p, b, steps, resume_at = 2, 8, 12, 5
    with Loader(ds, seed=3, prefetch=4) as first:
        ran = [[first.batch(s * p * b, i, p, b) for i in range(p)] for s in range(steps)]
    with Loader(ds, seed=3, prefetch=4) as fresh:
        for s in range(resume_at, steps):
            for i in range(p):
                assert torch.equal(fresh.batch(s * p * b, i, p, b), ran[s][i])
    with Loader(ds, seed=4, prefetch=0) as other_seed:
        assert not torch.equal(other_seed.batch(0, 0, p, b), ran[0][0])


def test_batches_are_dataset_rows_in_global_order(ds: PackedDataset) -> None:
    with Loader(ds, seed=11, prefetch=0) as loader:
        out = loader.batch(len(ds) - 3, 1, 2, 4)  # spans the end of epoch 0
        assert out.dtype == torch.int64 and out.shape == (4, SEQ + 1)
        start, stop = Loader.positions(len(ds) - 3, 1, 2, 4)
        np.testing.assert_array_equal(out.numpy(), ds.samples(loader.order.indices(start, stop)))


def test_prefetched_batches_equal_synchronous_ones(ds: PackedDataset) -> None:
    p, b = 3, 5
    with Loader(ds, seed=2, prefetch=3) as pre, Loader(ds, seed=2, prefetch=0) as sync:
        for s in range(8):
            c = s * p * b
            assert torch.equal(pre.batch(c, 1, p, b), sync.batch(c, 1, p, b))
            assert pre.wait_prefetched(timeout=10)
        assert pre.hits == 7  # every batch after the first came from the thread
        # A new quorum size and a retried step miss the prefetch and are computed correctly.
        for key in [(8 * p * b, 0, 2, b), (8 * p * b, 0, 2, b), (0, 2, 3, b)]:
            assert torch.equal(pre.batch(*key), sync.compute(*key))
        assert pre.hits == 7
        assert pre.wait_seconds > 0


def test_served_batch_is_not_shared_with_the_cache() -> None:
    with Loader(IndexDataset(10), seed=0, prefetch=2) as loader:
        loader.batch(0, 0, 1, 2)
        assert loader.wait_prefetched(timeout=10)
        got = loader.batch(2, 0, 1, 2)
        got.zero_()
        assert torch.equal(loader.batch(2, 0, 1, 2), loader.compute(2, 0, 1, 2))


def test_close_stops_the_thread_and_sync_reads_still_work() -> None:
    dataset = IndexDataset(10)
    loader = Loader(dataset, seed=0, prefetch=2)
    assert loader.alive
    loader.batch(0, 0, 1, 2)
    loader.close(timeout=5)
    assert not loader.alive
    loader.close()  # idempotent
    calls = dataset.calls
    assert loader.batch(2, 0, 1, 2)[:, 0].tolist() == list(loader.order.indices(2, 4))
    assert dataset.calls == calls + 1  # computed on the caller's thread, nothing prefetched
    with Loader(dataset, seed=0, prefetch=0) as no_thread:
        assert not no_thread.alive


def test_dataset_errors_reach_the_caller() -> None:
    class Broken(IndexDataset):
        def samples(self, indices):
            raise DataError("shard gone")

    with Loader(Broken(10), seed=0, prefetch=2) as loader:
        for cursor in (0, 2, 4):
            with pytest.raises(DataError, match="shard gone"):
                loader.batch(cursor, 0, 1, 2)
    assert not loader.alive


# --- malformed manifests: one-line DataErrors, shards confined to the folder ------------------

def _edit_manifest(folder: Path, edit) -> None:
    path = folder / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def _refused(folder: Path, *needles: str) -> str:
    with pytest.raises(DataError) as err:
        PackedDataset(folder, SEQ)
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert str(folder / "manifest.json") in msg or str(folder / "shard-00000.parquet") in msg, msg
    for needle in needles:
        assert needle in msg, msg
    return msg


@pytest.mark.parametrize("edit, needles", [
    (lambda m: m.pop("shards"), ["shards=None", "non-empty list"]),
    (lambda m: m.pop("seq_len"), ["seq_len is missing"]),
    (lambda m: m.pop("num_samples"), ["num_samples is missing"]),
    (lambda m: m.update(seq_len="64"), ["seq_len='64'", "integer"]),
    (lambda m: m.update(seq_len=64.0), ["seq_len=64.0", "integer"]),
    (lambda m: m.update(num_samples=None), ["num_samples=None", "integer"]),
    (lambda m: m.update(shards={"file": "x"}), ["shards=", "non-empty list"]),
    (lambda m: m.update(shards=[]), ["shards=[]", "non-empty list"]),
    (lambda m: m["shards"].__setitem__(0, "shard-00000.parquet"), ["shards[0]", "found a string"]),
    (lambda m: m["shards"][0].pop("file"), ["shards[0].file=None", "relative path"]),
    (lambda m: m["shards"][0].pop("rows"), ["shards[0].rows is missing"]),
    (lambda m: m["shards"][0].update(rows=True), ["shards[0].rows=True", "integer"]),
    (lambda m: m["shards"][0].update(rows=-3), ["shards[0].rows=-3", "integer"]),
    (lambda m: m["shards"][0].pop("sha256"), ["shards[0].sha256=None", "hex"]),
    (lambda m: m["shards"][0].update(sha256=7), ["shards[0].sha256=7", "hex"]),
    (lambda m: m.update(tokenizer_fingerprint=[1]), ["tokenizer_fingerprint=[1]", "string"]),
    (lambda m: m.update(format_version="1"), ["format_version '1'", "reads 1"]),
    (lambda m: m["shards"].append(dict(m["shards"][0])), ["listed twice"]),
])
def test_malformed_manifest_fields_are_one_line_data_errors(copy: Path, edit, needles) -> None:
    _edit_manifest(copy, edit)
    _refused(copy, *needles, "ftlm data prepare")


@pytest.mark.parametrize("text, needle", [
    (b"[1, 2]", "must hold a JSON object, found a list"),
    (b"{\"format_version\": 1,", "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[" * 100_000, "not readable JSON"),
    (b"{\"format_version\": " + b"9" * 5000 + b"}", "not readable JSON"),
])
def test_unparseable_manifest_is_a_one_line_data_error(copy: Path, text: bytes, needle) -> None:
    (copy / "manifest.json").write_bytes(text)
    _refused(copy, needle)


@pytest.mark.parametrize("file", ["../../etc/passwd", "/etc/passwd", "sub/../../x.parquet"])
def test_shard_paths_outside_the_folder_are_refused(copy: Path, file: str) -> None:
    _edit_manifest(copy, lambda m: m["shards"][0].update(file=file))
    _refused(copy, f"file={file!r}", "relative path inside the data folder")


def test_symlinked_shard_leading_outside_is_refused(copy: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.parquet"
    shard = copy / "shard-00000.parquet"
    shard.rename(outside)
    shard.symlink_to(outside)
    msg = _refused(copy, "leads outside the data folder")
    assert str(outside) in msg
    # A symlink that stays inside the folder is fine.
    shard.unlink()
    outside.rename(copy / "real.parquet")
    shard.symlink_to(copy / "real.parquet")
    assert len(PackedDataset(copy, SEQ)) > 0


def test_shard_of_the_wrong_column_type_is_a_data_error(copy: Path) -> None:
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = copy / "shard-00000.parquet"
    rows = json.loads((copy / "manifest.json").read_text())["shards"][0]["rows"]
    pq.write_table(pa.table({"tokens": list(range(rows))}), bad)
    _edit_manifest(copy, lambda m: m["shards"][0].update(
        sha256=hashlib.sha256(bad.read_bytes()).hexdigest()))
    ds = PackedDataset(copy, SEQ)
    with pytest.raises(DataError, match=r"tokens column of type int64, expected a list"):
        ds[0]
