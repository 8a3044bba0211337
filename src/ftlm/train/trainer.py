"""The training loop of one replica group.

Per step (docs/design.md, 'One training step'): ask fault tolerance for this step's plan, train this
group's data slice (or contribute zeros while recovering), average gradients across groups, and
apply the update only if the commit vote passes. The trainer owns the model, optimizer, data loader,
durable checkpoints and this group's events; it does not know how quorums or transfers work
(``ftlm.ft``) and is the same code with or without fault tolerance (``NoFaultTolerance``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
import torch
import torch.distributed as dist

from ftlm import startup_beacon
from ftlm.data.loader import Loader, PackedDataset
from ftlm.data.split import split_heldout
from ftlm.data.tokenizer import Tokenizer
from ftlm.errors import ConfigError, DataError
from ftlm.ft.group import TooManyFailures, check_replay
from ftlm.ft.end_of_run import may_write_model
from ftlm.ft.history import extend_chain
from ftlm.ft.protocol import FaultTolerance, NoFaultTolerance, Recovered, ReloadCheckpoint, StepPlan, StopRequested
from ftlm.model import Transformer, flops_per_token
from ftlm.observe.events import EventLog, NullEvents, read_events
from ftlm.observe.metrics import NullMetrics, TrainingMetrics, start_rank_metrics
from ftlm.observe.summary import build_summary, write_summary
from ftlm.train.catchup import CatchUpBuffer, unflatten_into
from ftlm.train.config import TrainerConfig
from ftlm.train.checkpoint import CheckpointError, Checkpointer
from ftlm.train.evaluate import build_evaluator
from ftlm.train.model_file import MODEL_FILE, install_model, stamp_metadata
from ftlm.train.nonfinite import NonFiniteJudge
from ftlm.train.grad_sync import GradientSync
from ftlm.train.mfu import peak_flops
from ftlm.train.objective import LanguageModeling, Objective, TrainData
from ftlm.train.optim import apply_update, build_optimizer
from ftlm.train.parallelize import group_mesh, parallelize
from ftlm.train.schedule import degraded_lr_scale, lr_at
from ftlm.train.state import TrainState
from ftlm.ft.transport import state_digest


log = logging.getLogger("ftlm.train")

REPLAY_AT_LEAST = 2
"""Buffered updates a recovering group replays per step at least, even when its all-reduce
completed at once: the backlog grows by one a step, so it shrinks by at least one."""


@dataclass
class _Catching:
    """A peer's snapshot loaded, its backlog of buffered updates being replayed."""

    recovered: Recovered
    replayed: int = 0
    seconds: float = 0.0


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: writing to it writes the gradient), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but no CUDA device is available; use auto or cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype: bf16 on CUDA by default; on CPU float32 unless bfloat16 is asked for
    (CPU autocast runs matmuls in bf16, which pays off on CPUs with AMX or AVX512-BF16)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_data(config: TrainerConfig) -> tuple[Tokenizer, PackedDataset]:
    """The tokenizer and the prepared dataset, checked against each other and the config
    (its ``data`` and ``model`` sections: a ``RunConfig`` serves as well)."""
    data_dir = Path(config.data.dir)
    # The folder first: a missing data.dir is not a missing tokenizer.
    if not data_dir.is_dir():
        raise DataError(f"data folder {data_dir} (data.dir) does not exist; prepare one with "
                        f"`ftlm data prepare INPUT --out {data_dir} --tokenizer TOKENIZER` or set "
                        "data.dir to a prepared folder")
    if not (data_dir / "manifest.json").is_file():
        raise DataError(f"{data_dir / 'manifest.json'} not found: data folder {data_dir} "
                        f"(data.dir) is not prepared data; run `ftlm data prepare INPUT --out "
                        f"{data_dir} --tokenizer TOKENIZER` or set data.dir to a prepared folder")
    tok_path = Path(config.data.tokenizer) if config.data.tokenizer else data_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise DataError(f"tokenizer {tok_path} not found; run `ftlm data prepare` or set "
                        "data.tokenizer to the tokenizer.json the data was prepared with")
    tokenizer = Tokenizer.load(tok_path)
    dataset = PackedDataset(data_dir, config.data.seq_len, tokenizer.fingerprint)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(f"model.vocab_size={config.model.vocab_size} is smaller than the "
                          f"tokenizer's vocabulary ({tokenizer.vocab_size}); raise model.vocab_size")
    if config.data.seq_len > config.model.max_seq_len:
        raise ConfigError(f"data.seq_len={config.data.seq_len} exceeds "
                          f"model.max_seq_len={config.model.max_seq_len}")
    return tokenizer, dataset


def build_model(config: TrainerConfig, device: torch.device) -> Transformer:
    """The model of ``config.model`` on ``device``, initialised from ``config.run.seed``."""
    with torch.device("meta"):
        model = Transformer(config.model)
    model.to_empty(device=device)
    model.init_weights(config.run.seed)
    return model


