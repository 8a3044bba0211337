"""prepare: packing, shards and manifest, equal results across input formats, input errors."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ftlm.data.loader import PackedDataset
from ftlm.data.prepare import prepare
from ftlm.data.tokenizer import Tokenizer
from ftlm.errors import DataError

SEQ = 16


@pytest.fixture(scope="module")
def tok_path(demo_data: Path) -> Path:
    return demo_data / "tokenizer.json"


@pytest.fixture(scope="module")
def docs() -> list[str]:
    rng = random.Random(3)
    words = ["import", "def", "return", "class", "self", "None", "x", "=", "(", ")", "ü", "🙂"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 120))) for _ in range(40)]


def _inputs(root: Path, docs: list[str]) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    folder = root / "txt"
    folder.mkdir(exist_ok=True)
    for i, d in enumerate(docs):
        (folder / f"doc-{i:04d}.txt").write_text(d, encoding="utf-8")
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)),
                     encoding="utf-8")
    parquet = root / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), parquet)
    return {"txt": folder, "jsonl": jsonl, "parquet": parquet}


def _all_samples(out: Path) -> np.ndarray:
    ds = PackedDataset(out, SEQ)
    return ds.samples(np.arange(len(ds)))


def test_txt_jsonl_parquet_give_the_same_samples(tmp_path, docs, tok_path) -> None:
    results = {}
    for kind, path in _inputs(tmp_path / "in", docs).items():
        m = prepare(path, tmp_path / kind, tok_path, SEQ, rows_per_shard=7, progress=False)
        results[kind] = (_all_samples(tmp_path / kind), m["tokenizer_fingerprint"], m["documents"])
    first = results["txt"]
    for kind in ("jsonl", "parquet"):
        np.testing.assert_array_equal(results[kind][0], first[0])
        assert results[kind][1:] == first[1:]


def test_packing_is_bos_doc_eos_cut_into_non_overlapping_samples(tmp_path, docs, tok_path) -> None:
    tok = Tokenizer.load(tok_path)
    stream = [t for d in docs for t in [tok.bos_id, *tok.encode(d), tok.eos_id]]
    width = SEQ + 1
    n = len(stream) // width
    m = prepare(_inputs(tmp_path / "in", docs)["jsonl"], tmp_path / "out", tok_path, SEQ,
                rows_per_shard=5, progress=False)
    samples = _all_samples(tmp_path / "out")
    assert m["num_samples"] == n == len(samples)
    assert m["tokens"] == len(stream)
    np.testing.assert_array_equal(samples.reshape(-1), np.array(stream[: n * width]))
    assert samples.dtype == np.int64 and samples.shape == (n, width)


def test_manifest_describes_the_shards(tmp_path, docs, tok_path) -> None:
    out = tmp_path / "out"
    m = prepare(_inputs(tmp_path / "in", docs)["txt"], out, tok_path, SEQ, rows_per_shard=10,
                progress=False)
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == m
    tok = Tokenizer.load(tok_path)
    assert m["format_version"] == 1
    assert m["seq_len"] == SEQ
    assert m["tokenizer_fingerprint"] == tok.fingerprint
    assert m["vocab_size"] == tok.vocab_size
    assert m["source"] == str((tmp_path / "in" / "txt").resolve())
    assert m["documents"] == len(docs)
    assert isinstance(m["created_at"], float)
    rows = [s["rows"] for s in m["shards"]]
    assert sum(rows) == m["num_samples"] and len(rows) > 1
    assert all(r == 10 for r in rows[:-1]) and 0 < rows[-1] <= 10
    for i, shard in enumerate(m["shards"]):
        assert shard["file"] == f"shard-{i:05d}.parquet"
        data = (out / shard["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        table = pq.read_table(out / shard["file"])
        assert table.column_names == ["tokens"]
        assert table.schema.field("tokens").type == pa.list_(pa.int32(), SEQ + 1)
    assert Tokenizer.load(out / "tokenizer.json").fingerprint == tok.fingerprint
    assert not list(out.glob("*.tmp"))


def test_re_prepare_replaces_stale_shards(tmp_path, docs, tok_path) -> None:
    inputs = _inputs(tmp_path / "in", docs)
    out = tmp_path / "out"
    prepare(inputs["txt"], out, tok_path, SEQ, rows_per_shard=3, progress=False)
    m = prepare(inputs["txt"], out, tok_path, SEQ, rows_per_shard=1000, progress=False)
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-00000.parquet"]
    assert len(m["shards"]) == 1


def test_worker_pool_gives_the_same_samples(tmp_path, docs, tok_path) -> None:
    path = _inputs(tmp_path / "in", docs * 8)["jsonl"]
    a = prepare(path, tmp_path / "a", tok_path, SEQ, progress=False)
    b = prepare(path, tmp_path / "b", tok_path, SEQ, workers=2, progress=False)
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]


def test_progress_bar_goes_to_stderr(tmp_path, docs, tok_path, capsys) -> None:
    prepare(_inputs(tmp_path / "in", docs)["txt"], tmp_path / "out", tok_path, SEQ, progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"{len(docs)}/{len(docs)}" in captured.err


def _expect(match: str, input: Path, out: Path, tok: Path, **kw) -> None:
    with pytest.raises(DataError, match=match):
        prepare(input, out, tok, kw.pop("seq_len", SEQ), progress=False, **kw)
    assert not (out / "manifest.json").exists()


def test_each_bad_input_gets_its_error(tmp_path, tok_path) -> None:
    out = tmp_path / "out"
    _expect(r"input .*missing does not exist", tmp_path / "missing", out, tok_path)
    csv = tmp_path / "docs.csv"
    csv.write_text("text\nhello\n")
    _expect(r"unsupported input file type '\.csv'", csv, out, tok_path)
    (tmp_path / "empty").mkdir()
    _expect(r"no \.txt files", tmp_path / "empty", out, tok_path)
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    _expect(r"no documents found", tmp_path / "blank", out, tok_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "a.txt").write_text("hi")
    _expect(r"too small: its 1 document\(s\) gave \d+ tokens .* needs seq_len \+ 1 = 1001",
            tmp_path / "tiny", out, tok_path, seq_len=1000)
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "a"}\n\n{"text": "b"}\n{"text": oops}\n')
    _expect(r"bad\.jsonl:4: not valid JSON", bad_json, out, tok_path)
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"text": "a"}\n{"body": "b"}\n')
    _expect(r"nofield\.jsonl:2: no field 'text' \(found \['body'\]\)", no_field, out, tok_path)
    _expect(r"nofield\.jsonl:1: no field 'body'", no_field, out, tok_path, text_field="body")
    _expect(r"--field of `ftlm data prepare`", no_field, out, tok_path)  # the option's real name
    huge = tmp_path / "huge.jsonl"
    huge.write_text('{"text": "a", "n": ' + "9" * 5000 + "}\n")
    _expect(r"huge\.jsonl:1: not readable JSON", huge, out, tok_path)
    not_str = tmp_path / "notstr.jsonl"
    not_str.write_text('{"text": 5}\n')
    _expect(r"notstr\.jsonl:1: field 'text' is a int", not_str, out, tok_path)
    parquet = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"body": ["a"], "id": [1]}), parquet)
    _expect(r"no column 'text'; its columns are \['body', 'id'\]", parquet, out, tok_path)
    _expect(r"tokenizer file .*none\.json does not exist", tmp_path / "tiny", out,
            tmp_path / "none.json")


# --- malformed text: one-line errors naming the file and line, nothing left behind --------------

def test_latin1_bytes_in_jsonl_name_the_line(tmp_path, tok_path) -> None:
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    _expect(r"latin1\.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 14\); re-encode the file "
            r"as UTF-8", bad, tmp_path / "out", tok_path)


def test_lone_surrogate_in_jsonl_names_the_line(tmp_path, tok_path) -> None:
    bad = tmp_path / "surrogate.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "half \\ud800 a pair"}\n', encoding="utf-8")
    _expect(r"surrogate\.jsonl:2: field 'text' holds a lone surrogate \(\\ud800\).*UTF-8",
            bad, tmp_path / "out", tok_path)


def test_deeply_nested_jsonl_line_is_a_data_error(tmp_path, tok_path) -> None:
    bad = tmp_path / "deep.jsonl"
    bad.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    _expect(r"deep\.jsonl:1: .*nested too deeply", bad, tmp_path / "out", tok_path)


def test_invalid_utf8_in_parquet_names_the_row(tmp_path, tok_path) -> None:
    raw = pa.array([b"fine", b"also fine", b"caf\xe9"], type=pa.binary()).view(pa.string())
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": raw}), bad)
    _expect(r"bad\.parquet: row 2 of column 'text' is not valid UTF-8", bad, tmp_path / "out",
            tok_path)


def test_empty_folder_is_refused_before_anything_is_created(tmp_path, tok_path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"no \.txt files found in .*empty"):
        prepare(tmp_path / "empty", out, tok_path, SEQ, progress=True)
    assert not out.exists()
    assert capsys.readouterr().err == ""  # no empty progress bar either


def test_failed_prepare_removes_the_output_folder_it_created(tmp_path, tok_path) -> None:
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "a.txt").write_text("hi")
    out = tmp_path / "new" / "out"
    with pytest.raises(DataError, match="too small"):
        prepare(tmp_path / "tiny", out, tok_path, 1000, progress=False)
    assert not out.exists()
    # A folder that was there before is kept (it may hold other things), only emptied of shards.
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="too small"):
        prepare(tmp_path / "tiny", out, tok_path, 1000, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_output_that_is_a_file_is_refused(tmp_path, docs, tok_path) -> None:
    folder = _inputs(tmp_path / "in", docs)["txt"]
    out = tmp_path / "out.txt"
    out.write_text("not a folder")
    with pytest.raises(DataError, match=r"out\.txt exists and is not a folder"):
        prepare(folder, out, tok_path, SEQ, progress=False)
    assert out.read_text() == "not a folder"
