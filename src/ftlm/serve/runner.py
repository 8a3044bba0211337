"""The decode loop of the server: one thread that runs every request in flight through one Engine.

Responsible for: accepting sequences from the event loop (``submit``; bounded: ``Overloaded``
when the queue of sequences waiting for a slot would exceed ``max_queue``), adding them to the
engine between steps (continuous batching), stepping the engine while there is work, and sending
each sequence's progress (``Update``: its tokens so far, its finish reason, or an error) back to
the asyncio queue of its request. Cancellation (a client gone, a timeout) frees the slot at the
next step. An exception inside a step fails the sequences in flight and the loop keeps running.

Not responsible for: HTTP, text or validation (``ftlm.serve.server``, ``ftlm.serve.protocol``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from ftlm.errors import ConfigError
from ftlm.infer.engine import Engine, Sequence
from ftlm.infer.sampling import SamplingParams
from ftlm.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The queue is full (answer 429)."""


class Stopped(Exception):
    """The runner is stopping or stopped (answer 503)."""


@dataclass
class Update:
    """Progress of one sequence: choice ``index`` of its request."""

    index: int
    tokens: list[int]
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[float] | None = None
    """Set on the final update only."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Set on the final update only: each token's alternatives (``SamplingParams.top_logprobs``)."""


@dataclass(eq=False)
class Handle:
    """One submitted sequence, as the event loop sees it."""

    index: int
    prompt: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.perf_counter)
    seq: Sequence | None = None
    first_seen: bool = False
    retired: bool = False


class EngineRunner:
    """Owns the engine and the thread that steps it."""

    def __init__(self, engine: Engine, max_queue: int, metrics: ServeMetrics) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self._cond = threading.Condition()
        self._pending: list[Handle] = []
        self._cancels: list[Handle] = []
        self._waiting = 0  # sequences in engine.waiting after the last step
        self._in_flight = 0  # submitted and not finished: the bound of the queue
        self._live: dict[int, Handle] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ftlm-serve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the engine thread did not stop within %.1f s", timeout)

    def queued(self) -> int:
        """Sequences waiting for a slot (as of the last step)."""
        with self._cond:
            return len(self._pending) + self._waiting

    def in_flight(self) -> int:
        """Sequences submitted and not finished yet (running or waiting)."""
        with self._cond:
            return self._in_flight

    def submit(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue,
               items: list[tuple[list[int], SamplingParams]]) -> list[Handle]:
        """Queue sequences whose updates go to ``queue`` (as ``Update``); all or none."""
        handles = [Handle(i, prompt, params, queue, loop) for i, (prompt, params) in enumerate(items)]
        with self._cond:
            if self._stopping:
                raise Stopped("the server is shutting down")
            # max_batch run, max_queue wait: counted from submission to the last token, so the
            # bound holds however far the engine thread is behind.
            if self._in_flight + len(handles) > self.max_queue + self.engine.max_batch:
                raise Overloaded(f"the request queue is full ({self.max_queue} sequences wait for "
                                 f"{self.engine.max_batch} slots); retry later")
            self._pending.extend(handles)
            self._in_flight += len(handles)
            self._cond.notify_all()
        return handles

    def cancel(self, handles: list[Handle]) -> None:
        with self._cond:
            self._cancels.extend(handles)
            self._cond.notify_all()

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while (not self._pending and not self._cancels and not self._stopping
                       and not self.engine.has_work()):
                    self.metrics.on_idle(0)
                    self._cond.wait(1.0)
                if self._stopping:
                    break
                new, self._pending = self._pending, []
                cancels, self._cancels = self._cancels, []
            self._admit(new)
            for h in cancels:
                if h.seq is not None and not h.retired:
                    self.engine.cancel(h.seq)
                    self._retire(h)
            if self.engine.has_work():
                self._step()
        for h in list(self._live.values()):  # still in flight at shutdown
            self._send(h, Update(h.index, [], "abort", "the server is shutting down"))

    def _admit(self, handles: list[Handle]) -> None:
        for h in handles:
            try:
                h.seq = self.engine.add(h.prompt, h.params)
            except ConfigError as e:  # validated before submit: only a bug gets here
                self._send(h, Update(h.index, [], "abort", str(e)))
                self._retire(h)
                continue
            self.metrics.on_prefill(len(h.prompt))
            if h.seq.done:
                self._report(h, h.seq)
            else:
                self._live[h.seq.id] = h

    def _step(self) -> None:
        started = time.perf_counter()
        before = {sid: len(h.seq.tokens) for sid, h in self._live.items()}
        try:
            touched = self.engine.step()
        except Exception as e:
            log.exception("engine step failed")
            for h in list(self._live.values()):
                self.engine.cancel(h.seq)
                self._send(h, Update(h.index, [], "abort", f"generation failed: {e}"))
                self._retire(h)
            return
        now = time.perf_counter()
        batch = 0
        produced = 0
        for seq in touched:
            h = self._live.get(seq.id)
            if h is None:
                continue
            batch += 1
            produced += len(seq.tokens) - before.get(seq.id, 0) + (1 if seq.finish_reason == "stop" else 0)
            self._report(h, seq)
        with self._cond:
            self._waiting = len(self.engine.waiting)
        self.metrics.on_step(now, now - started, produced, batch, self.queued())

    def _report(self, h: Handle, seq: Sequence) -> None:
        if not h.first_seen and (seq.tokens or seq.done):
            h.first_seen = True
            self.metrics.on_first_token(time.perf_counter() - h.submitted)
        self._send(h, Update(h.index, list(seq.tokens), seq.finish_reason,
                             logprobs=list(seq.logprobs) if seq.done else None,
                             top_logprobs=list(seq.top_logprobs) if seq.done else None))
        if seq.done:
            self._retire(h)

    def _retire(self, h: Handle) -> None:
        if h.retired:
            return
        h.retired = True
        if h.seq is not None:
            self._live.pop(h.seq.id, None)
        with self._cond:
            self._in_flight -= 1

    @staticmethod
    def _send(h: Handle, update: Update) -> None:
        try:
            h.loop.call_soon_threadsafe(h.queue.put_nowait, update)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