def load_weights(model: Transformer, path: Path, field: str = "train.init_from") -> None:
    """Load ``model.safetensors`` weights (as ``Trainer.save_model`` writes them) into ``model``;
    errors name the config ``field`` the path came from."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model
    if not path.is_file():
        raise ConfigError(f"{field}={str(path)!r} does not exist; point it at a "
                          "model.safetensors written by a run (RUN_DIR/model.safetensors)")
    try:
        missing, unexpected = load_model(model, str(path), strict=False)
    except (SafetensorError, RuntimeError, OSError) as e:
        raise DataError(f"{field}={str(path)!r} is not a model of this shape "
                        f"(model.* config) or not a safetensors file: {e}") from None
    if missing or unexpected:
        raise DataError(f"{field}={str(path)!r} does not match the model config: "
                        f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")


def start_metrics(config: TrainerConfig, group: str, rank: int) -> TrainingMetrics | NullMetrics:
    """This rank's metrics (Prometheus endpoint, tracer, storage gauges of the run directory and
    its checkpoints), started; the null object when ``observe.metrics`` and tracing are off."""
    checkpoints = Path(config.checkpoint.dir) if config.checkpoint.dir else config.run.path / "checkpoints"
    metrics, _ = start_rank_metrics(config.observe, config.run.name, group, rank,
                                    run_dir=config.run.path, checkpoints=checkpoints)
    return metrics


def _served_port(metrics: Any) -> int | None:
    """The port ``metrics`` serve ``/metrics`` on, or None (off, or tracing only)."""
    try:
        return metrics.port if isinstance(metrics, TrainingMetrics) else None
    except RuntimeError:  # not started: tracing without serving
        return None


class Trainer:
    """Trains one replica group; ``train()`` runs the loop and returns the final summary fields."""

    def __init__(self, config: TrainerConfig, ft: FaultTolerance | None = None, group: str = "g0",
                 groups: int = 1, standalone: bool = True, objective: Objective | None = None,
                 data: TrainData | None = None, metrics: Any = None):
        """``objective`` and ``data`` default to language modelling on ``data.dir`` (pretraining);
        post-training commands inject their own (``ftlm.train.objective``). ``ft`` (fault
        tolerance) and ``metrics`` are injected by the job (``ftlm.train.job``), which builds them
        first and shares the metrics with ``ft``; alone, the trainer runs without fault tolerance
        and starts its own metrics. ``config`` holds only the sections training reads
        (``RunConfig.trainer_config()``, or ``Trainer.for_run``)."""
        self.config = config
        self.ft = ft or NoFaultTolerance()
        self.group = group
        self.groups = groups
        self.standalone = standalone
        tc = config.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        self.device = resolve_device(tc.device)
        self.dtype = resolve_dtype(tc.dtype, self.device)
        self.run_dir = config.run.path
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if data is None:
            startup_beacon.phase("loading data")
            tokenizer, dataset = load_data(config)
            # Training (and so the cursor) ranges over every sample but the held-out ones.
            split = split_heldout(dataset, config.data.eval_samples, config.data.eval_seed)
            data = TrainData(tokenizer, split.train, split.heldout)
        self.data = data
        self.tokenizer = data.tokenizer
        self.objective = objective or LanguageModeling(config.data.seq_len)
        self.loader = Loader(data.train, seed=config.run.seed, prefetch=config.data.prefetch)
        # Ranks inside this replica group (torchrun environment): FSDP2 shards the model over them.
        self.mesh = group_mesh(self.device)
        self.rank = dist.get_rank() if self.mesh is not None else 0
        self.ranks = dist.get_world_size() if self.mesh is not None else 1
        if standalone and self.rank == 0 and config.resolved:
            (self.run_dir / "config.toml").write_text(tomli_w.dumps(config.resolved))
        if tc.batch_size % (self.ranks * tc.grad_accum):
            raise ConfigError(f"train.batch_size={tc.batch_size} must be divisible by the group's "
                              f"{self.ranks} rank(s) x train.grad_accum={tc.grad_accum}")
        startup_beacon.phase("building the model")
        self.model = build_model(config, self.device)
        if tc.init_from:
            load_weights(self.model, Path(tc.init_from))
        self.step_model = parallelize(self.model, self.mesh,
                                      activation_checkpointing=tc.activation_checkpointing,
                                      compile=tc.compile)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Cross-group buckets start from backward hooks (single-rank groups; FSDP2's sharded
        # gradients are final only after its reduce-scatter, so sharded groups start them after).
        self.sync = GradientSync(self.params, config.ft.bucket_bytes,
                                 start=lambda grads: self.ft.allreduce_start(grads), local=_local,
                                 hooks=self.mesh is None and not standalone)
        self.evaluator = build_evaluator(self.step_model, data.heldout, tc, rank=self.rank,
                                         ranks=self.ranks, device=self.device,
                                         autocast=self._autocast, objective=self.objective)
        self.state = TrainState(self.model, build_optimizer(self.model, tc), config.run.seed,
                                mesh=self.mesh)
        # One record per group: rank 0 speaks for it.
        self.events = (EventLog(self.run_dir / "events.jsonl", group=group) if self.rank == 0
                       else NullEvents(group=group, rank=self.rank))
        ck = config.checkpoint
        # Background saves run collectives of their own: give them a process group of their own,
        # or they would interleave with FSDP's collectives on the group's default one.
        ckpt_pg = dist.new_group(backend="gloo") if self.mesh is not None else None
        self.checkpointer = Checkpointer(
            Path(ck.dir) if ck.dir else self.run_dir / "checkpoints", ck.every, ck.keep,
            ck.async_save, process_group=ckpt_pg, on_saved=self._on_checkpoint_saved,
            writer=self.rank == 0, on_rejected=self._on_checkpoint_rejected,
            # The job token authenticates checkpoint manifests (HMAC); none without a token.
            key=(os.environ.get("FTLM_TOKEN", "") or config.ft.read_token()).encode() or None)
        self.catchup = CatchUpBuffer(config.ft.catchup_max_steps, config.ft.catchup_max_bytes)
        self._catching: _Catching | None = None  # a loaded snapshot not yet at the head
        self._check_memory_budgets()
        self.metrics = metrics if metrics is not None else start_metrics(config, group, self.rank)
        self.metrics_port = _served_port(self.metrics)
        self.events = self.metrics.watch_events(self.events)  # feeds the live ETT gauge
        self.tokens_per_sample = self.objective.tokens_per_sample
        self.flops_per_token = flops_per_token(config.model, config.data.seq_len)
        self.losses: list[float] = []
        self._stalled = False  # a step failed since the last commit
        self._nonfinite = NonFiniteJudge()  # whose fault a non-finite loss or gradient is
        self._last_commit: float | None = None
        self._stop = False  # this rank was asked to stop (SIGTERM, Ctrl-C)
        self._stop_agreed = False  # some rank of the group wanted to stop at a step's all-reduce
        self._asked_next = False  # the quorum of the next step was asked for (``ft.ask``)
        # Whether this group was participant 0 (the checkpoint writer) of the last step it
        # committed as a participant (False before its first such step and while recovering).
        self._writer = False
        self._interrupted = False  # Ctrl-C: it may land mid-update, so nothing is saved after it
        self._wall0 = time.time()  # when training started (``train.max_seconds``)

    @classmethod
    def for_run(cls, config: Any, **kwargs: Any) -> Trainer:
        """A trainer of the run ``config`` (a ``ftlm.config.RunConfig``: only its trainer's
        sections reach the trainer); ``kwargs`` as for the constructor."""
        return cls(config.trainer_config(), **kwargs)

    # -- set-up ----------------------------------------------------------------------------------
    def _check_memory_budgets(self) -> None:
        """Refuse to start when one buffered catch-up step (a gradient shard of this rank) does
        not fit in ``ft.catchup_max_bytes``: better now than when a peer fails.

        The ranks of a sharded group may hold shards of different sizes (a dimension that does
        not divide by the ranks): the buffer holds as many steps as the largest shard allows, on
        every rank, so that all of them find it full at the same step (a rank that dropped its
        recovery alone would leave the others waiting in a collective)."""
        if self.standalone:
            return
        mine = sum(_local(p).numel() * _local(p).element_size() for p in self.params)
        step_bytes = _group_max(mine, self.device) if self.mesh is not None else mine
        budget = self.config.ft.catchup_max_bytes
        if step_bytes > budget:
            raise ConfigError(
                f"ft.catchup_max_bytes={budget} cannot hold one step of this group's largest "
                f"gradient shard ({step_bytes} bytes, {step_bytes / 2**30:.2f} GiB); raise it to "
                f"at least {step_bytes} x the steps a recovery may take (host memory per rank), "
                "or shard the model over more ranks")
        steps = self.catchup.fit_steps(step_bytes)
        log.info("catch-up buffer: up to %d steps of %.1f MiB (ft.catchup_max_steps=%d, "
                 "ft.catchup_max_bytes=%d)", steps, step_bytes / 2**20,
                 self.config.ft.catchup_max_steps, budget)

    def _autocast(self):
        if self.dtype != torch.float32:  # master weights and optimizer state stay float32
            return torch.autocast(self.device.type, dtype=self.dtype)
        return contextlib.nullcontext()

    # -- one step --------------------------------------------------------------------------------
    def _forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        """Accumulate the gradient of the mean loss over ``batch``; returns that loss (detached)."""
        micro = batch.chunk(self.config.train.grad_accum)
        total = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro):
            with self._autocast():
                loss = self.objective.loss(self.step_model, mb)
            # Gradients are final in the last micro-batch's backward: start buckets from there.
            self.sync.armed = i == len(micro) - 1
            (loss / len(micro)).backward()
            total += loss.detach() / len(micro)
        return total

    def _lr(self, plan: StepPlan) -> float:
        tc = self.config.train
        base = lr_at(plan.step, lr=tc.lr, steps=tc.steps, warmup_steps=tc.warmup_steps,
                     schedule=tc.schedule, min_lr_ratio=tc.min_lr_ratio,
                     decay_fraction=tc.decay_fraction)
        return base * degraded_lr_scale(self.config.ft.lr_policy, plan.participants, self.groups)

    def step(self) -> None:
        """Run one step of the protocol; the state advances only if the step commits."""
        state, tc = self.state, self.config.train
        t0 = time.perf_counter()
        try:
            plan = self.ft.start_step(state.step, state.chain, state.flat)
        except ReloadCheckpoint as e:
            self._reload_checkpoint(e)
            return
        if plan.drain:
            self._drain_step(plan)
            return
        self.sync.begin()
        if plan.participating:
            batch = self.loader.batch(state.cursor, plan.participant_index, plan.participants,
                                      tc.batch_size)
            per_rank = tc.batch_size // self.ranks  # rank r trains its share of the group's slice
            batch = batch[self.rank * per_rank:(self.rank + 1) * per_rank]
            with self.metrics.phase("forward_backward"):
                loss = self._forward_backward(batch.to(self.device, non_blocking=True))
        else:
            for p in self.params:
                p.grad = torch.zeros_like(p)
            loss = torch.zeros((), device=self.device)
        grads = self.sync.finish()  # starts the buckets backward did not start
        if plan.recovering:
            self._catch_up_while_waiting(plan)
        # A non-finite gradient must not reach any replica's state: the flag that travels with
        # the loss makes every group fail this step together, so no average that includes it is
        # ever applied, nor buffered for a catch-up (the buckets are already on their way).
        # One device sync for all of them (a norm is non-finite iff an element is, or overflows).
        # The gradients are only read here; the averages are written back in ft.allreduce.
        norms = torch._foreach_norm(grads) if grads else []
        finite = bool(torch.isfinite(torch.stack([loss.float().reshape(()), *[n.float() for n in norms]])).all())
        if plan.participating and self._device_fault(state.step, plan):
            finite = False
        loss_buf = torch.stack([torch.nan_to_num(loss.float(), nan=0.0, posinf=0.0, neginf=0.0),
                                torch.tensor(0.0 if finite else 1.0, device=loss.device)])
        stops = None
        if self.mesh is not None:  # the group's loss: FSDP already averaged the gradients
            # With it, which ranks want to stop: the group stops together (``_stopping``).
            wants = torch.tensor([1.0 if self._stop or self._time_up() else 0.0], device=loss.device)
            group_buf = torch.cat([loss_buf, wants])
            dist.all_reduce(group_buf)
            loss_buf, stops = group_buf[:2] / self.ranks, group_buf[2]
        # One entry per participant: its group's flag, so that every group sees whose loss was
        # not finite (``NonFiniteJudge``); a recovering group's entries are all zero.
        origins = torch.zeros(plan.participants, device=loss.device)
        if plan.participating:
            origins[plan.participant_index] = loss_buf[1]
        loss_buf = torch.cat([loss_buf, origins])
        self.ft.allreduce([loss_buf])  # and waits for the gradient buckets started above
        nonfinite = bool(loss_buf[1] > 0)
        if stops is not None and bool(stops > 0):
            self._stop_agreed = True
        if nonfinite:
            self.ft.fail_step("non-finite loss or gradient")
        with self.metrics.phase("vote"):
            ok = self.ft.commit()
        lr = self._lr(plan)
        samples = plan.participants * tc.batch_size
        if plan.recovering:
            self._recovering_step(plan, ok, grads, lr, samples, float(loss_buf[0]))
            return
        if not ok:
            self.state.optimizer.zero_grad(set_to_none=True)
            reason = "non-finite loss or gradient" if nonfinite else "collective or vote failed"
            who = (loss_buf[2:] > 0).nonzero().flatten().tolist() if nonfinite else []
            self.metrics.on_step_failed()
            self._stalled = True
            # Which samples (global positions) the non-finite participants trained: a recovering
            # group does not know (its own cursor is behind the step's).
            known = bool(who) and plan.participating
            self.events.emit("step_failed", step=state.step, quorum_id=plan.quorum_id, reason=reason,
                             **({"nonfinite_samples": [[state.cursor + i * tc.batch_size,
                                                        state.cursor + (i + 1) * tc.batch_size]
                                                       for i in who]} if known else {}))
            self._nonfinite.failed(state.step, who, plan.participants,
                                   plan.participant_index if plan.participating else None,
                                   state.cursor, tc.batch_size,
                                   plan.quorum.recovering_count if plan.quorum is not None else 0)
            return
        self._nonfinite.committed()
        start, parent = state.cursor, state.chain
        chain = (plan.quorum.next_chain() if plan.quorum is not None
                 else extend_chain(parent, plan.step, plan.quorum_id, [self.group]))
        # The next quorum's round trip overlaps with the update below. Once it is asked for, the
        # group owes that quorum its next step, even if asked to stop meanwhile: a member that
        # left a quorum it was counted in would fail the others' step.
        self._asked_next = not self._stopping() and self.ft.ask(state.step + 1, chain)
        with self.metrics.phase("commit"):
            grad_norm = apply_update(self.params, state.optimizer, lr, tc.grad_clip)
        state.step += 1
        state.cursor += samples
        state.chain = chain
        self._writer = plan.participant_index == 0
        global_loss = float(loss_buf[0])
        self.losses.append(global_loss)
        seconds = time.perf_counter() - t0
        self.events.emit("commit", step=plan.step, quorum_id=plan.quorum_id,
                         participants=plan.participants, samples=[start, start + samples],
                         loss=global_loss, tokens=samples * self.tokens_per_sample, lr=lr,
                         grad_norm=grad_norm, step_seconds=seconds, chain=state.chain,
                         parent=parent, quorum_wait=plan.waited)
        now = time.monotonic()
        if self._stalled and self._last_commit is not None:
            # Time this healthy group lost to a failure: the gap since its previous commit,
            # beyond what this (ordinary) step took.
            self.metrics.on_stall(max(0.0, now - self._last_commit - seconds))
        self._stalled, self._last_commit = False, now
        rank_tokens = tc.batch_size // self.ranks * self.tokens_per_sample
        self.metrics.on_commit(plan.step, global_loss, rank_tokens, seconds, lr, grad_norm,
                               data_wait_seconds=self.loader.wait_seconds)
        self.metrics.sample_memory()
        self._checkpoint(self.checkpointer.poll)
        if state.step == tc.steps and plan.participant_index == 0:
            self._save_final()  # at once by its writer; by any group that finishes, if not on disk
        elif self.checkpointer.due(state.step) and plan.participant_index == 0:
            self._checkpoint(self.checkpointer.wait)  # a save in flight that failed: on its own
            self._checkpoint(lambda: self.checkpointer.save(state))
        if self.evaluator.due(state.step):  # committed, participating: every rank of the group
            ev = self.evaluator.evaluate()
            self.events.emit("eval", step=state.step, loss=ev.loss,
                             tokens=state.cursor * self.tokens_per_sample, seconds=ev.seconds)
            self.metrics.on_eval(ev.loss)

    def _reload_checkpoint(self, why: ReloadCheckpoint) -> None:
        """Every group holding the job's newest state died: load the newest durable checkpoint if
        it is newer than this group's state (a holder wrote it after this group started, or this
        group restarted from an older one), so that the coordinator's rollback, which continues
        from the newest state a live group holds, gives up no step that is on disk. The next
        ``start_step`` asks with the state loaded (or the same one: nothing newer on disk)."""
        before = self.state.step
        if not self.config.checkpoint.resume:
            log.info("no live group holds step %d; checkpoint.resume is off, so no checkpoint is "
                     "loaded", why.head)
            return
        t0 = time.perf_counter()
        step = self.checkpointer.restore_latest(self.state, newer_than=before)
        if step is None:
            log.info("no live group holds step %d and no checkpoint is newer than step %d",
                     why.head, before)
            return
        seconds = time.perf_counter() - t0
        log.warning("no live group holds step %d: loaded the checkpoint of step %d (was at step %d)",
                    why.head, step, before)
        # A pull in flight, or a snapshot being replayed, leads from an older state: dropped.
        self._catching = None
        self._writer = False
        self.catchup.clear()
        self.ft.restart_recovery(f"loaded the durable checkpoint of step {step}")
        self.events.emit("checkpoint_reloaded", step=step, from_step=before, head=why.head,
                         seconds=seconds, chain=self.state.chain)

    def _catch_up_while_waiting(self, plan: StepPlan) -> None:
        """A recovering group's work while its zero contribution waits for the participants'
        gradients: load the peer's snapshot if it arrived, then replay buffered updates until
        the all-reduce completes (at least ``REPLAY_AT_LEAST``), so the catch-up never holds
        the participants up, however large the state. A backlog left over is replayed in the
        next steps, behind which the new steps' averages are recorded (docs/design.md, 'Joining
        and catching up')."""
        # The buckets in flight write this step's average into these gradients, and the
        # replay needs the parameters' .grad for its own updates: set them aside meanwhile.
        held = [p.grad for p in self.params]
        try:
            if self._catching is None and (rec := self.ft.poll_recovery()) is not None:
                self.state.load_flat(rec.tensors, rec.meta, copy=False)  # received: ours alone
                self._catching = _Catching(rec)
            if self._catching is not None:
                self._replay_backlog(plan, until_head=False)
        finally:
            for p, g in zip(self.params, held):
                p.grad = g

    def _replay_backlog(self, plan: StepPlan, until_head: bool) -> bool:
        """Replay buffered updates toward the head of ``plan``, checked against the quorum's
        history first; all of them with ``until_head`` or in a group of several ranks (their
        ranks must stay at one step). False (and the recovery restarts) when the snapshot plus
        the buffer does not lead to the head."""
        state, catching = self.state, self._catching
        assert catching is not None
        updates = self.catchup.run_from(state.step)
        check = (check_replay(state.step, state.chain,
                              [(u.step, u.quorum_id, u.participants) for u in updates],
                              plan.quorum, committed_now=False)
                 if updates is not None else None)
        if check is None or not check.ok:
            # The snapshot stays loaded; the group reports its step and recovers again.
            self._catching = None
            self.catchup.clear()
            self.ft.restart_recovery(check.reason if check is not None
                                     else f"a buffered update after step {state.step} is missing")
            return False
        t0 = time.perf_counter()
        everything = until_head or self.ranks > 1
        for n, u in enumerate(updates[:check.apply]):
            if not everything and n >= REPLAY_AT_LEAST and not self.ft.allreduce_in_flight():
                break
            unflatten_into(u.grads, self.params)
            apply_update(self.params, state.optimizer, u.lr, self.config.train.grad_clip)
            state.chain = extend_chain(state.chain, u.step, u.quorum_id, u.participants)
            state.step += 1
            state.cursor += u.samples
            self.catchup.drop(u.step)
            catching.replayed += 1
            self.ft.fire("during_replay")
        catching.seconds += time.perf_counter() - t0
        self.metrics.on_catchup_lag(plan.step - state.step)
        return True

    def _recovering_step(self, plan: StepPlan, ok: bool, grads: list[torch.Tensor], lr: float,
                         samples: int, global_loss: float) -> None:
        at_head = self._catching is not None and self.state.step == plan.step
        self._writer = False  # a recovering group is no checkpoint writer until it commits
        # Ask for the next quorum now, as the participants do right after their vote, with the
        # state this step leaves (the head's successor once it caught up here): the next
        # quorum waits for every member of this one, and the bookkeeping below (a copy of the
        # whole gradient, or the update) would make this group late for it.
        after = ((plan.step + 1, plan.quorum.next_chain()) if at_head and ok
                 else (self.state.step, self.state.chain))
        self._asked_next = not self._stopping() and self.ft.ask(*after)
        if at_head:
            # At this step's head: apply its average, if committed (the participants may still
            # have failed it after the all-reduce completed here, as for any participant).
            self._finish_catch_up(plan, lr if ok else None, samples, global_loss)
        else:
            if ok:  # behind the backlog, or before the snapshot arrived: kept for the replay
                self.catchup.record(plan.step, grads, lr, samples, plan.quorum_id,
                                    plan.quorum.participants if plan.quorum is not None else [])
            self.metrics.on_catchup_lag(plan.step + 1 - self.state.step if self._catching
                                        else len(self.catchup))
            if self.catchup.overflowing:
                reason = f"catch-up buffer exceeded {self.catchup.limit()}"  # before it is emptied
                self.catchup.clear()
                self._catching = None
                self.ft.restart_recovery(reason)
        for p in self.params:
            p.grad = None

    def _drain_step(self, plan: StepPlan) -> None:
        """The job reached its last step: a recovering group only catches up, nobody trains."""
        if plan.recovering:
            if self._catching is None and (rec := self.ft.poll_recovery()) is not None:
                self.state.load_flat(rec.tensors, rec.meta, copy=False)
                self._catching = _Catching(rec)
            if self._catching is not None and self._replay_backlog(plan, until_head=True):
                self._finish_catch_up(plan, None, 0, None)
                return
        time.sleep(0.1)  # the snapshot is on its way; ask again shortly

    def _finish_catch_up(self, plan: StepPlan, lr: float | None, samples: int,
                         global_loss: float | None) -> None:
        """At the head of ``plan`` after its vote: apply that step's average (``lr`` set: it
        committed here) and report the head."""
        state, catching = self.state, self._catching
        assert catching is not None
        self._catching = None
        t0 = time.perf_counter()
        if lr is not None:
            start = state.cursor
            grad_norm = apply_update(self.params, state.optimizer, lr, self.config.train.grad_clip)
            state.step += 1
            state.cursor += samples
            state.chain = plan.quorum.next_chain()
            catching.replayed += 1
            self.events.emit("commit", step=plan.step, quorum_id=plan.quorum_id,
                             participants=plan.participants, samples=[start, start + samples],
                             loss=global_loss, tokens=samples * self.tokens_per_sample,
                             lr=lr, grad_norm=grad_norm, chain=state.chain,
                             parent=plan.quorum.chain, replayed=True)
            self.ft.fire("during_replay")
        self.catchup.clear()
        rec = catching.recovered
        self.ft.caught_up(state.step, state.chain)
        replay_seconds = catching.seconds + time.perf_counter() - t0
        self.metrics.on_recovery(rec.seconds, rec.nbytes, replay_seconds=replay_seconds,
                                 source=rec.source)
        self.metrics.on_catchup_lag(0)
        self.events.emit("recovery_end", step=state.step, ok=True, source=rec.source,
                         snapshot_step=rec.step, replayed=catching.replayed, bytes=rec.nbytes,
                         transfer_seconds=rec.seconds, chain=state.chain,
                         replay_seconds=replay_seconds)

    def _checkpoint(self, action: Callable[[], None]) -> None:
        """Start or finish a durable checkpoint; a failure (a full disk, a lost mount) is logged
        and recorded (``checkpoint_failed``), never raised. The replicas hold the state, the
        newest valid checkpoint stays, the next due step tries again, and the checkpoint-age
        alert fires if none succeeds; a group stopped for it would restart, catch up and fail
        the same way at the next save."""
        try:
            action()
        except CheckpointError as e:
            log.error("step %d: %s; training goes on (the replicas hold the state, the newest "
                      "valid checkpoint is kept, the next due step tries again): free space or "
                      "fix checkpoint.dir", self.state.step, e)
            self.events.emit("checkpoint_failed", step=self.state.step, error=str(e))

    def _on_checkpoint_saved(self, step: int, path: Path, seconds: float) -> None:
        self.events.emit("checkpoint_saved", step=step, path=str(path), seconds=seconds)
        self.metrics.on_checkpoint(step, seconds, path)

    def _on_checkpoint_rejected(self, step: int, path: Path, reason: str) -> None:
        self.events.emit("checkpoint_rejected", step=step, path=str(path), reason=reason)

    # -- the loop --------------------------------------------------------------------------------
    def request_stop(self, *_: Any) -> None:
        """Finish the current step, then stop (SIGTERM / Ctrl-C); a wait for a quorum ends at
        once (``StopRequested``): the group leaves within the grace, not after the quorum timeout."""
        self._stop = True
        self.ft.request_stop()

    def train(self) -> dict:
        tc, cfg = self.config.train, self.config
        startup_beacon.phase("loading the newest checkpoint")
        if cfg.checkpoint.resume and (step := self.checkpointer.restore_latest(self.state)):
            log.info("resumed from checkpoint at step %d", step)
        # From the first heartbeat on a SIGTERM (preemption, node drain) must end in an explicit
        # leave, never in a silent death the others detect only by timeout.
        old = signal.signal(signal.SIGTERM, self.request_stop) if _main_thread() else None
        if getattr(old, "requested", False):  # a SIGTERM during the set-up (``ftlm.cli``)
            self.request_stop()
        self.events.emit("group_start", step=self.state.step,
                         metrics_port=self.metrics_port)
        if not self.standalone:
            startup_beacon.phase("warming up")
            self._warm_up()
        startup_beacon.phase("registering with the coordinator")
        self.ft.join(self.state.step, self.state.chain)
        startup_beacon.phase("training")
        wall0 = time.time()
        try:
            try:
                self._loop(wall0)
            except TooManyFailures:
                self._save_giving_up()
                raise
            if self.state.step >= tc.steps:
                self._save_final()
                # Serve the groups still catching up, then leave the job (not a failure); a
                # SIGTERM meanwhile ends the serving and still leaves.
                self.ft.finish(self.state.step, self.state.chain, self.state.flat)
            else:
                self._leave_stopped()
        finally:
            if old is not None:
                signal.signal(signal.SIGTERM, old)
        try:
            # Finish while still heartbeating, so the end of a run is not mistaken for a hang.
            return self._finish(time.time() - wall0)
        finally:
            self.ft.close()
            self.metrics.stop()
            self.events.emit("group_exit", step=self.state.step, ok=True)

    def _loop(self, wall0: float) -> None:
        """Train until the last step, a stop request or ``train.max_seconds``."""
        bar = self._progress()
        self._wall0 = wall0
        try:
            while self.state.step < self.config.train.steps and (self._asked_next or not self._stopping()):
                before = self.state.step
                self._asked_next = False
                self.step()
                if self.state.step != before:
                    bar.update(self.state.step - before, self)
        except StopRequested as e:
            log.warning("stopping at step %d: %s", self.state.step, e)
        except KeyboardInterrupt:
            log.warning("interrupted at step %d", self.state.step)
            self._stop = self._interrupted = True
        finally:
            bar.close()
            self._checkpoint(self.checkpointer.wait)
            self.loader.close()

    def _leave_stopped(self) -> None:
        """Leave the job after a stop before the last step, saving the committed state first
        (``checkpoint.on_stop``) when this group wrote its last step's checkpoints and that step
        is not on disk (a step due for a checkpoint was saved when committed). Not after Ctrl-C,
        which may have cut an update in half; a stop request or ``train.max_seconds`` ends the
        loop between steps (or in the quorum wait, before any change).

        Before the leave, not after: until the coordinator hears of it this group is a live
        member holding the newest state, so no rollback is decided meanwhile, and a group told
        afterwards that no live group holds that state finds it on disk. Saved after the leave,
        a rollback decided during the save would continue from an older checkpoint, and the
        late save would leave a checkpoint of a history the job had given up (the protocol
        simulation found that order's rollback). The others wait for the save: they hold the
        same state, and their next quorum waits for this member (at most ``ft.join_timeout``
        when they are a majority without it). Every rank takes the same branch: the role comes
        from the quorum, the step from the agreed stop, and whether any rank was interrupted is
        agreed (a collective) since the save itself is one."""
        if self._saves_on_stop():
            interrupted = (_group_max(int(self._interrupted), self.device) if self.ranks > 1
                           else int(self._interrupted))
            if not interrupted:
                self._save_on_stop()
        self.ft.leave("stopped")

    def _saves_on_stop(self) -> bool:
        """Whether this group saves its committed state on its way out: it wrote the last
        step's checkpoints, ``checkpoint.on_stop`` is on and that step is not on disk already
        (periodic checkpoints on or off: a job stopped as a whole resumes where it stopped)."""
        return (self._writer and self.config.checkpoint.on_stop
                and not self.checkpointer.due(self.state.step))

    def _save_final(self) -> None:
        """Make the job's last step durable, whatever ``checkpoint.every`` says, unless another
        group did (``Checkpointer.save_once``): a group restarted after the others finished and
        left resumes there and ends at once holding the final state, instead of training alone
        from an older checkpoint, or from step 0. A failure is logged, never raised: the groups
        still hold the state."""
        t0 = time.perf_counter()
        try:
            saved = self.checkpointer.save_once(self.state)
        except (CheckpointError, OSError) as e:
            log.warning("the final step %d was not saved (%s); a group restarted after the others "
                        "left would have no final state to resume", self.state.step, e)
            self.events.emit("checkpoint_failed", step=self.state.step, error=str(e))
            return
        if saved:
            log.info("saved the final step %d in %.1f s", self.state.step, time.perf_counter() - t0)

    def _save_giving_up(self) -> None:
        """This group gives up (``ft.max_consecutive_failures`` steps failed with the same
        members, or no quorum within ``ft.quorum_timeout``): save the committed state first, as
        on a stop. Its peers give up at the same step when the failures are everyone's (one
        group's bad link fails every group's all-reduce), and the job then resumes from here
        instead of from its newest periodic checkpoint (a 3-group run lost its 10 steps). A
        failed step applied nothing, so the state is the last commit's; every rank of the group
        gives up at the same quorum (the leader's verdict is shared), so the save's collective
        is everyone's."""
        if self._saves_on_stop():
            self._save_on_stop()

    def _save_on_stop(self) -> None:
        """Save the committed state now; a failure is logged, never raised (the stop goes on)."""
        t0 = time.perf_counter()
        try:
            self.checkpointer.save(self.state)
            self.checkpointer.wait()
        except (CheckpointError, OSError) as e:
            log.warning("stopping at step %d: its checkpoint was not saved (%s); a resume starts "
                        "from the newest checkpoint before it", self.state.step, e)
            return
        log.info("stopping at step %d: saved its checkpoint in %.1f s (checkpoint.on_stop)",
                 self.state.step, time.perf_counter() - t0)

    def _warm_up(self) -> None:
        """One forward and backward pass of a micro-batch before joining, its gradients dropped:
        a (re)started group's first steps (memory allocation, autograd's first graph) are then
        no slower than its peers', which would wait for it in every all-reduce. Pretraining
        only: a post-training objective may count or sample what it sees."""
        if not isinstance(self.objective, LanguageModeling):
            return
        tc = self.config.train
        rows = tc.batch_size // self.ranks // tc.grad_accum
        batch = self.loader.compute(self.state.cursor, 0, 1, tc.batch_size)[:rows]
        self.sync.armed = False  # nothing goes to the other groups
        with self._autocast():
            loss = self.objective.loss(self.step_model, batch.to(self.device))
        loss.backward()
        for p in self.params:
            p.grad = None

    def _stopping(self) -> bool:
        """Whether training ends after this step: a stop request (SIGTERM) or the end of
        ``train.max_seconds``. A group of one rank decides on its own. The ranks of a larger group
        each get the signal and read the clock at their own moment, and one that stopped alone
        would leave the others waiting for it in a collective until a timeout killed the group:
        they stop together, after the first step whose in-group all-reduce carried the wish of
        any of them (a stop while the leader waits for a quorum ends that wait on every rank,
        ``StopRequested``)."""
        if self.ranks == 1:
            return self._stop or self._time_up()
        return self._stop_agreed

    def _device_fault(self, step: int, plan: StepPlan) -> bool:
        """Whether an injected fault makes this attempt non-finite: a faulty device
        (``FTLM_FAULT=nonfinite@STEP``: every attempt from that step on) or samples that break
        training (``nonfinite_sample@POSITION``: any slice holding that position), as
        ``ftlm.ft.faults`` describes."""
        batch = self.config.train.batch_size
        start = self.state.cursor + plan.participant_index * batch
        return self.ft.nonfinite_fault(step, start, start + batch)

    def _time_up(self) -> bool:
        """``train.max_seconds`` of training have passed."""
        limit = self.config.train.max_seconds
        return bool(limit) and time.time() - self._wall0 > limit

    def state_hash(self) -> str:
        """sha256 of this rank's replicated state (its shard when the model is sharded)."""
        tensors, meta = self.state.flat()
        return state_digest(tensors, {"step": meta["step"], "cursor": meta["cursor"]})

    def save_model(self) -> Path:
        """Write the model weights as ``model.safetensors`` in the run directory (atomically),
        stamped with the state they are (``ftlm.train.model_file``), when this group's state may
        be the job's model (``ftlm.ft.end_of_run.may_write_model``): never over a newer state,
        never from a group that knows no quorum unless it holds the final step."""
        from safetensors.torch import save_file, save_model
        path = self.run_dir / MODEL_FILE
        head = self.ft.head_step()
        joined, final = head is not None, self.config.train.steps
        # Decided alike on every rank (the file is read by rank 0 only, below): the gather of a
        # sharded model is a collective.
        ok, why = may_write_model(None, self.state.step, joined, final, head or 0)
        if not ok:
            log.info("not writing %s: %s", path, why)
            return path
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        meta = stamp_metadata(self.state.step, self.state.chain)
        try:
            if self.mesh is None:
                save_model(self.model, str(tmp), metadata=meta)
            else:  # gather the full weights (a collective), rank 0 writes them
                from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                     get_model_state_dict)
                full = get_model_state_dict(self.model, options=StateDictOptions(
                    full_state_dict=True, cpu_offload=True))
                if self.rank != 0:
                    return path
                save_file({k: v.clone().contiguous() for k, v in full.items()}, str(tmp), metadata=meta)
            why = install_model(tmp, path, self.state.step, joined, final, head or 0)
            if why:
                log.info("not writing %s: %s", path, why)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def _finish(self, wall_seconds: float) -> dict:
        self.save_model()
        if not self.standalone or self.rank != 0:
            return {"state_hash": self.state_hash(), "step": self.state.step, "rank": self.rank}
        events = read_events(self.run_dir / "events.jsonl")
        # A resumed run's record starts with its first incarnation: measure from there.
        if events:
            wall_seconds = max(wall_seconds, time.time() - events[0]["ts"])
        summary = build_summary(events, wall_seconds=wall_seconds,
                                state_hashes={self.group: self.state_hash()},
                                config=self.config.resolved, groups=[self.group])
        write_summary(self.run_dir / "summary.json", summary)
        return summary

    def _progress(self) -> "_Progress":
        show = self.config.observe.progress and self.rank == 0
        return _Progress(self.config, self.state.step, self.flops_per_token,
                         peak_flops(str(self.device), self.dtype) if show else 0.0,
                         quiet=self.rank != 0)


