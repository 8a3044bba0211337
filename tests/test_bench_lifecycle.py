"""The pure parts of bench/lifecycle.py. The held-out draws: a fresh test draw (``test_seed``)
shares no problem with the draws fixed before it (seed 1234, then 20261201) nor with any
training stage's tasks, and the draws the earlier tables scored are unchanged. Merging a
labelled variant's rows beside the plain ones, and the settings check of ``--reuse``. No model
is trained or scored."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # bench/ is a top-level package beside src/, not installed
    sys.path.insert(0, str(REPO_ROOT))

import pytest

from bench.lifecycle import (FIRST_TEST, FULL, STAGE_SIZES, TEST_DRAWS, _config,
                             _post_sections, _saved_settings_differ, _unfinished, base_stage,
                             reusable, earlier_draws, evaluation_tasks, format_section, merge,
                             training_problems, verdict, CHAINS, RPO, chaos_lines,
                             interval_over_chains)
from ftlm.tasks import generate

FRESH_SEED = 20261201  # the fresh draw of the 2026-12-01 confirmation (chosen before scoring it)
PREREGISTERED_SEED = 20261202  # the draw of the run whose seeds vary the SFT run (the same)


def _keys(tasks) -> set[tuple[str, str]]:
    return {(t.family, t.key) for t in tasks}


def test_the_defaults_are_the_pre_registered_five_chain_settings_and_the_first_draw_is_unchanged() -> None:
    # `make lifecycle` reproduces the table: the settings fixed before that run was scored.
    registered = json.loads((REPO_ROOT / "bench/results/lifecycle/fresh20261204/settings.json").read_text())
    assert FULL == registered["plain"] and {**FULL, **RPO} == registered["rpo"]
    assert FULL["sft_seeds"] == CHAINS == 5
    assert FULL["test_seed"] == TEST_DRAWS[-1][0] == 20261204
    first = {**FULL, "test_seed": FIRST_TEST[0]}
    assert evaluation_tasks(first, "test", 3) == generate(FULL["families"], "test", 1600, 1234)


def test_the_new_draw_shares_no_problem_with_the_earlier_draws() -> None:
    new = _keys(evaluation_tasks(FULL, "test", CHAINS))
    assert len(new) == 1600
    for seed, size in TEST_DRAWS[:-1]:
        assert not new & _keys(evaluation_tasks({**FULL, "test_seed": seed}, "test", CHAINS))


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


def test_the_fresh_draw_is_the_one_the_0818_table_scored() -> None:
    # The draw as e0cb123 defined it (before the draws were a list): the first draw's problems
    # taken out of a longer draw of seed 20261201. Listing later draws must not change it.
    first = _keys(generate("add", "test", 1600, FIRST_TEST[0]))
    pool = generate("add", "test", 1600 + len(first), FRESH_SEED)
    as_scored = [t for t in pool if (t.family, t.key) not in first][:1600]
    assert evaluation_tasks({**FULL, "test_seed": FRESH_SEED}, "test", 3) == as_scored
    assert earlier_draws(FRESH_SEED) == (FIRST_TEST,)


def test_preregistered_draw_shares_no_problem_with_earlier_draws_nor_training() -> None:
    # The run of 2026-12-01 ~10:00 UTC: 3 seeds, each with its own SFT run (sft_seeds=3).
    sizes = {**FULL, "test_seed": PREREGISTERED_SEED, "sft_seeds": 3}
    draw = evaluation_tasks(sizes, "test", 3)
    assert len(draw) == len(_keys(draw)) == 1600
    assert all(t.split == "test" and t.family == "add" for t in draw)
    assert earlier_draws(PREREGISTERED_SEED) == ((1234, 1600), (FRESH_SEED, 1600))
    raw = _keys(generate(FULL["families"], "test", 1600, PREREGISTERED_SEED))
    for seed in (FIRST_TEST[0], FRESH_SEED):
        scored = _keys(evaluation_tasks({**FULL, "test_seed": seed}, "test", 3))
        assert len(scored) == 1600 and not _keys(draw) & scored
        assert raw & scored  # the same problem space: without the exclusion they would share
    trained = training_problems(sizes, 3)
    # Three SFT draws of 4,000 add,mod tasks (seeds 0, 1, 2), pairs and GRPO tasks of 3 seeds.
    assert len(trained) > 3 * 4000 and not _keys(draw) & trained
    assert not _keys(draw) & _keys(evaluation_tasks(sizes, "val", 3))


def test_a_seed_not_listed_leaves_out_every_listed_draw() -> None:
    assert earlier_draws(7) == TEST_DRAWS
    draw = _keys(evaluation_tasks({**FULL, "test_seed": 7, "heldout_tasks": 400}, "test", 1))
    assert len(draw) == 400
    for seed, size in TEST_DRAWS:
        assert not draw & _keys(evaluation_tasks({**FULL, "test_seed": seed}, "test", 1))


def test_a_fresh_draw_of_several_families_leaves_out_their_listed_draws() -> None:
    # (Not mod: its test split holds fewer problems than three draws of 1,600 tasks need.)
    sizes = {**FULL, "families": "add,sort", "test_seed": 7, "heldout_tasks": 200}
    fresh = _keys(evaluation_tasks(sizes, "test", 1))
    assert len(fresh) == 200 and {family for family, _ in fresh} == {"add", "sort"}
    assert not fresh & _keys(generate("add,sort", "test", FIRST_TEST[1], FIRST_TEST[0]))
    for seed, _ in TEST_DRAWS:
        assert not fresh & _keys(evaluation_tasks({**sizes, "test_seed": seed}, "test", 1))


def _run(stages: dict[str, dict[int, list[int]]], **sizes) -> dict:
    """A result as one bench.lifecycle run writes it: per stage and seed, the per-task
    correctness (no compute but what format_section reads)."""
    z = {**FULL, **sizes}
    entry = lambda correct: {"acc": sum(correct) / len(correct), "ci95": 0.1, "seconds": 1.0,
                             "tokens": 10, "correct": correct, "families": {"add": 0.5},
                             "pair_seconds": 1.0}
    return {"sizes": z, "split": "test", "command": "python -m bench.lifecycle",
            "stages": {stage: {str(seed): entry(c) for seed, c in by_seed.items()}
                       for stage, by_seed in stages.items()},
            "stage_sizes": {stage: {k: z[k] for k in STAGE_SIZES[base_stage(stage)]}
                            for stage in stages if base_stage(stage) in STAGE_SIZES}}


def test_merge_keeps_a_labelled_variant_beside_the_plain_row_with_its_own_settings() -> None:
    sft = [1, 0, 0, 1, 0, 0, 1, 0]
    plain = _run({"pretrained": {0: [0] * 8}, "SFT": {0: sft}, "DPO": {0: sft, 1: sft}})
    chosen = _run({"pretrained": {0: [0] * 8}, "SFT": {0: sft},
                   "DPO, chosen": {0: [1] * 8, 1: [1] * 8}}, dpo_lr=2e-4, dpo_beta=0.5)
    out = merge([plain, chosen])
    assert list(out["stages"]) == ["pretrained", "SFT", "DPO", "DPO, chosen"]
    assert out["sizes"]["dpo_lr"] == FULL["dpo_lr"]  # the plain row's are the table's settings
    assert out["stage_sizes"]["DPO, chosen"]["dpo_lr"] == 2e-4
    text = verdict(out)
    assert "DPO - SFT: paired per task +0.000" in text and "NOT met" in text
    assert "DPO, chosen - SFT: paired per task +0.625" in text
    section = format_section(out, ["--no-write"])
    assert "* DPO, chosen: the DPO settings above, but dpo_lr 0.0002, dpo_beta 0.5\n" in section


def test_chaos_rows_are_judged_against_the_recipe_over_chains_and_their_own_start() -> None:
    """A chaos run inside the plain stage's interval over chains reads "inside"; one far off,
    OUTSIDE; its GRPO is judged against its own chaos SFT (not the plain SFT) for the gain."""
    def frac(k, n=20):  # a per-task list with k of n right
        return [1] * k + [0] * (n - k)
    chains = {s: frac(4 + s) for s in range(3)}
    runs = {"pretrained": {0: frac(0)}, "SFT": chains,
            "GRPO": {s: frac(8 + 2 * s) for s in range(3)},
            "SFT, chaos": {0: frac(5)}, "GRPO, chaos": {0: frac(9)}}
    result = _run(runs)
    for stage in ("SFT, chaos", "GRPO, chaos"):
        result["stages"][stage]["0"].update(failures=2, replicas_identical=True, hashes=2,
                                             groups=2)
    text = chaos_lines(result)
    assert "SFT, chaos 0.250 against SFT over chains 0.250" in text and "OUTSIDE" not in text
    assert "its gain over SFT, chaos +0.200 against GRPO's gain over chains +0.250" in text
    assert "4 SIGKILLs survived" not in text and text.count("2 SIGKILLs survived") == 2
    assert "GRPO, chaos - SFT, chaos: paired per task +0.200" in verdict(result)
    far = _run({**runs, "SFT, chaos": {0: frac(19)}})
    assert "SFT, chaos 0.950 against SFT over chains 0.250" in chaos_lines(far)
    assert "OUTSIDE" in chaos_lines(far)


def test_merge_refuses_two_runs_of_one_row_with_different_settings() -> None:
    sft = [1, 0, 1, 0]
    a = _run({"pretrained": {0: [0] * 4}, "SFT": {0: sft}, "GRPO, long": {0: sft}}, grpo_steps=40)
    b = _run({"pretrained": {0: [0] * 4}, "SFT": {0: sft}, "GRPO, long": {1: sft}}, grpo_steps=20)
    with pytest.raises(SystemExit, match="differ in sizes"):
        merge([a, b])


def test_reuse_check_names_a_changed_setting_and_follows_linked_models(tmp_path: Path) -> None:
    models = tmp_path / "elsewhere"
    models.mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "sft0").symlink_to(models)
    saved = _config(tmp_path / "work" / "dpo0", 0, **_post_sections(
        FULL, 5e-5, 40, models / "model.safetensors", beta=0.1))
    saved.run.path.mkdir()
    (saved.run.path / "config.toml").write_text(saved.to_toml())
    linked = _post_sections(FULL, 5e-5, 40, tmp_path / "work" / "sft0" / "model.safetensors",
                            beta=0.1)
    assert _saved_settings_differ(saved.run.path, _config(saved.run.path, 0, **linked)) == []
    linked["post"]["beta"] = 0.5
    differ = _saved_settings_differ(saved.run.path, _config(saved.run.path, 0, **linked))
    assert differ == ["post.beta: 0.1 there, 0.5 now"]


def test_a_run_stopped_early_is_trained_again_not_taken_back(tmp_path: Path, capsys) -> None:
    """A SIGTERMed run writes its summary and weights at the step it reached: ``--reuse`` (and
    ``make tts``) must not score that partly trained model as the finished one."""
    from bench import tts_pipeline
    config = tts_pipeline.sft_config(tmp_path / "policy", FULL, None)
    assert not reusable(config.run.path, config)  # nothing there
    config.run.path.mkdir()
    (config.run.path / "config.toml").write_text(config.to_toml())
    (config.run.path / "model.safetensors").write_bytes(b"weights")
    summary = config.run.path / "summary.json"
    summary.write_text(json.dumps({"steps_committed": 321}))
    assert _unfinished(config.run.path, config) == "it stopped at step 321 of 800"
    assert not reusable(config.run.path, config)
    assert "training " + str(config.run.path) + " again: it stopped at step 321 of 800" in (
        capsys.readouterr().out)
    summary.write_text(json.dumps({"steps_committed": 800}))
    assert _unfinished(config.run.path, config) == ""
    assert reusable(config.run.path, config)
    other = tts_pipeline.sft_config(tmp_path / "policy", {**FULL, "sft_lr": 1e-3}, None)
    with pytest.raises(SystemExit, match="train.lr: 0.003 there, 0.001 now.*remove it"):
        reusable(config.run.path, other)


def test_a_stage_stopped_by_a_signal_ends_the_benchmark(tmp_path: Path, monkeypatch) -> None:
    """A trainer stops gracefully on SIGTERM and returns; the next stage must not start from its
    partly trained model."""
    from bench import lifecycle
    from ftlm.post import run as post_run
    config = _config(tmp_path / "sft0", 0, **_post_sections(FULL, 3e-3, 800, tmp_path / "m"))
    monkeypatch.setattr(post_run, "run", lambda kind, cfg: {
        "steps_committed": 321, "tokens_committed": 1, "final_loss": 1.0})
    with pytest.raises(SystemExit, match="stopped at step 321 of 800; a rerun with --reuse"):
        lifecycle._train("sft", config)


def test_independent_chains_are_judged_by_their_interval_over_chains() -> None:
    """Five chains, each DPO from its own SFT model: the statistic is the mean of the chains'
    differences with a Student-t interval over the chains, not an interval over tasks."""
    mean, half = interval_over_chains([0.1, 0.2, 0.3])
    assert mean == pytest.approx(0.2) and half == pytest.approx(4.303 * 0.1 / 3 ** 0.5)
    assert interval_over_chains([0.4]) is None
    sft = {s: [1] * s + [0] * (8 - s) for s in range(5)}
    up = {s: [1] * (s + 1) + [0] * (7 - s) for s in range(5)}  # +1/8 in every chain
    mixed = {s: [1] * (s + (1 if s % 2 else -1)) + [0] * (8 - s - (1 if s % 2 else -1))
             for s in range(1, 5)} | {0: [1] + [0] * 7}
    result = _run({"pretrained": {0: [0] * 8}, "SFT": sft, "DPO": up, "GRPO": mixed})
    text = verdict(result)
    assert "DPO - SFT: over 5 chains +0.125 ± 0.000: met" in text
    assert "GRPO - SFT: over 5 chains +0.025 ± " in text
    grpo = text.split("GRPO - SFT: ")[1]
    assert "NOT met" in grpo.split(";")[0], "chains that disagree: not above the interval"
    section = format_section(result, ["--no-write"])
    assert "mean over chains (± 95 % CI over chains)" in section
