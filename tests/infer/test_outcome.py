"""The outcome verifier: likelihood features of a small model, a balanced logistic head, scoring."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from infer_helpers import tiny_model

from ftlm.errors import ConfigError, DataError
from ftlm.infer import strategies as st
from ftlm.infer.outcome import (
    FEATURES,
    FLOOR,
    Head,
    OutcomeVerifier,
    fit_head,
    likelihood_features,
    load_head,
    save_head,
    split_answer,
    token_ids,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))
from serve_helpers import make_tokenizer

WORK = "<think>\n2+0=2, write 2\n</think>\nAnswer: 42"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_the_answer_part_is_read_after_the_reasoning(tok):
    assert split_answer(WORK) == ("<think>\n2+0=2, write 2\n</think>", "\nAnswer: 42")
    assert split_answer("no answer here") == ("no answer here", "")
    ids, start, answer = token_ids(tok, "What is 12 + 30?", WORK)
    assert start < answer < len(ids) - 1
    assert tok.decode(ids[start:answer]) == "<think>\n2+0=2, write 2\n</think>"
    assert tok.decode(ids[answer:-1]) == "\nAnswer: 42"
    assert ids[-1] == tok.token_id("<|end|>")


def test_features_are_the_models_log_probabilities_batched_or_not(tok):
    model = tiny_model(vocab_size=tok.vocab_size, max_seq_len=128)
    pairs = [("What is 12 + 30?", WORK), ("What is 12 + 30?", WORK.replace("42", "24")),
             ("What is 1 + 1?", "no reasoning")]
    batched = likelihood_features(model, tok, pairs, batch=3)
    alone = [likelihood_features(model, tok, [p], batch=1)[0] for p in pairs]
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(alone), atol=1e-4, rtol=1e-4)
    # By hand for the first pair: teacher-forced log-probabilities of the completion's tokens.
    ids, start, answer = token_ids(tok, *pairs[0])
    with torch.no_grad():
        lp = model(torch.tensor([ids]))[0].log_softmax(-1)
    per_token = [lp[t - 1, ids[t]].item() for t in range(start, len(ids))]
    tail = per_token[answer - start:]
    want = [sum(per_token) / len(per_token), min(per_token), sum(tail), min(tail)]
    assert batched[0] == pytest.approx(want, abs=1e-4)
    assert batched[2][2:] == [FLOOR * 4, FLOOR]  # no </think>: no answer line to read


def test_the_head_separates_rare_right_rows_and_round_trips(tmp_path):
    g = torch.Generator().manual_seed(0)
    wrong = torch.randn(60, len(FEATURES), generator=g).tolist()
    right = (torch.randn(4, len(FEATURES), generator=g) + 3.0).tolist()  # 4 of 64 are right
    head = fit_head(wrong + right, [False] * 60 + [True] * 4, info={"policy": "p"})
    scores = [head.probability(r) for r in wrong + right]
    assert min(scores[60:]) > max(scores[:60])
    # Balanced: a rare class is not pushed to 0 (an unweighted head would score it ~0.06).
    assert min(scores[60:]) > 0.5
    path = save_head(head, tmp_path / "head.json")
    again = load_head(path)
    assert again == head and again.info == {"policy": "p"}
    assert [again.probability(r) for r in right] == [head.probability(r) for r in right]


def test_bad_heads_and_too_few_labels_are_refused(tmp_path):
    rows = [[0.0] * len(FEATURES)] * 5
    with pytest.raises(DataError, match="at least 2 of each"):
        fit_head(rows, [True, False, False, False, False])
    with pytest.raises(ConfigError, match="labels"):
        fit_head(rows, [True, False])
    with pytest.raises(ConfigError, match="not known"):
        Head(features=["length"], mean=[0.0], std=[1.0], weights=[1.0])
    with pytest.raises(ConfigError, match="one of each"):
        Head(features=list(FEATURES), mean=[0.0], std=[1.0], weights=[1.0])
    with pytest.raises(ConfigError, match="does not exist"):
        load_head(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"weights": [1]}))
    with pytest.raises(DataError, match="not an outcome head"):
        load_head(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match=".json"):
        save_head(Head(list(FEATURES), [0.0] * 4, [1.0] * 4, [0.0] * 4), tmp_path / "h.txt")


def test_the_verifier_is_a_memoised_scorer_of_the_head(tok):
    model = tiny_model(vocab_size=tok.vocab_size, max_seq_len=128)
    head = Head(features=list(FEATURES), mean=[0.0] * 4, std=[1.0] * 4,
                weights=[0.0, 0.0, 1.0, 0.0])  # the answer line's log-probability alone
    verifier = OutcomeVerifier(model, tok, head)
    prompt = "What is 12 + 30?"
    cands = [st.Candidate(text=t, tokens=[], logprobs=[], finish_reason="stop")
             for t in (WORK, WORK.replace("42", "24"), "no reasoning")]
    verifier.score_all(prompt, cands)
    want = verifier.probabilities([(prompt, c.text) for c in cands])
    assert [verifier(prompt, c) for c in cands] == want
    assert want[2] == min(want)  # no answer line scores lowest under this head
    assert verifier.token_ids(prompt, WORK) == token_ids(tok, prompt, WORK)[0]
    assert st.best_of_n(cands, prompt, verifier).text in (cands[0].text, cands[1].text)
