"""Training a model of ``[model]`` on prepared data: the first user of ``ftlm.train.Session``.

The trainer builds what a run's config describes (the model, or one injected; the data, its
loader and the held-out evaluation; the optimizer; the console progress) and loops over a
``Session`` like any user of the API: it maps each step's sample positions to rows, computes the
objective's loss over the step's micro-batches and commits. Pretraining and post-training differ
only in the ``Objective`` and ``TrainData`` injected (``ftlm.train.objective``).

Not here: anything of the fault-tolerance protocol (quorums, recovery, checkpoints, the vote,
stopping): the session owns it (``ftlm.train.session``), and ``ftlm.ft`` below it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
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
from ftlm.ft.protocol import FaultTolerance
from ftlm.model import Transformer, flops_per_token
from ftlm.train.config import TrainerConfig
from ftlm.train.evaluate import build_evaluator
from ftlm.train.mfu import peak_flops
from ftlm.train.objective import (
    LanguageModeling,
    Objective,
    ReportingObjective,
    SummedObjective,
    TrainData,
)
from ftlm.train.optim import build_optimizer
from ftlm.train.parallelize import group_mesh, parallelize
from ftlm.train.session import Session, Step, StepDoomed


log = logging.getLogger("ftlm.train")

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
    """Load ``model.safetensors`` weights (as the session (``Durability.save_model``) writes them) into ``model``;
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


