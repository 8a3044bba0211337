"""``ftlm convert``: HF folder -> ftlm folder -> HF folder, and ftlm runs and checkpoints -> HF,
each checked by logits (and by transformers loading the result)."""

from __future__ import annotations

import json

import pytest
import torch

from ftlm.cli import main
from ftlm.convert_cli import load_model_source
from ftlm.model.hf import load_hf_model

transformers = pytest.importorskip("transformers")


def _logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


@pytest.fixture
def hf_folder(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16})
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer_config.json").write_text("{}")
    return model, tmp_path / "hf"


def test_hf_to_ftlm_and_back(hf_folder, tmp_path, capsys):
    hf, folder = hf_folder
    assert main(["convert", str(folder), "--out", str(tmp_path / "ftlm")]) == 0
    assert "ftlm model folder" in capsys.readouterr().out
    out = tmp_path / "ftlm"
    assert {p.name for p in out.iterdir()} >= {"model.safetensors", "config.toml",
                                                "tokenizer_config.json"}
    tokens = torch.randint(0, 80, (1, 32))
    expected = _logits(hf, tokens)
    # The folder loads alone (config in the file's metadata) and with its config.toml.
    for source in (out / "model.safetensors", out):
        ours = load_model_source(source).model
        assert ours.cfg.rope_scaling["factor"] == 4.0
        assert (_logits(ours, tokens) - expected).abs().max() <= 1e-4
    # train.init_from takes the converted weights as it takes a run's model.safetensors.
    from ftlm.config import load_config
    from ftlm.model import Transformer
    from ftlm.train.trainer import load_weights
    fresh = Transformer(load_config(out / "config.toml").model)
    load_weights(fresh, out / "model.safetensors")
    assert (_logits(fresh.eval(), tokens) - expected).abs().max() <= 1e-4
    assert main(["convert", str(out), "--out", str(tmp_path / "back"), "--config",
                 str(out / "config.toml")]) == 0
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert (_logits(again, tokens) - expected).abs().max() <= 1e-4


def test_run_directory_and_checkpoint_to_hf(tiny_config, tmp_path, capsys):
    from ftlm.train.trainer import Trainer
    config = tiny_config(train={"steps": 2}, checkpoint={"every": 1, "async_save": False})
    trainer = Trainer.for_run(config)
    trainer.train()
    run_dir = config.run.path
    tokens = torch.randint(0, 1000, (1, 16))
    expected = _logits(trainer.model.eval(), tokens)
    assert main(["convert", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    said = capsys.readouterr().out
    assert "model file" in said and "no tokenizer" not in said
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert (_logits(hf, tokens) - expected).abs().max() <= 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.eos_token == "<|eos|>" and tok.eos_token_id in hf.config.eos_token_id
    assert tok("def f(x): return x")["input_ids"] == trainer.tokenizer.encode("def f(x): return x")
    # The last checkpoint holds the same step as the final weights.
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    assert main(["convert", str(checkpoint), "--out", str(tmp_path / "hf2")]) == 0
    assert "checkpoint" in capsys.readouterr().out
    assert (_logits(load_hf_model(tmp_path / "hf2"), tokens) - expected).abs().max() <= 1e-4


def test_bad_sources_are_one_line_errors(tmp_path, hf_folder, capsys):
    _, folder = hf_folder
    cases = [
        ([str(tmp_path / "missing"), "--out", str(tmp_path / "o1")], "does not exist"),
        ([str(tmp_path), "--out", str(tmp_path / "o2")], "is neither a Hugging Face folder"),
        ([str(folder), "--out", str(folder)], "exists and is not an empty folder"),
    ]
    (tmp_path / "w.safetensors").write_bytes(b"not safetensors")
    cases.append(([str(tmp_path / "w.safetensors"), "--out", str(tmp_path / "o3")],
                  "not a readable safetensors file"))
    config = json.loads((folder / "config.json").read_text())
    config["model_type"], config["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    cases.append(([str(folder), "--out", str(tmp_path / "o4")], "not a Llama model"))
    for argv, message in cases:
        assert main(["convert", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
