"""Hugging Face Llama folders <-> ftlm models: config mapping, weight names, files.

Responsible for: mapping a Hugging Face ``LlamaForCausalLM`` ``config.json`` to a ``ModelConfig``
and back (``config_from_hf``, ``config_to_hf``: shapes, ``rope_theta``, Llama 3.x
``rope_scaling``, tied embeddings), renaming the weights (``state_from_hf``, ``state_to_hf``),
and reading / writing whole folders (``load_hf_model``: ``config.json`` + ``model.safetensors``
or a sharded ``model.safetensors.index.json``; ``save_hf_model``: ``config.json``,
``generation_config.json``, ``model.safetensors``, and the tokenizer files).

Weights copy unchanged: ftlm's rotary embedding pairs dimension ``i`` with ``i + head_dim/2``
("rotate half"), which is the layout of HF's Llama. The q/k permutation in HF's
``convert_llama_weights_to_hf.py`` maps Meta's original interleaved pairs to that layout, so a
folder converted by HF needs none between it and ftlm (the logits parity test proves it).

Not responsible for: Meta's original ``consolidated.*.pth`` files (pickles, never loaded here)
or ``pytorch_model.bin`` (pickle: only safetensors are read); other architectures or rope types
(refused with a message); ftlm run directories and checkpoints (``ftlm.convert_cli``); training
a tokenizer. Imports torch and safetensors only.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from ftlm.errors import ConfigError, DataError
from ftlm.model.config import ROPE_SCALING_KEYS, SIZES, ModelConfig
from ftlm.model.counts import size_problem
from ftlm.model.llama import Transformer

# ftlm name pattern -> HF name pattern ("{}" is the layer index).
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")


def hf_name(name: str) -> str:
    """The HF name of the ftlm parameter ``name``."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    prefix, index, rest = name.split(".", 2)
    if prefix != "layers" or rest not in _LAYER_NAMES:
        raise KeyError(name)
    return f"model.layers.{index}.{_LAYER_NAMES[rest]}"


def ftlm_names(cfg: ModelConfig) -> list[str]:
    """Every parameter name of a model of shape ``cfg`` (``output.weight`` also when tied)."""
    names = ["tok_embeddings.weight", "norm.weight", "output.weight"]
    for i in range(cfg.n_layers):
        names += [f"layers.{i}.{rest}" for rest in _LAYER_NAMES]
    return names


def _get(config: dict, key: str, kind: type, where: str):
    value = config.get(key)
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ConfigError(f"{where}: {key}={value!r} must be a positive integer")
    if kind is float and (not isinstance(value, (int, float)) or isinstance(value, bool)
                          or not math.isfinite(value)):
        raise ConfigError(f"{where}: {key}={value!r} must be a number")
    return value


def _rope_from_hf(config: dict, where: str) -> tuple[float, dict]:
    """``(rope_theta, rope_scaling)`` from the legacy keys (``rope_theta``, ``rope_scaling``) or
    transformers 5's ``rope_parameters``."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or params)
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise ConfigError(f"{where}: rope_theta={theta!r} must be a number")
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    scaling.pop("rope_theta", None)
    if kind == "default":
        return float(theta), {}
    if kind != "llama3":
        raise ConfigError(f"{where}: rope type {kind!r} is not supported; ftlm implements the "
                          "default rotary embedding and Llama 3.x scaling (rope_type llama3)")
    scaling.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return float(theta), {k: scaling.get(k) for k in ROPE_SCALING_KEYS}


def config_from_hf(config: dict, where: str = "config.json") -> ModelConfig:
    """The ``ModelConfig`` of an HF Llama ``config.json`` (parsed); refuses what ftlm can't run.

    ``size`` is the row of ``SIZES`` whose shape matches, else ``tiny``; every field is set
    explicitly either way.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: not a JSON object")
    archs = config.get("architectures") or []
    if config.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        raise ConfigError(f"{where}: model_type={config.get('model_type')!r} is not a Llama "
                          "model; ftlm converts LlamaForCausalLM folders only")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={config.get('hidden_act')!r}: ftlm's MLP is SwiGLU "
                          "(silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ConfigError(f"{where}: {flag}=true: ftlm's Llama has no biases")
    heads = _get(config, "num_attention_heads", int, where)
    hidden = _get(config, "hidden_size", int, where)
    head_dim = config.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise ConfigError(f"{where}: head_dim={head_dim} x num_attention_heads={heads} != "
                          f"hidden_size={hidden}; ftlm needs head_dim = hidden_size / heads")
    theta, scaling = _rope_from_hf(config, where)
    fields = dict(
        vocab_size=_get(config, "vocab_size", int, where), dim=hidden,
        n_layers=_get(config, "num_hidden_layers", int, where), n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        ffn_dim=_get(config, "intermediate_size", int, where),
        max_seq_len=_get(config, "max_position_embeddings", int, where),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        norm_eps=_get(config, "rms_norm_eps", float, where) if "rms_norm_eps" in config else 1e-6,
        rope_theta=theta, rope_scaling=scaling,
        init_std=float(config.get("initializer_range", 0.02)))
    size = next((name for name, row in SIZES.items()
                 if all(row[k] == fields[k] for k in _SHAPE_FIELDS)), "tiny")
    try:
        cfg = ModelConfig(size=size, **fields)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    too_large = size_problem(cfg)
    if too_large:  # checked before any tensor or module of that shape is made
        raise ConfigError(f"{where}: {too_large}; this is not a model ftlm can load")
    return cfg


