"""Step-level beam search: the process scorer decides which partials grow; cost is counted."""

from __future__ import annotations

import itertools

import pytest
from test_strategies import CharCodec

from ftlm.errors import ConfigError
from ftlm.infer import Engine, SamplingParams
from ftlm.infer.search import beam_search


def text_score(text: str) -> float:
    """A deterministic process score of a partial text (ties are rare, and handled)."""
    return (sum(ord(c) * (i + 1) for i, c in enumerate(text)) * 7919 % 10007) / 10007


class RecordingScorer:
    def __init__(self) -> None:
        self.calls: list[list[tuple[str, str]]] = []

    def __call__(self, pairs):
        self.calls.append(list(pairs))
        return [text_score(c) for _, c in pairs]


def search(model, n, width, max_steps, seed=0, step_tokens=3, stop_ids=()):
    codec = CharCodec()
    engine = Engine(model, max_batch=8, eos_id=None, detokenize=codec.decode)
    prompts = ["Q: 1+1?", "Q: sort b a"]
    scorer = RecordingScorer()
    params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=seed, stop_ids=stop_ids)
    found = beam_search(engine, codec, [codec.encode(p) for p in prompts], prompts, scorer, n,
                        width, params, max_steps=max_steps, step_tokens=step_tokens)
    return prompts, scorer, found


def test_each_round_grows_only_the_best_scored_partials_of_the_last(model):
    n, width, rounds = 6, 2, 4
    prompts, scorer, _ = search(model, n, width, rounds)
    assert len(scorer.calls) == rounds  # one batched scorer call per round
    for prompt in prompts:
        by_round = [[c for p, c in call if p == prompt] for call in scorer.calls]
        assert [len(r) for r in by_round] == [n] * rounds
        for before, after in itertools.pairwise(by_round):
            distinct = sorted(set(before), key=text_score, reverse=True)
            kept = distinct[:n // width]
            threshold = text_score(kept[-1])
            for child in after:
                parent = max((b for b in before if child.startswith(b) and child != b), key=len)
                assert text_score(parent) >= threshold, "a partial below the top n/width grew"
            # each kept partial is expanded: width children (more when fewer are distinct)
            parents = {max((b for b in before if c.startswith(b) and c != b), key=len)
                       for c in after}
            assert parents == set(kept)


def test_out_of_rounds_the_pick_is_the_best_scored_finished_candidate_and_cost_is_counted(model):
    n, width, rounds = 4, 2, 3
    prompts, scorer, found = search(model, n, width, rounds)
    for prompt, result in zip(prompts, found):
        cands = result.choice.candidates
        assert result.rounds == rounds and len(cands) == n // width
        assert all(c.finish_reason == "length" for c in cands)
        assert result.choice.text == max(cands, key=lambda c: c.score).text
        assert all(c.score == pytest.approx(text_score(c.text)) for c in cands)
        # one character per token: an expansion costs its prompt, its parent and its step
        scored = [c for call in scorer.calls for p, c in call if p == prompt]
        assert result.policy_tokens == sum(len(prompt) + len(c) for c in scored)
        # one pass per expansion: its prompt and parent read, then a step of at most 3 tokens
        assert len(result.passes) == len(scored)
        assert all(read >= len(prompt) and 1 <= made <= 3 for read, made in result.passes)


def test_a_reply_that_ends_is_finished_and_leaves_the_frontier(model):
    # Half the vocabulary ends the reply: most partials finish within a few tokens.
    _, scorer, found = search(model, 4, 2, 30, stop_ids=tuple(range(0, 96, 2)))
    for result in found:
        assert result.rounds == len(scorer.calls) < 30 and result.choice.candidates
        assert any(c.finish_reason == "stop" for c in result.choice.candidates)
        assert result.choice.text == max(result.choice.candidates, key=lambda c: c.score).text


def test_same_seed_same_search(model):
    first = [r.choice.text for r in search(model, 4, 2, 3, seed=5)[2]]
    assert first == [r.choice.text for r in search(model, 4, 2, 3, seed=5)[2]]


@pytest.mark.parametrize("n, width, steps, message", [
    (0, 1, 3, "n=0"), (6, 4, 3, "width=4"), (4, 2, 0, "max_steps=0")])
def test_bad_search_settings_are_refused(model, n, width, steps, message):
    with pytest.raises(ConfigError, match=message):
        search(model, n, width, steps)
