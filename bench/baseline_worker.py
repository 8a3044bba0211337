"""One training process of a *baseline* the head-to-head benchmark compares ftlm against.

``python -m bench.baseline_worker '<json spec>'`` trains ftlm's model on ftlm's batches
(``ftlm.train.trainer.build_model``, ``ftlm.data.loader.Loader``, ``build_optimizer``,
``apply_update``) under one of two fault-tolerance schemes, and appends one JSON event per line to
its own events file, in the format of ftlm's ``events.jsonl`` (``commit`` with ``step``, ``ts``,
``samples``, ``tokens``, ``loss``, ``step_seconds``; ``failure_injected``; ``recovery_start``), so
that ``ftlm.observe.summary.build_summary`` computes the baselines' stall and ETT with the very
code that computes ftlm's:

* ``torchft``: one replica group of one rank under ``torchft.Manager`` (lighthouse given by the
  spec, ``ProcessGroupGloo``, ``Manager.allreduce`` of flat gradient buckets, its default HTTP
  checkpoint transport for healing, ``min_replica_size=1``). Participant ``i`` of ``P`` takes the same global
  samples as ftlm's participant ``i`` (``Loader.batch(cursor, i, P, b)``).
* ``ddp``: rank ``r`` of a plain ``torch.distributed`` DDP job that saves a durable checkpoint
  every ``ckpt_every`` steps and resumes from the latest one when (re)started: the
  checkpoint-restart baseline (the supervisor restarts every rank on any failure).

A fault ``kill@N`` / ``stop@N`` SIGKILLs / SIGSTOPs the process at step ``N`` after the forward
pass, before the backward pass (whose buckets carry the all-reduce): the point ftlm calls
``before_allreduce``. It does not supervise, restart or measure anything (``bench.baselines``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.common import DEMO_DIR, DEMO_SEQ_LEN
from ftlm.config import RunConfig, build_config


def run_config(model: dict, batch: int, threads: int, run_dir: str) -> RunConfig:
    """The config both ftlm and the baselines train with (constant LR, no warm-up)."""
    return build_config({
        "run": {"name": "bench-vs", "dir": run_dir, "seed": 0},
        "model": dict(model),
        "data": {"dir": str(DEMO_DIR), "seq_len": DEMO_SEQ_LEN},
        "train": {"steps": 10**6, "batch_size": batch, "threads": threads, "warmup_steps": 0,
                  "schedule": "constant"},
        "checkpoint": {"every": 0, "resume": False},
        "observe": {"progress": False, "log_every": 10**6},
    })


class Events:
    """Appends ftlm-format events to this process's own file (one line each, flushed)."""

    def __init__(self, path: Path, group: str):
        self.f = open(path, "a", buffering=1)
        self.group = group

    def emit(self, kind: str, step: int, **fields) -> None:
        self.f.write(json.dumps({"ts": time.time(), "kind": kind, "group": self.group,
                                 "step": step, **fields}) + "\n")


