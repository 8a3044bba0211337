"""What a session keeps on disk: durable checkpoints of the committed state and the model file.

A group resumes from the newest intact checkpoint at start; its writer (participant 0 of the step)
saves every ``checkpoint.every`` committed steps in the background and the final step always;
a group that stops early or gives up saves its committed state on the way out
(``checkpoint.on_stop``); before the job rolls back, a group loads a newer checkpoint than its own
state (``reload``). A failed save is recorded (``checkpoint_failed``), never raised: the replicas
hold the state. The model file is written when ``may_write_model`` allows it.

Not here: when a group stops or is the writer (``ftlm.train.session``), the checkpoint format and
its verification (``ftlm.train.checkpoint``), the model file's stamp (``ftlm.train.model_file``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftlm.errors import CheckpointError
from ftlm.ft.durable_rules import saves_on_stop
from ftlm.ft.end_of_run import may_write_model
from ftlm.train.checkpoint import Checkpointer
from ftlm.train.job_token import checkpoint_signing
from ftlm.train.model_file import MODEL_FILE, install_model, stamp_metadata
from ftlm.train.state import TrainState

log = logging.getLogger("ftlm.train")


class Durability:
    """The checkpoints and model file of one group (every rank holds one; rank 0 writes)."""

    def __init__(self, config: Any, run_dir: Path, state: TrainState, events: Any, metrics: Any,
                 rank: int, mesh: Any) -> None:
        ck = config.checkpoint
        self.config = ck
        self.state = state
        self.events = events
        self.metrics = metrics
        self.run_dir = run_dir
        self.rank = rank
        self.mesh = mesh
        # Background saves run collectives of their own: give them a process group of their own,
        # or they would interleave with FSDP's collectives on the group's default one.
        ckpt_pg = dist.new_group(backend="gloo") if mesh is not None else None
        self.checkpointer = Checkpointer(
            Path(ck.dir) if ck.dir else run_dir / "checkpoints", ck.every, ck.keep,
            ck.async_save, process_group=ckpt_pg, on_saved=self._on_saved,
            writer=rank == 0, on_rejected=self._on_rejected,
            # The job token signs checkpoint manifests for this run (HMAC); none without a token.
            **dict(zip(("key", "run"), checkpoint_signing(config.ft, run_dir))))

    def resume(self) -> int | None:
        """Load the newest intact checkpoint (``checkpoint.resume``); its step, or None."""
        if not self.config.resume:
            return None
        return self.checkpointer.restore_latest(self.state)

    def guard(self, action: Callable[[], None]) -> None:
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

    def committed(self, writer: bool, final: bool) -> None:
        """After a commit: reap a finished background save; the writer saves a due step, and
        the final step at once (any group that finishes saves it later if it is not on disk)."""
        self.guard(self.checkpointer.poll)
        if final and writer:
            self.save_final()
        elif self.checkpointer.due(self.state.step) and writer:
            self.guard(self.checkpointer.wait)  # a save in flight that failed: on its own
            self.guard(lambda: self.checkpointer.save(self.state))

    def wait(self) -> None:
        self.guard(self.checkpointer.wait)

    def saves_on_stop(self, writer: bool) -> bool:
        """Whether this group saves its committed state on its way out: it wrote the last
        step's checkpoints, ``checkpoint.on_stop`` is on and that step is not on disk already."""
        return saves_on_stop(writer, self.config.on_stop, self.checkpointer.due(self.state.step))

    def save_final(self, job_history: bool = False) -> None:
        """Make the job's last step durable, whatever ``checkpoint.every`` says, unless another
        group did (``Checkpointer.save_once``): a group restarted after the others finished and
        left resumes there and ends at once holding the final state. ``job_history``: the
        coordinator confirmed this state as the job's; a final checkpoint of another history
        is replaced. A failure is logged, never raised: the groups still hold the state."""
        t0 = time.perf_counter()
        try:
            saved = self.checkpointer.save_once(self.state, job_history=job_history)
        except (CheckpointError, OSError) as e:
            log.warning("the final step %d was not saved (%s); a group restarted after the others "
                        "left would have no final state to resume", self.state.step, e)
            self.events.emit("checkpoint_failed", step=self.state.step, error=str(e))
            return
        if saved:
            log.info("saved the final step %d in %.1f s", self.state.step, time.perf_counter() - t0)

    def save_on_stop(self) -> None:
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

    def set_aside(self, step: int, chain: str) -> None:
        """This group was retired because its state (``step``, ``chain``) may hold the bits of a
        group found corrupt (the coordinator's rule I2): move that state's checkpoint aside, so
        that the next process starts from an older one. Errors are logged, never raised."""
        try:
            moved = self.checkpointer.set_aside(step, chain)
        except OSError as e:
            log.warning("could not set the checkpoint of step %d aside: %s", step, e)
            return
        if moved is not None:
            log.warning("the checkpoint of step %d may hold a corrupt group's state: moved to %s; the "
                        "next start loads an older one", step, moved)

    def reload(self, head: int) -> tuple[int, float] | None:
        """No live group holds the job's newest state (step ``head``): load the newest durable
        checkpoint if it is newer than this group's state. Returns (its step, seconds), or None
        when nothing newer is on disk or ``checkpoint.resume`` is off."""
        before = self.state.step
        if not self.config.resume:
            log.info("no live group holds step %d; checkpoint.resume is off, so no checkpoint is "
                     "loaded", head)
            return None
        t0 = time.perf_counter()
        step = self.checkpointer.restore_latest(self.state, newer_than=before)
        if step is None:
            log.info("no live group holds step %d and no checkpoint is newer than step %d",
                     head, before)
            return None
        log.warning("no live group holds step %d: loaded the checkpoint of step %d (was at step %d)",
                    head, step, before)
        return step, time.perf_counter() - t0

    def save_model(self, model: torch.nn.Module, head: int | None, final: int) -> Path:
        """Write the model weights as ``model.safetensors`` in the run directory (atomically),
        stamped with the state they are, when this group's state may be the job's model
        (``may_write_model``): never over a newer state, never from a group that knows no quorum
        (``head`` None) unless it holds the final step."""
        from safetensors.torch import save_file, save_model
        path = self.run_dir / MODEL_FILE
        joined, step = head is not None, self.state.step
        # Decided alike on every rank (the file is read by rank 0 only, below): the gather of a
        # sharded model is a collective.
        ok, why = may_write_model(None, step, joined, final, head or 0)
        if not ok:
            log.info("not writing %s: %s", path, why)
            return path
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        meta = stamp_metadata(step, self.state.chain)
        try:
            if self.mesh is None:
                save_model(model, str(tmp), metadata=meta)
            else:  # gather the full weights (a collective), rank 0 writes them
                from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                     get_model_state_dict)
                full = get_model_state_dict(model, options=StateDictOptions(
                    full_state_dict=True, cpu_offload=True))
                if self.rank != 0:
                    return path
                save_file({k: v.clone().contiguous() for k, v in full.items()}, str(tmp), metadata=meta)
            why = install_model(tmp, path, step, joined, final, head or 0)
            if why:
                log.info("not writing %s: %s", path, why)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def _on_saved(self, step: int, path: Path, seconds: float) -> None:
        self.events.emit("checkpoint_saved", step=step, path=str(path), seconds=seconds)
        self.metrics.on_checkpoint(step, seconds, path)

    def _on_rejected(self, step: int, path: Path, reason: str) -> None:
        self.events.emit("checkpoint_rejected", step=step, path=str(path), reason=reason)
