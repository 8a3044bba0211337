"""What a ``Session`` is configured with, and where it comes from: the launcher's resolved config
(``FTLM_CONFIG``), the session's own arguments, or the ``Trainer``'s config.

The launcher writes the resolved TOML of each run and names it in ``FTLM_CONFIG``; its checks (the
exactly-once proof) judge the run against that file, so an argument that contradicts it is refused
(``ConfigError`` naming both values) rather than silently preferred. Without the variable, the
arguments and each section's defaults apply.

Not here: the whole run configuration and its ``--set`` overrides (``ftlm.config``, which training
never imports), validating values (each section's ``__post_init__`` does).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftlm.errors import ConfigError
from ftlm.ft.config import FTConfig
from ftlm.observe.config import ObserveConfig
from ftlm.train.config import CheckpointConfig, RunSection, TrainConfig

CONFIG_ENV = "FTLM_CONFIG"
RUN_DIR_ENV = "FTLM_RUN_DIR"


@dataclass(frozen=True)
class SessionConfig:
    """The sections a ``Session`` reads (a ``TrainerConfig`` serves as well)."""

    run: RunSection = field(default_factory=RunSection)
    """Name, directory and seed of the run."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batch size, schedule, clipping, ``max_seconds``."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Durable checkpoints."""
    ft: FTConfig = field(default_factory=FTConfig)
    """Buckets, catch-up budgets, the degraded LR policy, the coordinator, the token."""
    observe: ObserveConfig = field(default_factory=lambda: ObserveConfig(progress=False))
    """Metrics and tracing."""
    resolved: dict[str, Any] = field(default_factory=dict)
    """The resolved configuration as plain data, recorded in summary.json."""


_SECTIONS = {"run": RunSection, "train": TrainConfig, "checkpoint": CheckpointConfig,
             "ft": FTConfig, "observe": ObserveConfig}


def read_launcher_config(path: Path) -> SessionConfig:
    """The sections of the resolved run config at ``path`` a session reads (others are skipped:
    they belong to the launcher or other commands)."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{CONFIG_ENV}={str(path)!r} cannot be read ({e.strerror}); point it at "
                          "the resolved config.toml the launcher wrote, or unset it") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{CONFIG_ENV}={str(path)!r} is not a TOML file: {e}") from None
    sections = {}
    for name, cls in _SECTIONS.items():
        values = raw.get(name, {})
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(values, dict) or set(values) - known:
            extra = sorted(set(values) - known) if isinstance(values, dict) else values
            raise ConfigError(f"{CONFIG_ENV}={str(path)!r}: [{name}] has unknown keys {extra}; "
                              "was it written by another ftlm version?")
        sections[name] = cls(**values)
    return SessionConfig(**sections, resolved=raw)


def _same(name: str, given: Any, configured: Any, path: str) -> None:
    if given is not None and given != configured:
        raise ConfigError(f"{name}={given!r} contradicts the launcher's config ({path}: "
                          f"{configured!r}); the launcher judges the run against its config: drop "
                          f"the argument or change the config")


def resolve_config(*, steps: int | None, batch_size: int | None, run_dir: str | Path | None,
                   checkpoint_every: int | None, seed: int | None) -> SessionConfig:
    """The session's config: the launcher's (``FTLM_CONFIG``) when set, checked against the
    arguments given; else the arguments over each section's defaults (``steps`` and
    ``batch_size`` are then required: nothing else knows them)."""
    path = os.environ.get(CONFIG_ENV, "")
    if path:
        config = read_launcher_config(Path(path))
        where = f"{CONFIG_ENV}={path}"
        _same("steps", steps, config.train.steps, f"{where} train.steps")
        _same("batch_size", batch_size, config.train.batch_size, f"{where} train.batch_size")
        _same("checkpoint_every", checkpoint_every, config.checkpoint.every,
              f"{where} checkpoint.every")
        _same("seed", seed, config.run.seed, f"{where} run.seed")
        if run_dir is not None and Path(run_dir) != config.run.path:
            raise ConfigError(f"run_dir={str(run_dir)!r} contradicts the launcher's config "
                              f"({where} run.dir: {str(config.run.path)!r}); drop the argument")
        return config
    missing = [name for name, v in (("steps", steps), ("batch_size", batch_size)) if v is None]
    if missing:
        raise ConfigError(f"Session needs {' and '.join(missing)}: pass them, or run under a "
                          f"launcher that sets {CONFIG_ENV}")
    run = RunSection(dir=str(run_dir or os.environ.get(RUN_DIR_ENV, "")), seed=seed or 0)
    config = SessionConfig(run=run, train=TrainConfig(steps=steps, batch_size=batch_size),
                           checkpoint=CheckpointConfig(every=checkpoint_every or 0))
    resolved = {name: dataclasses.asdict(getattr(config, name)) for name in _SECTIONS}
    return dataclasses.replace(config, resolved=resolved)
