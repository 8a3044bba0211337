"""The static KV cache and the model's forward pass over it: ``KVCache``, ``prefill``, ``decode``.

Responsible for: a preallocated key/value cache of ``slots`` sequences by ``max_seq_len``
positions per layer, and the two cached forward passes of a ``ftlm.model.Transformer`` built from
its own modules and weights (embedding, norms, q/k/v/o projections, MLP, output) and its rotary
table: ``prefill`` (whole prompts, written into chosen slots) and ``decode`` (one token for each
of the first ``B`` slots, every slot at its own position). Both are pure functions of their
inputs apart from the cache writes, in the gpt-fast shape.

Not responsible for: sampling (``ftlm.infer.sampling``), scheduling sequences into slots or
stopping them (``ftlm.infer.engine``), or the model itself: ``ftlm.model.llama`` is untouched and
its uncached forward stays the reference the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ftlm.model.llama import Transformer, apply_rope


@dataclass
class KVCache:
    """Keys and values per layer, each ``[slots, n_kv_heads, max_seq_len, head_dim]``."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, model: Transformer, slots: int, max_seq_len: int | None = None,
                 dtype: torch.dtype | None = None) -> KVCache:
        """A zeroed cache for ``slots`` sequences on the model's device (and in its dtype)."""
        cfg = model.cfg
        length = max_seq_len or cfg.max_seq_len
        weight = model.tok_embeddings.weight
        shape = (slots, cfg.n_kv_heads, length, cfg.head_dim)
        make = lambda: torch.zeros(shape, dtype=dtype or weight.dtype, device=weight.device)
        return cls([make() for _ in range(cfg.n_layers)], [make() for _ in range(cfg.n_layers)])

    @property
    def slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k[0].shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def _rope(model: Transformer, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary ``(cos, sin)`` rows of ``positions [B, T]``, flattened to ``[B * T, D / 2]``.

    Looked up once per forward pass and shared by every layer's queries and keys (it was two
    gathers per layer and projection: per-op overhead is what a small model's decode step pays).
    """
    flat = positions.reshape(-1)
    return model.rope_cos[flat], model.rope_sin[flat]


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``apply_rope`` with a position per token: ``x [B, T, heads, D]``, ``rope`` from ``_rope``.

    ``apply_rope`` rotates along its time axis; flattening batch and time into that axis lets
    every row carry its own positions.
    """
    batch, seq, heads, dim = x.shape
    rotated = apply_rope(x.reshape(1, batch * seq, heads, dim), *rope)
    return rotated.view(batch, seq, heads, dim)


def _qkv(model: Transformer, layer: torch.nn.Module, h: torch.Tensor,
         rope: tuple[torch.Tensor, torch.Tensor]
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = model.cfg
    attn = layer.attention
    batch, seq, _ = h.shape
    x = layer.attention_norm(h)
    q = attn.wq(x).view(batch, seq, cfg.n_heads, cfg.head_dim)
    k = attn.wk(x).view(batch, seq, cfg.n_kv_heads, cfg.head_dim)
    v = attn.wv(x).view(batch, seq, cfg.n_kv_heads, cfg.head_dim)
    return _rotate(q, rope), _rotate(k, rope), v


def prefill(model: Transformer, cache: KVCache, tokens: torch.Tensor, lengths: torch.Tensor,
            slots: torch.Tensor) -> torch.Tensor:
    """Run prompts ``tokens [B, T]`` (right-padded; row ``i`` is ``lengths[i]`` long) from position 0.

    Writes their keys and values into cache rows ``slots [B]`` at positions ``0..T-1`` (the padding
    positions hold junk that decoding overwrites before it reads them) and returns the logits of
    each prompt's last token, ``[B, vocab]``. Causal attention makes padding invisible to the real
    tokens before it.
    """
    cfg = model.cfg
    batch, seq = tokens.shape
    rope = _rope(model, torch.arange(seq, device=tokens.device).expand(batch, seq))
    h = model.tok_embeddings(tokens)
    repeats = cfg.n_heads // cfg.n_kv_heads
    for i, layer in enumerate(model.layers):
        q, k, v = _qkv(model, layer, h, rope)
        cache.k[i][slots, :, :seq] = k.transpose(1, 2).to(cache.k[i].dtype)
        cache.v[i][slots, :, :seq] = v.transpose(1, 2).to(cache.v[i].dtype)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if repeats > 1:  # as the model does it, so prefill matches its numerics
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + layer.attention.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    last = h[torch.arange(batch, device=h.device), lengths.to(h.device) - 1]
    return model.output(model.norm(last))


@dataclass
class DecodeWeights:
    """The decode step's weights, fused once from a model's (the engine builds them at start).

    Per layer: ``wqkv`` (``wq``, ``wk``, ``wv`` stacked: one matmul instead of three), ``wo``,
    ``w13`` (the MLP's gate ``w1`` and up ``w3`` stacked), ``w2`` and the two RMSNorm weights;
    then the final norm, the output projection and the embedding. A decode step of a small model
    on a CPU is bound by per-operator overhead, not by its matmuls, so fewer and larger operators
    are what make it faster. The stacked tensors are copies: a model whose weights change after
    the engine started needs a new engine (the engine never trains).
    """

    wqkv: list[torch.Tensor]
    wo: list[torch.Tensor]
    w13: list[torch.Tensor]
    w2: list[torch.Tensor]
    attention_norm: list[torch.Tensor]
    ffn_norm: list[torch.Tensor]
    norm: torch.Tensor
    output: torch.Tensor
    embedding: torch.Tensor
    eps: float

    @classmethod
    @torch.no_grad()
    def of(cls, model: Transformer) -> DecodeWeights:
        """The fused weights of ``model`` (on its device, in its dtype)."""
        layers = list(model.layers)
        return cls(
            wqkv=[torch.cat([l.attention.wq.weight, l.attention.wk.weight, l.attention.wv.weight])
                  for l in layers],
            wo=[l.attention.wo.weight for l in layers],
            w13=[torch.cat([l.feed_forward.w1.weight, l.feed_forward.w3.weight]) for l in layers],
            w2=[l.feed_forward.w2.weight for l in layers],
            attention_norm=[l.attention_norm.weight for l in layers],
            ffn_norm=[l.ffn_norm.weight for l in layers],
            norm=model.norm.weight, output=model.output.weight,
            embedding=model.tok_embeddings.weight, eps=model.cfg.norm_eps)


def decode(model: Transformer, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
           kv_len: int, weights: DecodeWeights | None = None, masked: bool = True
           ) -> torch.Tensor:
    """One step for cache slots ``0..B-1``: token ``tokens[i]`` sits at ``positions[i]``.

    ``tokens`` and ``positions`` are ``[B]``; attention reads cache positions ``0..positions[i]``
    of the first ``kv_len`` (``> max(positions)``; a constant ``max_seq_len`` keeps shapes static
    for ``torch.compile``). ``weights`` are ``DecodeWeights.of(model)`` (built here when not
    given: pass them in a loop). ``masked=False`` is allowed only when every row sits at
    ``kv_len - 1`` (then every row sees every position and the mask is dropped). Returns the
    next-token logits ``[B, vocab]``.
    """
    cfg = model.cfg
    w = weights if weights is not None else DecodeWeights.of(model)
    batch = tokens.shape[0]
    heads, kv_heads, dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    repeats = heads // kv_heads
    rows = torch.arange(batch, device=tokens.device)
    mask = None
    if masked:  # [B, 1, 1, kv_len], broadcast over kv heads and repeats
        mask = (torch.arange(kv_len, device=tokens.device)[None, :]
                <= positions[:, None])[:, None, None, :]
    cos, sin = model.rope_cos[positions][:, None, :], model.rope_sin[positions][:, None, :]
    h = F.embedding(tokens, w.embedding)  # [B, dim]
    for i in range(cfg.n_layers):
        x = F.rms_norm(h, (h.shape[-1],), w.attention_norm[i], w.eps)
        qkv = F.linear(x, w.wqkv[i]).view(batch, heads + 2 * kv_heads, dim)
        # Queries and keys are rotated together (one rotation of heads + kv_heads rows), as
        # apply_rope does it: "rotate half", in float32.
        qk = qkv[:, :heads + kv_heads].float()
        x1, x2 = qk.chunk(2, dim=-1)
        qk = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(qkv)
        ck, cv = cache.k[i], cache.v[i]
        ck[rows, :, positions] = qk[:, heads:].to(ck.dtype)
        cv[rows, :, positions] = qkv[:, heads + kv_heads:].to(cv.dtype)
        # Grouped-query attention without copying the cache: the query heads that share kv head
        # g become g's "query positions" ([B, kv_heads, repeats, D]); query head h reads kv head
        # h // repeats, as in the model.
        q = qk[:, :heads].reshape(batch, kv_heads, repeats, dim)
        out = F.scaled_dot_product_attention(q, ck[:batch, :, :kv_len], cv[:batch, :, :kv_len],
                                             attn_mask=mask)
        h = h + F.linear(out.reshape(batch, -1), w.wo[i])
        x = F.rms_norm(h, (h.shape[-1],), w.ffn_norm[i], w.eps)
        gate, up = F.linear(x, w.w13[i]).chunk(2, dim=-1)
        h = h + F.linear(F.silu(gate) * up, w.w2[i])
    return F.linear(F.rms_norm(h, (h.shape[-1],), w.norm, w.eps), w.output)
