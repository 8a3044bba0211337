"""Durable checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, asynchronous, rotated.

A checkpoint is the directory ``step-NNNNNNNN`` holding DCP files; it is valid only once its
``COMPLETE`` marker (JSON: step, cursor, time) has been written after every file is on disk. A
crash mid-save leaves a directory without a marker, which is ignored and later removed. Live
recovery between groups does not use this module; it is for whole-job restarts.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ftlm.errors import CheckpointError
from ftlm.train.state import TrainState

MARKER = "COMPLETE"
_PREFIX = "step-"


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"{_PREFIX}{step:08d}"


def valid_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint under ``root`` whose marker exists, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.name.startswith(_PREFIX) and (path / MARKER).is_file():
            try:
                found.append((int(path.name[len(_PREFIX):]), path))
            except ValueError:
                continue
    return sorted(found)


# DCP warns from its background writer thread too, where a local catch_warnings cannot reach.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def _reason(e: BaseException) -> str:
    """One line saying why DCP failed (its own message embeds whole tracebacks)."""
    if isinstance(e, CheckpointException) and e.failures:
        first = next(iter(e.failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    return " ".join(str(e).split())[:300]


def _quiet(fn, *args, **kwargs):
    # DCP warns that no process group exists when a single process saves or loads; that is the
    # intended single-group use, so the warning would only be noise on the console.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return fn(*args, **kwargs)


class Checkpointer:
    """Saves every ``every`` steps into ``root``, keeps the newest ``keep`` valid checkpoints."""

    def __init__(self, root: Path, every: int, keep: int, async_save: bool = True,
                 process_group=None, on_saved=None, writer: bool = True):
        self.root = Path(root)
        self.every = every
        self.keep = keep
        self.async_save = async_save
        self.process_group = process_group
        # With several ranks, DCP's coordinator (rank 0) finishes last: it alone marks and rotates.
        self.writer = writer
        self.on_saved = on_saved or (lambda step, path, seconds: None)
        self._pending: tuple[Future, int, int, Path, float] | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def save(self, state: TrainState) -> None:
        """Start saving ``state`` (at its current step); returns once the state has been copied."""
        self.wait()  # one save in flight at a time: bounded memory for staged copies
        path = checkpoint_dir(self.root, state.step)
        if self.writer and path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        if self.async_save:
            future = _quiet(dcp.async_save, {"train": state}, checkpoint_id=str(path),
                            process_group=self.process_group)
            self._pending = (future, state.step, state.cursor, path, started)
        else:
            _quiet(dcp.save, {"train": state}, checkpoint_id=str(path),
                   process_group=self.process_group)
            self._finish(state.step, state.cursor, path, started)

    def poll(self) -> None:
        """Finish a background save that has completed (cheap; call once per step)."""
        if self._pending and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk and marked valid."""
        if not self._pending:
            return
        future, step, cursor, path, started = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"writing checkpoint {path} failed: {_reason(e)}") from e
        self._finish(step, cursor, path, started)

    def _finish(self, step: int, cursor: int, path: Path, started: float) -> None:
        if not self.writer:
            return
        marker = {"step": step, "cursor": cursor, "time": time.time()}
        tmp = path / (MARKER + ".tmp")
        tmp.write_text(json.dumps(marker))
        os.replace(tmp, path / MARKER)
        self._rotate()
        self.on_saved(step, path, time.monotonic() - started)

    def _rotate(self) -> None:
        valid = valid_checkpoints(self.root)
        newest = valid[-1][0] if valid else -1
        for step, path in valid[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)
        for path in self.root.iterdir():
            # Directories without a marker older than the newest valid one are dead saves.
            if path.name.startswith(_PREFIX) and not (path / MARKER).exists():
                try:
                    if int(path.name[len(_PREFIX):]) < newest:
                        shutil.rmtree(path, ignore_errors=True)
                except ValueError:
                    pass

    def restore_latest(self, state: TrainState) -> int | None:
        """Load the newest valid checkpoint into ``state``; its step, or None if there is none."""
        valid = valid_checkpoints(self.root)
        if not valid:
            return None
        step, path = valid[-1]
        try:
            _quiet(dcp.load, {"train": state}, checkpoint_id=str(path),
                   process_group=self.process_group)
        except (Exception, CheckpointException) as e:
            raise CheckpointError(
                f"checkpoint {path} could not be loaded ({_reason(e)}); it may come from a different "
                "model size or be damaged: delete it, or set checkpoint.resume=false") from e
        if state.step != step:
            raise CheckpointError(f"checkpoint {path} holds step {state.step}, expected {step}")
        return step