def config_to_hf(cfg: ModelConfig, bos_id: int | None = None, eos_id: int | list[int] | None = None,
                 dtype: torch.dtype = torch.float32) -> dict:
    """The HF ``config.json`` (as a dict) of a model of shape ``cfg``.

    Rope settings are written both as transformers 5's ``rope_parameters`` and as the legacy
    ``rope_theta`` / ``rope_scaling`` keys that Llama 3.x folders and older transformers use.
    """
    scaling = ({"rope_type": "llama3", **cfg.rope_scaling} if cfg.rope_scaling else None)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
        "rope_parameters": {"rope_theta": cfg.rope_theta, **(scaling or {"rope_type": "default"})},
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "initializer_range": cfg.init_std, "bos_token_id": bos_id, "eos_token_id": eos_id,
        "torch_dtype": str(dtype).removeprefix("torch."), "use_cache": True,
    }


def state_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig,
                  where: str = "model.safetensors") -> dict[str, torch.Tensor]:
    """ftlm state dict (float32) from HF tensors; every name and shape is checked."""
    expected = {hf_name(n): n for n in ftlm_names(cfg)}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight")  # HF folders of tied models may carry it or not
    # Rotary tables some exports include are recomputed from the config, never read.
    extra = sorted(n for n in set(tensors) - set(expected) - {"lm_head.weight"}
                   if not n.endswith("rotary_emb.inv_freq"))
    missing = sorted(set(expected) - set(tensors))
    if missing or extra:
        raise DataError(f"{where} does not match its config.json: missing {missing[:4]}, "
                        f"unexpected {extra[:4]}")
    state = {ours: tensors[theirs].to(torch.float32) for theirs, ours in expected.items()}
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Transformer(cfg).state_dict().items()}
    for name, tensor in state.items():
        if tensor.shape != shapes[name]:
            raise DataError(f"{where}: {hf_name(name)} has shape {tuple(tensor.shape)}, the "
                            f"config needs {tuple(shapes[name])}")
    return state


