"""Settings of the inference server (``ftlm serve``)."""

from __future__ import annotations

from dataclasses import dataclass

from ftlm.errors import ConfigError


@dataclass
class ServeConfig:
    """Where the server listens and how much work it accepts."""

    host: str = "127.0.0.1"
    """Address to bind; anything but loopback needs a token (or ``insecure``)."""
    port: int = 8000
    """TCP port; 0 picks a free one."""
    model_name: str = "ftlm"
    """Model id reported by ``/v1/models`` and accepted in requests."""
    token: str = ""
    """Bearer key every request must carry (the job token); empty: no key."""
    insecure: bool = False
    """Allow a non-loopback ``host`` without a token."""
    max_batch: int = 8
    """Sequences decoded together (KV-cache slots)."""
    max_queue: int = 64
    """Sequences allowed to wait for a slot; beyond it requests get 429."""
    max_n: int = 8
    """Largest ``n`` (completions per request)."""
    default_max_tokens: int = 128
    """``max_tokens`` of a request that gives none."""
    max_request_bytes: int = 1 << 20
    """Largest request body accepted (413 beyond)."""
    request_timeout: float = 600.0
    """Seconds a request may take before it is aborted (its sequences cancelled)."""
    read_timeout: float = 10.0
    """Seconds a client may take to send a request's headers, and then its body, and the longest
    an idle connection stays open; slower clients are disconnected (slowloris)."""
    max_connections: int = 1024
    """Most connections open at once; beyond it a new connection gets 503 and is closed."""

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"serve port={self.port!r} must be in [0, 65535] (0: any free port)")
        for name, low in (("max_batch", 1), ("max_queue", 1), ("max_n", 1),
                          ("default_max_tokens", 1), ("max_request_bytes", 1024),
                          ("max_connections", 8)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"serve {name}={value!r} must be an integer >= {low}")
        for name in ("request_timeout", "read_timeout"):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not 0 < value < float("inf")):
                raise ConfigError(f"serve {name}={value!r} must be a number of seconds > 0")
        if not self.model_name or not isinstance(self.model_name, str):
            raise ConfigError(f"serve model_name={self.model_name!r} must be a non-empty string")
        if self.max_n > self.max_queue:
            raise ConfigError(f"serve max_n={self.max_n} must be <= max_queue={self.max_queue} "
                              "(a request with n samples queues n sequences)")
