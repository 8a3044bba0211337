"""Loading a trained model (and its tokenizer) for inference.

Responsible for: finding the pieces of a finished run (``config.toml``, ``model.safetensors``
written by the training session (``Durability.save_model``), the tokenizer named by the run's data config) and building an
eval-mode ``Transformer`` on a device and dtype, with one-line errors for what is missing.

Not responsible for: training checkpoints (DCP directories: ``ftlm convert`` or the trainer load
those) or Hugging Face folders (``ftlm.model.hf``). Weights are read with safetensors only, never
``torch.load``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ftlm.data.tokenizer import Tokenizer
from ftlm.errors import ConfigError, DataError
from ftlm.model.config import ModelConfig
from ftlm.model.llama import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready for inference, with its tokenizer when one was found."""

    model: Transformer
    tokenizer: Tokenizer | None
    name: str
    config: Any = None
    """The run's ``RunConfig`` (its ``ft`` section names the job token)."""
    run_dir: Path | None = None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"dtype={name!r} is not known; valid: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device={name!r} is not a torch device; try cpu, cuda or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} asked for CUDA but none is available; use cpu")
    return device


def load_run(path: str | Path, tokenizer: str | Path | None = None, device: str = "auto",
             dtype: str = "auto", *, read_config: Callable[[Path], Any]) -> LoadedModel:
    """Load ``model.safetensors`` of a run directory (or that file) with the run's model config.

    ``read_config`` reads the run's ``config.toml`` into its ``RunConfig``: the composition root's
    ``ftlm.config.load_config``, passed in by the caller (inference does not import the root)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    path = Path(path)
    run_dir = path.parent if path.is_file() else path
    weights = path if path.is_file() else path / "model.safetensors"
    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise DataError(f"{config_path} not found: give a run directory written by `ftlm train` "
                        "(config.toml and model.safetensors)")
    if not weights.is_file():
        raise DataError(f"{weights} not found: the run has not finished (the trainer writes "
                        "model.safetensors at its end)")
    config = read_config(config_path)
    dev = resolve_device(device)
    model = build_model(config.model, dev)
    try:
        load_model(model, str(weights), device=str(dev))
    except (SafetensorError, RuntimeError, OSError) as e:
        raise DataError(f"cannot load {weights} into the model of {config_path} ({str(e)[:200]}); "
                        "is it the model of this run?") from None
    model = model.to(resolve_dtype(dtype, dev)).eval()
    tok = _find_tokenizer(config, run_dir, tokenizer)
    return LoadedModel(model, tok, config.run.name, config, run_dir)


def build_model(cfg: ModelConfig, device: torch.device) -> Transformer:
    """An initialised model of shape ``cfg`` on ``device`` (weights to be loaded over it)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.init_weights(0)  # fills the rotary buffers; the parameters are overwritten on load
    return model


def _find_tokenizer(config, run_dir: Path, explicit: str | Path | None) -> Tokenizer | None:
    if explicit:
        return Tokenizer.load(Path(explicit))
    candidates = [Path(config.data.tokenizer)] if config.data.tokenizer else []
    candidates += [run_dir / "tokenizer.json", Path(config.data.dir) / "tokenizer.json"]
    for candidate in candidates:
        if candidate.is_file():
            return Tokenizer.load(candidate)
    return None
