"""What a run shows on the console and records in its run directory."""

from __future__ import annotations

from dataclasses import dataclass

from ftlm.errors import ConfigError


@dataclass
class ObserveConfig:
    """Console output and structured records of a run."""

    progress: bool = True
    """Show a progress bar on the console (off: one log line every ``log_every`` steps)."""
    log_every: int = 10
    """Steps between console lines when the progress bar is off."""
    log_format: str = "text"
    """Console log lines: text (human-readable) or json (one object per line, for log shippers)."""
    metrics: bool = False
    """Export Prometheus metrics from every rank (``/metrics``)."""
    metrics_port: int = 0
    """Port of rank 0's metrics endpoint (rank r uses port + r); 0 picks free ports."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoints bind to."""
    tracing: bool = False
    """Export OpenTelemetry spans (step, quorum, all-reduce, checkpoint, recovery); needs ftlm[otel]."""
    otlp_endpoint: str = ""
    """OTLP/HTTP collector for the spans, e.g. http://127.0.0.1:4318; empty: OTEL_EXPORTER_OTLP_* or localhost."""

    def __post_init__(self) -> None:
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"observe.log_format={self.log_format!r}; valid: text, json")
        if not isinstance(self.metrics_port, int) or not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"observe.metrics_port={self.metrics_port!r} must be in [0, 65535]")
        if self.otlp_endpoint and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"observe.otlp_endpoint={self.otlp_endpoint!r} must be an http:// or "
                              "https:// URL (e.g. http://127.0.0.1:4318), or empty")
        if not isinstance(self.log_every, int) or self.log_every < 1:
            raise ConfigError(f"observe.log_every={self.log_every!r} must be an integer >= 1")
