"""Bytes and seconds this process moved, by kind: snapshot transfers, checkpoint reads, data reads.

The code that moves bytes (the snapshot server and client, the checkpoint reader, the data
loader) has no metrics object at hand, so it adds to one process-wide tally instead: one call
(``count_io``) or one decorator line (``timed_io``) at the call site. A rank's
``TrainingMetrics`` exports the tally as counters when Prometheus scrapes (``IO_FAMILIES``), so
GB/s per link or per disk is ``rate(..._bytes_total) / rate(..._seconds_total)``.

Per process, not per exporter: a rank is a process (the launchers start one per rank), so the
tally is the rank's. Several exporters in one process (tests, threads) all show the same tally.
Counts only grow (a new process starts at 0, which Prometheus reads as a counter reset).

Not responsible for: timing the all-reduce (``TrainingMetrics.on_allreduce``), checkpoint
writes (``TrainingMetrics.on_checkpoint``), or deciding what to count (the call sites do).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

KINDS = ("transfer_received", "transfer_sent", "checkpoint_read", "data_read")
"""What is counted: snapshot bytes fetched from a peer (live recovery) and served to one, durable
checkpoint bytes read back (restore), and dataset bytes the loader read from storage."""

IO_FAMILIES: dict[str, tuple[str, str, str]] = {
    # family name -> (kind, "bytes" or "seconds", help)
    "ftlm_ft_transfer_received_bytes_total": (
        "transfer_received", "bytes", "Snapshot bytes this rank fetched from a healthy peer (live recovery)"),
    "ftlm_ft_transfer_received_seconds_total": (
        "transfer_received", "seconds", "Seconds this rank spent fetching snapshots from peers"),
    "ftlm_ft_transfer_sent_bytes_total": (
        "transfer_sent", "bytes", "Snapshot bytes this rank served to recovering peers"),
    "ftlm_ft_transfer_sent_seconds_total": (
        "transfer_sent", "seconds", "Seconds this rank spent sending snapshot bytes to peers"),
    "ftlm_checkpoint_read_bytes_total": (
        "checkpoint_read", "bytes", "Bytes of the durable checkpoints this rank restored from (each one's whole size)"),
    "ftlm_checkpoint_read_seconds_total": (
        "checkpoint_read", "seconds", "Seconds this rank spent reading durable checkpoints"),
    "ftlm_data_read_bytes_total": (
        "data_read", "bytes", "Dataset bytes the data loader read from storage"),
    "ftlm_data_read_seconds_total": (
        "data_read", "seconds", "Seconds the data loader spent reading and decoding dataset files"),
}
"""The counter families the tally becomes, as PromQL names them (``ftlm.observe.metrics``)."""

_lock = threading.Lock()
_tally: dict[str, list[float]] = {kind: [0, 0.0] for kind in KINDS}

F = TypeVar("F", bound=Callable[..., Any])


def count_io(kind: str, nbytes: int, seconds: float) -> None:
    """Add ``nbytes`` moved in ``seconds`` to ``kind`` (one of ``KINDS``); negative values count
    as 0. An unknown kind is a programming error (``ValueError``), never silently dropped."""
    if kind not in _tally:
        raise ValueError(f"count_io kind={kind!r} is not one of {', '.join(KINDS)}")
    with _lock:
        entry = _tally[kind]
        entry[0] += max(int(nbytes), 0)
        entry[1] += max(float(seconds), 0.0)


def io_totals() -> dict[str, tuple[int, float]]:
    """Bytes and seconds counted so far in this process, by kind (every kind, zeros included)."""
    with _lock:
        return {kind: (int(b), s) for kind, (b, s) in _tally.items()}


def timed_io(kind: str, size: Callable[..., int]) -> Callable[[F], F]:
    """Decorator: count each successful call of the function as ``kind``, with its wall time
    and ``size(result, *args, **kwargs)`` bytes. A call that raises, or whose size is 0 (it
    moved nothing of this kind, e.g. a server's small JSON answer), counts nothing: its seconds
    would only dilute the rate."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            seconds = time.perf_counter() - t0
            nbytes = size(result, *args, **kwargs)
            if nbytes > 0:
                count_io(kind, nbytes, seconds)
            return result
        return timed  # type: ignore[return-value]
    return wrap
