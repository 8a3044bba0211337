"""Post-training data: the chat template's learn mask, packing with document ids, files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ftlm.errors import ConfigError, DataError
from ftlm.data.chat import completion_ids, completion_text, prompt_ids, render
from ftlm.post.config import PostConfig
from ftlm.post.data import pack, pair_rows, read_records, sft_rows, task_records
from ftlm.tasks import generate, write_tasks


def test_template_learns_only_assistant_content_and_its_end(tokenizer) -> None:
    ids, mask = render(tokenizer, [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "What is 2 + 2?"},
                                   {"role": "assistant", "content": "Answer: 4"}])
    learned = [i for i, m in zip(ids, mask) if m]
    assert learned == completion_ids(tokenizer, "Answer: 4")
    # The prompt a sampler starts from is exactly the unlearned head of the conversation.
    head = prompt_ids(tokenizer, "What is 2 + 2?")
    user_only, _ = render(tokenizer, [{"role": "user", "content": "What is 2 + 2?"},
                                      {"role": "assistant", "content": "Answer: 4"}])
    assert user_only[:len(head)] == head and user_only[len(head):] == learned
    assert completion_text(tokenizer, learned + [5, 6]) == "Answer: 4"


def test_template_refuses_unknown_roles(tokenizer) -> None:
    with pytest.raises(DataError, match="role one of system, user, assistant"):
        render(tokenizer, [{"role": "bot", "content": "hi"}])


def test_packing_keeps_every_document_whole_and_in_order() -> None:
    docs = [([1] * n, [0] * (n // 2) + [1] * (n - n // 2)) for n in (5, 7, 3, 9, 2)]
    rows = pack(docs, seq_len=11, pad_id=2)  # rows of 12 tokens
    assert rows.shape[1:] == (3, 12)
    seen = []
    for row in rows:
        tokens, mask, doc = row
        for d in range(doc.max() + 1):
            where = np.flatnonzero(doc == d)
            assert np.all(np.diff(where) == 1)  # contiguous
            if np.all(tokens[where] == 2) and mask[where].sum() == 0 and where[-1] == 11:
                continue  # the padding document
            seen.append(len(where))
    assert seen == [5, 7, 3, 9, 2]
    assert rows[0, 2].tolist() == [0] * 5 + [1] * 7  # 5 + 7 fill the first row exactly


def test_packing_refuses_a_document_longer_than_a_row() -> None:
    with pytest.raises(DataError, match="raise data.seq_len"):
        pack([([1] * 20, [1] * 20)], seq_len=10, pad_id=2)


@pytest.mark.parametrize("suffix,style", [(".jsonl", "messages"), (".parquet", "prompt_completion")])
def test_task_files_of_either_style_and_format_give_the_same_rows(tmp_path, tokenizer, suffix,
                                                                  style) -> None:
    tasks = generate("mod,count", "train", 6, 0)
    path = write_tasks(tasks, tmp_path / f"t{suffix}", style=style)
    rows = sft_rows(read_records(path, "instruction"), tokenizer, 96, str(path))
    expected = sft_rows(task_records(tasks), tokenizer, 96, "suite")
    assert np.array_equal(rows, expected)


def test_preference_rows_mask_only_the_completions(tokenizer) -> None:
    rows = pair_rows([{"prompt": "What is 2 + 2?", "chosen": "Answer: 4", "rejected": "Answer: 5"}],
                     tokenizer, 40, "pairs")
    chosen, cmask, rejected, rmask = rows[0]
    assert chosen[cmask == 1].tolist() == completion_ids(tokenizer, "Answer: 4")
    assert rejected[rmask == 1].tolist() == completion_ids(tokenizer, "Answer: 5")
    assert chosen[cmask == 0][-1] == tokenizer.pad_id  # right-padded


def test_bad_files_and_records_are_one_line_errors(tmp_path, tokenizer) -> None:
    with pytest.raises(DataError, match="not found"):
        read_records(tmp_path / "missing.jsonl", "instruction")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not JSON"):
        read_records(bad, "instruction")
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DataError, match="'prompt' and 'completion'"):
        sft_rows(read_records(bad, "instruction"), tokenizer, 32, str(bad))
    with pytest.raises(DataError, match="'chosen' and 'rejected'"):
        pair_rows([{"prompt": "x", "chosen": "y"}], tokenizer, 32, "pairs")


def test_post_config_names_the_bad_field() -> None:
    with pytest.raises(ConfigError, match=r"post.dpo_loss='hinge' must be one of sigmoid, ipo"):
        PostConfig(dpo_loss="hinge")
    with pytest.raises(ConfigError, match=r"post.group_size=1 must be at least 2"):
        PostConfig(group_size=1)
    with pytest.raises(ConfigError, match=r"post.clip=1.5 must be a finite number > 0 and < 1"):
        PostConfig(clip=1.5)
    with pytest.raises(ConfigError, match=r"post.verify='steps' must be one of answer, trace"):
        PostConfig(verify="steps")


@pytest.mark.parametrize("line, message", [
    (b'{"prompt": "caf\xe9", "completion": "x"}', r"bad.jsonl:2: not UTF-8 \(byte 0xe9"),
    (b'{"prompt": "a\\ud800", "completion": "x"}', r"bad.jsonl:2: prompt holds a lone surrogate"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", r"bad.jsonl:2: the JSON nests"),
    (b'{"prompt": "x", "completion": "y", "n": ' + b"9" * 5000 + b"}", r"bad.jsonl:2: not JSON"),
    (b'{"messages": ["hello", "hi"]}', r"bad.jsonl:2: messages\[0\] must be an object"),
    (b'{"chosen": [{"role": "user", "content": 3}]}', r"bad.jsonl:2: chosen\[0\] must be"),
])
def test_broken_records_are_one_line_errors_naming_file_and_line(tmp_path, line, message) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "fine", "completion": "ok"}\n' + line + b"\n")
    with pytest.raises(DataError, match=message) as caught:
        read_records(bad, "instruction")
    assert "\n" not in str(caught.value)


def test_an_overlong_line_is_refused_by_its_length(tmp_path, monkeypatch) -> None:
    import ftlm.post.data as data
    monkeypatch.setattr(data, "MAX_LINE_BYTES", 1 << 10)  # the rule at 1 KiB: no 100 MB file
    bad = tmp_path / "big.jsonl"
    bad.write_text(json.dumps({"prompt": "x" * 5000, "completion": "y"}) + "\n")
    with pytest.raises(DataError, match=r"big.jsonl:1: the line is longer than"):
        read_records(bad, "instruction")


def test_messages_given_as_strings_are_refused_by_the_chat_template(tokenizer) -> None:
    from ftlm.data.chat import render
    with pytest.raises(DataError, match="a message must be"):
        render(tokenizer, ["hello", "hi"])
