"""``ftlm convert SRC --out DST``: Hugging Face Llama folder <-> ftlm model, and ftlm model sources.

The direction follows from SRC:

* an HF folder (``config.json`` + safetensors) -> an ftlm model folder DST: ``model.safetensors``
  (the layout ``Session``'s model file (``Durability.save_model``) writes; ``train.init_from`` takes it), ``config.toml``
  holding the ``[model]`` section to train or evaluate it with, and the HF tokenizer files;
* an ftlm source -> an HF folder DST (``config.json``, ``model.safetensors``, the tokenizer as
  ``tokenizer.json`` + ``tokenizer_config.json``). An ftlm source is a run directory (its
  ``model.safetensors``, else its newest valid checkpoint), a checkpoint directory
  (``.../checkpoints/step-NNNNNNNN``), or a ``model.safetensors`` file; the model's shape comes from
  ``--config``, else the ``config.toml`` next to it or in its run directory, else the file's own
  metadata (folders written by this command carry it).

``load_model_source`` (the same resolution, returning a model) is what ``ftlm eval`` uses.

Checkpoints are read through ``ftlm.train.checkpoint``'s verification (manifest, sizes, sha256,
and the HMAC when the job token is known: ``FTLM_TOKEN`` or the run directory's ``token`` file)
and its restricted deserialisation. Not done here: the HF mapping itself (``ftlm.model.hf``),
sharded writing, or merging optimizer state (only the weights are converted).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ftlm.errors import CheckpointError, ConfigError, DataError

METADATA_KEY = "ftlm.model"
"""safetensors metadata entry holding the ``ModelConfig`` as JSON (files written here)."""


@dataclass
class ModelSource:
    """A model loaded from an ftlm or HF source, with what was learnt about it on the way."""

    model: object
    """The ``Transformer`` (CPU, float32, eval mode)."""
    kind: str
    """``hf``, ``model file`` or ``checkpoint``."""
    path: Path
    """What was actually read (the weights file or checkpoint directory)."""
    tokenizer: Path | None
    """The tokenizer found for it (``tokenizer.json``), if any."""


def _model_config_from_toml(path: Path):
    from ftlm.config import load_config
    return load_config(path).model


def _config_near(path: Path, explicit: Path | None) -> Path | None:
    """``--config``, else the ``config.toml`` of the run ``path`` belongs to: next to a weights
    file, in a run directory, or in the run directory of a checkpoint (``RUN/checkpoints/step-N``)."""
    if explicit is not None:
        if not explicit.is_file():
            raise ConfigError(f"--config {explicit} does not exist")
        return explicit
    if path.is_file():
        candidates = [path.parent]
    elif path.name.startswith("step-"):
        candidates = [path.parent.parent, path.parent]
    else:
        candidates = [path]
    return next((c / "config.toml" for c in candidates if (c / "config.toml").is_file()), None)


def _tokenizer_near(path: Path, config_path: Path | None, explicit: Path | None) -> Path | None:
    if explicit is not None:
        if not explicit.is_file():
            raise DataError(f"--tokenizer {explicit} does not exist")
        return explicit
    folder = path if path.is_dir() else path.parent
    candidates = [folder / "tokenizer.json"]
    if config_path is not None:
        from ftlm.config import load_config
        data = load_config(config_path).data
        if data.tokenizer:
            candidates.insert(0, Path(data.tokenizer))
        if data.dir:
            candidates.append(Path(data.dir) / "tokenizer.json")
    return next((c for c in candidates if c.is_file()), None)


def _read_model_file(path: Path, config_path: Path | None, explicit: bool):
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_model
    from ftlm.model import ModelConfig, Transformer
    from ftlm.model.counts import size_problem
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise DataError(f"{path} is not a readable safetensors file ({e})") from None
    if config_path is not None and (explicit or METADATA_KEY not in metadata):
        cfg = _model_config_from_toml(config_path)
    elif METADATA_KEY in metadata:
        config_path = None  # the file describes itself
        try:
            cfg = ModelConfig(**json.loads(metadata[METADATA_KEY]))
        except (ValueError, TypeError, RecursionError) as e:
            raise DataError(f"{path}: its {METADATA_KEY} metadata is not a model config "
                            f"({' '.join(str(e).split())[:200]})") from None
        too_large = size_problem(cfg)
        if too_large:
            raise DataError(f"{path}: its {METADATA_KEY} metadata describes a model too large "
                            f"to build: {too_large}")
    else:
        raise ConfigError(f"{path}: no config.toml next to it or in its run directory; pass "
                          "--config RUN_CONFIG.toml with the [model] section it was trained with")
    import torch
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    try:
        missing, unexpected = load_model(model, str(path), strict=False)
    except (SafetensorError, RuntimeError) as e:
        raise DataError(f"{path} does not fit the model config "
                        f"({config_path or 'its metadata'}): {str(e).splitlines()[0]}") from None
    if missing or unexpected:
        raise DataError(f"{path} does not fit the model config ({config_path or 'its metadata'}): "
                        f"missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}")
    model.init_rope()
    return model


def _job_key(run_dir: Path) -> tuple[bytes | None, str]:
    """The key and run id that signed the checkpoints of ``run_dir`` (none without a token)."""
    from ftlm.train.job_token import TOKEN_FILE, read_token_file, run_id
    token = os.environ.get("FTLM_TOKEN", "")
    if not token and (run_dir / TOKEN_FILE).is_file():
        token = read_token_file(run_dir / TOKEN_FILE)
    return (token.encode(), run_id(run_dir, create=False)) if token else (None, "")


def _read_checkpoint(path: Path, config_path: Path | None):
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from ftlm.model import Transformer
    from ftlm.train.checkpoint import load_verified, verify
    if config_path is None:
        raise ConfigError(f"{path}: no config.toml in its run directory; pass --config "
                          "RUN_CONFIG.toml with the [model] section it was trained with")
    cfg = _model_config_from_toml(config_path)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    key, run = _job_key(config_path.parent)
    checkpoint = verify(path, key=key, run=run)
    # The trainer saves {"train": TrainState}; read only the model's part of it.
    wanted = get_model_state_dict(model)
    stored = set(checkpoint.metadata.state_dict_metadata)
    missing = sorted(k for k in wanted if f"train.model.{k}" not in stored)
    if missing:
        raise DataError(f"checkpoint {path} does not fit the model config {config_path}: it lacks "
                        f"{missing[:4]}")
    try:
        load_verified(checkpoint, {"train": {"model": wanted}})
    except CheckpointError:
        raise
    except Exception as e:  # DCP reports a shape mismatch as one of several types
        raise DataError(f"checkpoint {path} does not fit the model config {config_path}: "
                        f"{str(e).splitlines()[0][:300]}") from None
    # The tensors were loaded in place into the model's own parameters.
    model.init_rope()
    return model


def load_model_source(src: Path, config: Path | None = None,
                      tokenizer: Path | None = None) -> ModelSource:
    """The model at ``src`` (see the module docstring for what ``src`` may be), eval mode."""
    from ftlm.model.hf import is_hf_folder, load_hf_model
    from ftlm.train.checkpoint import MANIFEST, valid_checkpoints
    src = Path(src)
    if not src.exists():
        raise DataError(f"{src} does not exist")
    if is_hf_folder(src):
        tok = tokenizer or (src / "tokenizer.json")
        return ModelSource(load_hf_model(src), "hf", src, tok if tok.is_file() else None)
    if src.is_file():
        config_path = _config_near(src, config)
        model = _read_model_file(src, config_path, config is not None)
        kind, read = "model file", src
    elif (src / MANIFEST).is_file():
        config_path = _config_near(src, config)
        model = _read_checkpoint(src, config_path)
        kind, read = "checkpoint", src
    elif (src / "model.safetensors").is_file():
        config_path = _config_near(src, config)
        model = _read_model_file(src / "model.safetensors", config_path, config is not None)
        kind, read = "model file", src / "model.safetensors"
    else:
        config_path = _config_near(src, config)
        root = src / "checkpoints"
        if config_path is not None:
            from ftlm.config import load_config
            ck = load_config(config_path).checkpoint
            root = Path(ck.dir) if ck.dir else root
        found = valid_checkpoints(root)
        if not found:
            raise DataError(f"{src} is neither a Hugging Face folder (config.json), an ftlm run "
                            "directory (model.safetensors or checkpoints/), a checkpoint nor a "
                            ".safetensors file")
        read = found[-1][1]
        model = _read_checkpoint(read, config_path)
        kind = "checkpoint"
    model.eval()
    return ModelSource(model, kind, read, _tokenizer_near(src, config_path, tokenizer))


def write_ftlm_folder(model, out: Path, hf_folder: Path | None = None) -> Path:
    """Write ``model`` as an ftlm model folder: ``model.safetensors`` (with its config in the
    metadata), ``config.toml`` (``[model]``), and the tokenizer files of ``hf_folder``."""
    import tomli_w
    from safetensors.torch import save_model
    from ftlm.model.hf import copy_tokenizer_files
    out.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.asdict(model.cfg)
    weights = out / "model.safetensors"
    tmp = weights.with_name(f".{weights.name}.tmp{os.getpid()}")
    try:
        save_model(model, str(tmp), metadata={"format": "pt", METADATA_KEY: json.dumps(cfg)})
        os.replace(tmp, weights)
    finally:
        tmp.unlink(missing_ok=True)
    header = ("# The [model] section of the converted model: use it in the run config that\n"
              f"# trains or evaluates it (train.init_from = \"{weights}\").\n")
    (out / "config.toml").write_text(header + tomli_w.dumps({"model": cfg}))
    if hf_folder is not None:
        copy_tokenizer_files(hf_folder, out)
    return out


def convert(src: Path, out: Path, config: Path | None = None, tokenizer: Path | None = None,
            dtype: str = "float32") -> str:
    """Convert ``src`` into ``out`` (direction from ``src``); returns a one-line description."""
    import torch
    from ftlm.model.hf import save_hf_model
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty folder; choose a new path")
    if Path(src).resolve() == out.resolve():
        raise ConfigError("--out must differ from SRC")
    source = load_model_source(Path(src), config, tokenizer)
    if source.kind == "hf":
        write_ftlm_folder(source.model, out, Path(src))
        return f"Hugging Face folder {src} -> ftlm model folder {out} ({_shape(source.model)})"
    from ftlm.data.chat import HF_CHAT_TEMPLATE
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    save_hf_model(source.model, out, tokenizer=source.tokenizer, dtype=torch_dtype,
                  chat_template=HF_CHAT_TEMPLATE)
    note = "" if source.tokenizer else " (no tokenizer found: pass --tokenizer to include one)"
    if source.tokenizer is not None and source.tokenizer.is_symlink():
        note = (f" (tokenizer {source.tokenizer} is a symbolic link: the content of "
                f"{source.tokenizer.resolve()} was copied as a plain file, mode 0644)")
    return (f"ftlm {source.kind} {source.path} -> Hugging Face folder {out} "
            f"({_shape(source.model)}, {dtype}){note}")


def _shape(model) -> str:
    cfg = model.cfg
    params = sum(p.numel() for p in model.parameters())
    rope = f", rope_theta {cfg.rope_theta:g}" + (", llama3 scaling" if cfg.rope_scaling else "")
    return f"{params / 1e6:.2f}M parameters, {cfg.n_layers} layers, dim {cfg.dim}{rope}"


def cmd_convert(args: argparse.Namespace) -> int:
    print(convert(Path(args.src), Path(args.out),
                  config=Path(args.config) if args.config else None,
                  tokenizer=Path(args.tokenizer) if args.tokenizer else None, dtype=args.dtype))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ftlm convert``."""
    p = sub.add_parser("convert", help="Hugging Face Llama folder <-> ftlm model (direction from SRC)",
                       description="An HF folder becomes an ftlm model folder (model.safetensors, "
                                   "config.toml, tokenizer files); an ftlm run directory, "
                                   "checkpoint or model.safetensors becomes an HF Llama folder.")
    p.add_argument("src", help="HF folder (config.json), or an ftlm run directory, checkpoint "
                               "directory or model.safetensors")
    p.add_argument("--out", required=True, help="output folder (new or empty)")
    p.add_argument("--config", default="", help="run config whose [model] section describes an "
                                                "ftlm SRC (default: the config.toml found with it)")
    p.add_argument("--tokenizer", default="", help="ftlm tokenizer.json to ship with an HF output "
                                                   "(default: the run's)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="dtype of HF output weights (default float32)")
    p.set_defaults(fn=cmd_convert)
