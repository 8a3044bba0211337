"""The public training API: a user's own model, optimizer and loop, made fault tolerant.

    session = Session(model, optimizer, lr=3e-4, grad_clip=1.0, steps=1000, batch_size=32)
    for step in session:                       # joins the job on the first next()
        batch = rows_at(step.samples)          # this rank's global sample positions
        loss = loss_fn(model, batch)
        loss.backward()                        # buckets leave for the other groups from hooks
        session.commit(loss)                   # average, vote, clip, LR, optimizer step
    result = session.close()

Per step (docs/design.md, 'One training step'): ``next()`` asks fault tolerance for the step's
plan and yields a ``Step`` only when this group trains data; recovering from a peer, standing by
as a hot spare (following each step with zero gradients and applying its average), draining at
the job's end and reloading a checkpoint before a rollback happen inside ``next()``, invisible to
the loop. ``commit`` averages the gradients and the loss over the participating groups, applies
the update only if the commit vote passes, and records the commit. The iteration ends at
``steps``, on a stop request (SIGTERM) or after ``train.max_seconds``.

The session owns the replicated ``TrainState``, the gradient overlap (``GradientSync``), the
catch-up (``ftlm.train.recovery``), the non-finite judge, durable checkpoints and the model file
(``ftlm.train.durability``), this group's events, and the SIGTERM handler. It does not know
how quorums or transfers work (``ftlm.ft``, reached through ``FaultTolerance``), nor what a model
or a sample is: the caller maps sample positions to rows and computes the loss.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftlm import startup_beacon
from ftlm.errors import EXIT_RETIRED, ConfigError, RetiredError
from ftlm.ft.group import TooManyFailures
from ftlm.ft.history import extend_chain
from ftlm.ft.protocol import FaultTolerance, NoFaultTolerance, ReloadCheckpoint, StepPlan, StopRequested
from ftlm.ft.transport import state_digest
from ftlm.observe.events import EventLog, NullEvents, read_events
from ftlm.observe.metrics import TrainingMetrics
from ftlm.observe.summary import build_summary, write_summary
from ftlm.train.catchup import CatchUpBuffer
from ftlm.train.diloco import DiLoCo
from ftlm.train.durability import Durability
from ftlm.train.grad_sync import GradientSync, StepDoomed
from ftlm.train.job import join_job, start_metrics
from ftlm.train.nonfinite import NonFiniteJudge
from ftlm.train.optim import apply_update
from ftlm.train.parallelize import group_mesh
from ftlm.train.recovery import Recovery
from ftlm.train.schedule import degraded_lr_scale, lr_at
from ftlm.train.session_config import SessionConfig, resolve_config
from ftlm.train.state import TrainState

log = logging.getLogger("ftlm.train")

__all__ = ["Session", "Step", "StepDoomed"]


@dataclass(frozen=True)
class Step:
    """One step this group trains: which samples, at what learning rate, with whom."""

    step: int
    """The step being computed (0-based; the state holds ``step`` committed updates)."""
    samples: range
    """The global sample positions this rank trains: its share of ``group_samples``."""
    group_samples: range
    """The global sample positions this group trains (its slice of the step's batch)."""
    lr: float
    """The learning rate the update is applied at (schedule x degraded-mode scale)."""
    participants: int
    """Groups training data this step; gradients are averaged over them."""
    index: int
    """This group's index among the participants (decides ``group_samples``)."""

    @property
    def cursor(self) -> int:
        """The step's first sample position over all participants (the global data cursor)."""
        return self.group_samples.start - self.index * len(self.group_samples)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: writing to it writes the gradient), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def group_max(value: int, device: torch.device) -> int:
    """The largest ``value`` over the ranks of this replica group (a collective of the default
    process group: every rank calls it, at the same point)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


class Session:
    """Trains one replica group of a job through the caller's loop (module docstring).

    ``lr``: a float, or a function of the step; default the config's schedule (``[train]``).
    ``grad_clip``: clip the averaged gradient's norm to this (0: off); default ``train.grad_clip``.
    ``steps``, ``batch_size`` (samples a group trains per step), ``checkpoint_every``, ``seed``,
    ``run_dir``: default the launcher's config (``FTLM_CONFIG``), which they may not contradict;
    without one, ``steps`` and ``batch_size`` are required and ``run_dir`` defaults to
    ``FTLM_RUN_DIR``, else ``runs/run``. ``state``: extra objects with ``state_dict`` /
    ``load_state_dict`` replicated and checkpointed with the model. ``tokens_per_sample``: for
    the throughput records. ``abandon_doomed_steps``: when a step can no longer commit (a peer's
    process ended, or the coordinator reported a member of the quorum dead), raise
    ``StepDoomed`` from inside its forward or backward pass instead of computing the rest of a
    step that will be thrown away; the loop catches it and calls ``commit`` as usual. Single-
    rank groups (a sharded group computes its doomed step to the end); off by default, so that
    a loop that does not catch it is never surprised.

    Internal (the ``Trainer``): ``config`` (its sections), ``ft``, ``events``, ``metrics``,
    ``mesh``, ``coordinator``, ``data_wait`` (seconds the data loader has made training wait),
    ``standalone`` (whether this group is alone: default, without a coordinator).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 lr: float | Callable[[int], float] | None = None, grad_clip: float | None = None,
                 *, steps: int | None = None, batch_size: int | None = None,
                 state: dict[str, Any] | None = None, run_dir: str | Path | None = None,
                 checkpoint_every: int | None = None, seed: int | None = None,
                 tokens_per_sample: int = 1, config: SessionConfig | Any = None,
                 ft: FaultTolerance | None = None, events: Any = None, metrics: Any = None,
                 mesh: Any = None, coordinator: str | None = None,
                 data_wait: Callable[[], float] | None = None,
                 standalone: bool | None = None, abandon_doomed_steps: bool = False) -> None:
        if config is None:
            config = resolve_config(steps=steps, batch_size=batch_size, run_dir=run_dir,
                                    checkpoint_every=checkpoint_every, seed=seed)
        self.config = config
        tc = config.train
        self.steps, self.batch_size = tc.steps, tc.batch_size
        self.grad_clip = tc.grad_clip if grad_clip is None else grad_clip
        self._lr = lr
        self.tokens_per_sample = tokens_per_sample
        self._data_wait = data_wait or (lambda: 0.0)
        self.model = model
        self._abandon = abandon_doomed_steps
        self._block_hooks: list[Any] = []
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no parameter that requires a gradient: nothing to train")
        self.device = _local(self.params[0]).device
        self.mesh = mesh if mesh is not None else group_mesh(self.device)
        self.rank = dist.get_rank() if self.mesh is not None else 0
        self.ranks = dist.get_world_size() if self.mesh is not None else 1
        if self.batch_size % self.ranks:
            raise ConfigError(f"batch_size={self.batch_size} (train.batch_size) must be divisible "
                              f"by the group's {self.ranks} ranks")
        self.run_dir = config.run.path
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if coordinator is None and ft is None:
            coordinator = config.ft.coordinator or os.environ.get("FTLM_COORDINATOR", "")
        # Alone: no coordinator, so no catch-up budget to check and no buckets from hooks.
        self.standalone = not coordinator if standalone is None else standalone
        self.group, self.groups = "g0", 1
        if coordinator:
            member = join_job(config, coordinator, self.device, self.rank, metrics)
            self.group, self.groups, ft, metrics = member.group, member.groups, member.ft, member.metrics
        self.ft: FaultTolerance = ft or NoFaultTolerance()
        try:
            self._build(optimizer, state, events, metrics)
        except BaseException:
            self.ft.close()
            if metrics is not None:
                metrics.stop()
            raise

    def _build(self, optimizer: torch.optim.Optimizer, extra: dict[str, Any] | None,
               events: Any, metrics: Any) -> None:
        config = self.config
        # DiLoCo (``ft.sync = "diloco"``): the replicated state is the outer model and optimizer;
        # the caller's optimizer takes the inner steps (``ftlm.train.diloco``).
        self.diloco = (DiLoCo(self.model, optimizer, config.ft, self.ft, _local, self.grad_clip,
                              multi_rank=self.ranks > 1)
                       if config.ft.sync == "diloco" else None)
        if self.diloco is not None:
            self.params = self.diloco.outer
        self.per_sync = config.ft.inner_steps_per_sync  # the loop's steps per protocol step
        self._phase_t0 = 0.0  # when the DiLoCo phase in progress started
        # Cross-group buckets start from backward hooks (single-rank groups; FSDP2's sharded
        # gradients are final only after its reduce-scatter, so sharded groups start them after).
        self.sync = GradientSync(self.params, config.ft.bucket_bytes,
                                 start=lambda grads: self.ft.allreduce_start(grads), local=_local,
                                 hooks=self.mesh is None and not self.standalone and not self.diloco)
        self._block_hooks = self._watch_for_doom() if self._abandon and self.sync.handles else []
        d = self.diloco
        self.state = TrainState(d.outer_module if d else self.model, d.outer_optimizer if d else optimizer,
                                config.run.seed, mesh=self.mesh, extra=extra)
        # Payload a group puts on the wire between groups per step (every-step mode).
        self._grad_bytes = sum(_local(p).numel() * _local(p).element_size() for p in self.params)
        self.metrics = metrics if metrics is not None else start_metrics(config, self.group, self.rank)
        try:
            self.metrics_port = self.metrics.port if isinstance(self.metrics, TrainingMetrics) else None
        except RuntimeError:  # not started: tracing without serving
            self.metrics_port = None
        # One record per group: rank 0 speaks for it.
        if events is None:
            events = (EventLog(self.run_dir / "events.jsonl", group=self.group) if self.rank == 0
                      else NullEvents(group=self.group, rank=self.rank))
        self.events = self.metrics.watch_events(events)  # feeds the live ETT gauge
        self.disk = Durability(config, self.run_dir, self.state, self.events, self.metrics,
                               self.rank, self.mesh)
        buffer = CatchUpBuffer(config.ft.catchup_max_steps, config.ft.catchup_max_bytes)
        self.recovery = Recovery(self.state, self.params, self.ft, self.events, self.metrics,
                                 buffer, 0.0 if d else self.grad_clip, self.ranks,
                                 self.tokens_per_sample, params_of=d.params_of if d else None)
        self._check_memory_budgets(buffer)
        self.losses: list[float] = []
        self._nonfinite = NonFiniteJudge()  # whose fault a non-finite loss or gradient is
        self._stalled = False  # a step failed since the last commit
        self._abandoned: str | None = None  # where this step's pass was abandoned (StepDoomed)
        self._loop_thread = threading.get_ident()  # the thread that runs the caller's loop
        self._last_commit: float | None = None
        self._stop = False  # this rank was asked to stop (SIGTERM, Ctrl-C)
        self._stop_agreed = False  # some rank of the group wanted to stop at a step's all-reduce
        self._asked_next = False  # the quorum of the next step was asked for (``ft.ask``)
        # Whether this group was participant 0 (the checkpoint writer) of the last step it
        # committed as a participant (False before its first such step and while recovering).
        self._writer = False
        self._interrupted = False  # Ctrl-C: it may land mid-update, so nothing is saved after it
        self._pending: tuple[StepPlan, float] | None = None  # a yielded step not committed yet
        self._phase = "new"  # new -> training -> ended (the loop) -> closed; or failed
        self._old_handler: Any = None
        self._wall0 = time.time()
        startup_beacon.phase("loading the newest checkpoint")
        if (step := self.disk.resume()):
            log.info("resumed from checkpoint at step %d", step)

    def _check_memory_budgets(self, buffer: CatchUpBuffer) -> None:
        """Refuse to start when one buffered catch-up step (a gradient shard of this rank) does
        not fit in ``ft.catchup_max_bytes``: better now than when a peer fails. The ranks of a
        sharded group may hold shards of different sizes: the buffer holds as many steps as the
        largest shard allows, on every rank, so that all of them find it full at the same step."""
        if self.standalone:
            return
        mine = sum(_local(p).numel() * _local(p).element_size() for p in self.params)
        step_bytes = group_max(mine, self.device) if self.mesh is not None else mine
        budget = self.config.ft.catchup_max_bytes
        if step_bytes > budget:
            raise ConfigError(
                f"ft.catchup_max_bytes={budget} cannot hold one step of this group's largest "
                f"gradient shard ({step_bytes} bytes, {step_bytes / 2**30:.2f} GiB); raise it to "
                f"at least {step_bytes} x the steps a recovery may take (host memory per rank), "
                "or shard the model over more ranks")
        steps = buffer.fit_steps(step_bytes)
        log.info("catch-up buffer: up to %d steps of %.1f MiB (ft.catchup_max_steps=%d, "
                 "ft.catchup_max_bytes=%d)", steps, step_bytes / 2**20,
                 self.config.ft.catchup_max_steps, budget)

    # -- the loop ---------------------------------------------------------------------------------
    def __iter__(self) -> Session:
        return self

    def __next__(self) -> Step:
        if self._phase == "new":
            self._start()
        if self._phase != "training":
            raise StopIteration
        if self._pending is not None:
            raise RuntimeError("session.commit(loss) was not called for step "
                               f"{self._pending[0].step}: call it once per step, after backward")
        try:
            # A DiLoCo phase is owed to its quorum like an asked-for step: a stop waits for its end.
            while self.state.step < self.steps and (self._asked_next or self._in_phase()
                                                    or not self._stopping()):
                self._asked_next = False
                step = self._attempt()
                if step is not None:
                    return step
        except StopRequested as e:
            log.warning("stopping at step %d: %s", self.state.step, e)
        except KeyboardInterrupt:
            log.warning("interrupted at step %d", self.state.step)
            self._stop = self._interrupted = True
        except TooManyFailures:
            self.disk.wait()
            if self.disk.saves_on_stop(self._writer):
                self.disk.save_on_stop()
            self._fail()
            raise
        except BaseException:
            self._fail()
            raise
        self._end_loop()
        raise StopIteration

    def _start(self) -> None:
        """Take SIGTERM over, record the start and join the job."""
        # From the first heartbeat on a SIGTERM (preemption, node drain) must end in an explicit
        # leave, never in a silent death the others detect only by timeout.
        if _main_thread():
            self._old_handler = signal.signal(signal.SIGTERM, self.request_stop)
            if getattr(self._old_handler, "requested", False):  # a SIGTERM during the set-up
                self.request_stop()
        self.events.emit("group_start", step=self.state.step, metrics_port=self.metrics_port)
        startup_beacon.phase("registering with the coordinator")
        self.ft.join(self.state.step, self.state.chain)
        startup_beacon.phase("training")
        self._wall0 = time.time()
        self._phase = "training"

    def _restore_handler(self) -> None:
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
            self._old_handler = None

    def _fail(self) -> None:
        self._phase = "failed"
        self._restore_handler()

    def _end_loop(self) -> None:
        """The iteration ended (last step, stop, time): make the end durable, then finish (serve
        the groups still catching up, leave) or leave stopped."""
        self._pending = None
        self._phase = "ended"
        try:
            self.disk.wait()
            if self.state.step >= self.steps:
                self.disk.save_final()
                # Serve the groups still catching up, then leave the job (not a failure); a
                # SIGTERM meanwhile ends the serving and still leaves.
                self.ft.finish(self.state.step, self.state.chain, self.state.flat)
                if self.ft.holds_head(self.state.step, self.state.chain):
                    # A quorum at the last step took this group in: its history is the job's.
                    # Another history's final checkpoint (a group that committed the last step
                    # alone, then left before the coordinator heard of it) is replaced.
                    self.disk.save_final(job_history=True)
            else:
                self._leave_stopped()
        finally:
            self._restore_handler()

    def _leave_stopped(self) -> None:
        """Leave the job after a stop before the last step, saving the committed state first
        (``checkpoint.on_stop``) when this group wrote its last step's checkpoints and that step
        is not on disk. Not after Ctrl-C, which may have cut an update in half.

        Before the leave, not after: until the coordinator hears of it this group is a live
        member holding the newest state, so no rollback is decided meanwhile, and a group told
        afterwards that no live group holds that state finds it on disk. The others wait for
        the save: they hold the same state. Every rank takes the same branch: the role comes
        from the quorum, the step from the agreed stop, and whether any rank was interrupted is
        agreed (a collective) since the save itself is one."""
        if self.disk.saves_on_stop(self._writer):
            interrupted = (group_max(int(self._interrupted), self.device) if self.ranks > 1
                           else int(self._interrupted))
            if not interrupted:
                self.disk.save_on_stop()
        self.ft.leave("stopped")

    def _in_phase(self) -> bool:
        return self.diloco is not None and self.diloco.in_phase

    def _stopping(self) -> bool:
        """Whether training ends after this step: a stop request (SIGTERM) or the end of
        ``train.max_seconds``. The ranks of a larger group stop together, after the first step
        whose in-group all-reduce carried the wish of any of them (a rank that stopped alone
        would leave the others waiting for it in a collective)."""
        if self.ranks == 1:
            return self._stop or self._time_up()
        return self._stop_agreed

    def _time_up(self) -> bool:
        limit = self.config.train.max_seconds
        return bool(limit) and time.time() - self._wall0 > limit

    def request_stop(self, *_: Any) -> None:
        """Finish the current step, then stop (SIGTERM); a wait for a quorum ends at once: the
        group leaves within the grace, not after the quorum timeout."""
        self._stop = True
        self.ft.request_stop()

    # -- one step ---------------------------------------------------------------------------------
    def lr_at(self, plan_step: int, participants: int) -> float:
        """The learning rate of ``plan_step``: the schedule, scaled in degraded mode."""
        tc = self.config.train
        if self._lr is None:
            base = lr_at(plan_step, lr=tc.lr, steps=tc.steps * self.per_sync, warmup_steps=tc.warmup_steps,
                         schedule=tc.schedule, min_lr_ratio=tc.min_lr_ratio,
                         decay_fraction=tc.decay_fraction)
        else:
            base = self._lr(plan_step) if callable(self._lr) else float(self._lr)
        if self.diloco is not None:  # inner steps are the group's own: P does not change them
            return base
        return base * degraded_lr_scale(self.config.ft.lr_policy, participants, self.groups)

    def _attempt(self) -> Step | None:
        """Start one step of the protocol: a ``Step`` when this group trains data; else the
        whole step (recovering, draining, reloading) happens here and None is returned."""
        if self.diloco is not None and self.diloco.in_phase:
            return self._inner_step()
        t0 = time.perf_counter()
        state = self.state
        try:
            plan = self.ft.start_step(state.step, state.chain, state.flat)
        except ReloadCheckpoint as e:
            self._reload_checkpoint(e)
            return None
        if plan.drain:
            self.recovery.drain(plan)
            return None
        self.sync.begin()
        self._abandoned = None
        if not plan.participating:
            if self.diloco is not None:
                self.diloco.exchange(plan, zeros=True)
            else:
                for p in self.params:
                    p.grad = torch.zeros_like(p)
            self._finish_step(plan, torch.zeros((), device=self.device), t0)
            return None
        if self.diloco is not None:
            self.diloco.begin(plan, state.step, state.chain)
        else:
            self.optimizer.zero_grad(set_to_none=True)
            # Gradients are final in the (last) backward: buckets start from there (``no_sync``).
            self.sync.armed = True
        self._pending = (plan, t0)
        self._loop_thread = threading.get_ident()  # (``_check_doomed`` raises into it alone)
        return self._step_of(plan, 0)

    def _step_of(self, plan: StepPlan, k: int) -> Step:
        """The loop's step ``k`` of the protocol step ``plan`` (DiLoCo: of its inner phase)."""
        b, state = self.batch_size, self.state
        first = state.cursor + (plan.participant_index * self.per_sync + k) * b
        group = range(first, first + b)
        per_rank = b // self.ranks  # rank r trains its share of the group's slice
        mine = range(group.start + self.rank * per_rank, group.start + (self.rank + 1) * per_rank)
        step = plan.step * self.per_sync + k
        return Step(step=step, samples=mine, group_samples=group,
                    lr=self.lr_at(step, plan.participants),
                    participants=plan.participants, index=plan.participant_index)

    def _inner_step(self) -> Step | None:
        """The next inner step of this group's DiLoCo phase; when the phase's quorum lost a
        member, the step fails here (its samples are given out again) and None is returned."""
        plan = self.diloco.plan
        if self.diloco.alive():
            self._pending = (plan, self._phase_t0)
            return self._step_of(plan, self.diloco.k)
        self.ft.fail_step("a member of the quorum was reported dead during the inner steps")
        self._finish_step(plan, self.diloco.abandon(), self._phase_t0)
        return None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside start no gradient buckets (micro-batches before the last of a
        step, as DDP's ``no_sync``): the buckets leave once the last backward finished them."""
        armed, self.sync.armed = self.sync.armed, False
        try:
            yield
        finally:
            self.sync.armed = armed

    def _watch_for_doom(self) -> list[Any]:
        """``abandon_doomed_steps``: ask whether the step can still commit as backward makes each
        bucket ready and before each block of the forward pass (the children of every
        ``ModuleList`` and ``ModuleDict``: a transformer's layers), and raise ``StepDoomed``
        when it cannot. Single-rank groups only: the ranks of a sharded group would leave
        their collectives at different points."""
        self.sync.doomed = lambda: self._check_doomed("backward")
        blocks = [b for m in self.model.modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))
                  for b in m.children()]
        return [b.register_forward_pre_hook(lambda *_: self._check_doomed("forward")) for b in blocks]

    def _check_doomed(self, where: str) -> None:
        if self._pending is None or threading.get_ident() != self._loop_thread or self.ft.step_alive():
            return  # (outside a step: an evaluation, the warm-up; or on a thread of the caller's own)
        self._abandoned = where
        self.ft.fail_step(f"the step can no longer commit: the rest of its {where} pass is skipped")
        raise StepDoomed(f"step {self._pending[0].step} can no longer commit (a member of its quorum "
                         f"was lost): its {where} pass was abandoned; call session.commit to go on")

    def commit(self, loss: torch.Tensor | float) -> bool:
        """Average the gradients and ``loss`` (this rank's mean loss of the step) over the
        participating groups, vote, and apply the update (clip, LR, ``optimizer.step``,
        ``zero_grad``) only if every participant's step succeeded. True if committed; a failed
        step changes nothing and is retried by the next ``next()``."""
        if self._pending is None:
            raise RuntimeError("session.commit(loss) outside a step: call it once per step "
                               "yielded by the session, after backward")
        plan, t0 = self._pending
        self._pending = None
        if not torch.is_tensor(loss):
            loss = torch.tensor(float(loss), device=self.device)
        loss = loss.detach().float().reshape(())
        try:
            if self.diloco is not None:
                self._phase_t0 = t0
                step = plan.step * self.per_sync + self.diloco.k
                loss = self.diloco.inner_commit(loss, self.lr_at(step, plan.participants))
                if loss is None:  # the phase goes on: nothing leaves the group
                    return True
            return self._finish_step(plan, loss, t0)
        except Exception:  # (Ctrl-C is the caller's: ``interrupt``, then ``close``)
            self._fail()
            raise

    def _finish_step(self, plan: StepPlan, loss: torch.Tensor, t0: float) -> bool:
        state = self.state
        d = self.diloco
        # Starts the buckets backward did not start (DiLoCo: the outer gradient's, unless an
        # overlapped exchange started them already).
        grads = self.sync.finish() if d is None else d.exchange(plan)
        if plan.recovering:
            self.recovery.while_waiting(plan)
        loss_buf = self._exchange(plan, loss, grads)
        if d is not None:
            d.decode()
        nonfinite = bool(loss_buf[1] > 0)
        if nonfinite:
            self.ft.fail_step("non-finite loss or gradient")
        with self.metrics.phase("vote"):
            ok = self.ft.commit()
        lr = self.lr_at(plan.step, plan.participants) if d is None else self.config.ft.diloco_outer_lr
        samples = plan.participants * self.batch_size * self.per_sync
        if plan.recovering:
            self._writer = False  # a recovering group is no checkpoint writer until it commits
            self._asked_next = self.recovery.after_vote(plan, ok, grads, lr, samples,
                                                        float(loss_buf[0]), self._stopping())
            # Ends the step's trace span: its phases belong to this step, not the next.
            self.metrics.on_recovering_step(plan.step, time.perf_counter() - t0, ok)
            return ok
        if not ok:
            self._failed(plan, loss_buf, nonfinite)
            if d is not None:
                d.failed()
            return False
        self._nonfinite.committed()
        start, parent = state.cursor, state.chain
        chain = (plan.quorum.next_chain() if plan.quorum is not None
                 else extend_chain(parent, plan.step, plan.quorum_id, [self.group]))
        # The next quorum's round trip overlaps with the update below. Once it is asked for, the
        # group owes that quorum its next step, even if asked to stop meanwhile: a member that
        # left a quorum it was counted in would fail the others' step.
        self._asked_next = not self._stopping() and self.ft.ask(state.step + 1, chain)
        with self.metrics.phase("commit"):
            grad_norm = (apply_update(self.params, state.optimizer, lr, self.grad_clip) if d is None
                         else apply_update(d.params_of(plan.step), state.optimizer, lr, 0.0))
        state.step += 1
        state.cursor += samples
        state.chain = chain
        wire = {"wire_bytes": self._grad_bytes}
        if d is not None:
            d.committed(state.step, state.chain)
            wire = {"wire_bytes": d.wire_bytes, "inner_steps": self.per_sync,
                    "fragment": d.fragment_of(plan.step), "outer_seconds": d.outer_seconds,
                    "staleness": d.staleness}
            self.metrics.on_outer_step(d.outer_seconds, d.staleness)
        self._writer = plan.participant_index == 0
        global_loss = float(loss_buf[0])
        self.losses.append(global_loss)
        seconds = time.perf_counter() - t0
        self.events.emit("commit", step=plan.step, quorum_id=plan.quorum_id,
                         participants=plan.participants, samples=[start, start + samples],
                         loss=global_loss, tokens=samples * self.tokens_per_sample, lr=lr,
                         grad_norm=grad_norm, step_seconds=seconds, chain=state.chain,
                         parent=parent, quorum_wait=plan.waited, **wire,
                         **({"spare": True} if plan.spare else {}))
        now = time.monotonic()
        if self._stalled and self._last_commit is not None:
            # Time this healthy group lost to a failure: the gap since its previous commit,
            # beyond what this (ordinary) step took.
            self.metrics.on_stall(max(0.0, now - self._last_commit - seconds))
        self._stalled, self._last_commit = False, now
        # A spare applied the step's average but trained none of its tokens.
        rank_tokens = (0 if plan.spare else
                       self.batch_size // self.ranks * self.tokens_per_sample * self.per_sync)
        self.metrics.on_wire(wire["wire_bytes"], rank_tokens * self.ranks)
        self.metrics.on_commit(plan.step, global_loss, rank_tokens, seconds, lr, grad_norm,
                               data_wait_seconds=self._data_wait())
        self.metrics.sample_memory()
        self.disk.committed(writer=plan.participant_index == 0, final=state.step == self.steps)
        return True

    def _exchange(self, plan: StepPlan, loss: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
        """All-reduce the loss with a non-finite flag per participant (and wait for the gradient
        buckets); returns [mean loss, any non-finite, one flag per participant]."""
        state = self.state
        # A non-finite gradient must not reach any replica's state: the flag that travels with
        # the loss makes every group fail this step together, so no average that includes it is
        # ever applied, nor buffered for a catch-up (the buckets are already on their way).
        # One device sync for all of them (a norm is non-finite iff an element is, or overflows).
        norms = torch._foreach_norm(grads) if grads else []
        finite = bool(torch.isfinite(torch.stack([loss.float().reshape(()),
                                                  *[n.float().to(loss.device) for n in norms]])).all())
        if plan.participating:
            b = self.batch_size * self.per_sync  # a participant's slice of the step
            start = state.cursor + plan.participant_index * b
            # An injected fault (``FTLM_FAULT=nonfinite@STEP``, ``nonfinite_sample@POSITION``).
            if self.ft.nonfinite_fault(state.step, start, start + b):
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
        if stops is not None and bool(stops > 0):
            self._stop_agreed = True
        return loss_buf

    def _failed(self, plan: StepPlan, loss_buf: torch.Tensor, nonfinite: bool) -> None:
        state = self.state
        state.optimizer.zero_grad(set_to_none=True)
        reason = "non-finite loss or gradient" if nonfinite else "collective or vote failed"
        who = (loss_buf[2:] > 0).nonzero().flatten().tolist() if nonfinite else []
        self.metrics.on_step_failed(plan.step)
        self._stalled = True
        # Which samples (global positions) the non-finite participants trained: a recovering
        # group does not know (its own cursor is behind the step's).
        known = bool(who) and plan.participating
        b = self.batch_size * self.per_sync  # a participant's slice of the step
        if self._abandoned:
            reason += f" (the rest of its {self._abandoned} pass was skipped)"
        self.events.emit("step_failed", step=state.step, quorum_id=plan.quorum_id, reason=reason,
                         **({"abandoned": self._abandoned} if self._abandoned else {}),
                         **({"nonfinite_samples": [[state.cursor + i * b, state.cursor + (i + 1) * b]
                                                   for i in who]} if known else {}))
        self._nonfinite.failed(state.step, who, plan.participants,
                               plan.participant_index if plan.participating else None,
                               state.cursor, b,
                               plan.quorum.recovering_count if plan.quorum is not None else 0)

    def _reload_checkpoint(self, why: ReloadCheckpoint) -> None:
        """Every group holding the job's newest state died: load the newest durable checkpoint if
        it is newer than this group's state, so that the coordinator's rollback gives up no step
        that is on disk. The next ``start_step`` asks with the state loaded (or the same one)."""
        before = self.state.step
        loaded = self.disk.reload(why.head)
        if loaded is None:
            return
        step, seconds = loaded
        # A pull in flight, or a snapshot being replayed, leads from an older state: dropped.
        self.recovery.drop()
        self._writer = False
        self.ft.restart_recovery(f"loaded the durable checkpoint of step {step}")
        self.events.emit("checkpoint_reloaded", step=step, from_step=before, head=why.head,
                         seconds=seconds, chain=self.state.chain)

    # -- the end ----------------------------------------------------------------------------------
    def state_hash(self) -> str:
        """sha256 of this rank's replicated state (its shard when the model is sharded)."""
        tensors, meta = self.state.flat()
        return state_digest(tensors, {"step": meta["step"], "cursor": meta["cursor"]})

    def interrupt(self) -> None:
        """The caller's loop was interrupted (Ctrl-C) mid-step: end without saving the state,
        which may hold half an update."""
        self._stop = self._interrupted = True
        if self._phase == "training":
            self._end_loop()

    def close(self) -> dict:
        """End the session: the loop's end if it did not run (a ``break``: a stop; a step not
        committed: an interruption), the model file, the summary (alone) or the ``FTLM_RESULT``
        line (in a job), then leave the coordinator and stop metrics. Returns the summary alone,
        else this rank's result (state hash, step, rank, incarnation)."""
        if self._phase in ("new", "closed", "failed"):  # never joined: nothing to record
            self._release()
            return {}
        if self._phase == "training":
            if self._pending is not None:
                self.interrupt()
            else:
                self._stop = True
                self._end_loop()
        try:
            # Finish while still heartbeating, so the end of a run is not mistaken for a hang.
            return self._finish(time.time() - self._wall0)
        finally:
            self._release()
            self.events.emit("group_exit", step=self.state.step, ok=True)

    def _release(self) -> None:
        if self._phase == "closed":
            return
        self._phase = "closed"
        self._restore_handler()
        self.sync.close()
        for h in self._block_hooks:
            h.remove()
        self.ft.close()
        self.metrics.stop()

    def _finish(self, wall_seconds: float) -> dict:
        if self.diloco is not None:
            self.diloco.load_outer_into_model()
        self.disk.save_model(self.model, self.ft.head_step(), self.steps)
        result = {"state_hash": self.state_hash(), "step": self.state.step, "rank": self.rank}
        if not self.standalone:
            result["incarnation"] = getattr(self.ft, "incarnation", "")
            # The supervisor collects each group's final state hash from this line.
            print("FTLM_RESULT " + json.dumps(result), flush=True)
            return result
        if self.rank != 0:
            return result
        events = read_events(self.run_dir / "events.jsonl")
        # A resumed run's record starts with its first incarnation: measure from there.
        if events:
            wall_seconds = max(wall_seconds, time.time() - events[0]["ts"])
        summary = build_summary(events, wall_seconds=wall_seconds,
                                state_hashes={self.group: self.state_hash()},
                                config=self.config.resolved, groups=[self.group])
        write_summary(self.run_dir / "summary.json", summary)
        return summary

    def abort(self) -> None:
        """Release what the session holds after an error (no records, no model file, no leave:
        the job finds this group gone as it finds a crash)."""
        self._fail()
        self._release()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 *_: Any) -> None:
        if kind is None:
            self.close()
        elif kind is KeyboardInterrupt and self._phase in ("training", "ended"):
            self.interrupt()
            self.close()
        else:
            suspect = getattr(error, "suspect_state", None)  # (``ftlm.ft.Convicted``)
            if suspect is not None:
                self.disk.set_aside(*suspect)
            self.abort()
            if isinstance(error, RetiredError):
                # The launchers count a group retired by its exit status, not by a message.
                log.error("%s", error)
                raise SystemExit(EXIT_RETIRED) from error
