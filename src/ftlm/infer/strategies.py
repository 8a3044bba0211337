"""Test-time-compute strategies: spend more samples (or more thinking) for better answers.

Responsible for, over an ``Engine`` and a tokenizer-like object (``encode``/``decode``):

* ``sample_candidates``: ``n`` samples per prompt, all batched through the engine together, each
  with its own seed (``seed + i``), so results are reproducible;
* ``self_consistency``: majority vote over the extracted final answers;
* ``best_of_n``: the candidate a scorer rates highest;
* ``weighted_best_of_n``: answers voted with the sum of their candidates' scores;
* ``thinking_budget``: cap the reasoning at ``budget`` tokens, then force ``</think>`` and the
  answer prefix and let the model write only the final answer;
* scorers (``Scorer = (prompt, candidate) -> float``): ``confidence`` (the policy's own
  geometric-mean token probability, a verifier-free heuristic), ``has_answer`` (the format check), ``task_checker``
  (the exact checker of ``ftlm.tasks`` -- an oracle, for measuring the ceiling of a verifier).

Every strategy returns a ``Choice`` with the chosen completion, its answer, the candidates and the
tokens generated (the inference cost, for accuracy-vs-compute studies).

A learned verifier (``ftlm.infer.verifier.Verifier``, trained by ``ftlm verifier train``) is a
``Scorer``; ``beam-search`` (in ``STRATEGIES`` for the command line) is ``ftlm.infer.search``.

Not responsible for: training a verifier, step-level search (``ftlm.infer.search``), or the
answer format (``ftlm.tasks``: ``<think>...</think>`` then ``Answer: ...``).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from ftlm.errors import ConfigError
from ftlm.infer.engine import Engine
from ftlm.infer.sampling import SamplingParams
from ftlm.infer.text import cut_at_stop
from ftlm.tasks import Task, check, extract_answer

THINK_CLOSE, ANSWER_PREFIX = "</think>", "Answer:"
STRATEGIES = ("sample", "self-consistency", "best-of-n", "weighted-best-of-n", "beam-search")


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class Candidate:
    """One sampled completion."""

    text: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    answer: str | None = None
    score: float | None = None
    passes: list[tuple[int, int]] = field(default_factory=list)
    """``(tokens read, tokens generated)`` of each pass through the policy that produced it: its
    prefill context and its sampled tokens, what its inference cost is counted over
    (``ftlm.model.counts.forward_flops``). Empty when unknown."""

    @property
    def mean_logprob(self) -> float:
        return sum(self.logprobs) / len(self.logprobs) if self.logprobs else float("-inf")


@dataclass
class Choice:
    """What a strategy picked for one prompt, and what it cost."""

    text: str
    answer: str | None
    candidates: list[Candidate]
    votes: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_generated(self) -> int:
        return sum(len(c.tokens) for c in self.candidates)


Scorer = Callable[[str, Candidate], float]
"""``(prompt text, candidate) -> score``; higher is better."""


def confidence(prompt: str, candidate: Candidate) -> float:
    """The policy's own confidence: the geometric mean of its token probabilities, in [0, 1]."""
    return math.exp(candidate.mean_logprob)


def has_answer(prompt: str, candidate: Candidate) -> float:
    """1.0 when the completion ends in a parsable final answer, else 0.0 (a format check)."""
    return 1.0 if candidate.answer is not None else 0.0


def task_checker(tasks_by_prompt: dict[str, Task]) -> Scorer:
    """Exact correctness against ``ftlm.tasks`` (an oracle verifier: an upper bound)."""
    def score(prompt: str, candidate: Candidate) -> float:
        return 1.0 if check(tasks_by_prompt[prompt], candidate.text) else 0.0
    return score


SCORERS: dict[str, Scorer] = {"confidence": confidence, "has-answer": has_answer}


def sample_candidates(engine: Engine, codec: TextCodec, prompts: Sequence[list[int]], n: int,
                      params: SamplingParams) -> list[list[Candidate]]:
    """``n`` candidates for each prompt, generated in one continuous batch."""
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"n={n!r} must be an integer >= 1")
    base = params.seed if params.seed is not None else 0
    seqs = [[engine.add(p, replace(params, seed=base + i)) for i in range(n)] for p in prompts]
    while engine.has_work():
        engine.step()
    out = []
    for row in seqs:
        cands = []
        for s in row:
            text, _ = cut_at_stop(codec.decode(s.tokens), params.stop)
            cands.append(Candidate(text, s.tokens, s.logprobs, s.finish_reason or "abort",
                                   extract_answer(text), passes=[(len(s.prompt), len(s.tokens))]))
        out.append(cands)
    return out


