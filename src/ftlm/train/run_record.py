"""The record of a run directory is never erased: what a new run would replace is moved aside
into ``RUN_DIR/previous/<UTC time>/`` first.

The record is what a run writes about itself: ``events.jsonl``, ``summary.json``, ``report.md``
and its plots, ``logs/``, ``model.safetensors`` and ``prometheus_targets.json``. A run that
starts over at step 0 (no checkpoint to resume from) in a directory holding an earlier record
moves all of it; a run that resumes from a checkpoint continues ``events.jsonl`` and moves only
what it writes anew (``also``), plus ``model.safetensors`` when that holds a state newer than the
checkpoint (resuming behind it is an explicit rollback, and the newer weights are kept).

Not touched: ``checkpoints/`` (what a run resumes from), ``token`` (it authenticates them) and
``config.toml`` (rewritten by every run; the summary holds each run's config). Where a run resumes is
``resume_step`` (the checkpoint verification is ``ftlm.train.checkpoint``'s). Not done here:
locking the directory against a concurrent run (``ftlm.launch.run_lock``).
"""

from __future__ import annotations

import time
from pathlib import Path

from ftlm.errors import DataError
from ftlm.observe.events import read_events
from ftlm.train.checkpoint_files import valid_checkpoints
from ftlm.train.config import CheckpointConfig
from ftlm.train.model_file import MODEL_FILE, read_stamp

RECORD = ("events.jsonl", "summary.json", "report.md", "logs", MODEL_FILE, "prometheus_targets.json")
"""What a run writes about itself into its directory (report.md's plots go with it)."""
PREVIOUS = "previous"


def resume_step(checkpoint: CheckpointConfig, run_dir: Path, key: bytes | None,
                run: str = "") -> int | None:
    """The checkpoint step a run into ``run_dir`` will resume from, verified as the trainer
    verifies it under the job token ``key``, signed for ``run`` (``newest_intact``); None when
    it starts over (``checkpoint.resume`` off, or no intact checkpoint)."""
    root = Path(checkpoint.dir) if checkpoint.dir else Path(run_dir) / "checkpoints"
    if not checkpoint.resume or not valid_checkpoints(root):
        return None
    from ftlm.train.checkpoint import newest_intact  # imports torch: only with checkpoints to verify
    return newest_intact(root, key, run)


def set_aside(run_dir: Path, resume_step: int | None, also: tuple[str, ...] = ()) -> str | None:
    """Before a run into ``run_dir`` starts: move the parts of the earlier record that it would
    replace into ``previous/<UTC time>/``; one line saying what moved where (None if nothing did).

    ``resume_step`` is the checkpoint step the run resumes from, None when it starts over.
    """
    run_dir = Path(run_dir)
    if resume_step is None:
        last = last_committed_step(run_dir / "events.jsonl")
        moved = archive(run_dir, _with_plots(run_dir, RECORD))
        if moved is None:
            return None
        earlier = f"last committed step {last}" if last is not None else "no committed step"
        return (f"starting over at step 0 (no checkpoint to resume from, or checkpoint.resume "
                f"is off); the earlier record ({earlier}) was moved to {moved}")
    stamp = read_stamp(run_dir / MODEL_FILE)
    newer = stamp.step if stamp is not None and stamp.step > resume_step else None
    moved = archive(run_dir, _with_plots(run_dir, also) + ((MODEL_FILE,) if newer is not None else ()))
    if moved is None:
        return None
    line = (f"resuming from the checkpoint of step {resume_step}; the earlier launch's files were "
            f"moved to {moved}")
    if newer is not None:
        line += (f", with {MODEL_FILE} of step {newer} (rolled back to step {resume_step}: "
                 f"its newer weights are kept there)")
    return line


def archive(run_dir: Path, names: tuple[str, ...], now: float | None = None) -> Path | None:
    """Move those of ``names`` that exist in ``run_dir`` (an empty folder does not count) into a
    new ``previous/<UTC time>/``; that folder, or None when there was nothing to move."""
    present = [name for name in names if _holds_something(run_dir / name)]
    if not present:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    target = run_dir / PREVIOUS / stamp
    n = 1
    while target.exists():  # two runs within a second
        n += 1
        target = run_dir / PREVIOUS / f"{stamp}-{n}"
    target.mkdir(parents=True)
    for name in present:
        (run_dir / name).rename(target / name)
    return target


def last_committed_step(events: Path) -> int | None:
    """The highest step a ``commit`` event of ``events`` names; None without one (or a readable
    file)."""
    try:
        recorded = read_events(events)
    except (DataError, OSError):
        return None
    steps = [e["step"] for e in recorded if e["kind"] == "commit" and type(e.get("step")) is int]
    return max(steps, default=None)


def _holds_something(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.exists()


def _with_plots(run_dir: Path, names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` plus report.md's plots when it moves: the report links them by relative path."""
    if "report.md" not in names or not (run_dir / "report.md").exists():
        return names
    from ftlm.observe.plots import PLOT_FILES  # imports matplotlib: only when there is a report
    return names + tuple(PLOT_FILES.values())
