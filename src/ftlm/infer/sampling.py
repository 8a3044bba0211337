"""Turning a batch of next-token logits into token ids: ``SamplingParams`` and ``sample``.

Responsible for: the per-request sampling settings (temperature, top-k, top-p, min-p, token
budget, stop strings, seed) with their validation, and one batched draw where every row has its
own settings and its own seeded random stream, so a request samples the same tokens whether it
runs alone or next to others in a continuous batch.

Not responsible for: running the model (``ftlm.infer.engine``), or stopping (the engine decides
when a sequence ends; ``ftlm.infer.text`` cuts text at stop strings).

The draw is inverse-CDF sampling over the logits sorted in descending order: the filters are
prefix masks of the sorted row (top-k keeps exactly ``k`` tokens, ties broken towards the lower
token id by a stable sort), and one uniform number per row, taken from that row's own CPU
``torch.Generator``, picks the token. ``temperature == 0`` is greedy (argmax) and draws nothing.
A row with no filter is not sorted: its draw is looked up among its ``HEAD`` most likely tokens
(``torch.topk``), which picks the token the sorted row would (the same CDF, summed over the
whole row in another order: equal up to float rounding at a CDF boundary); a row whose draw
falls beyond them, or whose head holds tied logits, takes the sorted path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ftlm.errors import ConfigError


MAX_TOP_LOGPROBS = 20
"""Most alternatives a sequence may record per position (OpenAI's limit for chat)."""


@dataclass
class SamplingParams:
    """How one request samples and when it stops."""

    max_new_tokens: int = 128
    """Most tokens to generate (the context length may end a sequence earlier)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_k: int = 0
    """Keep only the ``top_k`` most likely tokens (exactly that many); 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p`` (0, 1]."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one, in [0, 1)."""
    stop: tuple[str, ...] = ()
    """Strings that end the completion; the text is cut before the first one that appears."""
    seed: int | None = None
    """Seed of this request's random stream; None draws a fresh one."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks)."""
    stop_ids: tuple[int, ...] = field(default=())
    """Extra token ids that end the sequence (the engine adds the tokenizer's EOS)."""
    top_logprobs: int = 0
    """Also record the ``top_logprobs`` most likely tokens (and their log-probabilities) at each
    generated position, at most ``MAX_TOP_LOGPROBS``; 0: only the drawn token's."""

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 0")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ConfigError(f"temperature={self.temperature!r} must be a number in [0, 100] "
                              "(0 means greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k!r} must be an integer >= 0 (0: no top-k filter)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p={self.top_p!r} must be a number in (0, 1] (1: no filter)")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p < 1.0:
            raise ConfigError(f"min_p={self.min_p!r} must be a number in [0, 1) (0: no filter)")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"stop={self.stop!r} must be a list of non-empty strings")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ConfigError(f"seed={self.seed!r} must be a non-negative integer or None")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ConfigError(f"top_logprobs={self.top_logprobs!r} must be an integer in "
                              f"[0, {MAX_TOP_LOGPROBS}]")
        self.stop_ids = tuple(self.stop_ids)
        if not all(_is_int(t) and t >= 0 for t in self.stop_ids):
            raise ConfigError(f"stop_ids={self.stop_ids!r} must be non-negative token ids")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(float(value)))


