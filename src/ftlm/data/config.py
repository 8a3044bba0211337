"""Where the training data comes from and how it is read."""

from __future__ import annotations

from dataclasses import dataclass

from ftlm.errors import ConfigError


@dataclass
class DataConfig:
    """Prepared dataset used by the trainer."""

    dir: str = "data/demo"
    """Directory written by ``ftlm data prepare`` (``manifest.json`` plus Parquet shards)."""
    tokenizer: str = ""
    """Path of ``tokenizer.json``; empty means the copy inside ``dir``."""
    seq_len: int = 256
    """Tokens per training sample (input length); must equal the manifest's ``seq_len``."""
    prefetch: int = 4
    """Batches the background thread prepares ahead of the trainer (0 disables the thread)."""
    eval_samples: int = 256
    """Samples held out of training for the eval loss (seeded, ftlm.data.split); 0: none."""
    eval_seed: int = 0
    """Seed of the held-out choice; apart from run.seed so runs of any seed share one eval set."""

    def __post_init__(self) -> None:
        if not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ConfigError(f"data.seq_len={self.seq_len!r} must be an integer >= 2")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ConfigError(f"data.prefetch={self.prefetch!r} must be an integer >= 0")
        for name in ("eval_samples", "eval_seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"data.{name}={value!r} must be an integer >= 0")
