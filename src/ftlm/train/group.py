"""A replica group's own ranks: joining their process group before the trainer is built.

Shared by ``ftlm train`` and the post-training commands. Not here: the process group across
replica groups (``ftlm.ft.process_group``), sharding the model over the ranks
(``ftlm.train.parallelize``).
"""

from __future__ import annotations

import os

from ftlm import startup_beacon
from ftlm.ft.config import FTConfig
from ftlm.train.config import TrainConfig


def init_group(train: TrainConfig, ft: FTConfig) -> None:
    """Join this replica group's own process group when torchrun started several ranks."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    startup_beacon.phase("joining the group's other ranks")
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from ftlm.train.trainer import resolve_device
    device = resolve_device(train.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # Followers wait for their leader's quorum inside group collectives: outlast that wait.
    timeout = timedelta(seconds=ft.quorum_timeout + ft.allreduce_timeout)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
