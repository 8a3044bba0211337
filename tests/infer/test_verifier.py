"""The outcome verifier: labelled training data from the task suite and P(yes) scoring."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from infer_helpers import tiny_model

from ftlm.infer import strategies as st
from ftlm.infer.chat import render_chat
from ftlm.infer.verifier import (
    Verifier,
    verification_messages,
    verifier_records,
    write_verifier_data,
)
from ftlm.tasks import check, extract_answer
from ftlm.tasks import generate as generate_tasks

sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))
from serve_helpers import make_tokenizer


def test_records_label_reference_solutions_yes_and_changed_answers_no(tmp_path):
    tasks = generate_tasks(["add", "mod", "sort", "count"], "train", 12, 0)
    by_prompt = {t.prompt: t for t in tasks}
    records = verifier_records(tasks, wrong_per_task=2, seed=1)
    assert len(records) == 36 and sum(r["label"] == "yes" for r in records) == 12
    for r in records:
        user, reply = r["messages"]
        prompt, rest = user["content"].split("\n\nProposed solution:\n")
        completion = rest.rsplit("\n\n", 1)[0]
        assert reply == {"role": "assistant", "content": r["label"]}
        assert check(by_prompt[prompt], completion) == (r["label"] == "yes")
        assert extract_answer(completion) is not None
    path = write_verifier_data(tasks, tmp_path / "verifier.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == verifier_records(tasks)


def test_verifier_probability_is_the_yes_no_softmax_of_the_model(tmp_path):
    tok = make_tokenizer(tmp_path)
    model = tiny_model(vocab_size=tok.vocab_size, max_seq_len=128)
    verifier = Verifier(model, tok, batch=2)
    pairs = [("What is 1 + 2?", "Answer: 3"), ("What is 1 + 2?", "Answer: 4"),
             ("How many a in banana?", "<think>\nb:0 a:1\n</think>\nAnswer: 3")]
    got = verifier.probabilities(pairs)
    for (prompt, completion), p in zip(pairs, got):
        ids = torch.tensor([render_chat(verification_messages(prompt, completion), tok)])
        with torch.no_grad():
            last = model(ids)[0, -1]
        want = last[[verifier.yes, verifier.no]].softmax(-1)[0].item()
        assert abs(p - want) < 1e-4 and 0.0 <= p <= 1.0
    cands = [st.Candidate(c, [1], [-1.0], "stop", extract_answer(c)) for _, c in pairs[:2]]
    verifier.score_all(pairs[0][0], cands)
    choice = st.best_of_n(cands, pairs[0][0], verifier)
    assert choice.text == pairs[int(got[1] > got[0])][1]


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
