"""Durable checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, verified, rotated.

**Layout.** A checkpoint is the directory ``step-NNNNNNNN`` holding DCP's files (``.metadata``,
``*.distcp``), then ``MANIFEST.json``, then the ``COMPLETE`` marker, each written atomically. The
marker comes last, once every other file is on disk, so a directory is valid only once its marker
exists; a crash mid-save leaves one without it, which is ignored and later removed.

**Integrity.** The manifest records the step, the cursor and the size and sha256 of every file of
the checkpoint, and the run that wrote it (its run id, ``ftlm.train.job_token.run_id``); given a
key (the job token), it carries an HMAC-SHA256 of all of that, so a checkpoint of another run under
the same token is refused too. Restoring checks, before a single byte is deserialised: the manifest
(under a key, one without a valid HMAC, or signed for another run, is refused), each listed file's size and sha256, and that no unlisted file DCP would read is
present. Deserialisation is restricted too, so even an unauthenticated checkpoint cannot run code:
DCP's pickled ``.metadata`` goes through an unpickler that admits only DCP's metadata classes, and
non-tensor values through ``torch.load(weights_only=True)`` (DCP's default would unpickle anything).

**Fallback.** ``restore_latest`` tries the valid checkpoints newest first. One that fails
verification is reported (``on_rejected``: a warning log, and the trainer's ``checkpoint_rejected``
event), moved aside to ``rejected-step-NNNNNNNN`` for inspection (so that rotation never weighs it
against newer saves), and the next older one is tried; with none intact, training starts from
scratch. A checkpoint without a manifest (written before these checks existed) is never trusted:
restoring stops with a message saying how to proceed.

Not done here: guarding against someone who rewrites files *while* they are restored (files are
hashed, then read again by DCP; only ``.metadata`` is parsed from the very bytes that were hashed),
encryption, and live recovery between groups (``ftlm.ft.transport``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from ftlm.errors import CheckpointError
from ftlm.ft.durable_rules import checkpoint_due, keeps_final_on_disk
from ftlm.ft.integrity import state_fingerprint
from ftlm.observe.iostats import timed_io
from ftlm.train.checkpoint_files import MARKER, checkpoint_dir, valid_checkpoints
from ftlm.train.model_file import file_lock
from ftlm.train.checkpoint_files import PREFIX as _PREFIX
from ftlm.train.state import TrainState

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
STATE_DIGEST = "state-digest-r{rank}.json"
"""Each rank's digest of the state it saved (``ftlm.ft.integrity``), checked after a load: the
files verify the bytes on disk, this the state they make."""
METADATA = ".metadata"  # DCP's name for its (pickled) global metadata file
REJECTED_PREFIX = "rejected-"
_FORMAT = 1
_MAX_MANIFEST_BYTES = 16 << 20
_DCP_READS = (".distcp", ".metadata")  # what DCP's file-system reader opens in a checkpoint
_HMAC_CONTEXT = b"ftlm checkpoint manifest v1\0"  # the token also signs other things: separate them
_SHA256 = re.compile(r"[0-9a-f]{64}")


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


# -- manifest -----------------------------------------------------------------------------------

class RejectedCheckpoint(CheckpointError):
    """A checkpoint failed verification (damaged, tampered with or not authenticated)."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"checkpoint {path} rejected: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self):  # DCP pickles a rank's exception to report it on the others
        return type(self), (self.path, self.reason)


class UnverifiableCheckpoint(CheckpointError):
    """A complete checkpoint without a manifest, from an ftlm version before integrity checks."""