def _maybe_fault(fault: str, step: int, events: Events) -> None:
    if not fault:
        return
    what, _, at = fault.partition("@")
    if int(at) != step:
        return
    sig = signal.SIGSTOP if what == "stop" else signal.SIGKILL
    events.emit("failure_injected", step=step, point="before_allreduce", signal=sig.name)
    events.f.flush()
    os.kill(os.getpid(), sig)


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def _allreduce(manager, params: list[torch.Tensor], bucket_bytes: int) -> None:
    """Average the gradients across replica groups through ``Manager.allreduce`` in flat
    buckets of ``bucket_bytes`` (ftlm's bucket size). ``torchft.ddp.DistributedDataParallel``
    is not used: in torchft 0.2.0 its comm hook fails an assertion (``assert fut._fut``,
    torchft/ddp.py) when a peer dies mid-all-reduce, which kills the healthy replica; the
    manual all-reduce is the other way torchft documents. Errors are recorded by the Manager
    and make ``should_commit`` return False."""
    grads = [p.grad for p in params]
    buckets, current, size = [], [], 0
    for g in grads:
        if current and size + g.numel() * g.element_size() > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(g)
        size += g.numel() * g.element_size()
    buckets.append(current)
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        manager.allreduce(flat).wait()
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def run_torchft(spec: dict, config: RunConfig, events: Events) -> None:
    from torchft import Manager, ProcessGroupGloo

    from ftlm.data.loader import Loader
    from ftlm.train.optim import apply_update, build_optimizer
    from ftlm.train.trainer import build_model, load_data

    tc = config.train
    timeout = timedelta(seconds=spec["allreduce_timeout"])
    _, dataset = load_data(config)
    loader = Loader(dataset, seed=config.run.seed, prefetch=config.data.prefetch)
    model = build_model(config, torch.device("cpu"))
    optimizer = build_optimizer(model, tc)
    params = [p for p in model.parameters() if p.requires_grad]
    cursor = [0]

    def load_state(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])
        cursor[0] = int(sd["cursor"])

    def state() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict(), "cursor": cursor[0]}

    # Each replica group of one rank hosts its own TCPStore, as torchrun would per group.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state,
                      state_dict=state, min_replica_size=1, rank=0, world_size=1,
                      store_addr="127.0.0.1", store_port=store.port,
                      lighthouse_addr=spec["lighthouse"], replica_id=spec["group"],
                      timeout=timeout, quorum_timeout=timedelta(seconds=60),
                      heartbeat_interval=timedelta(milliseconds=100))
    if spec["incarnation"] > 0:  # a restarted group: its first quorum heals it from a peer
        events.emit("recovery_start", step=-1)
    try:
        while manager.current_step() < spec["steps"]:
            t0 = time.perf_counter()
            manager.start_quorum()
            manager.wait_quorum()  # the data slice depends on the participants
            rank, p = manager.participating_rank(), manager.num_participants()
            start = cursor[0]
            batch = loader.batch(start, rank or 0, max(p, 1), tc.batch_size)
            loss = _loss(model, batch)
            _maybe_fault(spec["fault"], manager.current_step(), events)
            loss.backward()
            _allreduce(manager, params, config.ft.bucket_bytes)
            if manager.should_commit():  # a healing group loads the fetched state here
                apply_update(params, optimizer, tc.lr, tc.grad_clip)
                start = cursor[0]  # the healed cursor, when this step healed
                cursor[0] += p * tc.batch_size
                events.emit("commit", step=manager.current_step(), samples=[start, cursor[0]],
                            tokens=p * tc.batch_size * config.data.seq_len,
                            loss=float(loss.detach()), participants=p,
                            step_seconds=time.perf_counter() - t0)
            else:
                optimizer.zero_grad(set_to_none=True)
                events.emit("step_failed", step=manager.current_step())
    finally:
        loader.close()
        manager.shutdown(wait=False)


def run_ddp(spec: dict, config: RunConfig, events: Events) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from ftlm.data.loader import Loader
    from ftlm.train.optim import apply_update, build_optimizer
    from ftlm.train.trainer import build_model, load_data

    tc = config.train
    rank, world = spec["rank"], spec["world"]
    store = dist.TCPStore("127.0.0.1", spec["store_port"], world_size=world,
                          is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec["allreduce_timeout"]))
    _, dataset = load_data(config)
    loader = Loader(dataset, seed=config.run.seed, prefetch=config.data.prefetch)
    model = build_model(config, torch.device("cpu"))
    optimizer = build_optimizer(model, tc)
    step = cursor = 0
    ckpt = Path(spec["ckpt_dir"]) / "latest.pt" if spec.get("ckpt_dir") else None
    if ckpt is not None and ckpt.is_file():  # resume from the latest durable checkpoint
        sd = torch.load(ckpt, weights_only=True)
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])
        step, cursor = int(sd["step"]), int(sd["cursor"])
        events.emit("recovery_start", step=step)
    ddp = DistributedDataParallel(model, bucket_cap_mb=config.ft.bucket_bytes / 2**20)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        while step < spec["steps"]:
            t0 = time.perf_counter()
            batch = loader.batch(cursor, rank, world, tc.batch_size)
            loss = _loss(ddp, batch)
            _maybe_fault(spec["fault"], step, events)
            loss.backward()
            apply_update(params, optimizer, tc.lr, tc.grad_clip)
            start, cursor, step = cursor, cursor + world * tc.batch_size, step + 1
            if rank == 0 and ckpt is not None and step % spec["ckpt_every"] == 0:
                tmp = ckpt.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                            "step": step, "cursor": cursor}, tmp)
                os.replace(tmp, ckpt)  # durable only once complete
            events.emit("commit", step=step, samples=[start, cursor],
                        tokens=world * tc.batch_size * config.data.seq_len, loss=float(loss.detach()),
                        participants=world, step_seconds=time.perf_counter() - t0)
    finally:
        loader.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    torch.set_num_threads(spec["threads"])
    config = run_config(spec["model"], spec["batch"], spec["threads"], spec["dir"])
    events = Events(Path(spec["events"]), spec["group"])
    {"torchft": run_torchft, "ddp": run_ddp}[spec["mode"]](spec, config, events)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
