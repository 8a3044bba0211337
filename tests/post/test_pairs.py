"""Preference pairs from the task suite: sampled, checked, deterministic, in DPO's file format."""

from __future__ import annotations

from ftlm.post.data import pair_rows, read_records
from ftlm.post.pairs import make_pairs, write_pairs
from ftlm.tasks import check, generate


def test_pairs_are_checked_deterministic_and_readable_by_dpo(model, tokenizer, tmp_path) -> None:
    tasks = generate("mod,count", "train", 3, 0)
    kwargs = {"samples": 2, "max_new_tokens": 6, "temperature": 1.0, "top_k": 0, "seed": 0}
    records, counts = make_pairs(model, tokenizer, tasks, **kwargs)
    assert (records, counts) == make_pairs(model, tokenizer, tasks, **kwargs)
    # An untrained model answers nothing right: every pair falls back to the reference solution.
    assert counts["correct_samples"] == 0 and counts["solution"] == len(records) == 3
    for task, r in zip(tasks, records):
        assert check(task, r["chosen"]) and not check(task, r["rejected"])
    assert make_pairs(model, tokenizer, tasks, solution_fallback=False, **kwargs)[0] == []
    # The verifier decides what a correct sample is: one that accepts everything leaves no
    # incorrect sample, so every task is skipped.
    none, skipped = make_pairs(model, tokenizer, tasks, verify=lambda t, c: True, **kwargs)
    assert none == [] and skipped["all_correct"] == 3
    path = write_pairs(records, tmp_path / "pairs.jsonl")
    rows = pair_rows(read_records(path, "preference"), tokenizer, 96, str(path))
    assert rows.shape == (3, 4, 97)