def _digest(path: Path) -> tuple[int, str]:
    """(size, sha256 hex) of the file at ``path``, read once."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _mac(key: bytes, manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "hmac"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, _HMAC_CONTEXT + canonical, hashlib.sha256).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a synced temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(path: Path, step: int, cursor: int, key: bytes | None = None,
                   run: str = "") -> dict[str, Any]:
    """Hash every file of checkpoint ``path`` into its ``MANIFEST.json``, with the ``run`` that
    wrote it (none when empty), HMAC'ed under ``key``."""
    files = {}
    for f in sorted(path.iterdir()):
        if f.name in (MANIFEST, MARKER) or f.name.endswith(".tmp") or not f.is_file():
            continue
        size, sha = _digest(f)
        files[f.name] = {"size": size, "sha256": sha}
    manifest: dict[str, Any] = {"format": _FORMAT, "step": step, "cursor": cursor, "files": files}
    if run:
        manifest["run"] = run
    if key:
        manifest["hmac"] = _mac(key, manifest)
    _write_atomic(path / MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_shape(manifest: Any) -> str | None:
    """What is malformed about a parsed manifest, or None."""
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        return f"{MANIFEST} is not an ftlm manifest of format {_FORMAT}"
    if not (_is_int(manifest.get("step")) and _is_int(manifest.get("cursor"))):
        return f"{MANIFEST} has no integer step and cursor"
    if not isinstance(manifest.get("run", ""), str):
        return f"{MANIFEST} has a run that is not a string"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return f"{MANIFEST} has no file list"
    for name, entry in files.items():
        if (name in (".", "..", MANIFEST, MARKER) or "/" in name or "\\" in name or "\0" in name
                or not isinstance(entry, dict) or not _is_int(entry.get("size"))
                or entry["size"] < 0 or not isinstance(entry.get("sha256"), str)
                or not _SHA256.fullmatch(entry["sha256"])):
            return f"{MANIFEST} has a malformed entry {name[:80]!r}"
    return None


def read_manifest(path: Path, key: bytes | None = None, run: str = "") -> dict[str, Any]:
    """The manifest of checkpoint ``path``, authenticated when ``key`` is given, and then (with
    ``run``) signed for that run.

    Raises ``UnverifiableCheckpoint`` when there is none, ``RejectedCheckpoint`` when it is
    unreadable, malformed or (under ``key``) not authentic.
    """
    file = path / MANIFEST
    try:
        with open(file, "rb") as f:
            raw = f.read(_MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise UnverifiableCheckpoint(
            f"checkpoint {path} has no {MANIFEST}: it was written by an ftlm version without "
            "integrity checks, or its manifest was removed, so its contents cannot be verified "
            f"and it is not loaded; delete it (older checkpoints in {path.parent} are then "
            "tried), or set checkpoint.resume=false to start from scratch") from None
    except OSError as e:
        raise RejectedCheckpoint(path, f"{MANIFEST} cannot be read ({e.strerror})") from e
    if len(raw) > _MAX_MANIFEST_BYTES:
        raise RejectedCheckpoint(path, f"{MANIFEST} is larger than {_MAX_MANIFEST_BYTES} bytes")
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise RejectedCheckpoint(path, f"{MANIFEST} is not valid JSON") from e
    if key:
        mac = manifest.get("hmac") if isinstance(manifest, dict) else None
        if not isinstance(mac, str):
            raise RejectedCheckpoint(path, f"{MANIFEST} carries no HMAC but a job token is set: "
                                           "it was written without a token, or tampered with")
        # An HMAC is 64 hex digits: anything else (non-ASCII text, which compare_digest refuses
        # with a TypeError) is no valid HMAC either.
        if not _SHA256.fullmatch(mac) or not hmac.compare_digest(mac, _mac(key, manifest)):
            raise RejectedCheckpoint(path, f"{MANIFEST}'s HMAC does not match this job's token: "
                                           "written under another token, or tampered with")
        written_by = manifest.get("run") if isinstance(manifest, dict) else None
        if run and written_by != run:
            whose = (f"run {written_by!r}" if isinstance(written_by, str) and written_by
                     else "no named run (an ftlm version before checkpoints named their run)")
            raise RejectedCheckpoint(path, f"it was signed for {whose}, not this run {run!r}: "
                                           "another run's checkpoint under the same job token")
    if problem := _check_shape(manifest):
        raise RejectedCheckpoint(path, problem)
    return manifest


# -- restricted deserialisation -----------------------------------------------------------------

_DCP_MD = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = frozenset({
    (_DCP_MD, "Metadata"), (_DCP_MD, "MetadataIndex"), (_DCP_MD, "StorageMeta"),
    (_DCP_MD, "TensorStorageMetadata"), (_DCP_MD, "BytesStorageMetadata"),
    (_DCP_MD, "ChunkStorageMetadata"), (_DCP_MD, "TensorProperties"),
    (_DCP_MD, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup among torch.layout values, nothing more
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
})
"""Every global a DCP ``.metadata`` pickle refers to, besides torch dtypes: listed by saving model
and optimizer state dicts, plain and FSDP2-sharded over 2 ranks (DTensor), and recording what the
pickles name. Each is a data class, an enum, or a pure lookup: none runs code of the file's
choosing."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}"[:120])


def load_dcp_metadata(data: bytes, path: Path) -> Metadata:
    """Unpickle DCP metadata, admitting only the classes DCP metadata consists of.

    A pickle naming anything else (``os.system``, ``builtins.eval``, ...) is refused before
    that name is resolved, so nothing it asks for is run.
    """
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise RejectedCheckpoint(path, f"{METADATA} refers to {e}, which DCP metadata never "
                                       "contains: refused to unpickle it (crafted file?)") from e
    except Exception as e:  # noqa: BLE001 - any failure of a damaged pickle is a rejection
        raise RejectedCheckpoint(
            path, f"{METADATA} is not DCP metadata ({type(e).__name__})") from e
    if not isinstance(metadata, Metadata):
        raise RejectedCheckpoint(path, f"{METADATA} holds a {type(metadata).__name__}, "
                                       "not DCP metadata")
    return metadata


def _data_files(metadata: Metadata, path: Path) -> set[str]:
    """The files DCP will read tensors and values from, as named by ``metadata``."""
    try:
        names = {info.relative_path for info in metadata.storage_data.values()}
    except (AttributeError, TypeError) as e:
        raise RejectedCheckpoint(path, f"{METADATA} has malformed storage entries") from e
    if not all(isinstance(n, str) for n in names):
        raise RejectedCheckpoint(path, f"{METADATA} has malformed storage entries")
    return names


class VerifiedReader(FileSystemReader):
    """DCP's file-system reader, minus its unrestricted unpickling of ``.metadata``.

    Given ``metadata`` (parsed from the bytes that were checked against the manifest) it hands
    that to DCP and never reads ``.metadata`` again; otherwise it parses the file with
    ``load_dcp_metadata``. Given ``files``, it refuses metadata naming any other data file.
    Rank-local metadata (``__N.metadata``, which ftlm never writes) is refused.
    """

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None,
                 files: set[str] | None = None):
        super().__init__(path)
        self._metadata = metadata
        self._files = files

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path)
        if kwargs.get("rank") is not None:
            raise RejectedCheckpoint(path, "only global DCP metadata is read, not rank-local")
        metadata = self._metadata
        if metadata is None:
            metadata = load_dcp_metadata((path / METADATA).read_bytes(), path)
        if self._files is not None and (unlisted := _data_files(metadata, path) - self._files):
            raise RejectedCheckpoint(path, f"{METADATA} names files the manifest does not list "
                                           f"({', '.join(sorted(unlisted))[:200]})")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values (the optimizer's hyper-
    parameters) are unpickled by torch's weights-only unpickler, which builds plain data only;
    DCP's own uses ``torch.load(weights_only=False)``, which runs whatever the bytes ask for."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            what = f" (it names {found.group(1)})" if found else ""
            raise CheckpointError(f"value {fqn} is not plain data{what}: refused to unpickle it "
                                  "(crafted file?)") from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


# -- verification -------------------------------------------------------------------------------

@dataclass
class Verified:
    """A checkpoint whose manifest, listing and (this rank's share of) files checked out."""

    path: Path
    step: int
    manifest: dict[str, Any]
    metadata: Metadata


def verify(path: Path, key: bytes | None = None, share: tuple[int, int] = (0, 1),
           run: str = "") -> Verified:
    """Check checkpoint ``path`` against its manifest, deserialising nothing unverified.

    Everyone checks the manifest, the listing, every size, and the hash and contents of
    ``.metadata``; the data files are hashed only in this rank's ``share = (rank, ranks)``, so
    the ranks of a sharded group split the reading (their verdicts must then be combined).
    Under ``key`` and with ``run``, the checkpoint must be signed for that run. Raises
    ``RejectedCheckpoint`` or ``UnverifiableCheckpoint``.
    """
    manifest = read_manifest(path, key, run)
    if path.name != f"{_PREFIX}{manifest['step']:08d}":
        raise RejectedCheckpoint(path, f"its manifest says it holds step {manifest['step']}, its "
                                       "name another: renamed, or tampered with")
    files = manifest["files"]
    try:
        present = {f.name: f.stat().st_size for f in path.iterdir() if f.is_file()}
    except OSError as e:
        raise RejectedCheckpoint(path, f"its directory cannot be listed ({e.strerror})") from e
    for name in sorted(present):
        if name not in files and name.endswith(_DCP_READS):
            raise RejectedCheckpoint(path, f"{name[:80]} is not in its manifest")
    for name, entry in sorted(files.items()):
        if name not in present:
            raise RejectedCheckpoint(path, f"{name} is missing")
        if present[name] != entry["size"]:
            raise RejectedCheckpoint(path, f"{name} has {present[name]} bytes, its manifest "
                                           f"says {entry['size']}")
    if METADATA not in files:
        raise RejectedCheckpoint(path, f"its manifest lists no {METADATA}")
    # Parse the very bytes that were hashed: a later rewrite of the file cannot slip in.
    try:
        with open(path / METADATA, "rb") as f:
            data = f.read(files[METADATA]["size"] + 1)
    except OSError as e:
        raise RejectedCheckpoint(path, f"{METADATA} cannot be read ({e.strerror})") from e
    if hashlib.sha256(data).hexdigest() != files[METADATA]["sha256"]:
        raise RejectedCheckpoint(path, f"{METADATA} does not match its sha256 in the manifest "
                                       "(damaged or modified)")
    metadata = load_dcp_metadata(data, path)
    unlisted = _data_files(metadata, path) - set(files)
    if unlisted:
        raise RejectedCheckpoint(path, f"{METADATA} names files its manifest does not list "
                                       f"({', '.join(sorted(unlisted))[:200]})")
    rank, ranks = share
    for name in sorted(n for n in files if n != METADATA)[rank::ranks]:
        try:
            size, sha = _digest(path / name)
        except OSError as e:
            raise RejectedCheckpoint(path, f"{name} cannot be read ({e.strerror})") from e
        if (size, sha) != (files[name]["size"], files[name]["sha256"]):
            raise RejectedCheckpoint(path, f"{name} does not match its sha256 in the manifest "
                                           "(damaged or modified)")
    return Verified(path, manifest["step"], manifest, metadata)


def newest_intact(root: Path, key: bytes | None = None, run: str = "") -> int | None:
    """The step ``Checkpointer.restore_latest`` would resume from: that of the newest checkpoint
    under ``root`` that ``verify`` accepts under ``key`` for ``run``; None when none does. Loads nothing and
    moves nothing aside (the groups do, when they restore). Raises ``UnverifiableCheckpoint``
    where restoring would."""
    for step, path in reversed(valid_checkpoints(root)):
        try:
            verify(path, key, run=run)
        except RejectedCheckpoint:
            continue
        return step
    return None


@timed_io("checkpoint_read", lambda _, ckpt, *a, **k: sum(f["size"] for f in ckpt.manifest["files"].values()))
def load_verified(checkpoint: Verified, state_dict: dict[str, Any],
                  process_group: Any = None) -> None:
    """Load a verified checkpoint into ``state_dict`` (DCP semantics: in place, collective)."""
    _quiet(dcp.load, state_dict,
           storage_reader=VerifiedReader(checkpoint.path, checkpoint.metadata,
                                         set(checkpoint.manifest["files"])),
           planner=WeightsOnlyLoadPlanner(), process_group=process_group)


def _marker_chain(path: Path) -> str | None:
    """The history a checkpoint holds, as its marker records it (None: not recorded, or the
    marker is unreadable; such a checkpoint is never replaced)."""
    try:
        chain = json.loads((path / MARKER).read_text()).get("chain")
    except (OSError, ValueError, AttributeError):
        return None
    return chain if isinstance(chain, str) else None


@contextlib.contextmanager
def _dir_lock(root: Path, held: bool) -> Iterator[None]:
    """Hold ``root/.save.lock`` when ``held`` (``model_file.file_lock``)."""
    if not held:
        yield
        return
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / ".save.lock", "saving"):
        yield


# Verdicts of one rank on one checkpoint; the group acts on the highest any rank reached.
_INTACT, _GONE, _REJECTED, _UNVERIFIABLE = 0, 1, 2, 3


class Checkpointer:
    """Saves every ``every`` steps into ``root``, keeps the newest ``keep`` valid checkpoints.

    ``key`` (the job token's bytes) authenticates manifests, which name ``run`` (the run id:
    under a key, a checkpoint signed for another run is refused); ``on_saved(step, path, seconds)``
    follows each save that became valid, ``on_rejected(step, path, reason)`` each checkpoint
    that ``restore_latest`` skipped.
    """

    def __init__(self, root: Path, every: int, keep: int, async_save: bool = True,
                 process_group=None, on_saved=None, writer: bool = True,
                 key: bytes | None = None,
                 on_rejected: Callable[[int, Path, str], None] | None = None, run: str = ""):
        if key is not None and not isinstance(key, bytes):
            raise TypeError(f"Checkpointer key must be bytes or None, got {type(key).__name__}")
        self.root = Path(root)
        self.every = every
        self.keep = keep
        self.async_save = async_save
        self.process_group = process_group
        # With several ranks, DCP's coordinator (rank 0) finishes last: it alone marks and rotates.
        self.writer = writer
        self.key = key or None
        self.run = run
        self.on_saved = on_saved or (lambda step, path, seconds: None)
        self.on_rejected = on_rejected or (lambda step, path, reason: None)
        self._pending: tuple[Future, int, Path, float] | None = None

    def due(self, step: int) -> bool:
        return checkpoint_due(step, self.every)

    # -- saving ----------------------------------------------------------------------------------
    def save(self, state: TrainState) -> None:
        """Start saving ``state`` (at its current step); returns once the state has been copied.
        Raises ``CheckpointError`` when this save (or the one in flight before it) failed."""
        self.wait()  # one save in flight at a time: bounded memory for staged copies
        path = checkpoint_dir(self.root, state.step)
        started = time.monotonic()
        step, cursor, chain = state.step, state.cursor, state.chain
        rank, ranks = self._share()
        try:
            # The writer clears a stale directory before any rank writes into it (a rank whose
            # digest landed first lost it to the writer's rmtree, and then left the others
            # waiting in DCP's collectives).
            self._on_every_rank(lambda: self._clear(path), ranks)
            # Before the save: the manifest (sealed after it) must list the file.
            digest = {"step": step, "digest": state_fingerprint(state.flat()[0])}
            self._on_every_rank(lambda: _write_atomic(path / STATE_DIGEST.format(rank=rank),
                                                      json.dumps(digest).encode()), ranks)
            if self.async_save:
                written = _quiet(dcp.async_save, {"train": state}, checkpoint_id=str(path),
                                 process_group=self.process_group)
                self._pending = (self._sealed_after(written, step, cursor, chain, path), step, path, started)
                return
            _quiet(dcp.save, {"train": state}, checkpoint_id=str(path),
                   process_group=self.process_group)
            self._seal(step, cursor, chain, path)
        except (Exception, CheckpointException) as e:  # a full disk, a lost mount: one message
            raise CheckpointError(f"writing checkpoint {path} failed: {_reason(e)}") from e
        self._finish(step, path, started)

    def _clear(self, path: Path) -> None:
        if self.writer and path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)

    def _on_every_rank(self, work: Callable[[], None], ranks: int) -> None:
        """Run ``work`` here, then wait for the group's other ranks to have run theirs; raise on
        every rank if it failed on any (a rank that raised alone would leave the others in the
        next collective until its timeout)."""
        error: OSError | None = None
        try:
            work()
        except OSError as e:
            error = e
        if self._agree(int(error is not None), ranks):
            raise error or CheckpointError("another rank of this group could not write its part")

    def save_once(self, state: TrainState, job_history: bool = False) -> bool:
        """Save ``state`` now, and wait until it is valid, unless a complete checkpoint of its
        step is on disk already (another group of the job wrote it); whether this call saved.

        For the last step, which every group that finishes the job makes sure of: under the
        checkpoint directory's lock (``.save.lock``, an advisory ``flock`` held by the writing
        rank), so that groups finishing at once write it once and never over each other. Every
        rank of a group calls it (the save is a collective); the writing rank decides.

        ``job_history``: the coordinator confirmed ``state`` as the job's (a quorum at its step
        took this group in). A checkpoint of the same step from another history is then
        replaced: a group that committed the last step alone and left before the coordinator
        heard of it saved a history the job then gave up (the others redid that step), and a
        group restarted after the others left would resume from it and never be let in."""
        self.wait()
        rank, ranks = self._share()
        with _dir_lock(self.root, held=self.writer):
            verdict = 0
            if rank == 0:
                chains = [_marker_chain(path) for step, path in valid_checkpoints(self.root)
                          if step == state.step]
                # 1: keep what is on disk; 0: save (none, or another history to replace).
                verdict = int(keeps_final_on_disk(chains, state.chain, job_history))
                if chains and not verdict:
                    log.warning("replacing the checkpoint of step %d (history %s...) with the "
                                "job's (history %s...): the other history was given up",
                                state.step, str(chains[0])[:12], state.chain[:12])
            if self._agree(verdict, ranks):
                return False
            self.save(state)
            self.wait()
        return True

    def poll(self) -> None:
        """Finish a background save that has completed (cheap; call once per step)."""
        if self._pending and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk and marked valid."""
        if not self._pending:
            return
        sealed, step, path, started = self._pending
        self._pending = None
        try:
            sealed.result()
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"writing checkpoint {path} failed: {_reason(e)}") from e
        self._finish(step, path, started)

    def _sealed_after(self, written: Future, step: int, cursor: int, chain: str,
                      path: Path) -> Future:
        """A future that completes once DCP's write has and the checkpoint is sealed.

        Sealing (hashing the files) runs in DCP's writer thread, off the training loop.
        """
        sealed: Future = Future()

        def seal(_: Future) -> None:
            try:
                written.result()
                self._seal(step, cursor, chain, path)
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is one
                sealed.set_exception(e)
            else:
                sealed.set_result(None)

        written.add_done_callback(seal)
        return sealed

    def _seal(self, step: int, cursor: int, chain: str, path: Path) -> None:
        """Manifest, then marker: the directory becomes valid only with the marker."""
        if not self.writer:
            return
        write_manifest(path, step, cursor, self.key, self.run)
        marker = {"step": step, "cursor": cursor, "time": time.time(), "chain": chain}
        _write_atomic(path / MARKER, json.dumps(marker).encode())
        _sync_dir(path)

    def _finish(self, step: int, path: Path, started: float) -> None:
        if not self.writer:
            return
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

    # -- restoring -------------------------------------------------------------------------------
    def restore_latest(self, state: TrainState, newer_than: int = -1) -> int | None:
        """Load the newest intact checkpoint of a step above ``newer_than`` into ``state``; its
        step, or None if there is none (``state`` is then untouched).

        Checkpoints that fail verification are skipped (``on_rejected``) and moved aside. Raises
        ``CheckpointError`` for a checkpoint without a manifest, and for one that verifies but
        does not fit ``state`` (another model size).
        """
        candidates = [(step, path) for step, path in valid_checkpoints(self.root) if step > newer_than]
        rejected = 0
        for step, path in reversed(candidates):
            checkpoint = self._verify_with_group(step, path)
            if checkpoint is None:
                rejected += 1
                continue
            try:
                load_verified(checkpoint, {"train": state}, self.process_group)
            except (Exception, CheckpointException) as e:
                raise CheckpointError(
                    f"checkpoint {path} could not be loaded ({_reason(e)}); it may come from a "
                    "different model size: delete it, or set checkpoint.resume=false") from e
            if state.step != step:
                raise CheckpointError(f"checkpoint {path} holds step {state.step}, expected {step}")
            if self._state_differs(step, path, state, last=step == candidates[0][0]):
                rejected += 1
                continue
            return step
        if rejected:
            log.warning("no intact checkpoint in %s (%d skipped): training starts from scratch",
                        self.root, rejected)
        return None

    def _verify_with_group(self, step: int, path: Path) -> Verified | None:
        """Verify ``path`` together with the other ranks; the checkpoint, or None to skip it."""
        rank, ranks = self._share()
        verdict, reason, checkpoint = _INTACT, "", None
        try:
            checkpoint = verify(path, self.key, (rank, ranks), self.run)
        except UnverifiableCheckpoint as e:
            verdict, reason = _UNVERIFIABLE, str(e)
        except RejectedCheckpoint as e:
            # Gone meanwhile: rotated away by the group that writes checkpoints. Not damage.
            verdict = _REJECTED if (path / MARKER).is_file() else _GONE
            reason = e.reason
        agreed = self._agree(verdict, ranks)
        if agreed == _INTACT:
            return checkpoint
        if agreed == _UNVERIFIABLE:
            raise UnverifiableCheckpoint(reason or f"checkpoint {path} has no {MANIFEST}")
        if agreed == _GONE:
            log.info("checkpoint %s disappeared while being verified (rotated away)", path)
            return None
        reason = reason or "another rank of this group found a damaged file (see its log)"
        if self.writer and (moved := self._quarantine(path)):
            reason += f"; moved to {moved.name}"
        log.warning("checkpoint %s rejected, trying an older one: %s", path, reason)
        self.on_rejected(step, path, reason)
        return None

    def _state_differs(self, step: int, path: Path, state: TrainState, last: bool) -> bool:
        """Whether the state loaded from ``path`` differs from the state digest its ranks recorded
        when they saved it (a checkpoint without one, written before the digest was recorded,
        passes); such a checkpoint is rejected like a damaged one, or, the ``last`` one left,
        refused with an error (``state`` holds what it loaded)."""
        rank, ranks = self._share()
        recorded = path / STATE_DIGEST.format(rank=rank)
        differs = False
        if recorded.is_file():
            try:
                want = json.loads(recorded.read_bytes())["digest"]
            except (OSError, ValueError, KeyError, TypeError):
                want = None
            differs = want != state_fingerprint(state.flat()[0])
        if self._agree(_REJECTED if differs else _INTACT, ranks) == _INTACT:
            return False
        reason = "the state it loads differs from the state digest recorded when it was saved"
        if last:
            raise CheckpointError(f"checkpoint {path}: {reason}, and no older checkpoint is left: "
                                  "delete it, or set checkpoint.resume=false")
        if self.writer and (moved := self._quarantine(path)):
            reason += f"; moved to {moved.name}"
        log.warning("checkpoint %s rejected, trying an older one: %s", path, reason)
        self.on_rejected(step, path, reason)
        return True

    def _share(self) -> tuple[int, int]:
        if self._distributed():
            return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        return 0, 1

    @staticmethod
    def _distributed() -> bool:
        # The same rule DCP applies: collectives whenever a default process group exists.
        return dist.is_available() and dist.is_initialized()

    def _agree(self, verdict: int, ranks: int) -> int:
        """The worst verdict of any rank of the group (all ranks then load, or skip, together)."""
        if ranks == 1:
            return verdict
        backend = str(dist.get_backend(self.process_group))
        device = (torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend
                  else torch.device("cpu"))
        worst = torch.tensor([verdict], dtype=torch.int64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(worst.item())

    def set_aside(self, step: int, chain: str) -> Path | None:
        """Move the checkpoint of ``step`` aside (kept for inspection, never loaded) when it holds
        the state of history ``chain``; its new path, or None (another history, none of that step,
        or not this group's writer)."""
        if not self.writer:
            return None
        for s, path in valid_checkpoints(self.root):
            if s == step and _marker_chain(path) == chain:
                return self._quarantine(path)
        return None

    def _quarantine(self, path: Path) -> Path | None:
        """Move a rejected checkpoint out of the way (kept for inspection); its new path."""
        target = self.root / f"{REJECTED_PREFIX}{path.name}"
        n = 1
        while target.exists():
            n += 1
            target = self.root / f"{REJECTED_PREFIX}{path.name}.{n}"
        try:
            path.rename(target)
        except OSError as e:  # another group moved or rotated it first
            log.info("could not move rejected checkpoint %s aside: %s", path, e)
            return None
        return target
