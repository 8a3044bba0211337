"""The task suite: disjoint splits, determinism, exact checking, worked solutions, files, CLI."""

from __future__ import annotations

import json
import re

import pytest

from ftlm.cli import main
from ftlm.errors import ConfigError, DataError
from ftlm.tasks import (FAMILIES, VERIFIERS, Task, accuracy, check, check_trace, extract_answer,
                        format_completion, generate, read_tasks, split_of, write_tasks)


def _independent_answer(task: Task) -> str:
    """The answer computed from the prompt alone, not by the family's own solver."""
    numbers = [int(x) for x in re.findall(r"\d+", task.prompt)]
    if task.family == "add":
        return str(numbers[0] + numbers[1])
    if task.family == "mod":
        return str(numbers[0] % numbers[1])
    if task.family == "sort":
        return ", ".join(map(str, sorted(numbers)))
    letter, word = re.fullmatch(r"How many (\w) in ((?:\w )*\w)\?", task.prompt).groups()
    return str(word.split().count(letter))


def test_train_and_test_splits_never_share_a_problem():
    train = generate(FAMILIES, "train", 4000, seed=1)
    test = generate(FAMILIES, "test", 1000, seed=1)
    assert {t.split for t in train} == {"train"} and {t.split for t in test} == {"test"}
    assert not {(t.family, t.key) for t in train} & {(t.family, t.key) for t in test}
    assert not {t.prompt for t in train} & {t.prompt for t in test}
    # Other seeds draw other problems but never cross the line either.
    other = generate(FAMILIES, "train", 1000, seed=2)
    assert not {(t.family, t.key) for t in other} & {(t.family, t.key) for t in test}


def test_answer_preserving_forms_of_a_problem_share_a_key():
    # 47 + 85 and 85 + 47 (and every order of one list to sort) must land in the same split.
    tasks = generate(["add", "sort"], "train", 400, seed=3)
    for task in tasks:
        numbers = re.findall(r"\d+", task.prompt)
        if task.family == "add":
            assert task.key == "+".join(map(str, sorted(map(int, numbers))))
        else:
            assert task.key == task.answer
    # The held-out share is the designed 10 % (by hash), within sampling noise.
    keys = [f"{a}+{b}" for a in range(10, 110) for b in range(a, 110)]
    share = sum(split_of("add", k) == "test" for k in keys) / len(keys)
    assert 0.08 < share < 0.12


def test_generate_is_deterministic_extends_and_alternates_families():
    a = generate(["add", "count"], "train", 10, seed=5)
    assert a == generate("add,count", "train", 10, seed=5)
    assert a[:6] == generate(["add", "count"], "train", 6, seed=5)
    assert [t.family for t in a] == ["add", "count"] * 5
    assert a != generate(["add", "count"], "train", 10, seed=6)
    assert len({t.key for t in generate(["mod"], "test", 300, seed=0)}) == 300


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_solutions_are_correct_and_pass_the_checker(family):
    for task in generate([family], "train", 200, seed=0):
        assert task.answer == _independent_answer(task)
        assert task.solution.startswith("<think>\n") and "\n</think>\nAnswer: " in task.solution
        assert extract_answer(task.solution) == task.answer
        assert check(task, task.solution)


def test_check_is_exact_on_the_canonical_answer():
    add = Task("add", "What is 47 + 85?", "132", format_completion("...", "132"), "47+85")
    assert check(add, "<think>x</think>\nAnswer: 132")
    assert check(add, "<think>x</think> Answer:  0132.")
    assert not check(add, "<think>x</think>\nAnswer: 131")
    assert not check(add, "<think>x</think>\nAnswer: 132 or 133")
    assert not check(add, "<think>Answer: 132</think>\nAnswer: 7")   # inside think is not final
    assert not check(add, "<think>Answer: 132</think>")                # no final answer at all
    assert not check(add, "the answer is 132")
    assert check(add, "Answer: 12\nAnswer: 132")                        # the last one counts
    sort = Task("sort", "Sort ascending: 3, 1, 2", "1, 2, 3", "", "1, 2, 3")
    assert check(sort, "Answer: 1,2,3") and check(sort, "Answer: [1, 2, 3]")
    assert not check(sort, "Answer: 3, 2, 1") and not check(sort, "Answer: 1, 2")
    assert extract_answer("no answer") is None and extract_answer("Answer:   \n") is None
    assert accuracy([add, add], ["Answer: 132", "Answer: 1"]) == 0.5


def test_check_trace_also_needs_the_reference_reasoning():
    task = generate(["mod"], "train", 1, seed=0)[0]
    assert check_trace(task, task.solution)
    assert check_trace(task, task.solution.replace("\n", "\n  \n", 1))  # blank lines, spaces
    # A right remainder after a wrong division (a guess) passes check, not check_trace.
    guess = task.solution.replace("<think>\n", "<think>\n999 // 2 = 1\n", 1)
    assert check(task, guess) and not check_trace(task, guess)
    wrong = task.solution.rsplit("Answer:", 1)[0] + f"Answer: {int(task.answer) + 1}"
    assert not check_trace(task, wrong)
    assert not check_trace(task, f"Answer: {task.answer}")              # no reasoning at all
    assert VERIFIERS == {"answer": check, "trace": check_trace}


@pytest.mark.parametrize("style", ["messages", "prompt_completion"])
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_task_files_round_trip(tmp_path, style, suffix):
    tasks = generate(FAMILIES, "test", 12, seed=0)
    path = write_tasks(tasks, tmp_path / f"tasks{suffix}", style=style)
    assert read_tasks(path) == tasks
    if suffix == ".jsonl":
        row = json.loads(path.read_text().splitlines()[0])
        if style == "messages":
            assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        else:
            assert row["prompt"] == tasks[0].prompt and row["completion"] == tasks[0].solution


def test_bad_input_is_a_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown task family 'nope'"):
        generate(["nope"], "train", 1, 0)
    with pytest.raises(ConfigError, match="split='dev'"):
        generate(FAMILIES, "dev", 1, 0)
    with pytest.raises(ConfigError, match="n=-1"):
        generate(FAMILIES, "train", -1, 0)
    with pytest.raises(ConfigError, match="style='chat'"):
        write_tasks([], tmp_path / "a.jsonl", style="chat")
    with pytest.raises(ConfigError, match="end in .jsonl or .parquet"):
        write_tasks([], tmp_path / "a.csv")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "completion": "c", "family": "add", "answer": "1"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: .*lacks field\(s\) key"):
        read_tasks(bad)
    bad.write_text('{"messages": "hi", "family": "add", "answer": "1", "key": "k"}\n')
    with pytest.raises(DataError, match="messages must be a list"):
        read_tasks(bad)
    bad.write_text("not json\n")
    with pytest.raises(DataError, match="not JSON"):
        read_tasks(bad)
    with pytest.raises(DataError, match="not found"):
        read_tasks(tmp_path / "missing.jsonl")


def test_cli_tasks_write_and_list(tmp_path, capsys):
    out = tmp_path / "train.jsonl"
    assert main(["tasks", "write", "--out", str(out), "--n", "8", "--families", "add,sort",
                 "--seed", "4", "--style", "prompt_completion"]) == 0
    assert read_tasks(out) == generate(["add", "sort"], "train", 8, seed=4)
    assert main(["tasks", "list"]) == 0
    listing = capsys.readouterr().out
    assert all(f in listing for f in FAMILIES)
    assert main(["tasks", "write", "--out", str(out), "--families", "nope"]) == 2
    assert "unknown task family" in capsys.readouterr().err
