"""Step-level beam search: the policy proposes reasoning lines, a process scorer keeps the best.

Responsible for ``beam_search``: for each prompt, ``n`` partial solutions per round; a *step* is
one reasoning line (sampled until a newline, the end of the reply, or ``step_tokens``). Round 0
samples ``n`` first steps; every later round keeps the ``n // width`` best distinct unfinished
partials by the process scorer and samples ``width`` next steps from each (the shape of the
PRM beam search of Snell et al. 2024). A partial whose step ended the reply (EOS or a stop id),
filled the context or reached ``params.max_new_tokens`` is finished; the search ends when no
prompt has an unfinished partial or after ``max_steps`` rounds (the unfinished ones are then
finished as they stand). Every round runs the steps of all prompts through the engine together
and scores all new partials in one scorer call. The answer is the finished candidate the scorer
rates highest (``best_of_n`` over the finished ones; ``vote=True``: ``weighted_best_of_n``).

The cost is counted, for compute-matched comparisons: ``passes`` holds each expansion's prefill
(its prompt and partial: this engine shares no prefix cache between sequences) and the tokens it
generated, and ``policy_tokens`` is their total; the scorer's cost is the caller's
(it sees every ``(prompt, partial)`` pair it is asked about).

Not responsible for: the scorer (``ftlm.infer.verifier.Verifier.probabilities`` is one; its
line-labelled training data is ``ftlm.infer.verifier_data``), sampling, or outcome-only
strategies (``ftlm.infer.strategies``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ftlm.errors import ConfigError
from ftlm.infer.engine import Engine
from ftlm.infer.sampling import SamplingParams
from ftlm.infer.strategies import (
    Candidate,
    Choice,
    TextCodec,
    best_of_n,
    weighted_best_of_n,
)
from ftlm.infer.text import cut_at_stop
from ftlm.tasks import extract_answer

ProcessScorer = Callable[[Sequence[tuple[str, str]]], list[float]]
"""``[(prompt text, partial completion)] -> scores``, one call per round; higher is better."""

STEP_END = "\n"


@dataclass
class Beam:
    """One partial solution: its text so far and what generating it took."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    score: float = 0.0
    finish_reason: str | None = None

    def candidate(self) -> Candidate:
        return Candidate(self.text, self.tokens, self.logprobs, self.finish_reason or "length",
                         extract_answer(self.text), self.score)


@dataclass
class SearchResult:
    """The pick for one prompt, the finished candidates and the policy's cost."""

    choice: Choice
    passes: list[tuple[int, int]]
    """``(tokens read, tokens generated)`` of every expansion: its prefill and its step."""
    rounds: int

    @property
    def policy_tokens(self) -> int:
        """Tokens the policy processed: every expansion's prefill plus its generated tokens."""
        return sum(read + generated for read, generated in self.passes)


