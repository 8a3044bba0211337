"""The inference engine: sequences scheduled into the slots of a static KV cache, step by step.

Responsible for: admitting requests (``Engine.add``) into free cache slots, prefilling newly
admitted prompts together, decoding one token for every running sequence per ``Engine.step``
(continuous batching: sequences join and leave between steps, each at its own length), sampling
each with its own ``SamplingParams`` and seeded stream, and ending a sequence at EOS, a stop id, a
stop string, its token budget or the context length. ``Engine.generate`` runs a list of prompts to
completion; the server drives ``step`` from its own thread.

Not responsible for: the cached forward (``ftlm.infer.kv``), the sampling maths
(``ftlm.infer.sampling``), text streaming (``ftlm.infer.text``), threads, queues or HTTP
(``ftlm.serve``). An ``Engine`` is used from one thread at a time.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from ftlm.errors import ConfigError
from ftlm.infer import kv
from ftlm.infer.sampling import SamplingParams, draw_uniform, sample
from ftlm.model.llama import Transformer

_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One prompt in flight: its generated tokens and, once finished, why it ended."""

    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Log-probability of each generated token under the model (temperature 1, unfiltered)."""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per generated token, its ``params.top_logprobs`` most likely alternatives (token id,
    log-probability), most likely first; empty when ``params.top_logprobs`` is 0."""
    finish_reason: str | None = None
    """``"stop"`` (EOS, a stop id or stop string), ``"length"`` (budget or context) or ``"abort"``."""
    slot: int | None = None
    added_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Engine:
    """Continuous-batching generation over one model and one static KV cache.

    ``max_batch`` sequences run at once (the cache's slots); more wait in FIFO order. ``eos_id``
    ends every sequence unless its params say ``ignore_eos``; ``detokenize`` (token ids -> text)
    is needed only for stop strings. With ``compile=True`` the decode step runs through
    ``torch.compile`` over all slots and the full context (static shapes, one graph).
    """

    def __init__(self, model: Transformer, max_batch: int = 8, max_seq_len: int | None = None,
                 eos_id: int | None = None, detokenize: Callable[[list[int]], str] | None = None,
                 compile: bool = False) -> None:
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch={max_batch!r} must be an integer >= 1")
        limit = model.cfg.max_seq_len
        if max_seq_len is not None and not 2 <= max_seq_len <= limit:
            raise ConfigError(f"max_seq_len={max_seq_len} must be in [2, {limit}] "
                              "(model.max_seq_len)")
        self.model = model.eval()
        self.device = model.tok_embeddings.weight.device
        self.max_batch = max_batch
        self.cache = kv.KVCache.allocate(model, max_batch, max_seq_len)
        self.max_seq_len = self.cache.max_seq_len
        self.eos_id = eos_id
        self.detokenize = detokenize
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence | None] = [None] * max_batch
        self._positions = [0] * max_batch  # position of each slot's next input token
        self._last = [0] * max_batch  # each slot's next input token
        self._decode = torch.compile(kv.decode, fullgraph=True) if compile else kv.decode
        self._weights = kv.DecodeWeights.of(model)  # fused once; the engine never trains
        self._static = compile
        self.steps = 0

    # -- requests ---------------------------------------------------------------------------

    def add(self, prompt: Seq[int], params: SamplingParams | None = None) -> Sequence:
        """Queue ``prompt`` (token ids); it starts at the next ``step`` with a free slot."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        self.check_prompt(prompt)
        if params.stop and self.detokenize is None:
            raise ConfigError("stop strings need an engine with a detokenize function")
        generator = None
        if params.temperature > 0:
            generator = torch.Generator()
            # An unseeded request draws from the OS, not from torch's global generator (which
            # belongs to the caller).
            generator.manual_seed(params.seed if params.seed is not None else
                                  secrets.randbits(62))
        seq = Sequence(prompt, params, generator)
        if params.max_new_tokens == 0:
            self._finish(seq, "length")
        else:
            self.waiting.append(seq)
        return seq

    def check_prompt(self, prompt: Seq[int]) -> None:
        """Refuse an empty prompt, one that leaves no room to generate, or unknown token ids."""
        if not prompt:
            raise ConfigError("the prompt is empty; give at least one token")
        if len(prompt) >= self.max_seq_len:
            raise ConfigError(f"the prompt has {len(prompt)} tokens but the context holds "
                              f"{self.max_seq_len}; shorten it to at most {self.max_seq_len - 1}")
        vocab = self.model.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def cancel(self, seq: Sequence) -> None:
        """End ``seq`` now (finish reason ``"abort"``) and free its slot."""
        if seq.done:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, "abort")

    @property
    def active(self) -> int:
        return sum(s is not None for s in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.active > 0

    # -- the step -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """Admit waiting sequences, then decode one token for every running one.

        Returns the sequences that received tokens (or finished) in this step.
        """
        touched: dict[int, Sequence] = {}
        admitted = self._admit()
        if admitted:
            logits = self._prefill(admitted)
            self._emit(admitted, logits, touched)
        hi = max((i + 1 for i, s in enumerate(self.running) if s is not None), default=0)
        if hi:
            masked = True
            if self._static:
                hi, kv_len = self.max_batch, self.max_seq_len
            else:  # attention reads the filled part of the cache only
                kv_len = max(self._positions[:hi]) + 1
                # Rows all at the last position see everything: no mask to build or apply.
                masked = any(p != kv_len - 1 for p in self._positions[:hi])
            tokens = torch.tensor(self._last[:hi], device=self.device)
            positions = torch.tensor(self._positions[:hi], device=self.device)
            logits = self._decode(self.model, self.cache, tokens, positions, kv_len,
                                  self._weights, masked)
            self._emit(self.running[:hi], logits, touched)
        self.steps += 1
        return list(touched.values())

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None
                 = None) -> list[Sequence]:
        """Run ``prompts`` to completion, ``max_batch`` at a time; results in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"{len(params)} sampling params for {len(prompts)} prompts")
        seqs = [self.add(p, sp) for p, sp in zip(prompts, params)]
        while self.has_work():
            self.step()
        return seqs

    # -- internals ----------------------------------------------------------------------------

    def _admit(self) -> list[Sequence]:
        admitted = []
        for slot, current in enumerate(self.running):
            if not self.waiting:
                break
            if current is None:
                seq = self.waiting.popleft()
                seq.slot = slot
                self.running[slot] = seq
                admitted.append(seq)
        return admitted

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        longest = max(len(s.prompt) for s in seqs)
        tokens = torch.zeros(len(seqs), longest, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, :len(s.prompt)] = torch.tensor(s.prompt)
            self._positions[s.slot] = len(s.prompt)
        lengths = torch.tensor([len(s.prompt) for s in seqs])
        slots = torch.tensor([s.slot for s in seqs])
        return kv.prefill(self.model, self.cache, tokens.to(self.device), lengths.to(self.device),
                          slots.to(self.device))

    def _emit(self, rows: list[Sequence | None], logits: torch.Tensor,
              touched: dict[int, Sequence]) -> None:
        """Sample one token for each live row of ``logits`` and apply the stopping rules."""
        live = [s if s is not None and not s.done else None for s in rows]
        filler = SamplingParams(temperature=0.0)
        params = [s.params if s is not None else filler for s in live]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        top_k = torch.tensor([p.top_k for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        min_p = torch.tensor([p.min_p for p in params], device=logits.device)
        uniform = draw_uniform([s.generator if s is not None else None for s in live])
        ids = sample(logits, temperature, top_k, top_p, min_p, uniform)
        # log_softmax at the drawn token only (no [B, vocab] result to write and read back).
        scores = logits.float()
        norm = torch.logsumexp(scores, dim=-1)
        logprobs = scores.gather(-1, ids[:, None])[:, 0] - norm
        top = max((s.params.top_logprobs for s in live if s is not None), default=0)
        alternatives: list[list[tuple[int, float]]] = [[] for _ in live]
        if top:  # only when a request asked: a [B, k] top-k, not a [B, vocab] softmax
            values, indices = scores.topk(min(top, scores.shape[-1]), dim=-1)
            values = (values - norm[:, None]).tolist()
            alternatives = [list(zip(row_ids, row_lps))
                            for row_ids, row_lps in zip(indices.tolist(), values)]
        ids, logprobs = ids.tolist(), logprobs.tolist()  # one device sync per step
        now = time.perf_counter()
        for seq, token, logprob, alts in zip(live, ids, logprobs, alternatives):
            if seq is None:
                continue
            touched[seq.id] = seq
            if seq.first_token_at is None:
                seq.first_token_at = now
            self._last[seq.slot] = token
            p = seq.params
            if (token == self.eos_id and not p.ignore_eos) or token in p.stop_ids:
                self._finish(seq, "stop")  # the stop token is not part of the completion
                continue
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            if p.top_logprobs:
                seq.top_logprobs.append(alts[:p.top_logprobs])
            if p.stop and any(s in self.detokenize(seq.tokens) for s in p.stop):
                self._finish(seq, "stop")
            elif len(seq.tokens) >= p.max_new_tokens or len(seq.prompt) + len(seq.tokens) >= self.max_seq_len:
                self._finish(seq, "length")
            else:  # the token just drawn is the slot's next input
                self._positions[seq.slot] = len(seq.prompt) + len(seq.tokens) - 1

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.finished_at = time.perf_counter()
        if seq.slot is not None and self.running[seq.slot] is seq:
            self.running[seq.slot] = None
            self._positions[seq.slot] = 0
            self._last[seq.slot] = 0
        seq.slot = None
