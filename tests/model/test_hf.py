"""Hugging Face interop: logits parity with transformers' LlamaForCausalLM both ways, Llama 3.x
rope scaling, config mapping of real Llama 3.x folders, and refusals of what ftlm can't run."""

from __future__ import annotations

import json

import pytest
import torch

from ftlm.errors import ConfigError, DataError
from ftlm.model import ModelConfig
from ftlm.model.hf import config_from_hf, config_to_hf, load_hf_model, save_hf_model
from ftlm.model.llama import rope_inv_freq

transformers = pytest.importorskip("transformers")

# Llama 3.2 1B's config.json as published (transformers 4.x format: rope_theta + rope_scaling).
LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
}
# Wavelengths 6.3, 20, 63, ... against 32/4 and 32/1: one kept, one blended, the rest scaled.
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def random_hf_model(tmp_path, tie: bool, scaling: dict | None, theta: float = 500000.0):
    """A randomly initialised tiny LlamaForCausalLM saved with save_pretrained."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=tie,
        rope_parameters={"rope_theta": theta, **(scaling or {"rope_type": "default"})})
    model = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return model, folder


# Two cases cover tied/untied and scaled/unscaled in the default run (importing transformers
# alone costs ~6 s of CPU); the other two combinations are in the slow tier.
@pytest.mark.parametrize("tie,scaling,theta", [
    (False, None, 500000.0), (True, LLAMA3_SCALING, 10000.0),
    pytest.param(True, None, 10000.0, marks=pytest.mark.slow),
    pytest.param(False, LLAMA3_SCALING, 10000.0, marks=pytest.mark.slow)])
def test_logits_match_transformers_both_ways(tmp_path, tie, scaling, theta):
    hf, folder = random_hf_model(tmp_path, tie, scaling, theta)
    ours = load_hf_model(folder)
    assert ours.cfg.tie_embeddings == tie and bool(ours.cfg.rope_scaling) == bool(scaling)
    tokens = torch.randint(0, 101, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        assert (ours(tokens) - expected).abs().max() <= 1e-4
        save_hf_model(ours, tmp_path / "back")
        again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert (again(tokens).logits - expected).abs().max() <= 1e-4


def test_rope_scaling_changes_the_model_and_matches_transformers_frequencies():
    cfg = config_from_hf(LLAMA_32_1B)
    assert cfg.size == "1b" and cfg.max_seq_len == 131072 and cfg.tie_embeddings
    named = ModelConfig(size="1b")
    assert (cfg.rope_theta, cfg.rope_scaling) == (named.rope_theta, named.rope_scaling) == (
        500000.0, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192})
    assert ModelConfig(size="8b").rope_scaling["factor"] == 8.0
    assert ModelConfig(size="tiny").rope_theta == 10000.0 and ModelConfig().rope_scaling == {}
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**LLAMA_32_1B), "cpu")
    ours = rope_inv_freq(named)
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0)
    unscaled = rope_inv_freq(ModelConfig(size="1b", rope_scaling={}))
    assert (ours < unscaled).any() and (ours == unscaled).any()


def test_config_round_trips_through_hf():
    cfg = ModelConfig(size="tiny", rope_theta=500000.0, rope_scaling={k: v for k, v in
                      LLAMA3_SCALING.items() if k != "rope_type"})
    assert config_from_hf(config_to_hf(cfg)) == cfg
    assert config_from_hf(config_to_hf(ModelConfig(size="8b"))) == ModelConfig(size="8b")


@pytest.mark.parametrize("change,message", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "not a Llama model"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"head_dim": 128}, "head_dim=128"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 0.5, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0}}, "factor=0.5 must be >= 1"),
    ({"vocab_size": "many"}, "vocab_size='many'"),
])
def test_unsupported_configs_are_refused_with_a_reason(change, message):
    with pytest.raises(ConfigError, match=message):
        config_from_hf({**LLAMA_32_1B, **change})


def test_folders_ftlm_cannot_read_are_refused(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    small = {**LLAMA_32_1B, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 96, "num_hidden_layers": 1, "vocab_size": 50}
    (folder / "config.json").write_text(json.dumps(small))
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(DataError, match="pickled weights"):
        load_hf_model(folder)
    from safetensors.torch import save_file
    save_file({"model.embed_tokens.weight": torch.zeros(50, 64)}, str(folder / "model.safetensors"))
    with pytest.raises(DataError, match="missing"):
        load_hf_model(folder)
    with pytest.raises(DataError, match="not a Hugging Face model folder"):
        load_hf_model(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 10**9}, "n_layers=1000000000 is above"),
    ({"max_position_embeddings": 10**12}, "max_seq_len=1000000000000 is above"),
    ({"hidden_size": 2**20, "intermediate_size": 2**22}, "parameters, above"),
])
def test_sizes_are_checked_before_anything_is_allocated(tmp_path, change, message):
    folder = tmp_path / "hf"
    folder.mkdir()
    small = {**LLAMA_32_1B, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 128, "head_dim": None,
             **change}
    (folder / "config.json").write_text(json.dumps(small))
    with pytest.raises(ConfigError, match=message) as caught:
        load_hf_model(folder)  # no weights file: the config alone is refused
    assert "\n" not in str(caught.value)


def test_a_deeply_nested_config_json_is_a_one_line_error(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(DataError, match="nests too deeply") as caught:
        load_hf_model(folder)
    assert "\n" not in str(caught.value)


def test_a_tokenizer_symlinked_from_outside_the_folder_is_not_copied(tmp_path):
    from ftlm.model.hf import copy_tokenizer_files
    src, dst = tmp_path / "hf", tmp_path / "out"
    src.mkdir()
    dst.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("a private key")
    (src / "tokenizer.json").symlink_to(secret)
    with pytest.raises(DataError, match="symbolic link .* outside"):
        copy_tokenizer_files(src, dst)
    assert not (dst / "tokenizer.json").exists()
    (src / "tokenizer.json").unlink()
    (src / "real.json").write_text("{}")
    (src / "tokenizer.json").symlink_to(src / "real.json")  # inside the folder: copied
    assert copy_tokenizer_files(src, dst) == ["tokenizer.json"]
    copied = dst / "tokenizer.json"
    assert not copied.is_symlink() and copied.stat().st_mode & 0o777 == 0o644
