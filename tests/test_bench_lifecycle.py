"""The held-out draws of bench/lifecycle.py: the fresh test draw (``test_seed``) shares no problem
with the first draw (seed 1234) nor with any training stage's tasks, and the first draw is the
one the earlier tables scored. No model is trained or scored."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # bench/ is a top-level package beside src/, not installed
    sys.path.insert(0, str(REPO_ROOT))

from bench.lifecycle import FIRST_TEST, FULL, evaluation_tasks, training_problems
from ftlm.tasks import generate

FRESH_SEED = 20261201  # the fresh draw of the 2026-12-01 confirmation (chosen before scoring it)


def _keys(tasks) -> set[tuple[str, str]]:
    return {(t.family, t.key) for t in tasks}


def test_the_default_test_draw_is_the_first_one() -> None:
    assert FULL["test_seed"] == FIRST_TEST[0]
    assert evaluation_tasks(FULL, "test", 3) == generate(FULL["families"], "test", 1600, 1234)


def test_fresh_draw_shares_no_problem_with_the_first_draw_nor_training() -> None:
    sizes = {**FULL, "test_seed": FRESH_SEED, "sft_seeds": 2}
    fresh = evaluation_tasks(sizes, "test", 3)
    assert len(fresh) == len(_keys(fresh)) == 1600
    assert all(t.split == "test" and t.family == "add" for t in fresh)
    first = _keys(generate(FULL["families"], "test", FIRST_TEST[1], FIRST_TEST[0]))
    assert not _keys(fresh) & first
    # Both draws come from the same 10 % of the problem space: without the exclusion they
    # would share some problems, so the check above is not vacuous.
    raw = _keys(generate(FULL["families"], "test", 1600, FRESH_SEED))
    assert raw & first
    # Every training stage of 3 seeds (SFT on add,mod with 2 SFT seeds, pairs, GRPO) and the
    # validation set: not one problem in common.
    trained = training_problems(sizes, 3)
    assert len(trained) > 4000 and not _keys(fresh) & trained
    assert not _keys(fresh) & _keys(evaluation_tasks(sizes, "val", 3))


def test_a_fresh_draw_of_several_families_leaves_out_their_first_draw() -> None:
    sizes = {**FULL, "families": "add,mod", "test_seed": 7, "heldout_tasks": 200}
    fresh = evaluation_tasks(sizes, "test", 1)
    assert len(fresh) == 200 and {t.family for t in fresh} == {"add", "mod"}
    assert not _keys(fresh) & _keys(generate("add,mod", "test", FIRST_TEST[1], FIRST_TEST[0]))
