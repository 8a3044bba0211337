"""``ftlm generate`` on a finished run directory, and its one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from infer_helpers import tiny_model

from ftlm.cli import main
from ftlm.config import build_config, load_config, save_config
from ftlm.infer import Engine, SamplingParams
from ftlm.infer.load import load_run

sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))
from serve_helpers import make_tokenizer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from safetensors.torch import save_model
    root = tmp_path_factory.mktemp("run")
    tok = make_tokenizer(root)
    model = tiny_model(vocab_size=tok.vocab_size)
    m = model.cfg
    config = build_config({"run": {"name": "tiny-run", "dir": str(root)},
                           "model": {"size": "tiny", "vocab_size": m.vocab_size, "dim": m.dim,
                                     "n_layers": m.n_layers, "n_heads": m.n_heads,
                                     "n_kv_heads": m.n_kv_heads, "ffn_dim": m.ffn_dim,
                                     "max_seq_len": m.max_seq_len, "init_std": m.init_std},
                           "data": {"tokenizer": str(root / "tokenizer.json")}})
    save_config(config, root / "config.toml")
    save_model(model, str(root / "model.safetensors"))
    return root


def test_generate_prints_the_engines_greedy_completion(run_dir, capsys):
    loaded = load_run(run_dir, device="cpu", read_config=load_config)
    tok = loaded.tokenizer
    want = Engine(loaded.model, eos_id=tok.eos_id).generate(
        [tok.encode("the quick")], SamplingParams(max_new_tokens=6, temperature=0))[0]
    assert main(["generate", str(run_dir), "--prompt", "the quick", "--temperature", "0",
                 "--max-new-tokens", "6", "--json", "--device", "cpu"]) == 0
    record = json.loads(capsys.readouterr().out.strip())
    assert record["completion"] == tok.decode(want.tokens)


def test_generate_with_a_strategy_over_tasks_reports_accuracy(run_dir, capsys):
    assert main(["generate", str(run_dir), "--tasks", "3", "-n", "3", "--strategy",
                 "self-consistency", "--max-new-tokens", "4", "--json", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert len(rows) == 3 and all(len(r["samples"]) == 3 and "correct" in r for r in rows)
    assert "accuracy" in captured.err


def test_generate_errors_are_one_line(run_dir, tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert "config.toml not found" in capsys.readouterr().err
    assert main(["generate", str(run_dir), "--device", "cpu"]) == 2
    assert "nothing to generate" in capsys.readouterr().err
    assert main(["generate", str(run_dir), "--prompt", "x", "--top-p", "0", "--device",
                 "cpu"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_the_cli_names_every_strategy_and_scorer():
    from ftlm import infer_cli
    from ftlm.infer import strategies
    assert infer_cli.STRATEGIES == strategies.STRATEGIES
    assert infer_cli.SCORERS == tuple(strategies.SCORERS)


def test_chat_prompts_use_the_post_training_template(run_dir):
    from ftlm.data.tokenizer import Tokenizer
    from ftlm.infer.chat import chat_stop_ids, render_chat
    from ftlm.data.chat import prompt_ids
    tok = Tokenizer.load(run_dir / "tokenizer.json")
    assert render_chat([{"role": "user", "content": "hi"}], tok) == prompt_ids(tok, "hi")
    assert tok.token_id("<|end|>") in chat_stop_ids(tok)


def test_generate_beam_search_uses_the_verifier_as_process_scorer(run_dir, capsys):
    assert main(["generate", str(run_dir), "--tasks", "2", "-n", "4", "--strategy", "beam-search",
                 "--verifier", str(run_dir), "--beam-width", "2", "--max-new-tokens", "6",
                 "--json", "--device", "cpu", "--chat"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert len(rows) == 2 and all(r["samples"] and r["completion"] in r["samples"] for r in rows)
    assert "accuracy" in captured.err and "beam-search" in captured.err


def test_beam_search_and_verifier_errors_are_one_line(run_dir, tmp_path, capsys):
    base = ["generate", str(run_dir), "--prompt", "x", "--device", "cpu", "--strategy",
            "beam-search"]
    assert main(base) == 2
    assert "needs --verifier" in capsys.readouterr().err
    assert main(base + ["--verifier", str(run_dir), "-n", "6", "--beam-width", "4"]) == 2
    assert "must divide" in capsys.readouterr().err
    assert main(["verifier", "data", "--policy", str(run_dir), "--split", "test", "--out",
                 str(tmp_path / "v.jsonl")]) == 2
    assert "train split only" in capsys.readouterr().err
    # the verifier config is configs/tiny.toml: larger than this 64-wide policy
    assert main(["verifier", "train", str(Path(__file__).parents[2] / "configs" / "tiny.toml"),
                 "--policy", str(run_dir), "--set", f"run.dir={tmp_path / 'v'}"]) == 2
    assert "not smaller than the policy" in capsys.readouterr().err


def test_verifier_data_labels_policy_samples_with_the_checker(run_dir, tmp_path, capsys):
    out = tmp_path / "v.jsonl"
    assert main(["verifier", "data", "--policy", str(run_dir), "--n", "3", "--samples", "2",
                 "--max-new-tokens", "4", "--out", str(out)]) == 0
    assert "6 samples of 3 train tasks, 0 correct" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records and all(r["label"] == "no" and r["messages"][1]["content"] == "no"
                           for r in records)


def test_verifier_head_refuses_a_larger_verifier_and_a_policy_without_right_samples(
        run_dir, tmp_path, capsys):
    base = ["verifier", "head", str(run_dir), "--policy", str(run_dir), "--n", "2",
            "--samples", "2", "--max-new-tokens", "4", "--out", str(tmp_path / "head.json")]
    assert main(base) == 2  # the same model as verifier and policy: not smaller
    assert "not smaller than the policy" in capsys.readouterr().err
    assert main(base + ["--allow-larger"]) == 2  # a random policy gets nothing right
    err = capsys.readouterr().err
    assert "0 right and" in err and len(err.strip().splitlines()) == 1


def test_generate_best_of_n_scores_with_an_outcome_head(run_dir, tmp_path, capsys):
    from ftlm.infer.outcome import FEATURES, Head, save_head
    head = save_head(Head(list(FEATURES), [0.0] * 4, [1.0] * 4, [1.0, 0.0, 0.0, 0.0]),
                     tmp_path / "head.json")
    assert main(["generate", str(run_dir), "--tasks", "2", "-n", "3", "--strategy", "best-of-n",
                 "--scorer", "verifier", "--verifier", str(run_dir), "--verifier-head",
                 str(head), "--max-new-tokens", "4", "--json", "--device", "cpu",
                 "--chat"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and all(r["completion"] in r["samples"] for r in rows)
    assert main(["generate", str(run_dir), "--prompt", "x", "-n", "2", "--strategy",
                 "best-of-n", "--scorer", "verifier", "--verifier", str(run_dir),
                 "--verifier-head", str(tmp_path / "missing.json"), "--device", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err
