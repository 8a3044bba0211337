"""The run's final weights, ``RUN_DIR/model.safetensors``: which state they are, and who may
replace them.

Every group of a job writes the job's weights into the one run directory as it exits. The file
says which state it holds (safetensors metadata ``ftlm.step``, ``ftlm.chain``,
``ftlm.written_at``), and ``ftlm.ft.end_of_run.may_write_model`` decides whether a group's state
may replace it: never a state behind the one the file holds, and only a state the group knows to
be the job's (it took part in a quorum and is not behind its head, or it holds the final step).
The check and the replacement are one step under the run directory's model lock
(``install_model``). A new run into a directory holding an earlier run's model moves that
record aside first (``ftlm.train.run_record``): a group's exit never does.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ftlm.ft.end_of_run import may_write_model

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
STEP_KEY, CHAIN_KEY, WRITTEN_KEY = "ftlm.step", "ftlm.chain", "ftlm.written_at"
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own limit


@dataclass(frozen=True)
class ModelStamp:
    """The state a model file holds: its committed step and chain, and when it was written
    (seconds since the epoch, the writer's clock)."""
    step: int
    chain: str
    written_at: float


def stamp_metadata(step: int, chain: str) -> dict[str, str]:
    """The safetensors metadata of a model file holding the state at ``step`` (``chain``),
    written now."""
    return {"format": "pt", STEP_KEY: str(step), CHAIN_KEY: chain, WRITTEN_KEY: repr(time.time())}


def read_stamp(path: Path) -> ModelStamp | None:
    """The stamp of the model file at ``path``; None when there is no file, it is not a
    safetensors file, or it carries no stamp (written by ``ftlm convert`` or an older ftlm).
    Reads the header only (an 8-byte little-endian length, then that much JSON)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(size))
        meta = header["__metadata__"]
        return ModelStamp(int(meta[STEP_KEY]), str(meta.get(CHAIN_KEY, "")), float(meta[WRITTEN_KEY]))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None


def install_model(tmp: Path, path: Path, step: int, joined: bool, final_step: int,
                  head: int = 0) -> str:
    """Move the model file written at ``tmp`` (the state at ``step``) to ``path`` when
    ``may_write_model`` allows it over what ``path`` holds; returns "" when it did, else why not
    (``tmp`` is then left for the caller to remove). Under the run directory's model lock."""
    with model_lock(path.parent):
        held = read_stamp(path)
        ok, why = may_write_model(held.step if held is not None else None, step, joined,
                                  final_step, head)
        if ok:
            os.replace(tmp, path)
        return why


@contextlib.contextmanager
def model_lock(run_dir: Path) -> Iterator[None]:
    """Hold the run directory's model lock (``.model.lock``): the check of the file in place and
    its replacement are one step for the groups of the job."""
    with file_lock(run_dir / ".model.lock", "writing the model"):
        yield


@contextlib.contextmanager
def file_lock(path: Path, doing: str) -> Iterator[None]:
    """Hold an advisory ``flock`` on ``path`` (created when missing) while ``doing``. Where the
    file system has no locks, ``doing`` goes on without it, with a warning: the groups of a job
    then may race over the few ms of a check and a rename."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        log.warning("cannot open the lock %s (%s): %s without it", path, e, doing)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            log.warning("cannot lock %s (%s): %s without it", path, e, doing)
        yield
    finally:
        os.close(fd)  # releases the lock
