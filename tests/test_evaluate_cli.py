"""``ftlm eval``: held-out loss equal to the trainer's own eval loss, pass@k wired to the checker
and the estimator, real sampling end to end through the CLI (JSON + table), one-line errors."""

from __future__ import annotations

import json

import pytest

import ftlm.evaluate_cli as evaluate_cli
from ftlm.cli import main
from ftlm.evaluate_cli import heldout_loss, task_accuracy
from ftlm.observe.events import read_events
from ftlm.tasks import generate


@pytest.fixture(scope="module")
def trained(make_tiny_config, tmp_path_factory):
    """A finished 4-step tiny run (the trainer's eval loss at its end is in events.jsonl)."""
    from ftlm.train.trainer import Trainer
    config = make_tiny_config(tmp_path_factory.mktemp("eval") / "run",
                              train={"steps": 4, "eval_every": 4, "eval_batches": 2})
    trainer = Trainer.for_run(config)
    trainer.train()
    return trainer, config


def test_heldout_loss_is_the_trainers_eval_loss(trained, demo_data):
    trainer, config = trained
    evals = [e for e in read_events(config.run.path / "events.jsonl") if e["kind"] == "eval"]
    samples = config.train.eval_batches * config.train.batch_size
    ours = heldout_loss(trainer.model, demo_data, config.data.eval_samples, config.data.eval_seed,
                        samples=samples)
    assert ours["samples"] == samples
    assert ours["loss"] == pytest.approx(evals[-1]["loss"], rel=1e-5)
    assert ours["perplexity"] == pytest.approx(2.718281828 ** ours["loss"], rel=1e-6)


def test_pass_at_k_counts_exactly_what_the_checker_accepts(trained, monkeypatch):
    trainer, _ = trained
    tasks = generate(["add", "sort"], "test", 4, seed=0)
    # Task i gets i correct samples of 3 (the reference solution), the rest a wrong answer.
    fake = [[t.solution] * min(i, 3) + ["<think></think>\nAnswer: -1"] * (3 - min(i, 3))
            for i, t in enumerate(tasks)]
    monkeypatch.setattr(evaluate_cli, "sample_tasks", lambda *a, **k: fake)
    out = task_accuracy(trainer.model, trainer.tokenizer, tasks, samples=3, ks=[1, 3],
                        temperature=1.0)
    scores = out["scores"]
    assert scores["all"]["pass@1"]["mean"] == pytest.approx((0 + 1 + 2 + 3) / 12)
    assert scores["all"]["pass@3"]["mean"] == pytest.approx(3 / 4)
    assert scores["add"]["tasks"] == 2 and scores["add"]["pass@1"]["mean"] == pytest.approx(2 / 6)
    assert [e["correct"] for e in out["examples"]] == [False, True, True]


def test_cli_eval_samples_with_the_engine_and_writes_json_and_table(trained, demo_data, tmp_path,
                                                                   capsys):
    _, config = trained
    out = tmp_path / "eval.json"
    argv = ["eval", str(config.run.path), "--data", str(demo_data), "--loss-samples", "16",
            "--families", "add,count", "--n", "2", "--samples", "2", "--k", "1,2",
            "--temperature", "1.0", "--max-new-tokens", "8", "--out", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "| add | 1 |" in table and "perplexity" in table
    result = json.loads(out.read_text())
    assert set(result) == {"model", "loss", "tasks"}
    assert 0.0 <= result["tasks"]["scores"]["all"]["pass@2"]["mean"] <= 1.0
    assert result["tasks"]["examples"][0]["prompt"].startswith("What is")
    assert out.with_suffix(".md").read_text().strip() == table.split("\n\nwritten to")[0].strip()
    # Seeded: the same command samples the same completions.
    assert main(argv) == 0
    assert json.loads(out.read_text())["tasks"]["examples"] == result["tasks"]["examples"]


@pytest.mark.parametrize("extra,message", [
    (["--samples", "2"], "--temperature 0 draws the same"),
    (["--samples", "2", "--temperature", "1", "--k", "3"], "every k must lie in 1..--samples=2"),
    (["--families", "nope"], "unknown task family"),
    (["--no-tasks"], "nothing to evaluate"),
])
def test_bad_eval_arguments_are_one_line_errors(trained, extra, message, capsys):
    _, config = trained
    assert main(["eval", str(config.run.path), "--n", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
