"""Reading prepared data in one global order (docs/design.md, 'Data exactly once').

Three pieces, from pure to stateful:

* :class:`GlobalOrder` (pure): global position ``p`` (a cursor that grows forever across epochs)
  maps to sample ``perm(seed, epoch = p // N)[p % N]``, a seeded permutation per epoch.
* :class:`PackedDataset`: random access to the samples of a folder written by ``prepare``, after
  checking its manifest (``manifest``: every field, shard paths kept inside the folder) against
  the run (seq_len, tokenizer) and its shards against their sha256.
* :class:`Loader`: participant ``i`` of ``P`` with per-participant batch ``b`` at ``cursor`` gets
  the samples at positions ``[cursor + i*b, cursor + (i+1)*b)``. A background thread prefetches
  the batches that follow; the result never depends on it.

The loader holds no position: the integer cursor, passed in on every call, is the whole state, so
resuming or changing the number of participants is exact. Advancing the cursor (on commit) is the
trainer's job, not this module's.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ftlm.data.manifest import RERUN as _RERUN, read_manifest, shard_path
from ftlm.data.prepare import TOKENIZER_FILE, sha256_file
from ftlm.errors import DataError
from ftlm.observe.iostats import timed_io

_BUSY_WAIT_S = 60.0  # longest wait for the thread's in-flight batch before recomputing it


class PackedDataset:
    """Samples of a prepared folder, each an int64 array of ``seq_len + 1`` tokens.

    Shards are read whole into numpy on first use and kept in an LRU cache of at most
    ``cache_bytes`` (default 1 GiB: the demo data, a few tens of MB, stays resident). That makes
    random access a numpy index after the first touch. The trade-off: a global permutation over a
    corpus much larger than the cache touches a different shard per sample and re-decodes shards;
    such corpora would want uncompressed, memory-mapped shards instead.
    """

    def __init__(self, dir: Path, seq_len: int, tokenizer_fingerprint: str | None = None,
                 verify: bool = True, cache_bytes: int = 1 << 30) -> None:
        self.dir = Path(dir)
        manifest = read_manifest(self.dir)
        self.manifest = manifest.fields
        if manifest.seq_len != seq_len:
            raise DataError(f"data in {self.dir} was prepared with seq_len={manifest.seq_len}, "
                            f"but the run asks for seq_len={seq_len}; set data.seq_len="
                            f"{manifest.seq_len} or {_RERUN} with --seq-len {seq_len}")
        found = manifest.tokenizer_fingerprint
        if tokenizer_fingerprint is not None and found != tokenizer_fingerprint:
            raise DataError(f"data in {self.dir} was prepared with another tokenizer (fingerprint "
                            f"{str(found)[:12]}, the run's is {tokenizer_fingerprint[:12]}); "
                            f"{_RERUN} with the run's tokenizer")
        self.seq_len = seq_len
        self.width = seq_len + 1
        self._files = [shard_path(self.dir, s.file) for s in manifest.shards]
        self._rows = [s.rows for s in manifest.shards]
        # _starts[k] is the global index of shard k's first sample; the last entry is len(self).
        self._starts = np.concatenate([[0], np.cumsum(self._rows, dtype=np.int64)])
        if verify:
            for file, shard in zip(self._files, manifest.shards):
                self._verify(file, shard.sha256)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()  # the prefetch thread and the trainer share the cache

    @property
    def tokenizer_path(self) -> Path:
        return self.dir / TOKENIZER_FILE

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        return self.samples([i % len(self)])[0]

    def samples(self, indices) -> np.ndarray:
        """Samples at global ``indices`` as one int64 array ``[len(indices), seq_len + 1]``."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample indices must lie in [0, {len(self)})")
        out = np.empty((len(idx), self.width), dtype=np.int64)
        shard_of = np.searchsorted(self._starts, idx, side="right") - 1
        for k in np.unique(shard_of):
            sel = shard_of == k
            out[sel] = self._shard(int(k))[idx[sel] - self._starts[k]]
        return out

    def _verify(self, file: Path, expected: str) -> None:
        if not file.is_file():
            raise DataError(f"shard {file} is missing; {_RERUN}")
        if sha256_file(file) != expected:
            raise DataError(f"shard {file} is corrupt (sha256 differs from the manifest); {_RERUN}")

    def _shard(self, k: int) -> np.ndarray:
        with self._lock:
            if k in self._cache:
                self._cache.move_to_end(k)
                return self._cache[k]
        rows = self._read_shard(k)  # outside the lock: decoding is the slow part
        with self._lock:
            self._cache[k] = rows
            # Evict least recently used shards, but always keep the one just read.
            while len(self._cache) > 1 and self._cached_bytes() > self._cache_bytes:
                self._cache.popitem(last=False)
        return rows

    def _cached_bytes(self) -> int:
        return sum(a.nbytes for a in self._cache.values())

    @timed_io("data_read", lambda _, self, k: self._files[k].stat().st_size)  # bytes from storage
    def _read_shard(self, k: int) -> np.ndarray:
        file = self._files[k]
        try:
            column = pq.read_table(file, columns=["tokens"]).column("tokens").combine_chunks()
            if not (pa.types.is_list(column.type) or pa.types.is_fixed_size_list(column.type)) \
                    or not pa.types.is_integer(column.type.value_type):
                raise DataError(f"shard {file} has a tokens column of type {column.type}, "
                                f"expected a list of integers; {_RERUN}")
            flat = column.flatten().to_numpy(zero_copy_only=False)
        except (OSError, KeyError, pa.ArrowException) as e:
            raise DataError(f"cannot read shard {file} ({e}); {_RERUN}") from e
        if len(column) != self._rows[k] or flat.size != self._rows[k] * self.width:
            raise DataError(f"shard {file} holds {len(column)} rows ({flat.size} tokens), the "
                            f"manifest says {self._rows[k]} rows of {self.width}; {_RERUN}")
        return flat.reshape(self._rows[k], self.width)


