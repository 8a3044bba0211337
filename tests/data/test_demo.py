"""Demo corpus and the cached demo dataset."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from ftlm.data.corpus import build_demo_corpus
from ftlm.data.demo import ensure_demo_data
from ftlm.data.loader import PackedDataset
from ftlm.errors import DataError


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.txt"))}


def test_demo_corpus_is_deterministic_and_capped(tmp_path: Path) -> None:
    a = _files(build_demo_corpus(tmp_path / "a", max_bytes=300_000))
    b = _files(build_demo_corpus(tmp_path / "b", max_bytes=300_000))
    assert a == b and len(a) > 3
    total = sum(len(v) for v in a.values())
    assert 250_000 < total <= 300_000
    for data in a.values():
        data.decode("utf-8")  # cut at a line boundary: still valid UTF-8
    assert any(b'"""' in v for v in a.values())  # docstrings are in
    again = _files(build_demo_corpus(tmp_path / "a", max_bytes=100_000))  # rebuild in place
    assert sum(len(v) for v in again.values()) <= 100_000


def test_demo_corpus_refuses_a_foreign_folder(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("keep me")
    with pytest.raises(DataError, match="was not built by build_demo_corpus"):
        build_demo_corpus(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.md").read_text() == "keep me"


def test_demo_data_is_built_once_and_rebuilt_when_parameters_change(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    kw = dict(seq_len=32, vocab_size=300, max_bytes=120_000, progress=False)
    assert ensure_demo_data(root, **kw) == root
    manifest = root / "manifest.json"
    first = manifest.read_text()
    assert ensure_demo_data(root, **kw) == root
    assert manifest.read_text() == first  # cached: not rebuilt (created_at would differ)
    ensure_demo_data(root, **{**kw, "seq_len": 48})
    assert json.loads(manifest.read_text())["seq_len"] == 48
    ds = PackedDataset(root, 48)
    assert len(ds) > 100 and ds[0][0] == 0  # the stream starts with BOS


def test_concurrent_callers_build_once(tmp_path: Path, monkeypatch) -> None:
    import ftlm.data.demo as demo

    builds = []
    real_build = demo._build
    monkeypatch.setattr(demo, "_build", lambda *a: (builds.append(1), real_build(*a)))
    root = tmp_path / "demo"
    kw = dict(seq_len=32, vocab_size=300, max_bytes=60_000, progress=False)
    results, errors = [], []

    def call() -> None:
        try:
            results.append(ensure_demo_data(root, **kw))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert results == [root] * 3
    assert len(builds) == 1


def test_demo_fixture_has_enough_samples_for_trainer_tests(demo_data: Path) -> None:
    ds = PackedDataset(demo_data, 64)
    assert len(ds) > 1000
    assert (demo_data / "tokenizer.json").is_file()
