"""Verifier training data from policy samples: checker labels, train split only; and a tiny
trained verifier that ranks a correct solution above a wrong one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from infer_helpers import tiny_model

from ftlm.errors import ConfigError
from ftlm.infer import Engine, SamplingParams
from ftlm.infer.verifier import Verifier
from ftlm.infer.verifier_data import (
    label_samples,
    line_prefixes,
    sampled_records,
    write_records,
)
from ftlm.tasks import check
from ftlm.tasks import generate as generate_tasks

REPO = Path(__file__).parents[2]


def _completion(record: dict) -> tuple[str, str]:
    user = record["messages"][0]["content"]
    prompt, rest = user.split("\n\nProposed solution:\n")
    return prompt, rest.rsplit("\n\n", 1)[0]


def test_labels_are_the_checkers_verdicts_and_prefixes_carry_their_outcome():
    tasks = generate_tasks(["add", "mod", "sort", "count"], "train", 8, 0)
    wrong = [t.solution.rsplit("Answer:", 1)[0] + "Answer: 999999" for t in tasks]
    samples = [[t.solution, w, t.solution, "<think>\nno idea"] for t, w in zip(tasks, wrong)]
    records = label_samples(tasks, samples, seed=3)
    by_prompt = {t.prompt: t for t in tasks}
    outcomes = [r for r in records if r["kind"] == "outcome"]
    assert len(outcomes) == 3 * len(tasks)  # the duplicate solution counts once
    for r in outcomes:
        prompt, completion = _completion(r)
        assert r["label"] == ("yes" if check(by_prompt[prompt], completion) else "no")
        assert r["messages"][1] == {"role": "assistant", "content": r["label"]}
    for t, w in zip(tasks, wrong):
        prefixes = [(_completion(r)[1], r["label"]) for r in records
                    if r["kind"] == "prefix" and _completion(r)[0] == t.prompt]
        # a prefix on the way to both a right and a wrong answer is kept with both labels
        shared = set(line_prefixes(t.solution)) & set(line_prefixes(w))
        assert shared and all((p, "yes") in prefixes and (p, "no") in prefixes for p in shared)
        assert ("<think>\n", "no") in prefixes and all(p.endswith("\n") for p, _ in prefixes)
    assert label_samples(tasks, samples, seed=3) == records  # seeded shuffle
    assert sorted(map(json.dumps, label_samples(tasks, samples, prefixes=False))) == sorted(
        json.dumps(r) for r in outcomes)


def test_held_out_tasks_are_refused_before_anything_is_sampled(model):
    train = generate_tasks(["add"], "train", 3, 0)
    held = generate_tasks(["add"], "test", 1, 0)
    with pytest.raises(ConfigError, match="held-out split"):
        label_samples(train + held, [["x"]] * 4)

    class NoEngine:
        def add(self, *a, **k):
            raise AssertionError("sampled a held-out task")
    with pytest.raises(ConfigError, match="train split only"):
        sampled_records(NoEngine(), None, held, 2, SamplingParams())


def test_the_verifier_data_and_the_scaling_study_share_no_problem():
    families = ["add", "mod", "sort", "count"]
    train = generate_tasks(families, "train", 2000, 0)  # `ftlm verifier data --policy` draws
    test = generate_tasks(families, "test", 200, 0)  # bench.test_time_scaling measures
    assert {(t.family, t.key) for t in train}.isdisjoint({(t.family, t.key) for t in test})
    assert not {t.prompt for t in train} & {t.prompt for t in test}


def test_sampled_records_label_real_policy_samples(tmp_path):
    import sys
    sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))
    from serve_helpers import make_tokenizer
    tok = make_tokenizer(tmp_path)
    model = tiny_model(vocab_size=tok.vocab_size, max_seq_len=128)
    engine = Engine(model, max_batch=8, eos_id=tok.eos_id, detokenize=tok.decode)
    tasks = generate_tasks(["add", "count"], "train", 3, 0)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=0)
    records, counts = sampled_records(engine, tok, tasks, 4, params)
    assert counts["tasks"] == 3 and counts["samples"] == 12
    assert 1 <= counts["outcome_records"] <= 12 and counts["correct_samples"] == 0
    assert all(r["label"] == "no" for r in records)  # a random model answers nothing right
    path = write_records(records, tmp_path / "v.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == records
    with pytest.raises(ConfigError, match=".jsonl"):
        write_records(records, tmp_path / "v.json")


def separable_records() -> list[dict]:
    """Checker-labelled samples of a trivially separable kind: a worked solution (correct)
    against a bare guess with no reasoning (wrong)."""
    tasks = generate_tasks(["add", "count"], "train", 30, 0)
    samples = [[t.solution, "Answer: 0" if t.answer != "0" else "Answer: 1"] for t in tasks]
    records = label_samples(tasks, samples, prefixes=False)
    assert sum(r["label"] == "yes" for r in records) == 30
    return records


def assert_ranks_right_above_wrong(verifier: Verifier) -> None:
    for t in generate_tasks(["add", "count"], "test", 4, 0):
        right, wrong = verifier.probabilities([(t.prompt, t.solution), (t.prompt, "Answer: 0")])
        assert right > wrong, (t.prompt, right, wrong)


def test_ftlm_sft_on_checker_labels_trains_a_verifier_that_ranks_right_above_wrong(tmp_path, demo_data):
    """The route of `ftlm verifier train` after sampling: `ftlm sft` (one group, the real
    trainer) on checker-labelled records, a 1-layer model for 20 steps; then P(yes) on held-out
    tasks. Seconds of CPU; most of the wall time is importing the trainer."""
    from ftlm.config import load_config
    from ftlm.infer.load import load_run
    from ftlm.post import run
    data = write_records(separable_records(), tmp_path / "verifier.jsonl")
    config = load_config(REPO / "configs" / "tiny.toml", [
        f"run.dir={tmp_path / 'verifier'}", f"post.data={data}", f"data.dir={demo_data}",
        "model.vocab_size=1024",
        "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
        "model.ffn_dim=64", "model.max_seq_len=256", "data.seq_len=256", "data.eval_samples=0",
        "train.eval_every=0",
        "train.steps=20", "train.batch_size=4", "train.lr=1e-2", "train.warmup_steps=2",
        "observe.progress=false"])
    run.run("sft", config)
    loaded = load_run(tmp_path / "verifier", device="cpu")
    assert_ranks_right_above_wrong(Verifier(loaded.model, loaded.tokenizer))