def self_consistency(candidates: list[Candidate]) -> Choice:
    """Majority vote over the extracted answers (ties: the answer seen first)."""
    votes = Counter(c.answer for c in candidates if c.answer is not None)
    if not votes:
        return Choice(candidates[0].text, None, candidates)
    answer = max(votes, key=lambda a: (votes[a], -_first(candidates, a)))
    chosen = next(c for c in candidates if c.answer == answer)
    return Choice(chosen.text, answer, candidates, {a: float(v) for a, v in votes.items()})


def best_of_n(candidates: list[Candidate], prompt: str, scorer: Scorer) -> Choice:
    """The highest-scoring candidate (ties: the first)."""
    _score(candidates, prompt, scorer)
    best = max(range(len(candidates)), key=lambda i: (candidates[i].score, -i))
    return Choice(candidates[best].text, candidates[best].answer, candidates)


def weighted_best_of_n(candidates: list[Candidate], prompt: str, scorer: Scorer) -> Choice:
    """Answers voted with the summed scores of their candidates (weighted majority vote).

    Scores are weights: they should be >= 0 (probability-like, as ``confidence`` and verifier
    outputs are).
    """
    _score(candidates, prompt, scorer)
    votes: dict[str, float] = defaultdict(float)
    for c in candidates:
        if c.answer is not None:
            votes[c.answer] += c.score
    if not votes:
        return best_of_n(candidates, prompt, scorer)
    answer = max(votes, key=lambda a: (votes[a], -_first(candidates, a)))
    chosen = max((c for c in candidates if c.answer == answer), key=lambda c: c.score)
    return Choice(chosen.text, answer, candidates, dict(votes))


def thinking_budget(engine: Engine, codec: TextCodec, prompts: Sequence[list[int]], budget: int,
                    params: SamplingParams, answer_tokens: int = 24) -> list[Candidate]:
    """Reason for at most ``budget`` tokens, then force ``</think>`` and the final answer.

    A completion that closes its reasoning within the budget keeps its own ``</think>``; one that
    does not is cut there and continued from ``"\\n</think>\\nAnswer:"``. The answer phase is
    greedy-or-sampled like ``params`` and ends at a newline or ``answer_tokens``.
    """
    if not isinstance(budget, int) or budget < 1:
        raise ConfigError(f"thinking budget={budget!r} must be an integer >= 1 (tokens)")
    think = replace(params, max_new_tokens=budget, stop=tuple(params.stop) + (THINK_CLOSE,))
    first = [engine.add(p, think) for p in prompts]
    while engine.has_work():
        engine.step()
    reasoning = [cut_at_stop(codec.decode(s.tokens), (THINK_CLOSE,))[0] for s in first]
    forced = [("" if r.endswith("\n") else "\n") + f"{THINK_CLOSE}\n{ANSWER_PREFIX}"
              for r in reasoning]
    answer_params = replace(params, max_new_tokens=answer_tokens,
                            stop=tuple(params.stop) + ("\n",))
    room = engine.max_seq_len - 1
    contexts = [(p + codec.encode(r + f))[-room:] for p, r, f in zip(prompts, reasoning, forced)]
    second = [engine.add(c, answer_params) for c in contexts]
    while engine.has_work():
        engine.step()
    out = []
    for p, c, s1, s2, r, f in zip(prompts, contexts, first, second, reasoning, forced):
        tail, _ = cut_at_stop(codec.decode(s2.tokens), ("\n",) + tuple(params.stop))
        text = r + f + tail
        out.append(Candidate(text, s1.tokens + s2.tokens, s1.logprobs + s2.logprobs,
                             s2.finish_reason or "abort", extract_answer(text),
                             passes=[(len(p), len(s1.tokens)), (len(c), len(s2.tokens))]))
    return out


def _first(candidates: list[Candidate], answer: str) -> int:
    return next(i for i, c in enumerate(candidates) if c.answer == answer)


def _score(candidates: list[Candidate], prompt: str, scorer: Scorer) -> None:
    for c in candidates:
        c.score = float(scorer(prompt, c))
