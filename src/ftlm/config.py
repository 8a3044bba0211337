"""The root run configuration: one section per component, loaded from TOML plus ``--set`` overrides.

Each component owns its ``Config`` dataclass (``ModelConfig`` in ``ftlm.model``, ``DataConfig`` in
``ftlm.data``, ...); this module only composes them, coerces override strings to the field types,
refuses unknown keys, text no file can hold (NUL, undecodable bytes) and config files that are not
UTF-8, and writes the resolved config next to the run. It does not validate values: each
section's ``__post_init__`` does.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from ftlm.data.config import DataConfig
from ftlm.errors import ConfigError
from ftlm.ft.config import FTConfig
from ftlm.launch.cluster_config import ClusterConfig
from ftlm.model.config import ModelConfig
from ftlm.model.counts import size_problem
from ftlm.observe.config import ObserveConfig
from ftlm.post.config import PostConfig
from ftlm.observe.cost import CostConfig
from ftlm.train.config import CheckpointConfig, RunSection, TrainConfig, TrainerConfig


@dataclass
class RunConfig:
    """Everything a run needs, one section per component (docs/design.md, 'Config')."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ft: FTConfig = field(default_factory=FTConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    post: PostConfig = field(default_factory=PostConfig)
    cost: CostConfig = field(default_factory=CostConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: _section_dict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    def trainer_config(self) -> TrainerConfig:
        """The sections the ``Trainer`` reads, and this whole config as plain data for its
        records (config.toml, summary.json)."""
        return TrainerConfig(run=self.run, model=self.model, data=self.data, train=self.train,
                             checkpoint=self.checkpoint, ft=self.ft, observe=self.observe,
                             resolved=self.to_dict())


def _section_dict(section: Any) -> dict[str, Any]:
    # TOML has no null: an unset optional field is simply left out.
    return {k: v for k, v in dataclasses.asdict(section).items() if v is not None}


@functools.cache
def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)}


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    """Type hints of a section's fields (resolved once: ``get_type_hints`` is slow)."""
    return typing.get_type_hints(cls)


def _name(text: str) -> str:
    """A section or key name as typed when it is plain, else quoted: error messages stay one line."""
    return text if text.isprintable() else repr(text)


def _shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_text(where: str, value: Any) -> None:
    """Refuse strings (also inside lists and tables) no file or path can hold: NUL characters,
    and lone surrogates (what Python makes of undecodable bytes in command-line arguments)."""
    if isinstance(value, str):
        if "\0" in value:
            raise ConfigError(f"{where}: contains a NUL character; remove it")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{where}: is not valid UTF-8 text (undecodable bytes); pass "
                              "UTF-8 text") from None
    elif isinstance(value, list):
        for item in value:
            _check_text(where, item)
    elif isinstance(value, dict):
        for k, item in value.items():
            _check_text(where, k)
            _check_text(where, item)


def _coerce(section: str, key: str, hint: Any, value: Any, from_string: bool) -> Any:
    """Convert ``value`` to the field's type; strings from ``--set`` are parsed."""
    where = f"{section}.{key}={_shown(value)}"
    _check_text(where, value)
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    allowed = [t for t in options if t is not type(None)]
    if value is None or (from_string and value in ("none", "None") and type(None) in options):
        if type(None) in options:
            return None
        raise ConfigError(f"{where}: a value is required")
    for t in allowed:
        if t is bool:
            if isinstance(value, bool):
                return value
            if from_string and str(value).lower() in ("true", "false", "1", "0", "yes", "no"):
                return str(value).lower() in ("true", "1", "yes")
        elif t is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if from_string:
                try:
                    return int(value)
                except ValueError:
                    pass
        elif t is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                try:
                    return float(value)
                except OverflowError:  # an int beyond the float range: let the section refuse it
                    return value
            if from_string:
                try:
                    return float(value)
                except ValueError:
                    pass
        elif t is str:
            if isinstance(value, str):
                return value
        elif typing.get_origin(t) is list:
            if isinstance(value, list):
                return value
            if from_string:
                return [v.strip() for v in str(value).split(",") if v.strip()]
        elif typing.get_origin(t) is dict:
            if isinstance(value, dict):
                return value
            if from_string:  # key=value,key=value; the section validates the pairs
                return [v.strip() for v in str(value).split(",") if v.strip()]
    names = " or ".join(getattr(t, "__name__", str(t)) for t in allowed)
    raise ConfigError(f"{where}: expected {names}")


def build_config(raw: dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """Compose a ``RunConfig`` from a parsed TOML dict and ``section.key=value`` overrides."""
    sections = _section_types()
    values: dict[str, dict[str, Any]] = {name: {} for name in sections}
    for name, body in raw.items():
        if name not in sections:
            raise ConfigError(f"unknown config section [{_name(name)}]; valid: "
                              f"{', '.join(sections)}")
        if not isinstance(body, dict):
            raise ConfigError(f"config section [{name}] must be a table, got {_shown(body)}")
        for key, value in body.items():
            values[name][key] = (value, False)
    for item in overrides or []:
        dotted, sep, value = item.partition("=")
        name, dot, key = dotted.strip().partition(".")
        if not sep or not dot or not key:
            raise ConfigError(f"--set {_shown(item)}: expected section.key=value, e.g. "
                              "train.steps=100")
        if name not in sections:
            raise ConfigError(f"--set {_shown(item)}: unknown section {_shown(name)}; valid: "
                              f"{', '.join(sections)}")
        values[name][key] = (value.strip(), True)
    built = {}
    for name, cls in sections.items():
        hints = _field_hints(cls)
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, (value, from_string) in values[name].items():
            if key not in known:
                raise ConfigError(f"unknown key {name}.{_name(key)}; valid keys of [{name}]: "
                                  f"{', '.join(sorted(known))}")
            kwargs[key] = _coerce(name, key, hints[key], value, from_string)
        built[name] = cls(**kwargs)
    too_large = size_problem(built["model"]) if "model" in built else None
    if too_large:  # refused here, before a trainer or converter allocates the model
        raise ConfigError(f"model: {too_large}; check the [model] section and --set overrides")
    return RunConfig(**built)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML config file (or none) and apply ``--set`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; see configs/ for examples")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path} ({e.strerror or e}); check its "
                              "permissions") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise ConfigError(f"config file {path} is not UTF-8 text (byte 0x{data[e.start]:02x} "
                              f"on line {line}); TOML files must be UTF-8: re-save it as UTF-8"
                              ) from None
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        except RecursionError:
            raise ConfigError(f"config file {path} nests arrays or tables too deeply for a run "
                              "config; flatten it") from None
    return build_config(raw, overrides)


def save_config(config: RunConfig, path: Path) -> None:
    """Write the resolved config (every field, defaults included) as TOML."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config.to_toml())
