"""Parallelism applied to the model from outside, in torchtitan's order: activation
checkpointing, then ``torch.compile``, then FSDP2 sharding over the replica group.

Sharding is per transformer block and at the root, over a 1-D device mesh of the group's own
ranks (gloo on CPU, NCCL on CUDA). The model code never imports ``torch.distributed``; everything
distributed about it happens here. Fault tolerance *across* groups is not this module's business:
it only ever sees one group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard


def group_mesh(device: torch.device) -> DeviceMesh | None:
    """The mesh of this replica group's ranks, or None for a single-rank group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("shard",))


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each block's activations in the backward pass instead of storing them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: torch.nn.Module) -> None:
    """Compile each block on its own (blocks are identical, so one compilation is reused)."""
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block)


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Shard every block, then the root (embedding, final norm, output), over ``mesh``.

    The last block is not resharded after forward: backward needs it right away.
    """
    n = len(model.layers)
    for i, block in enumerate(model.layers):
        fully_shard(block, mesh=mesh, reshard_after_forward=i < n - 1)
    fully_shard(model, mesh=mesh)


def parallelize(model: torch.nn.Module, mesh: DeviceMesh | None, *, activation_checkpointing: bool,
                compile: bool) -> torch.nn.Module:
    """Apply the enabled transformations in order; returns the module to call in training."""
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model)
    if mesh is not None:
        apply_fsdp(model, mesh)
    return model
