"""AdamW with decoupled weight decay, and the one function that applies an averaged gradient.

``apply_update`` is the only place an optimizer step happens, live or replayed: a recovering
group replays buffered gradients through it and reaches the same bits as its peers, because the
update is a deterministic function of (state, averaged gradient, LR, clip).
"""

from __future__ import annotations

import torch

from ftlm.train.config import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (norm gains, biases) do not. Fused kernels when available."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError):
        # Fused kernels exist for CPU and CUDA floating tensors; anything else gets foreach.
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def apply_update(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, lr: float,
                 grad_clip: float) -> float:
    """Clip the (already averaged) gradients, step the optimizer at ``lr``, clear the gradients.

    Returns the gradient norm before clipping.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
