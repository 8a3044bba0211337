"""The replicated training state: model, optimizer, step, data cursor and seed.

Every up-to-date replica group holds bitwise the same ``TrainState``. It is one ``Stateful``
object (``state_dict`` / ``load_state_dict``) for durable checkpoints (DCP), and it flattens to a
``dict[str, Tensor]`` plus a JSON-able dict for live recovery, which is all ``ftlm.ft`` ever sees.
The committed history is a hash chain (``ftlm.ft.history``) kept next to the step: it travels
with live recovery and durable checkpoints, so every holder of a state can say which history
produced it. The LR schedule position is the step itself (``ftlm.train.schedule`` is a pure function of it).
A training step draws no random numbers (no dropout; the data order is a function of the seed
and the cursor), so the seed is the whole RNG state: the process-global torch generator is not
replicated, because unrelated code may draw from it differently in each process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ftlm.ft.history import GENESIS, is_chain

_TENSOR = "__tensor__"


class TrainState:
    """Model + optimizer + progress counters of one replica, and any ``extra`` objects with a
    ``state_dict`` / ``load_state_dict`` of their own (an LR scheduler, a data iterator's
    position) that must be replicated with them."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int,
                 mesh: Any = None, extra: dict[str, Any] | None = None):
        self.model = model
        self.optimizer = optimizer
        self.extra = dict(extra or {})
        for name, obj in self.extra.items():
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"state[{name!r}] is a {type(obj).__name__}, which has no "
                                "state_dict() and load_state_dict(): pass objects that have both")
        self.mesh = mesh  # the group's device mesh when the model is sharded (FSDP2)
        self.step = 0
        self.cursor = 0
        self.seed = seed
        self.chain = GENESIS
        _init_optimizer_state(model, optimizer)

    # -- durable checkpoints (DCP Stateful protocol) -------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sd = {
            "model": model_sd,
            "optim": optim_sd,
            "progress": torch.tensor([self.step, self.cursor, self.seed], dtype=torch.int64),
            "history": torch.tensor(list(bytes.fromhex(self.chain)), dtype=torch.uint8),
        }
        if self.extra:
            sd["extra"] = {name: obj.state_dict() for name, obj in self.extra.items()}
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        self.step, self.cursor, self.seed = (int(v) for v in sd["progress"].tolist())
        for name, obj in self.extra.items():
            obj.load_state_dict(sd["extra"][name])
        history = sd.get("history")
        self.chain = bytes(history.tolist()).hex() if history is not None else GENESIS

    # -- live recovery: tensors + JSON ---------------------------------------------------------
    def flat(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """All tensors under dotted names, and the rest (structure, hyper-parameters) as JSON.

        A sharded (DTensor) value contributes this rank's local shard only, with its layout in
        the JSON: rank r of a group exchanges state with rank r of another group.
        """
        tensors: dict[str, torch.Tensor] = {}
        meta = _flatten(self.state_dict(), "", tensors)
        return tensors, {"state": meta, "step": self.step, "cursor": self.cursor, "chain": self.chain}

    def load_flat(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                  copy: bool = True) -> None:
        """Load a state produced by ``flat()``. With ``copy`` the tensors are cloned first, so the
        source may be reused afterwards; ``copy=False`` is for tensors nobody else holds (a
        received snapshot), saving a full copy of the state on the training thread."""
        owned = {name: t.clone() for name, t in tensors.items()} if copy else dict(tensors)
        self.load_state_dict(_unflatten(meta["state"], owned, self.mesh))
        chain = meta.get("chain", GENESIS)
        if not is_chain(chain):
            raise ValueError(f"state meta has a malformed history chain {str(chain)[:80]!r}")
        self.chain = chain


def _init_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Materialise the optimizer state now, as if no step had been taken.

    ``get_state_dict`` lazily initialises an empty optimizer with a zero-LR step, which would
    leave ``step=1`` in some replicas and not in others; doing it eagerly and resetting the
    step counters keeps every replica's state identical from the start.
    """
    get_state_dict(model, optimizer)
    for per_param in optimizer.state.values():
        if "step" in per_param and torch.is_tensor(per_param["step"]):
            per_param["step"].zero_()


def _placement_names(placements) -> list[str]:
    from torch.distributed.tensor import Replicate, Shard
    names = []
    for p in placements:
        if isinstance(p, Shard):
            names.append(f"S{p.dim}")
        elif isinstance(p, Replicate):
            names.append("R")
        else:
            raise ValueError(f"cannot transfer a DTensor with placement {p}")
    return names


def _placements(names: list[str]):
    from torch.distributed.tensor import Replicate, Shard
    return [Replicate() if n == "R" else Shard(int(n[1:])) for n in names]


def _flatten(value: Any, name: str, out: dict[str, torch.Tensor]) -> Any:
    if _is_dtensor(value):
        out[name] = value.to_local().detach()
        return {_TENSOR: name, "placements": _placement_names(value.placements),
                "shape": list(value.shape), "stride": list(value.stride())}
    if torch.is_tensor(value):
        out[name] = value.detach()
        return {_TENSOR: name}
    if isinstance(value, dict):
        return {str(k): _flatten(v, f"{name}.{k}" if name else str(k), out) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_flatten(v, f"{name}.{i}", out) for i, v in enumerate(value)]
    return value


def _is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed support
        return False
    return isinstance(value, DTensor)


def _unflatten(meta: Any, tensors: dict[str, torch.Tensor], mesh: Any = None) -> Any:
    if isinstance(meta, dict):
        if _TENSOR in meta:
            local = tensors[meta[_TENSOR]]
            if "placements" not in meta:
                return local
            if mesh is None:
                raise ValueError("a sharded state needs the group's device mesh to be loaded")
            from torch.distributed.tensor import DTensor
            return DTensor.from_local(local, mesh, _placements(meta["placements"]),
                                      shape=torch.Size(meta["shape"]), stride=tuple(meta["stride"]))
        return {k: _unflatten(v, tensors, mesh) for k, v in meta.items()}
    if isinstance(meta, list):
        return [_unflatten(v, tensors, mesh) for v in meta]
    return meta
