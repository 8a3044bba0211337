"""OpenTelemetry spans of a rank's steps and recoveries, built from the timings it already reports.

A rank reports each phase to its metrics once the phase is over (``on_quorum`` with the wait,
``on_allreduce`` with its seconds, ``on_commit``/``on_step_failed`` at the end of the step...).
``StepTracer`` turns those reports into spans with their real start and end times: the phases
of a step are held until the step ends, then exported as children of one ``step`` span
(``quorum``, ``forward_backward``, ``allreduce``, ``vote``, ``commit``), with ``step``,
``quorum_id``, ``outcome`` attributes (a step a recovering group took part in, with no data of
its own, is a ``step`` span too, marked ``recovering``); a recovery (children ``transfer`` and ``replay``), a
snapshot copied for a recovering peer and a durable checkpoint are spans of their own. Nothing on the training path waits for an exporter
(a ``BatchSpanProcessor`` ships spans from its own thread).

Optional: ``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http`` (the ``otel``
extra). Off by default (``observe.tracing``); ``NullTracer`` stands in when it is off.
``make_tracer`` refuses, with the fix in one line, to turn tracing on without the SDK.

Not responsible for: metrics (``ftlm.observe.metrics``), or spans across processes (each rank
exports its own; the collector joins them by the ``ftlm.job``/``ftlm.group``/``ftlm.rank``
resource attributes and by time).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ftlm.errors import ConfigError

EXPORT_TIMEOUT_SECONDS = 3.0
"""Most seconds one OTLP export (retries included) may take; spans that miss it are dropped."""
STEP_PHASES = ("forward_backward", "vote", "commit")
"""Phases of a step the trainer times itself (``TrainingMetrics.phase``); the quorum wait and the
all-reduce come from the FT manager's reports (``on_quorum``, ``on_allreduce``)."""
SPAN_NAMES = ("step", "quorum", "forward_backward", "allreduce", "vote", "commit", "recovery",
              "transfer", "replay", "snapshot", "checkpoint")
"""Every span a rank exports (a catch-up is the ``recovery`` span: its ``transfer`` of the peer's
snapshot, then the ``replay`` of the buffered updates; the peer's copy is its ``snapshot`` span)."""


class NullTracer:
    """Tracing off: every method does nothing."""

    def phase(self, name: str, seconds: float, **attributes: Any) -> None:
        pass

    def end_step(self, step: int, seconds: float, outcome: str, **attributes: Any) -> None:
        pass

    def span(self, name: str, seconds: float, children: tuple[tuple[str, float], ...] = (),
             **attributes: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass


class StepTracer:
    """Spans of one rank, exported through ``provider`` (an SDK ``TracerProvider``)."""

    def __init__(self, provider: Any, clock_ns: Any = time.time_ns) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("ftlm")
        self._clock_ns = clock_ns
        self._pending: list[tuple[str, int, int, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def _window(self, seconds: float) -> tuple[int, int]:
        end = self._clock_ns()
        return end - int(max(seconds, 0.0) * 1e9), end

    def phase(self, name: str, seconds: float, **attributes: Any) -> None:
        """A phase of the current step that just ended after ``seconds``; exported with its step."""
        start, end = self._window(seconds)
        with self._lock:
            self._pending.append((name, start, end, attributes))

    def end_step(self, step: int, seconds: float, outcome: str, **attributes: Any) -> None:
        """The current step ended (``outcome``: ``commit`` or ``failed``) after ``seconds``:
        export its span with the phases reported since the previous step as children."""
        from opentelemetry import trace

        start, end = self._window(seconds)
        with self._lock:
            phases, self._pending = self._pending, []
        start = min([start] + [p[1] for p in phases])
        parent = self.tracer.start_span("step", start_time=start,
                                        attributes={"step": step, "outcome": outcome, **attributes})
        context = trace.set_span_in_context(parent)
        for name, p_start, p_end, attrs in phases:
            self.tracer.start_span(name, context=context, start_time=p_start,
                                   attributes={"step": step, **attrs}).end(end_time=p_end)
        if outcome != "commit":
            parent.set_status(trace.Status(trace.StatusCode.ERROR, outcome))
        parent.end(end_time=end)

    def span(self, name: str, seconds: float, children: tuple[tuple[str, float], ...] = (),
             **attributes: Any) -> None:
        """A span of its own (``recovery``, ``snapshot``, ``checkpoint``) that just ended after
        ``seconds``; ``children`` are ``(name, seconds)`` parts of it, one after the other, the
        last ending with it (a recovery: its transfer, then its replay)."""
        from opentelemetry import trace

        start, end = self._window(seconds)
        parent = self.tracer.start_span(name, start_time=start, attributes=attributes)
        context = trace.set_span_in_context(parent)
        at = end - sum(int(max(s, 0.0) * 1e9) for _, s in children)
        for child, child_seconds in children:
            length = int(max(child_seconds, 0.0) * 1e9)
            self.tracer.start_span(child, context=context, start_time=at).end(end_time=at + length)
            at += length
        parent.end(end_time=end)

    def shutdown(self) -> None:
        """Flush what is queued and stop the exporter (bounded by the SDK's own timeouts)."""
        self.provider.shutdown()


def make_tracer(enabled: bool, endpoint: str, job: str, group: str, rank: int | str,
                exporter: Any = None) -> NullTracer | StepTracer:
    """The rank's tracer: ``NullTracer`` when ``enabled`` is false; else spans exported over
    OTLP/HTTP to ``endpoint`` (empty: the SDK's default, ``OTEL_EXPORTER_OTLP_*`` variables or
    http://localhost:4318), or to ``exporter`` when given (tests pass the SDK's in-memory one,
    exported synchronously)."""
    if not enabled:
        return NullTracer()
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SimpleSpanProcessor,
        )
    except ImportError as e:
        raise ConfigError(f"observe.tracing=true needs the OpenTelemetry SDK ({e.name} is missing): "
                          "pip install 'ftlm[otel]', or set observe.tracing=false") from e
    resource = Resource.create({"service.name": "ftlm", "ftlm.job": str(job),
                                "ftlm.group": str(group), "ftlm.rank": str(rank)})
    provider = TracerProvider(resource=resource)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
        except ImportError as e:
            raise ConfigError("observe.tracing=true needs the OTLP exporter "
                              "(opentelemetry-exporter-otlp-proto-http): pip install 'ftlm[otel]'"
                              ) from e
        # A bounded export: an unreachable collector must not hold up a rank's exit for long.
        kwargs: dict[str, Any] = {"timeout": EXPORT_TIMEOUT_SECONDS}
        if endpoint:
            kwargs["endpoint"] = endpoint.rstrip("/") + "/v1/traces"
        otlp = OTLPSpanExporter(**kwargs)
        provider.add_span_processor(BatchSpanProcessor(otlp))
    return StepTracer(provider)
