"""Test-time-compute strategies: voting, best-of-N, weighted votes, thinking budget."""

from __future__ import annotations

import string

from ftlm.infer import Engine, SamplingParams
from ftlm.infer import strategies as st
from ftlm.tasks import generate as generate_tasks

CHARS = string.printable[:94] + " \n"  # one character per token id of the tiny model (96)


class CharCodec:
    def encode(self, text: str) -> list[int]:
        return [CHARS.index(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(CHARS[i] for i in ids)


def cand(answer: str | None, logprob: float = -1.0) -> st.Candidate:
    text = f"<think>\n...\n</think>\nAnswer: {answer}" if answer else "no idea"
    return st.Candidate(text, [1, 2], [logprob, logprob], "stop", answer)


def test_self_consistency_takes_the_majority_and_breaks_ties_by_order():
    choice = st.self_consistency([cand("5"), cand("4"), cand(None), cand("4")])
    assert choice.answer == "4" and choice.votes == {"5": 1.0, "4": 2.0}
    assert st.self_consistency([cand("7"), cand("3")]).answer == "7"
    assert st.self_consistency([cand(None)]).answer is None


def test_best_of_n_and_weighted_best_of_n_follow_the_scores():
    cands = [cand("1", -3.0), cand("1", -3.0), cand("1", -3.0), cand("2", -0.1)]
    assert st.best_of_n(cands, "q", st.confidence).answer == "2"
    # three weak votes for 1 (3 x e^-3 = 0.15) lose to one confident vote for 2 (0.90)
    weighted = st.weighted_best_of_n(cands, "q", st.confidence)
    assert weighted.answer == "2" and weighted.votes["1"] < weighted.votes["2"]
    flat = st.weighted_best_of_n(cands, "q", st.has_answer)  # equal weights: a majority vote
    assert flat.answer == "1"


def test_the_task_checker_scores_exact_answers():
    task = generate_tasks(["add"], "test", 1, 0)[0]
    score = st.task_checker({task.prompt: task})
    assert score(task.prompt, cand(task.answer)) == 1.0
    assert score(task.prompt, cand(task.answer + "1")) == 0.0


def test_sampled_candidates_are_seeded_and_batched(model):
    codec = CharCodec()
    engine = Engine(model, max_batch=4, detokenize=codec.decode)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    first = st.sample_candidates(engine, codec, [[1, 2, 3], [4, 5]], 3, params)
    again = st.sample_candidates(engine, codec, [[1, 2, 3], [4, 5]], 3, params)
    assert [[c.tokens for c in row] for row in first] == [[c.tokens for c in row] for row in again]
    assert len({tuple(c.tokens) for c in first[0]}) > 1  # seed + i: the samples differ
    assert all(c.text == codec.decode(c.tokens) for c in first[0])
    # One pass each, its prompt read and its tokens generated: what its FLOPs are counted over.
    assert [c.passes for c in first[1]] == [[(2, len(c.tokens))] for c in first[1]]


def test_thinking_budget_caps_the_reasoning_then_forces_the_answer(model):
    codec = CharCodec()
    engine = Engine(model, max_batch=2, detokenize=codec.decode)
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    prompts = [codec.encode("Q: 1+1? <think>\n"), codec.encode("Q: 2+2? <think>\n")]
    for c in st.thinking_budget(engine, codec, prompts, budget=5, params=params,
                                answer_tokens=4):
        close = c.text.index("</think>\nAnswer:")
        assert close <= 5 + 1  # at most 5 reasoning tokens (one character each) and a newline
        assert "\n" not in c.text[close + len("</think>\nAnswer:"):]  # the answer is one line
        assert len(c.tokens) <= 5 + 4
        # Two passes: the reasoning from the prompt, then the answer from the prompt, the
        # reasoning and the forced "</think>\nAnswer:" read again.
        (read1, made1), (read2, made2) = c.passes
        assert read1 == len(prompts[0]) and made1 + made2 == len(c.tokens)
        assert read2 == read1 + close + len("</think>\nAnswer:")