def _check(n: int, width: int, max_steps: int, step_tokens: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"beam search n={n!r} must be an integer >= 1 (partials per round)")
    if not isinstance(width, int) or width < 1 or n % width:
        raise ConfigError(f"beam search width={width!r} must be an integer >= 1 that divides "
                          f"n={n} (n // width partials are kept, each expanded width times)")
    for name, value in (("max_steps", max_steps), ("step_tokens", step_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"beam search {name}={value!r} must be an integer >= 1")


def beam_search(engine: Engine, codec: TextCodec, prompts: Sequence[list[int]],
                texts: Sequence[str], scorer: ProcessScorer, n: int, width: int,
                params: SamplingParams, max_steps: int = 12, step_tokens: int = 32,
                vote: bool = False) -> list[SearchResult]:
    """Step-level beam search for every prompt (token ids ``prompts``, scorer texts ``texts``).

    ``params`` sets the sampling (its ``max_new_tokens`` caps a whole solution; each step is cut
    at ``step_tokens``); expansion ``j`` of round ``r`` uses seed ``params.seed + r * n + j``.
    """
    _check(n, width, max_steps, step_tokens)
    if len(prompts) != len(texts):
        raise ConfigError(f"{len(texts)} prompt texts for {len(prompts)} prompts")
    base = params.seed if params.seed is not None else 0
    step_params = replace(params, max_new_tokens=step_tokens,
                          stop=tuple(params.stop) + (STEP_END,))
    frontier: list[list[Beam]] = [[Beam()] for _ in prompts]  # round 0 expands the empty beam
    finished: list[list[Beam]] = [[] for _ in prompts]
    passes: list[list[tuple[int, int]]] = [[] for _ in prompts]
    rounds = 0
    while rounds < max_steps and any(frontier):
        grown = _expand(engine, codec, prompts, frontier, n, step_params, params, base
                        + rounds * n, passes)
        rounds += 1
        pairs = [(texts[i], b.text) for i, beams in enumerate(grown) for b in beams]
        scores = iter(scorer(pairs)) if pairs else iter(())
        for i, beams in enumerate(grown):
            for b in beams:
                b.score = float(next(scores))
            done = [b for b in beams if b.finish_reason is not None]
            finished[i] += done
            live = _distinct([b for b in beams if b.finish_reason is None])
            live.sort(key=lambda b: -b.score)
            frontier[i] = live[:max(1, n // width)]
    results = []
    for i, beams in enumerate(finished):
        for b in frontier[i]:  # out of rounds: finished as they stand
            b.finish_reason = "length"
        beams = beams + frontier[i]
        cands = [b.candidate() for b in beams]
        if not cands:
            cands = [Beam(finish_reason="length").candidate()]
        pick = weighted_best_of_n if vote else best_of_n
        choice = pick(cands, texts[i], _own_score)
        results.append(SearchResult(choice, passes[i], rounds))
    return results


def _expand(engine: Engine, codec: TextCodec, prompts: Sequence[list[int]],
            frontier: list[list[Beam]], n: int, step_params: SamplingParams,
            params: SamplingParams, seed: int,
            passes: list[list[tuple[int, int]]]) -> list[list[Beam]]:
    """Sample the next step of each frontier beam (``n`` steps per prompt, spread evenly)."""
    room = engine.max_seq_len - 1
    jobs = []
    for i, beams in enumerate(frontier):
        if not beams:
            continue
        for j in range(n):
            parent = beams[j % len(beams)]
            context = list(prompts[i]) + (codec.encode(parent.text) if parent.text else [])
            left = params.max_new_tokens - len(parent.tokens)
            if len(context) >= room or left < 1:
                jobs.append((i, parent, None, context))
                continue
            sp = replace(step_params, seed=seed + j, max_new_tokens=min(left,
                         step_params.max_new_tokens))
            jobs.append((i, parent, engine.add(context, sp), context))
    while engine.has_work():
        engine.step()
    grown: list[list[Beam]] = [[] for _ in frontier]
    for i, parent, seq, context in jobs:
        if seq is None:  # no room left: the parent is finished as it is
            grown[i].append(replace(parent, finish_reason="length"))
            continue
        passes[i].append((len(context), len(seq.tokens)))
        raw = codec.decode(seq.tokens)
        step, ended_line = cut_at_stop(raw, (STEP_END,))
        child = Beam(parent.text + step + (STEP_END if ended_line else ""),
                     parent.tokens + seq.tokens, parent.logprobs + seq.logprobs)
        total = len(child.tokens)
        full = len(context) + len(seq.tokens) >= room
        if not ended_line and seq.finish_reason == "stop":
            child.finish_reason = "stop"  # the reply ended (EOS or a stop id)
        elif full or total >= params.max_new_tokens:
            child.finish_reason = "length"
        grown[i].append(child)
    return grown


def _own_score(prompt: str, candidate: Candidate) -> float:
    """The score the search gave a candidate (a ``Scorer`` for the final pick)."""
    return candidate.score


def _distinct(beams: list[Beam]) -> list[Beam]:
    """One beam per partial text (the first; duplicates waste the beam)."""
    seen: dict[str, Beam] = {}
    for b in beams:
        seen.setdefault(b.text, b)
    return list(seen.values())
