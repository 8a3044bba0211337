"""Forward passes of post-training: document-masked logits and per-token log-probabilities.

``packed_logits(model, tokens, doc_ids)`` runs the unchanged model with attention restricted to
the block-diagonal causal mask of ``doc_ids``: a token attends to the earlier tokens of its own
document only, so packed documents do not see each other. The model's attention calls
``scaled_dot_product_attention(..., is_causal=True)``; a ``TorchFunctionMode`` active for this one
forward replaces that call's ``is_causal`` by the explicit mask. That keeps the model file free of
post-training concerns and works through FSDP2's hooks (the model's own modules run as usual).
Rotary positions keep counting across a row; attention scores depend only on relative positions,
so a document's logits do not depend on where in the row it sits beyond float rounding.

The mode is active only while the forward runs: a backward that *recomputes* the forward
(activation checkpointing) or a compiled block would not see it, so ``check_packing_config``
refuses those settings for masked objectives.

Not responsible for: losses (``ftlm.post.sft``, ``dpo``, ``grpo``) or sampling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ftlm.errors import ConfigError


class _DocumentMask(TorchFunctionMode):
    """Turns every causal ``scaled_dot_product_attention`` call into one with ``mask``."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.mask = mask

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention and kwargs.get("is_causal"):
            kwargs["is_causal"] = False
            kwargs["attn_mask"] = self.mask
        return func(*args, **kwargs)


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` bool: query ``i`` may attend to key ``j`` iff ``j <= i`` in the same document."""
    seq = doc_ids.shape[1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    return (same & causal)[:, None]


def packed_logits(model: nn.Module, tokens: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, T, V]`` of ``tokens [B, T]`` with attention kept inside each document."""
    with _DocumentMask(document_mask(doc_ids)):
        return model(tokens)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log p(targets[b, t] | ...)`` as float32 ``[B, T]`` from ``logits [B, T, V]``."""
    flat = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                           reduction="none")
    return -flat.view(targets.shape)


def completion_logprobs(model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor,
                        temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs ``[B, T]`` of the targets ``tokens[:, 1:]`` and their mask (float),
    under ``softmax(logits / temperature)``.

    One sequence per row (right padding needs no attention mask under causal attention).
    """
    return sequence_logprobs(model, tokens, temperature), mask[:, 1:].float()


def sequence_logprobs(model: nn.Module, tokens: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probs ``[B, T - 1]`` of ``tokens[:, 1:]`` under ``softmax(logits / T)``, one
    sequence per row."""
    logits = model(tokens[:, :-1])
    if temperature != 1.0:
        logits = logits.float() / temperature
    return token_logprobs(logits, tokens[:, 1:])


def check_packing_config(train) -> None:
    """Refuse trainer settings under which the document mask would not hold in the backward."""
    for name in ("activation_checkpointing", "compile"):
        if getattr(train, name):
            raise ConfigError(f"train.{name}=true cannot be combined with packed post-training "
                              "(the document mask is applied during the forward only); set "
                              f"train.{name}=false")
