"""Where durable checkpoints live and which are complete, without torch (``ftlm.train.checkpoint``
reads, writes and verifies them; where a relaunch resumes is its ``newest_intact``).

A checkpoint is the directory ``step-NNNNNNNN`` under the checkpoint root; it is complete once its
``COMPLETE`` marker exists (written last). Complete is not intact: ``ftlm.train.checkpoint.verify``
checks the contents.
"""

from __future__ import annotations

from pathlib import Path

MARKER = "COMPLETE"
PREFIX = "step-"


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def valid_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint under ``root`` whose marker exists, oldest first.

    Valid means complete, not verified: ``ftlm.train.checkpoint.verify`` checks its contents.
    """
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.name.startswith(PREFIX) and (path / MARKER).is_file():
            try:
                found.append((int(path.name[len(PREFIX):]), path))
            except ValueError:
                continue
    return sorted(found)