class Trainer:
    """Trains one replica group; ``train()`` runs the loop and returns the final summary fields
    (alone) or this rank's result (in a job)."""

    def __init__(self, config: TrainerConfig, ft: FaultTolerance | None = None,
                 standalone: bool | None = None, objective: Objective | None = None,
                 data: TrainData | None = None, metrics: Any = None, coordinator: str = "",
                 model: torch.nn.Module | None = None):
        """``objective`` and ``data`` default to language modelling on ``data.dir`` (pretraining);
        post-training commands inject their own (``ftlm.train.objective``). ``model`` defaults to
        the ``Transformer`` of ``config.model``; an injected one (any module whose forward maps
        token rows to logits, or to an output with ``.logits``) is trained as it is placed.
        ``coordinator``: the job this group joins (``ftlm.train.job.run_group``); empty: alone.
        ``ft`` and ``metrics`` are for tests and internal callers (``Session``'s own). ``config``
        holds only the sections training reads (``RunConfig.trainer_config()``, or
        ``Trainer.for_run``)."""
        self.config = config
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
        self.last_stats: dict[str, float] = {}
        """What a ``ReportingObjective`` measured in the last committed step (shown by the
        progress view)."""
        self.loader = Loader(data.train, seed=config.run.seed, prefetch=config.data.prefetch)
        # Ranks inside this replica group (torchrun environment): FSDP2 shards the model over them.
        self.mesh = group_mesh(self.device)
        self.rank = dist.get_rank() if self.mesh is not None else 0
        self.ranks = dist.get_world_size() if self.mesh is not None else 1
        standalone = not coordinator if standalone is None else standalone
        if standalone and self.rank == 0 and config.resolved:
            (self.run_dir / "config.toml").write_text(tomli_w.dumps(config.resolved))
        if tc.batch_size % (self.ranks * tc.grad_accum):
            raise ConfigError(f"train.batch_size={tc.batch_size} must be divisible by the group's "
                              f"{self.ranks} rank(s) x train.grad_accum={tc.grad_accum}")
        startup_beacon.phase("building the model")
        if model is None:
            model = build_model(config, self.device)
            if tc.init_from:
                load_weights(model, Path(tc.init_from))
            self.flops_per_token = flops_per_token(config.model, config.data.seq_len)
        else:
            self.flops_per_token = 0.0  # an injected model's shape is not config.model's
        self.model = model
        self.step_model = parallelize(self.model, self.mesh,
                                      activation_checkpointing=tc.activation_checkpointing,
                                      compile=tc.compile)
        self.evaluator = build_evaluator(self.step_model, data.heldout, tc, rank=self.rank,
                                         ranks=self.ranks, device=self.device,
                                         autocast=self._autocast, objective=self.objective)
        self.session = Session(self.model, build_optimizer(self.model, tc), config=config, ft=ft,
                               metrics=metrics, mesh=self.mesh, coordinator=coordinator,
                               standalone=standalone,
                               # (not under torch.compile: a hook that may raise breaks its graphs)
                               abandon_doomed_steps=not tc.compile,
                               tokens_per_sample=self.objective.tokens_per_sample,
                               data_wait=lambda: self.loader.wait_seconds)

    @classmethod
    def for_run(cls, config: Any, **kwargs: Any) -> Trainer:
        """A trainer of the run ``config`` (a ``ftlm.config.RunConfig``: only its trainer's
        sections reach the trainer); ``kwargs`` as for the constructor."""
        return cls(config.trainer_config(), **kwargs)

    # What the session holds, named as callers and tests read it.
    state = property(lambda self: self.session.state)
    params = property(lambda self: self.session.params)
    losses = property(lambda self: self.session.losses)
    checkpointer = property(lambda self: self.session.disk.checkpointer)
    catchup = property(lambda self: self.session.recovery.buffer)

    def _autocast(self):
        if self.dtype != torch.float32:  # master weights and optimizer state stay float32
            return torch.autocast(self.device.type, dtype=self.dtype)
        return contextlib.nullcontext()

    # -- the loop --------------------------------------------------------------------------------
    def train(self) -> dict:
        """Train until the last step, a stop request or ``train.max_seconds``."""
        session = self.session
        try:
            if not session.standalone:
                self._warm_up()
            bar = self._progress()
            shown = self.state.step
            try:
                for step in session:
                    if self.train_step(step):
                        self._evaluate()
                    bar.update(self.state.step - shown, self)
                    shown = self.state.step
            except KeyboardInterrupt:
                log.warning("interrupted at step %d", self.state.step)
                session.interrupt()
            finally:
                bar.close()
                self.loader.close()
            return session.close()
        except BaseException:
            # The command line maps the error to the exit status (a retired group: 3).
            session.abort()
            raise

    def train_step(self, step: Step) -> bool:
        """Train this rank's rows of ``step`` and commit; True if the step committed."""
        tc = self.config.train
        rows = self.loader.batch(step.cursor, step.index, step.participants, tc.batch_size)
        offset = step.samples.start - step.group_samples.start  # this rank's share of the slice
        rows = rows[offset:offset + len(step.samples)]
        units = self._step_units(step)
        reporting = isinstance(self.objective, ReportingObjective)
        if reporting:
            self.objective.step_stats()  # drop what a failed step or the warm-up measured
        with self.session.metrics.phase("forward_backward"):
            try:  # (GRPO's rollouts run inside the objective's loss, so in here too)
                loss = self._forward_backward(rows.to(self.device, non_blocking=True), units,
                                              step.participants)
            except StepDoomed:  # a member of the step's quorum was lost: the step fails
                loss = torch.zeros((), device=self.device)
        committed = self.session.commit(loss)
        if committed and reporting:
            stats = self.objective.step_stats()
            if stats:
                self.session.events.emit("objective", step=step.step, **stats)
                self.last_stats = stats
        return committed

    def _step_units(self, step: Step) -> float | None:
        """The units every participant's rows of ``step`` hold, for a ``SummedObjective``."""
        if not isinstance(self.objective, SummedObjective):
            return None
        size = self.config.train.batch_size
        return sum(self.objective.units(self.loader.compute(step.cursor, i, step.participants, size))
                   for i in range(step.participants))

    def _forward_backward(self, batch: torch.Tensor, units: float | None = None,
                          participants: int = 1) -> torch.Tensor:
        """Accumulate the gradient of the step's loss over this rank's ``batch``: the mean of the
        micro-batch losses, or for a ``SummedObjective`` its sums over the step's ``units`` (of
        all ``participants``); returns this rank's share of that loss (detached)."""
        micro = batch.chunk(self.config.train.grad_accum)
        # The gradient is averaged over the group's ranks and the participants: a summed loss is
        # scaled up by both so that the averages leave sum / units.
        share = self.ranks * participants / max(units, 1.0) if units is not None else 0.0
        total = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro):
            with self._autocast():
                if units is None:
                    loss = self.objective.loss(self.step_model, mb) / len(micro)
                else:
                    loss = self.objective.loss_sum(self.step_model, mb) * share
            # Gradients are final in the last micro-batch's backward: buckets start from there.
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else self.session.no_sync():
                loss.backward()
            total += loss.detach()
        return total

    def _evaluate(self) -> None:
        """The held-out loss when due (committed, participating: every rank of the group)."""
        state = self.state
        if self.evaluator.due(state.step):
            ev = self.evaluator.evaluate()
            self.session.events.emit("eval", step=state.step, loss=ev.loss,
                                     tokens=state.cursor * self.objective.tokens_per_sample,
                                     seconds=ev.seconds)
            self.session.metrics.on_eval(ev.loss)

    def _warm_up(self) -> None:
        """One forward and backward pass of a micro-batch before joining, its gradients dropped:
        a (re)started group's first steps (memory allocation, autograd's first graph) are then
        no slower than its peers', which would wait for it in every all-reduce. Pretraining
        only: a post-training objective may count or sample what it sees."""
        if not isinstance(self.objective, LanguageModeling):
            return
        startup_beacon.phase("warming up")
        tc = self.config.train
        rows = tc.batch_size // self.ranks // tc.grad_accum
        batch = self.loader.compute(self.state.cursor, 0, 1, tc.batch_size)[:rows]
        with self.session.no_sync():  # nothing goes to the other groups
            with self._autocast():
                loss = self.objective.loss(self.step_model, batch.to(self.device))
            loss.backward()
        for p in self.params:
            p.grad = None

    def request_stop(self, *_: Any) -> None:
        """Finish the current step, then stop (as SIGTERM does)."""
        self.session.request_stop()

    def state_hash(self) -> str:
        """sha256 of this rank's replicated state (its shard when the model is sharded)."""
        return self.session.state_hash()

    def _progress(self) -> "_Progress":
        show = self.config.observe.progress and self.rank == 0
        return _Progress(self.config, self.state.step, self.flops_per_token,
                         peak_flops(str(self.device), self.dtype) if show and self.flops_per_token
                         else 0.0, quiet=self.rank != 0)


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
            post.update({k: f"{v:.3f}" for k, v in trainer.last_stats.items()})
            if self.peak:
                post["mfu"] = f"{100 * tps * self.flops_per_token / self.peak:.1f}%"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(n)
        elif not self.quiet and trainer.state.step % self.config.observe.log_every == 0:
            log.info("step %d/%d loss %.4f tok/s %s%s", trainer.state.step, tc.steps, loss,
                     f"{tps:,.0f}", "".join(f" {k} {v:.3f}" for k, v in trainer.last_stats.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
