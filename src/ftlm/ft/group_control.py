"""Control collectives inside one replica group: small values its ranks agree on (the quorum
the leader received, the vote, the transfer addresses), as CPU tensors on a gloo group.

Responsible for: the gloo group for that traffic (``control_group``) and three collectives over
it. Every rank calls each at the same point. Not responsible for: the cross-group gradient
all-reduce (``ftlm.ft.process_group``) or what the values mean (``ftlm.ft.manager``).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def control_group() -> dist.ProcessGroup | None:
    """The gloo group of this replica group's ranks for control traffic: the default group when it
    is gloo already, else a new gloo group (a collective: every rank calls it, in the same order)."""
    if dist.get_backend() == "gloo":
        return None  # None is the default group
    return dist.new_group(backend="gloo")


def broadcast_json(value: Any, ranks: int, group: dist.ProcessGroup | None) -> Any:
    """Rank 0's JSON value on every rank of the group (bytes in tensors: no pickle)."""
    if ranks == 1:
        return value
    data = json.dumps(value).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    buf = torch.zeros(int(size), dtype=torch.uint8)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=0, group=group)
    return json.loads(bytes(buf.tolist()).decode())


def gather_strings(value: str, ranks: int, group: dist.ProcessGroup | None) -> list[str]:
    """Every rank's ``value``, in rank order."""
    if ranks == 1:
        return [value]
    width = 512
    raw = value.encode()[:width]
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    out = [torch.zeros(width, dtype=torch.uint8) for _ in range(ranks)]
    dist.all_gather(out, mine, group=group)
    return [bytes(t.tolist()).rstrip(b"\0").decode() for t in out]


def group_all(flag: bool, ranks: int, group: dist.ProcessGroup | None) -> bool:
    """True on every rank iff ``flag`` is true on every rank of the group."""
    if ranks == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())