class GlobalOrder:
    """Maps a global position (cursor) to a sample index: a seeded permutation per epoch."""

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be positive")
        if seed < 0:
            raise ValueError(f"seed={seed} must be non-negative")
        self.num_samples, self.seed = num_samples, seed
        self._perm = lru_cache(maxsize=4)(self._compute_perm)  # per instance, not shared

    def _compute_perm(self, epoch: int) -> np.ndarray:
        # (seed, epoch) seeds the generator directly, so epoch e is computable without e-1.
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def epoch(self, p: int) -> int:
        return p // self.num_samples

    def index(self, p: int) -> int:
        if p < 0:
            raise ValueError(f"position {p} must be non-negative")
        return int(self._perm(p // self.num_samples)[p % self.num_samples])

    def indices(self, start: int, stop: int) -> np.ndarray:
        """Sample indices of positions ``[start, stop)`` (may span epoch boundaries)."""
        if not 0 <= start <= stop:
            raise ValueError(f"need 0 <= start <= stop, got [{start}, {stop})")
        parts, p, n = [], start, self.num_samples
        while p < stop:
            end = min(stop, (p // n + 1) * n)
            parts.append(self._perm(p // n)[p % n: p % n + (end - p)])
            p = end
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


class SampleSource(Protocol):
    """What :class:`Loader` needs from a dataset (``PackedDataset`` or a test double)."""

    def __len__(self) -> int: ...

    def samples(self, indices) -> np.ndarray: ...


Key = tuple[int, int, int, int]  # (cursor, participant_index, participants, batch_size)


class Loader:
    """Batches of participant ``i`` of ``P`` at a global cursor, with background prefetch.

    After serving ``(cursor, i, P, b)`` the thread prepares ``(cursor + k*P*b, i, P, b)`` for
    ``k = 1..prefetch``, the batches this participant will ask for if every step commits with the
    same participants. Any other request (a retried step, a new quorum size) is computed on the
    caller's thread, so the answer is always ``dataset.samples(order.indices(start, stop))``.
    """

    def __init__(self, dataset: SampleSource, seed: int, prefetch: int = 4) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch={prefetch} must be >= 0")
        self.dataset = dataset
        self.order = GlobalOrder(len(dataset), seed)
        self.prefetch = prefetch
        self.wait_seconds = 0.0
        """Cumulative seconds batch() spent producing or waiting for data (loader stall)."""
        self.hits = 0
        """Batches served from the prefetch cache (for tests and diagnostics)."""
        self._cond = threading.Condition()
        self._plan: list[Key] = []  # keys the thread should have ready, in order
        self._ready: dict[Key, torch.Tensor] = {}
        self._busy: Key | None = None  # key the thread is computing right now
        self._stop = False
        self._thread: threading.Thread | None = None
        if prefetch > 0:
            self._thread = threading.Thread(target=self._run, name="ftlm-data-prefetch",
                                            daemon=True)
            self._thread.start()

    @staticmethod
    def positions(cursor: int, participant_index: int, participants: int,
                  batch_size: int) -> tuple[int, int]:
        """Global positions ``[start, stop)`` of participant ``i``'s slice (docs/design.md,
        'Data exactly once')."""
        if cursor < 0 or batch_size < 1 or not 0 <= participant_index < participants:
            raise ValueError(f"bad slice: cursor={cursor}, participant {participant_index} of "
                             f"{participants}, batch_size={batch_size}")
        start = cursor + participant_index * batch_size
        return start, start + batch_size

    def compute(self, cursor: int, participant_index: int, participants: int,
                batch_size: int) -> torch.Tensor:
        """The batch, computed on the calling thread (what every path must equal)."""
        start, stop = self.positions(cursor, participant_index, participants, batch_size)
        rows = self.dataset.samples(self.order.indices(start, stop))
        return torch.from_numpy(np.asarray(rows, dtype=np.int64))

    def batch(self, cursor: int, participant_index: int, participants: int,
              batch_size: int) -> torch.LongTensor:
        """Tokens [batch_size, seq_len + 1] (int64) of participant ``i`` of ``P`` at ``cursor``."""
        key = (cursor, participant_index, participants, batch_size)
        self.positions(*key)  # validate before touching the cache
        t0 = time.perf_counter()
        out = None
        with self._cond:
            # If the thread is computing exactly this batch, waiting beats recomputing; the
            # thread always clears _busy (also on error), so the wait ends, but bound it anyway.
            deadline = t0 + _BUSY_WAIT_S
            while self._busy == key and not self._stop and time.perf_counter() < deadline:
                self._cond.wait(timeout=1.0)
            out = self._ready.pop(key, None)
        if out is None:
            out = self.compute(*key)
        else:
            self.hits += 1
        if self._thread is not None and not self._stop:
            step = participants * batch_size
            plan = [(cursor + k * step, participant_index, participants, batch_size)
                    for k in range(1, self.prefetch + 1)]
            with self._cond:
                self._plan = plan
                self._ready = {k: v for k, v in self._ready.items() if k in plan}
                self._cond.notify_all()
        self.wait_seconds += time.perf_counter() - t0
        return out

    def _next_job(self) -> Key | None:
        return next((k for k in self._plan if k not in self._ready), None)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and self._next_job() is None:
                    self._cond.wait(timeout=1.0)
                if self._stop:
                    return
                key = self._busy = self._next_job()
            try:
                value = self.compute(*key)
            except Exception:  # noqa: BLE001 - the caller recomputes and sees the error itself
                value = None
            with self._cond:
                self._busy = None
                if value is not None and key in self._plan:
                    self._ready[key] = value
                elif value is None:
                    self._plan = []  # do not spin on a failing batch
                self._cond.notify_all()

    def wait_prefetched(self, timeout: float = 10.0) -> bool:
        """Block until every planned batch is ready (or ``timeout``); for tests and benchmarks."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._plan and any(k not in self._ready for k in self._plan):
                left = deadline - time.monotonic()
                if left <= 0 or self._stop:
                    return False
                self._cond.wait(timeout=left)
            return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop the prefetch thread (waits at most ``timeout`` seconds); idempotent."""
        with self._cond:
            self._stop = True
            self._plan, self._ready = [], {}
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the prefetch thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
