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

    def __post_init__(self) -> None:
        if not isinstance(self.log_every, int) or self.log_every < 1:
            raise ConfigError(f"observe.log_every={self.log_every!r} must be an integer >= 1")
