"""An outcome verifier: a small generative model's likelihoods of a completion, read by a fitted head.

The line verifier (``ftlm.infer.verifier``) judges reasoning lines well but not the answer line
(BENCHMARKS.md, test-time scaling): on ``add`` most wrong samples write every digit right and then
assemble the answer wrongly, and on ``mod`` right answers come after wrong work. This verifier
judges the whole completion, answer line included, given the reasoning:

* ``likelihood_features``: a small model trained with ``ftlm sft`` on the task suite (the
  verifier's own SFT start, smaller than the policy) reads the completion in the chat template
  (teacher forcing) and gives its log-probabilities: mean and lowest over the completion, and sum
  and lowest over the answer line (the tokens after ``</think>``, with the end token): how
  plausible the answer is *given the written work* under an independent, smaller model;
* ``fit_head``: a logistic head on those features, fitted on the policy's own samples of
  train-split tasks labelled by ``ftlm.tasks.check`` (outcome labels), the two classes weighted
  equally (right samples are rare); standardised features, L2, full-batch L-BFGS;
* ``OutcomeVerifier``: the model plus a head as a ``Scorer`` (``P(correct)`` in [0, 1]) with the
  same interface as ``Verifier`` (``score_all``, ``token_ids`` for the FLOP count, a memo);
* ``save_head`` / ``load_head``: the head as JSON (``ftlm verifier head`` writes it).

Not responsible for: sampling or labelling (``ftlm.infer.verifier_data``), the line verifier, or
training the model (``ftlm sft``). Beam search needs per-line scores; it uses the line verifier.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ftlm.data.tokenizer import Tokenizer
from ftlm.errors import ConfigError, DataError
from ftlm.infer.chat import render_chat
from ftlm.infer.verifier import MemoScorer
from ftlm.model.llama import Transformer

THINK_CLOSE = "</think>"
FEATURES = ("mean_logprob", "min_logprob", "answer_logprob", "answer_min_logprob")
FLOOR = -20.0
"""Log-probabilities are clipped here (one impossible token must not dominate a mean)."""


@dataclass
class Head:
    """A logistic head: ``sigmoid(bias + sum(weights * (features - mean) / std))``."""

    features: list[str]
    """Names of the features, in order (``FEATURES``)."""
    mean: list[float]
    """Per-feature mean of the training rows (standardisation)."""
    std: list[float]
    """Per-feature standard deviation of the training rows (at least 1e-6)."""
    weights: list[float]
    """One weight per standardised feature."""
    bias: float = 0.0
    """The intercept."""
    info: dict = field(default_factory=dict)
    """What it was fitted on (policy, families, counts): for the record, not used in scoring."""

    def __post_init__(self) -> None:
        n = len(self.features)
        if not (len(self.mean) == len(self.std) == len(self.weights) == n) or n == 0:
            raise ConfigError(f"head: {n} features with {len(self.mean)} means, {len(self.std)} "
                              f"stds and {len(self.weights)} weights; give one of each per feature")
        unknown = [f for f in self.features if f not in FEATURES]
        if unknown:
            raise ConfigError(f"head feature {unknown[0]!r} is not known; valid: "
                              f"{', '.join(FEATURES)}")
        if any(s <= 0 for s in self.std):
            raise ConfigError(f"head std {self.std}: every standard deviation must be > 0")

    def probability(self, row: Sequence[float]) -> float:
        z = self.bias + sum(w * (x - m) / s
                            for w, x, m, s in zip(self.weights, row, self.mean, self.std))
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, z))))


def split_answer(completion: str) -> tuple[str, str]:
    """``(reasoning, answer part)``: the answer part is what follows ``</think>`` ('' if none)."""
    at = completion.find(THINK_CLOSE)
    if at < 0:
        return completion, ""
    at += len(THINK_CLOSE)
    return completion[:at], completion[at:]


def token_ids(tokenizer: Tokenizer, prompt: str, completion: str) -> tuple[list[int], int, int]:
    """The chat tokens read for ``completion``: ``(ids, completion start, answer start)``.

    The reasoning and the answer part are encoded separately (a clean boundary between them); the
    reply ends with ``<|end|>``, whose probability says "the reply is complete here".
    """
    reasoning, answer = split_answer(completion)
    ids = render_chat([{"role": "user", "content": prompt}], tokenizer)
    start = len(ids)
    ids = ids + tokenizer.encode(reasoning)
    answer_start = len(ids)
    return ids + tokenizer.encode(answer) + [tokenizer.token_id("<|end|>")], start, answer_start


@torch.no_grad()
def likelihood_features(model: Transformer, tokenizer: Tokenizer,
                        pairs: Sequence[tuple[str, str]], batch: int = 16) -> list[list[float]]:
    """``FEATURES`` of each ``(prompt, completion)`` under ``model`` (one forward pass each).

    A completion without ``</think>`` has no answer line: its answer features are ``FLOOR``.
    A conversation longer than the model's context keeps its end.
    """
    model = model.eval()
    device = model.tok_embeddings.weight.device
    limit = model.cfg.max_seq_len
    out: list[list[float]] = []
    for first in range(0, len(pairs), batch):
        rows = [token_ids(tokenizer, p, c) for p, c in pairs[first:first + batch]]
        cut = [max(0, len(ids) - limit) for ids, _, _ in rows]
        rows = [(ids[k:], max(1, s - k), max(1, a - k)) for (ids, s, a), k in zip(rows, cut)]
        tokens = torch.zeros(len(rows), max(len(ids) for ids, _, _ in rows), dtype=torch.long)
        for r, (ids, _, _) in enumerate(rows):
            tokens[r, :len(ids)] = torch.tensor(ids)
        # Causal attention: the right padding never reaches a real position's logits.
        logprobs = model(tokens.to(device)).float().log_softmax(dim=-1)
        for r, (ids, start, answer) in enumerate(rows):
            target = torch.tensor(ids[1:], device=device)
            lp = logprobs[r, :len(ids) - 1].gather(-1, target[:, None])[:, 0].clamp_min(FLOOR)
            whole, tail = lp[start - 1:], lp[answer - 1:]
            has_answer = answer < len(ids) - 1  # more than the end token after </think>
            out.append([whole.mean().item(), whole.min().item(),
                        tail.sum().item() if has_answer else FLOOR * 4,
                        tail.min().item() if has_answer else FLOOR])
    return out


def fit_head(rows: Sequence[Sequence[float]], labels: Sequence[bool], l2: float = 1e-2,
             info: dict | None = None) -> Head:
    """A balanced logistic head on feature ``rows`` (``FEATURES`` order) and outcome ``labels``.

    Each class carries half the loss whatever its size (right samples of a weak policy are a few
    percent). Needs at least 2 rows of each class.
    """
    if len(rows) != len(labels):
        raise ConfigError(f"{len(rows)} feature rows for {len(labels)} labels")
    n_pos = sum(map(bool, labels))
    if n_pos < 2 or len(labels) - n_pos < 2:
        raise DataError(f"{n_pos} right and {len(labels) - n_pos} wrong samples: a head needs at "
                        "least 2 of each (sample more tasks or samples per task)")
    x = torch.tensor([list(r) for r in rows], dtype=torch.float64)
    y = torch.tensor([float(bool(v)) for v in labels], dtype=torch.float64)
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mean) / std
    weight = torch.where(y > 0, 0.5 / n_pos, 0.5 / (len(labels) - n_pos))
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        opt.zero_grad()
        value = (weight * torch.nn.functional.binary_cross_entropy_with_logits(
            z @ w + b, y, reduction="none")).sum() + l2 * (w * w).sum()
        value.backward()
        return value

    opt.step(loss)
    return Head(features=list(FEATURES), mean=mean.tolist(), std=std.tolist(),
                weights=w.detach().tolist(), bias=float(b.detach()), info=dict(info or {}))


def save_head(head: Head, path: Path) -> Path:
    path = Path(path)
    if path.suffix != ".json":
        raise ConfigError(f"{path}: an outcome head is written as .json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(head), indent=1) + "\n")
    return path


def load_head(path: Path) -> Head:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"outcome head {path} does not exist; write one with `ftlm verifier "
                          "head`")
    try:
        return Head(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise DataError(f"{path} is not an outcome head ({e}); rewrite it with `ftlm verifier "
                        "head`") from None


class OutcomeVerifier(MemoScorer):
    """Scores candidates by ``head`` over ``model``'s likelihood features: ``P(correct)``."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, head: Head,
                 batch: int = 16) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.head = head
        self.batch = batch
        super().__init__()

    def token_ids(self, prompt: str, completion: str) -> list[int]:
        """The tokens the verifier reads for ``completion`` (its cost), cut to its context."""
        return token_ids(self.tokenizer, prompt, completion)[0][-self.model.cfg.max_seq_len:]

    def probabilities(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        rows = likelihood_features(self.model, self.tokenizer, pairs, self.batch)
        return [self.head.probability(r) for r in rows]
