"""Live effective training time: ``summary.json``'s ETT, computed while the run goes on.

``LiveEtt`` keeps the events one process emits (a group's rank 0 writes its commits, failed
steps, recoveries and restarts) and computes ETT from them with ``ftlm.observe.summary``'s own
code (``final_history`` then ``ett_figures``): the same formula as the end-of-run summary, never
a second one. ``WatchedEvents`` wraps an ``Events`` so that every record emitted also reaches a
``LiveEtt``.

What a group sees is the job's record as that group lived it: each step it committed carries
the job's global tokens, so a healthy group's value is the job's ETT since its process started
(stalls caused by other groups' failures included); a group that restarted reports from its
restart on. Dashboards take the best group per job (``max by (job)``).

Not responsible for: exporting (``ftlm.observe.metrics`` reads ``value()`` at scrape time), or
reading ``events.jsonl`` (the live value needs no shared file system).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ftlm.observe.events import Events
from ftlm.observe.summary import DISTURBANCE_KINDS, ett_figures, final_history

KEPT_KINDS = frozenset(("commit", *DISTURBANCE_KINDS))
"""The events ETT depends on (commits, and the disturbances that bound steady windows)."""
KEPT_FIELDS = ("ts", "kind", "group", "step", "samples", "tokens", "to_step")
"""The fields of a kept event that the summary's ETT code reads (the rest is dropped)."""
MAX_EVENTS = 50_000
"""Most events kept (about 20 MB). Past that the oldest go and ETT covers the newest ones:
the gauge then reads as ETT over a sliding window of that many steps."""
MIN_REFRESH_SECONDS = 5.0
"""A value is reused for at least this long, and for 100 times what computing it took: the
gauge never takes more than 1% of a core from training, however long the run (50,000 events
take about a second to evaluate)."""


class LiveEtt:
    """ETT so far of the events ``observe``d; thread-safe, computed lazily by ``value``."""

    def __init__(self, clock: Callable[[], float] = time.time, max_events: int = MAX_EVENTS) -> None:
        self._clock = clock
        self._started = clock()
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._lock = threading.Lock()
        self._cached: tuple[float, float | None] | None = None  # (valid until, value)

    def observe(self, record: dict[str, Any]) -> None:
        """Keep ``record`` (an event as emitted) if ETT depends on it."""
        if record.get("kind") not in KEPT_KINDS:
            return
        slim = {k: record[k] for k in KEPT_FIELDS if k in record}
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self._started = self._events[1]["ts"]  # the window starts at the oldest kept event
            self._events.append(slim)

    def value(self) -> float | None:
        """ETT (0..1) over this process's life so far; None before two steps were committed."""
        now = self._clock()
        with self._lock:
            # Time matters even without new events: a stall lowers ETT as it goes on.
            if self._cached is not None and now < self._cached[0]:
                return self._cached[1]
            events, started = list(self._events), self._started
        t0 = time.perf_counter()
        history = final_history(events)[0]
        commits = sum(1 for e in history if e["kind"] == "commit")
        result = ett_figures(history, now - started).ett if commits >= 2 else None
        took = time.perf_counter() - t0
        with self._lock:
            self._cached = (now + max(MIN_REFRESH_SECONDS, 100 * took), result)
        return result


class WatchedEvents:
    """An ``Events`` that forwards every call to ``inner`` and shows each emitted record to
    ``live`` (the records are exactly those ``inner`` built and wrote)."""

    def __init__(self, inner: Events, live: LiveEtt) -> None:
        self.inner, self.live = inner, live

    def emit(self, kind: str, step: int, **fields: Any) -> dict:
        record = self.inner.emit(kind, step, **fields)
        self.live.observe(record)
        return record

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # path, group, rank... of the wrapped log
        return getattr(self.inner, name)

    def __enter__(self) -> WatchedEvents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
