"""Byte-level BPE tokenizer: lossless round trip, special tokens, fingerprint, training inputs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ftlm.data.tokenizer import SPECIAL_TOKENS, Tokenizer, train_tokenizer
from ftlm.errors import ConfigError, DataError

# Code-point ranges that stress byte-level tokenisation: controls (NUL, lone CR/LF), Latin-1,
# combining marks, Arabic/Devanagari, CJK, emoji and other astral-plane characters.
_RANGES = [(0x00, 0x7F), (0x80, 0x24F), (0x300, 0x36F), (0x600, 0x6FF), (0x900, 0x97F),
           (0x2000, 0x206F), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
           (0xE000, 0xF8FF), (0x1F300, 0x1FAFF), (0x10000, 0x10FFFF)]


def _random_text(rng: random.Random) -> str:
    chars = []
    for _ in range(rng.randint(0, 60)):
        lo, hi = rng.choice(_RANGES)
        cp = rng.randint(lo, hi)
        if 0xD800 <= cp <= 0xDFFF:  # surrogates are not encodable as UTF-8
            cp = 0x20
        chars.append(chr(cp))
    return "".join(chars)


@pytest.fixture(scope="module")
def tok(demo_data: Path) -> Tokenizer:
    return Tokenizer.load(demo_data / "tokenizer.json")


def test_random_unicode_round_trips_exactly(tok: Tokenizer) -> None:
    rng = random.Random(1234)
    texts = [_random_text(rng) for _ in range(500)]
    for text in texts:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert [tok.decode(ids) for ids in tok.encode_batch(texts)] == texts


@pytest.mark.parametrize("text", ["", "\x00", "\n", "\r", "\r\n\n", " ", "  x  ", "e\u0301",
                                  "\U0001F469\u200D\U0001F467\U0001F389", "日本語のテキスト",
                                  "tab\tand\u00a0nbsp\u2028",
                                  "def f(x):\n    return x  # ok\n"])
def test_edge_strings_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_token_strings_in_text_are_not_special(tok: Tokenizer) -> None:
    text = "a<|eos|>b<|bos|><|assistant|>"
    ids = tok.encode(text)
    specials = {tok.token_id(t) for t in SPECIAL_TOKENS}
    assert not specials & set(ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *tok.encode("hi"), tok.eos_id]) == "<|bos|>hi<|eos|>"


def test_special_ids_distinct_and_stable_across_save_load(tok: Tokenizer, tmp_path: Path) -> None:
    ids = [tok.token_id(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(len(SPECIAL_TOKENS)))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    tok.save(tmp_path / "copy.json")
    again = Tokenizer.load(tmp_path / "copy.json")
    assert [again.token_id(t) for t in SPECIAL_TOKENS] == ids
    assert again.fingerprint == tok.fingerprint
    assert again.vocab_size == tok.vocab_size
    with pytest.raises(KeyError, match="not a special token"):
        tok.token_id("<|nope|>")


def _write_docs(tmp_path: Path, docs: list[str]) -> dict[str, Path]:
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"{i:03d}.txt").write_text(d, encoding="utf-8")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs), encoding="utf-8")
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"content": docs}), parquet)
    return {"txt": folder, "jsonl": jsonl, "parquet": parquet}


def test_trains_the_same_tokenizer_from_txt_jsonl_and_parquet(tmp_path: Path) -> None:
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "über", "naïve", "数据", "🙂", "the", "of"]
    docs = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(20)]
    inputs = _write_docs(tmp_path, docs)
    fps = set()
    for kind, path in inputs.items():
        t = train_tokenizer([path], tmp_path / f"{kind}.json", vocab_size=300,
                            text_field="body", column="content")
        assert t.vocab_size == 300
        assert Tokenizer.load(tmp_path / f"{kind}.json").fingerprint == t.fingerprint
        assert t.decode(t.encode(docs[0])) == docs[0]
        fps.add(t.fingerprint)
    assert len(fps) == 1  # same documents, same order -> identical tokenizer
    other = train_tokenizer([inputs["txt"]], tmp_path / "other.json", vocab_size=290)
    assert other.fingerprint not in fps


def test_train_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        train_tokenizer([tmp_path / "missing"], tmp_path / "t.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .txt files"):
        train_tokenizer([tmp_path / "empty"], tmp_path / "t.json")
    (tmp_path / "blank.txt").write_text("")
    with pytest.raises(DataError, match="no text found"):
        train_tokenizer([tmp_path / "blank.txt"], tmp_path / "t.json")
    with pytest.raises(ConfigError, match="vocab_size=100"):
        train_tokenizer([tmp_path / "blank.txt"], tmp_path / "t.json", vocab_size=100)
    assert not (tmp_path / "t.json").exists()


def test_load_errors_name_the_path_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nothere\.json does not exist.*ftlm tokenizer train"):
        Tokenizer.load(tmp_path / "nothere.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match=r"cannot read tokenizer file .*bad\.json"):
        Tokenizer.load(bad)


def test_train_on_malformed_jsonl_is_a_one_line_data_error(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl:1: not valid UTF-8"):
        train_tokenizer([latin1], tmp_path / "t.json", vocab_size=300)
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"text": "ok"}\n{"text": "\\udc80"}\n')
    with pytest.raises(DataError, match=r"surrogate\.jsonl:2: field 'text' holds a lone surrogate"):
        train_tokenizer([surrogate], tmp_path / "t.json", vocab_size=300)
    assert not (tmp_path / "t.json").exists()