def _group_max(value: int, device: torch.device) -> int:
    """The largest ``value`` over the ranks of this replica group (a collective of the default
    process group: every rank calls it, at the same point)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


class _Progress:
    """Console view of training: a tqdm bar (loss, tokens/s, MFU), or plain lines every N steps."""

    def __init__(self, config: TrainerConfig, initial: int, flops_per_token: float, peak: float,
                 quiet: bool = False):
        self.config = config
        self.quiet = quiet  # ranks other than 0 stay silent: one view per group
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.bar = None
        if config.observe.progress and not quiet:
            from tqdm import tqdm
            self.bar = tqdm(total=config.train.steps, initial=initial, unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def update(self, n: int, trainer: Trainer) -> None:
        tc = self.config.train
        self.tokens += n * tc.batch_size * self.config.data.seq_len
        elapsed = max(1e-9, time.perf_counter() - self.t0)
        tps = self.tokens / elapsed
        loss = trainer.losses[-1] if trainer.losses else float("nan")
        if self.bar is not None:
            post = {"loss": f"{loss:.3f}", "tok/s": f"{tps:,.0f}"}
            if self.peak:
                post["mfu"] = f"{100 * tps * self.flops_per_token / self.peak:.1f}%"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(n)
        elif not self.quiet and trainer.state.step % self.config.observe.log_every == 0:
            log.info("step %d/%d loss %.4f tok/s %s", trainer.state.step, tc.steps, loss,
                     f"{tps:,.0f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
