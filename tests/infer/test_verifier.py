"""The line-by-line verifier: its conversations, labelled data from the task suite, scoring."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from infer_helpers import tiny_model

from ftlm.errors import ConfigError
from ftlm.infer import strategies as st
from ftlm.infer.verifier import (
    INTRO,
    REDUCE,
    Verifier,
    solution_lines,
    verification_messages,
    verifier_records,
    write_verifier_data,
)
from ftlm.data.chat import render
from ftlm.tasks import check, extract_answer
from ftlm.tasks import generate as generate_tasks

sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))
from serve_helpers import make_tokenizer


def _lines_and_verdicts(record: dict) -> tuple[str, list[str], list[str]]:
    """The prompt, the judged lines and the verdicts of a verification conversation."""
    messages = record["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2)
    prompt, first = messages[0]["content"].split(f"\n\n{INTRO}\n")
    lines = [first] + [m["content"] for m in messages[2::2]]
    return prompt, lines, [m["content"] for m in messages[1::2]]


def test_records_label_reference_solutions_yes_and_changed_answers_no(tmp_path):
    tasks = generate_tasks(["add", "mod", "sort", "count"], "train", 12, 0)
    by_prompt = {t.prompt: t for t in tasks}
    records = verifier_records(tasks, wrong_per_task=2, seed=1)
    assert len(records) == 36 and sum(r["label"] == "yes" for r in records) == 12
    for r in records:
        prompt, lines, verdicts = _lines_and_verdicts(r)
        completion = "\n".join(lines)
        task = by_prompt[prompt]
        assert check(task, completion) == (r["label"] == "yes")
        assert extract_answer(completion) is not None
        assert lines[:-1] == solution_lines(task.solution)[:-1]  # the reasoning is the reference's
        assert verdicts == ["yes"] * (len(lines) - 1) + [r["label"]]  # only the answer line may be no
    path = write_verifier_data(tasks, tmp_path / "verifier.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == verifier_records(tasks)


def test_a_conversation_asks_about_every_non_blank_line_once():
    messages = verification_messages("What is 1 + 2?", "<think>\n1+2=3\n\n</think>\nAnswer: 3\n",
                                     ["yes", "yes", "yes", "no"])
    assert messages[0]["content"] == f"What is 1 + 2?\n\n{INTRO}\n<think>"
    assert [m["content"] for m in messages[1:]] == ["yes", "1+2=3", "yes", "</think>", "yes",
                                                    "Answer: 3", "no"]
    assert verification_messages("q", "a\nb")[1::2] == [{"role": "assistant", "content": "yes"}] * 2
    assert solution_lines("") == [""]  # an empty reply is still judged (one line)
    for verdicts in (["yes"], ["yes", "maybe"]):
        with pytest.raises(ConfigError, match="one 'yes' or 'no' per non-blank line"):
            verification_messages("q", "a\nb", verdicts)


def test_the_score_is_the_product_of_each_lines_yes_no_softmax_read_before_its_verdict(tmp_path):
    """Each factor is the model's P(yes) vs P(no) at the <|assistant|> cue of that line, with the
    earlier verdicts teacher-forced to yes; batched (right-padded) equals one at a time, and a
    partial solution's factors are the first factors of the whole (beam search scores partials)."""
    tok = make_tokenizer(tmp_path)
    model = tiny_model(vocab_size=tok.vocab_size, max_seq_len=256)
    verifier = Verifier(model, tok, batch=2)
    whole = "<think>\n2+0=2\n1+3=4\n</think>\nAnswer: 42"
    pairs = [("What is 12 + 30?", whole), ("What is 1 + 2?", "Answer: 4"),
             ("What is 12 + 30?", "<think>\n2+0=2\n")]
    lines = verifier.line_probabilities(pairs)
    assert [len(x) for x in lines] == [5, 1, 2]
    cue = tok.token_id("<|assistant|>")
    for (prompt, completion), got in zip(pairs, lines):
        ids, _ = render(tok, verification_messages(prompt, completion))
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0]
        want = [logits[t, [verifier.yes, verifier.no]].softmax(-1)[0].item()
                for t in range(len(ids) - 1) if ids[t] == cue]
        assert got == pytest.approx(want, abs=1e-5) and all(0.0 <= p <= 1.0 for p in got)
    assert lines[2] == pytest.approx(lines[0][:2], abs=1e-5)
    assert verifier.probabilities(pairs) == pytest.approx([min(x) for x in lines])
    verifier.reduce = REDUCE["product"]
    assert verifier.probabilities(pairs) == pytest.approx([math.prod(x) for x in lines])
    with pytest.raises(ConfigError, match="reduce='mean'"):
        Verifier(model, tok, reduce="mean")
    assert len(verifier.token_ids(*pairs[0])) == len(render(tok, verification_messages(*pairs[0]))[0])
    cands = [st.Candidate(c, [1], [-1.0], "stop", extract_answer(c)) for _, c in pairs[:2]]
    verifier.score_all(pairs[0][0], cands)
    got = verifier.probabilities([(pairs[0][0], c.text) for c in cands])
    assert st.best_of_n(cands, pairs[0][0], verifier).text == cands[int(got[1] > got[0])].text


def test_the_verifier_memo_stays_bounded_and_scores_stay_exact(tmp_path):
    tok = make_tokenizer(tmp_path)
    verifier = Verifier(tiny_model(vocab_size=tok.vocab_size, max_seq_len=128), tok)
    verifier.cache_limit = 4
    cands = [st.Candidate(f"Answer: {i}", [1], [-1.0], "stop", str(i)) for i in range(6)]
    want = verifier.probabilities([("q", c.text) for c in cands])
    for batch in (cands[:3], cands[3:]):
        verifier.score_all("q", batch)
        assert len(verifier._cache) <= 4  # a long-running server does not grow without bound
        assert [verifier("q", c) for c in batch] == pytest.approx(want[cands.index(batch[0]):][:3],
                                                                 abs=1e-6)
    assert [verifier("q", c) for c in cands] == pytest.approx(want, abs=1e-6)
    assert len(verifier._cache) <= 4