def state_to_hf(model: Transformer, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF tensors (contiguous, own storage, ``dtype``) of ``model``; no ``lm_head`` when tied."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "output.weight" and model.cfg.tie_embeddings:
            continue
        tensors[hf_name(name)] = tensor.detach().to("cpu", dtype).contiguous().clone()
    return tensors


def model_from_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> Transformer:
    """A CPU ``Transformer`` holding ``state`` (no random initialisation is drawn)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.load_state_dict(state, strict=True)
    model.init_rope()
    return model


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise DataError(f"cannot read {path} as JSON: it nests too deeply for a model "
                        "config") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and a 5,000-digit number included
        raise DataError(f"cannot read {path} as JSON ({' '.join(str(e).split())[:200]})"
                        ) from None


def is_hf_folder(path: Path) -> bool:
    """Whether ``path`` looks like an HF model folder (a directory with ``config.json``)."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def read_hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder: ``model.safetensors`` or the shards of its index."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise DataError(f"{index} has no weight_map")
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif any(folder.glob("*.bin")) or any(folder.glob("*.pth")):
        raise DataError(f"{folder} holds pickled weights (.bin/.pth), which ftlm never loads; "
                        "re-save the model with safetensors (save_pretrained's default)")
    else:
        raise DataError(f"{folder} has no model.safetensors (or model.safetensors.index.json)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = folder / name
        if Path(name).name != name or not path.is_file():
            raise DataError(f"{index}: shard {name!r} is missing or not a plain file name")
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError) as e:
            raise DataError(f"{path} is not a readable safetensors file ({e})") from None
    return tensors


def load_hf_model(folder: Path) -> Transformer:
    """An ftlm ``Transformer`` (float32, CPU, eval mode) from an HF Llama folder."""
    folder = Path(folder)
    if not is_hf_folder(folder):
        raise DataError(f"{folder} is not a Hugging Face model folder (no config.json)")
    cfg = config_from_hf(_read_json(folder / "config.json"), where=str(folder / "config.json"))
    state = state_from_hf(read_hf_tensors(folder), cfg, where=str(folder))
    return model_from_state(cfg, state).eval()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.chmod(tmp, 0o644)  # readable as a published file, whatever the source's mode was
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_hf_model(model: Transformer, folder: Path, tokenizer: Path | None = None,
                  dtype: torch.dtype = torch.float32, chat_template: str | None = None) -> Path:
    """Write ``model`` as an HF Llama folder; returns ``folder``.

    ``tokenizer`` is an ftlm ``tokenizer.json`` (``ftlm.data.tokenizer``): its content is copied
    (a plain file of mode 0644, whatever ``tokenizer`` links to), and a
    ``tokenizer_config.json`` naming its special tokens is written (with ``chat_template``, the
    Jinja form of the chat format, when given), so ``AutoTokenizer.from_pretrained(folder)``
    loads it and ``apply_chat_template`` renders ftlm's chat format. Its bos/eos ids go into the
    configs; ``eos_token_id`` lists ``<|eos|>`` and the turn end ``<|end|>``, so
    ``generate`` stops at the end of an assistant turn as ``ftlm serve`` does.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    bos_id = pad_id = None
    eos_ids: list[int] = []
    if tokenizer is not None:
        from tokenizers import Tokenizer as RawTokenizer
        try:
            content = Path(tokenizer).read_bytes()
            raw = RawTokenizer.from_str(content.decode("utf-8"))
        except Exception as e:  # the Rust side raises a bare Exception for any parse error
            raise DataError(f"cannot read tokenizer {tokenizer} ({e})") from None
        bos_id, pad_id = raw.token_to_id("<|bos|>"), raw.token_to_id("<|pad|>")
        eos_ids = [i for i in (raw.token_to_id("<|eos|>"), raw.token_to_id("<|end|>"))
                   if i is not None]
        _atomic_write(folder / "tokenizer.json", content)
        special = {k: v for k, v in (("bos_token", "<|bos|>"), ("eos_token", "<|eos|>"),
                                     ("pad_token", "<|pad|>"))
                   if raw.token_to_id(v) is not None}
        settings = {"tokenizer_class": "PreTrainedTokenizerFast",
                    "model_max_length": model.cfg.max_seq_len,
                    "clean_up_tokenization_spaces": False, **special}
        if chat_template is not None:
            settings["chat_template"] = chat_template
        _atomic_write(folder / "tokenizer_config.json", json.dumps(settings, indent=2).encode())
    eos: int | list[int] | None = (eos_ids[0] if len(eos_ids) == 1 else eos_ids) or None
    config = config_to_hf(model.cfg, bos_id=bos_id, eos_id=eos, dtype=dtype)
    _atomic_write(folder / "config.json", json.dumps(config, indent=2).encode())
    generation = {k: v for k, v in (("bos_token_id", bos_id), ("eos_token_id", eos),
                                    ("pad_token_id", pad_id)) if v is not None}
    _atomic_write(folder / "generation_config.json", json.dumps(generation, indent=2).encode())
    weights = folder / "model.safetensors"
    tmp = weights.with_name(f".{weights.name}.tmp{os.getpid()}")
    try:  # straight to disk: a large model's bytes never sit in memory twice
        save_file(state_to_hf(model, dtype), str(tmp), metadata={"format": "pt"})
        os.replace(tmp, weights)
    finally:
        tmp.unlink(missing_ok=True)
    return folder


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy the HF tokenizer files present in folder ``src`` to ``dst``; returns their names.

    A file that is a symbolic link to something outside ``src`` is refused (converting a folder
    must not publish a file the folder only points at, such as a key elsewhere on the machine);
    a copy is a plain file of mode 0644.
    """
    folder = Path(src).resolve()
    copied = []
    for name in TOKENIZER_FILES:
        path = Path(src) / name
        if not path.is_file():
            continue
        target = path.resolve()
        if path.is_symlink() and not target.is_relative_to(folder):
            raise DataError(f"{path} is a symbolic link to {target}, outside {folder}; copy the "
                            "file itself into the folder if it is the tokenizer you mean")
        _atomic_write(Path(dst) / name, target.read_bytes())
        copied.append(name)
    return copied
