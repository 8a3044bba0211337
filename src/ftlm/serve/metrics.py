"""Prometheus metrics of the inference server, in a registry of its own.

Responsible for: the ``ftlm_serve_*`` families (names, types, help texts in ``SERVE_METRICS``)
and recording what the server and its decode loop report. Conventions as in
``ftlm.observe.metrics`` (docs/design.md, 'Metrics'): ``ftlm_`` names, base units, ``_total``
counters, and the only label is ``job`` (the served model's name).

Not responsible for: serving them (``GET /metrics`` of ``ftlm.serve.server``) or deciding when to
report (the runner and the handlers call the ``on_*`` methods).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

SERVE_METRICS: dict[str, tuple[str, str]] = {
    "ftlm_serve_requests_total": ("counter", "Generation requests accepted"),
    "ftlm_serve_requests_rejected_total": ("counter", "Requests refused with 429 or 503 (queue full, stopping)"),
    "ftlm_serve_request_errors_total": ("counter", "Requests answered with a 4xx error other than 429"),
    "ftlm_serve_time_to_first_token_seconds": ("histogram", "Seconds from a sequence's arrival to its first token"),
    "ftlm_serve_request_duration_seconds": ("histogram", "Seconds from a request's arrival to its last token"),
    "ftlm_serve_tokens_generated_total": ("counter", "Tokens generated over all sequences"),
    "ftlm_serve_prompt_tokens_total": ("counter", "Prompt tokens prefilled"),
    "ftlm_serve_tokens_per_second": ("gauge", "Tokens generated per second over the last second of decoding"),
    "ftlm_serve_queue_depth": ("gauge", "Sequences waiting for a KV-cache slot"),
    "ftlm_serve_batch_size": ("gauge", "Sequences decoded in the last step"),
    "ftlm_serve_step_duration_seconds": ("histogram", "Wall time of one engine step (prefill and decode)"),
}

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class ServeMetrics:
    """The server's metric families, labelled with ``job=<model name>``."""

    def __init__(self, job: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        buckets = {"ftlm_serve_time_to_first_token_seconds": TTFT_BUCKETS,
                   "ftlm_serve_request_duration_seconds": DURATION_BUCKETS,
                   "ftlm_serve_step_duration_seconds": STEP_BUCKETS}
        self._m: dict[str, Any] = {}
        for name, (kind, help_text) in SERVE_METRICS.items():
            if kind == "counter":
                family = Counter(name.removesuffix("_total"), help_text, ("job",),
                                 registry=self.registry)
            elif kind == "histogram":
                family = Histogram(name, help_text, ("job",), buckets=buckets[name],
                                   registry=self.registry)
            else:
                family = Gauge(name, help_text, ("job",), registry=self.registry)
            self._m[name] = family.labels(job)
        self._window: list[tuple[float, int]] = []  # (time, tokens) of recent steps

    def on_request(self) -> None:
        self._m["ftlm_serve_requests_total"].inc()

    def on_rejected(self) -> None:
        self._m["ftlm_serve_requests_rejected_total"].inc()

    def on_error(self) -> None:
        self._m["ftlm_serve_request_errors_total"].inc()

    def on_first_token(self, seconds: float) -> None:
        self._m["ftlm_serve_time_to_first_token_seconds"].observe(seconds)

    def on_request_done(self, seconds: float) -> None:
        self._m["ftlm_serve_request_duration_seconds"].observe(seconds)

    def on_prefill(self, tokens: int) -> None:
        self._m["ftlm_serve_prompt_tokens_total"].inc(tokens)

    def on_step(self, now: float, seconds: float, tokens: int, batch: int, queued: int) -> None:
        """One engine step: its duration, the tokens it produced, the batch and queue after it."""
        self._m["ftlm_serve_step_duration_seconds"].observe(seconds)
        self._m["ftlm_serve_tokens_generated_total"].inc(tokens)
        self._m["ftlm_serve_batch_size"].set(batch)
        self._m["ftlm_serve_queue_depth"].set(queued)
        self._window.append((now, tokens))
        while self._window and self._window[0][0] < now - 1.0:
            self._window.pop(0)
        span = max(now - self._window[0][0] + seconds, 1e-6)
        self._m["ftlm_serve_tokens_per_second"].set(sum(t for _, t in self._window) / span)

    def on_idle(self, queued: int) -> None:
        self._m["ftlm_serve_batch_size"].set(0)
        self._m["ftlm_serve_queue_depth"].set(queued)
        self._m["ftlm_serve_tokens_per_second"].set(0)
        self._window.clear()

    def render(self) -> bytes:
        return generate_latest(self.registry)
