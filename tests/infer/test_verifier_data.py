"""Verifier training data from policy samples: checker labels, train split only; and a tiny
trained verifier that ranks a correct solution above a wrong one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from infer_helpers import tiny_model

from ftlm.errors import ConfigError
from ftlm.infer import Engine, SamplingParams
from ftlm.infer.verifier import INTRO, Verifier, solution_lines
from ftlm.infer.verifier_data import (
    label_samples,
    line_labels,
    sampled_records,
    write_records,
)
from ftlm.tasks import check
from ftlm.tasks import generate as generate_tasks

REPO = Path(__file__).parents[2]


def _judged(record: dict) -> tuple[str, str, list[str]]:
    """The prompt, the completion (its judged lines) and the verdicts of a record."""
    messages = record["messages"]
    prompt, first = messages[0]["content"].split(f"\n\n{INTRO}\n")
    lines = [first] + [m["content"] for m in messages[2::2]]
    return prompt, "\n".join(lines), [m["content"] for m in messages[1::2]]


def test_each_line_is_labelled_by_its_own_check_and_the_answer_line_by_the_outcome():
    task = generate_tasks(["add"], "train", 1, 0)[0]
    ref = solution_lines(task.solution)  # <think>, a line per column, </think>, Answer: ...
    assert line_labels(task, task.solution) == [True] * len(ref)
    miscopied = list(ref)
    miscopied[1] = "9" + ref[1][1:] if ref[1][0] != "9" else "8" + ref[1][1:]
    # a wrong step, yet the answer is right: only that line is wrong
    assert line_labels(task, "\n".join(miscopied)) == [i != 1 for i in range(len(ref))]
    wrong_answer = ref[:-1] + ["Answer: 100000"]
    assert line_labels(task, "\n".join(wrong_answer)) == [True] * (len(ref) - 1) + [False]
    skipped = [ref[0], ref[2], ref[-1]]  # a skipped step shifts the rest off the reference
    assert line_labels(task, "\n".join(skipped)) == [True, False, True]
    assert line_labels(task, "\n".join(ref[:3]) + "\n") == [True] * 3  # a partial solution


def test_labels_are_the_line_checks_and_the_outcome_once_per_distinct_sample():
    tasks = generate_tasks(["add", "mod", "sort", "count"], "train", 8, 0)
    wrong = [t.solution.rsplit("Answer:", 1)[0] + "Answer: 999999" for t in tasks]
    samples = [[t.solution, w, t.solution, "<think>\nno idea"] for t, w in zip(tasks, wrong)]
    records = label_samples(tasks, samples, seed=3)
    by_prompt = {t.prompt: t for t in tasks}
    assert len(records) == 3 * len(tasks)  # the duplicate solution counts once
    for r in records:
        prompt, completion, verdicts = _judged(r)
        task = by_prompt[prompt]
        assert r["label"] == ("yes" if check(task, completion) else "no")
        assert verdicts == ["yes" if ok else "no" for ok in line_labels(task, completion)]
    assert label_samples(tasks, samples, seed=3) == records  # seeded shuffle
    for r in label_samples(tasks, samples, process=False):  # the ablation: the outcome everywhere
        assert set(_judged(r)[2]) == {r["label"]}


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
    assert 1 <= counts["completions"] == len(records) <= 12 and counts["correct_samples"] == 0
    assert all(r["label"] == "no" for r in records)  # a random model answers nothing right
    assert counts["lines"] >= len(records) and counts["yes_lines"] <= counts["lines"]
    path = write_records(records, tmp_path / "v.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == records
    with pytest.raises(ConfigError, match=".jsonl"):
        write_records(records, tmp_path / "v.json")


def separable_records() -> list[dict]:
    """Checker-labelled samples of a trivially separable kind: a worked solution (correct)
    against a bare guess with no reasoning (wrong)."""
    tasks = generate_tasks(["add", "count"], "train", 30, 0)
    samples = [[t.solution, "Answer: 0" if t.answer != "0" else "Answer: 1"] for t in tasks]
    records = label_samples(tasks, samples)
    assert sum(r["label"] == "yes" for r in records) == 30
    return records


def assert_ranks_right_above_wrong(verifier: Verifier) -> None:
    for t in generate_tasks(["add", "count"], "test", 4, 0):
        right, wrong = verifier.probabilities([(t.prompt, t.solution), (t.prompt, "Answer: 0")])
        assert right > wrong, (t.prompt, right, wrong)


def test_ftlm_sft_on_checker_labels_trains_a_verifier_that_ranks_right_above_wrong(tmp_path, demo_data):
    """The route of `ftlm verifier train` after sampling: `ftlm sft` (one group, the real
    trainer) on checker-labelled records, a 1-layer model for 60 steps (at 20 it still
    answers the base rate of yes lines everywhere); then P(yes) on held-out
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
        "train.steps=60", "train.batch_size=4", "train.lr=1e-2", "train.warmup_steps=2",
        "observe.progress=false"])
    run.run("sft", config)
    loaded = load_run(tmp_path / "verifier", device="cpu", read_config=load_config)
    assert_ranks_right_above_wrong(Verifier(loaded.model, loaded.tokenizer))