def filtered_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort ``logits [B, V]`` descending and mask what the filters drop.

    Returns ``(scaled, order)``: the temperature-scaled sorted logits with ``-inf`` where a token
    is filtered out, and the token id at each sorted position. Each filter parameter is a ``[B]``
    tensor (row ``i`` uses its own value); ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` filter
    nothing. The most likely token always survives.
    """
    vocab = logits.shape[-1]
    temp = temperature.clamp_min(1e-5).to(torch.float32)[:, None]
    scaled, order = torch.sort(logits.float() / temp, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    drop = rank >= k  # exactly k tokens: the stable sort already broke the ties
    probs = torch.softmax(scaled.masked_fill(drop, float("-inf")), dim=-1)
    # top-p: a token is dropped when the tokens before it already reach p.
    top_p = top_p.to(torch.float32)[:, None]
    drop |= ((probs.cumsum(dim=-1) - probs) >= top_p) & (top_p < 1.0)
    drop |= probs < (min_p.to(torch.float32)[:, None] * probs[:, :1])
    drop[:, 0] = False
    return scaled.masked_fill(drop, float("-inf")), order


HEAD = 16
"""Most likely tokens among which an unfiltered row's draw is looked for before sorting it."""


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Draw one token id per row of ``logits [B, V]``; returns ``LongTensor[B]``.

    ``uniform [B]`` holds one number in [0, 1) per row (see :func:`draw_uniform`); rows with
    ``temperature == 0`` take the argmax and ignore it. Pure: the same inputs give the same ids.
    """
    hot = temperature > 0
    if not bool(hot.any()):
        return logits.argmax(dim=-1)
    ids = (logits.argmax(dim=-1) if not bool(hot.all())
           else torch.zeros(len(logits), dtype=torch.long, device=logits.device))
    uniform = uniform.to(logits.device, torch.float32)
    vocab = logits.shape[-1]
    todo = hot
    plain = hot & ((top_k == 0) | (top_k >= vocab)) & (top_p >= 1.0) & (min_p <= 0.0)
    if vocab > HEAD and bool(plain.any()):
        rows = _rows(plain)
        drawn, found = _head_draw(logits[rows], temperature[rows], uniform[rows])
        ids[rows] = torch.where(found, drawn, ids[rows])
        todo = hot.clone()
        todo[rows] = ~found
    if bool(todo.any()):
        rows = _rows(todo)
        ids[rows] = _sorted_draw(logits[rows], temperature[rows], top_k[rows], top_p[rows],
                                 min_p[rows], uniform[rows])
    return ids


def _rows(mask: torch.Tensor) -> torch.Tensor | slice:
    """An index of the rows where ``mask`` holds (every row: a slice, which copies nothing)."""
    return slice(None) if bool(mask.all()) else mask.nonzero()[:, 0]


def _sorted_draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The inverse-CDF draw over each row sorted and filtered (``filtered_logits``)."""
    scaled, order = filtered_logits(logits, temperature, top_k, top_p, min_p)
    cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)
    u = uniform[:, None] * cdf[:, -1:]
    pos = torch.searchsorted(cdf, u, right=True).clamp_max(logits.shape[-1] - 1)
    # A filtered token has zero mass, so the CDF is flat there and searchsorted skips it;
    # the clamp only guards u rounding up to the total.
    return order.gather(-1, pos).squeeze(-1)


def _head_draw(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfiltered ``_sorted_draw`` without the sort: ``(ids, found)``, where ``found`` says
    whether the row's draw lies among its ``HEAD`` most likely tokens (else its id is
    meaningless). The first ``HEAD`` entries of the sorted CDF are the CDF of ``topk``'s values;
    the total is the sum of the whole row (in token order, hence the rounding caveat)."""
    scaled = logits.float() / temperature.clamp_min(1e-5).to(torch.float32)[:, None]
    probs = torch.softmax(scaled, dim=-1)
    top, index = torch.topk(scaled, HEAD + 1, dim=-1)
    cdf = probs.gather(-1, index[:, :HEAD]).cumsum(dim=-1)
    u = uniform[:, None] * probs.sum(dim=-1, keepdim=True)
    pos = torch.searchsorted(cdf, u, right=True)
    # topk orders tied values as it likes; the stable sort puts the lower id first, so a tie
    # in the head (or at its edge) leaves the row to the sorted path.
    tied = (top[:, 1:] == top[:, :-1]).any(dim=-1)
    found = (pos[:, 0] < HEAD) & ~tied
    return index.gather(-1, pos.clamp_max(HEAD - 1)).squeeze(-1), found


def draw_uniform(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One uniform number per row, each from that row's own generator (CPU, float64 -> float32)."""
    values = [torch.rand((), generator=g, dtype=torch.float64) if g is not None else torch.zeros(())
              for g in generators]
    return torch.stack(values).float() if values else torch.zeros(0)


def params_tensors(params: list[SamplingParams], device: torch.device | str = "cpu"
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(temperature, top_k, top_p, min_p)`` as ``[B]`` tensors on ``device``."""
    return (torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device))
