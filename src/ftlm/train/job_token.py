"""The job token and the run id of a run directory: what signs its checkpoints, found one way.

The token authenticates the job's requests and signs its checkpoint manifests (HMAC). It comes
from ``FTLM_TOKEN`` (what the launchers export), else the file ``ft.token_file`` names, else the
run directory's own ``token`` file (what ``ftlm launch local`` writes and keeps, and what ``ftlm
convert`` reads): ``ftlm train RUN_DIR/config.toml`` run by hand in a run directory that has one
signs and checks its checkpoints as the launch did, and refuses an unsigned one.

The run id (``run-id`` in the run directory, drawn once) goes into every manifest the run signs:
another run's checkpoint under the same token (a shared ``FTLM_TOKEN``, a Slurm folder
regenerated for another run) is refused. Both files are created with ``O_EXCL | O_NOFOLLOW`` at
mode 600 (never through a symbolic link someone left in their place); a token file that other
users may read is warned about.

Not responsible for checking signatures (``ftlm.train.checkpoint``) or for the coordinator's
authentication (``ftlm.ft``).
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from ftlm.errors import ConfigError

log = logging.getLogger("ftlm.train")

TOKEN_FILE = "token"
RUN_ID_FILE = "run-id"
MIN_TOKEN_CHARS = 16


def _create_private(path: Path, text: str) -> bool:
    """Write ``text`` to a new file ``path`` (mode 600), never through a symbolic link; False
    when ``path`` exists already (another process of the run may have just created it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        if path.is_symlink():
            raise ConfigError(f"{path} is a symbolic link: ftlm does not create a job file "
                              "through one; remove it (a new one is made in its place)") from None
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return True


def read_token_file(path: Path, what: str = "") -> str:
    """The token in ``path``, warning when users other than its owner may read it."""
    try:
        mode = path.stat().st_mode
        token = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"{what or path}: the job token cannot be read ({e.strerror})") from e
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("%s is readable by other users (mode %03o): anyone who reads it can steer "
                    "the job and sign checkpoints; chmod 600 %s", path, mode & 0o777, path)
    return token


def run_token(run_dir: Path) -> str:
    """The job token of ``run_dir``, made once and kept (mode 600) in ``run_dir/token``: a
    relaunch into the same run directory uses the same one, or it would refuse every checkpoint
    it wrote before. A token shorter than 16 characters is replaced."""
    path = Path(run_dir) / TOKEN_FILE
    for _ in range(2):
        if path.exists():
            token = read_token_file(path)
            if len(token) >= MIN_TOKEN_CHARS:
                return token
            path.unlink()
        token = secrets.token_hex(16)
        if _create_private(path, token):
            return token
    raise ConfigError(f"{path}: another process keeps replacing the job token; stop it")


def job_token(ft: Any, run_dir: Path) -> str:
    """The job's token (``ft``: the ``FTConfig``): ``FTLM_TOKEN``, else ``ft.token_file``, else
    the run directory's ``token`` file; empty when there is none."""
    token = os.environ.get("FTLM_TOKEN", "")
    if token:
        return token
    if ft.token_file:
        path = Path(ft.token_file)
        if not path.is_file():
            raise ConfigError(f"ft.token_file={ft.token_file!r} does not exist")
        return read_token_file(path, f"ft.token_file={ft.token_file!r}")
    path = Path(run_dir) / TOKEN_FILE
    return read_token_file(path) if path.is_file() else ""


def run_id(run_dir: Path, create: bool = True) -> str:
    """The id of the run in ``run_dir``: drawn once, kept in ``run_dir/run-id``. Every process
    of the run reads the same one (the first to create the file wins; it is written whole
    before it appears, so nobody reads it half-written). Without ``create``, empty when the
    run has none."""
    run_dir = Path(run_dir)
    path = run_dir / RUN_ID_FILE
    if not path.is_file():
        if not create:
            return ""
        run_dir.mkdir(parents=True, exist_ok=True)
        draft = run_dir / f".{RUN_ID_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        _create_private(draft, secrets.token_hex(8))
        try:
            os.link(draft, path)  # atomic, and fails if another process linked its own first
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    rid = path.read_text().strip()
    if not rid:
        raise ConfigError(f"{path} is empty: delete it (a new run id is drawn; the run's "
                          "signed checkpoints then no longer count as its own)")
    return rid


def checkpoint_signing(ft: Any, run_dir: Path) -> tuple[bytes | None, str]:
    """``(key, run)`` for the run's checkpoints: the token's bytes (None without a token) and,
    with a token, the run id (empty without: nothing is signed then)."""
    token = job_token(ft, run_dir)
    return (token.encode(), run_id(run_dir)) if token else (None, "")
