"""The test-time-scaling study's arithmetic: intervals over tasks, FLOPs with attention, the
verifiers' training amortised, the rows the section shows, and its one-command pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import test_time_scaling as tts
from bench import tts_pipeline, tts_report
from bench.tts_report import (
    LARGE_GREEDY,
    LARGE_SAMPLE,
    amortised,
    bootstrap_interval,
    labelling,
    matched,
    merge,
    point,
    section,
    summarise,
    training_flops,
    training_runs,
)
from ftlm.infer.strategies import Candidate
from ftlm.model import ModelConfig, flops_per_token, forward_flops, param_count
from ftlm.tasks import generate

CFG = ModelConfig(size="tiny", vocab_size=100, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                  ffn_dim=32, max_seq_len=64)


def outcomes(rate: float, n: int) -> list[float]:
    """``n`` task outcomes, ``int(n * rate)`` of them right, spread evenly."""
    return [float(int((i + 1) * rate) > int(i * rate)) for i in range(n)]


def test_the_bootstrap_over_tasks_is_seeded_covers_the_mean_and_shrinks_with_more_tasks():
    few, many = outcomes(0.3, 40), outcomes(0.3, 400)
    assert bootstrap_interval(few) == bootstrap_interval(few)  # the same draws every call
    assert bootstrap_interval(few, seed=1) != bootstrap_interval(few)
    for values in (few, many):
        low, high = bootstrap_interval(values)
        assert low < sum(values) / len(values) < high
    width = lambda values: bootstrap_interval(values)[1] - bootstrap_interval(values)[0]
    # The half-width goes as 1/sqrt(tasks): ten times the tasks, about a third of the width.
    assert width(many) < 0.45 * width(few)
    assert bootstrap_interval([1.0] * 10) == (1.0, 1.0)
    with pytest.raises(ValueError, match="no values"):
        bootstrap_interval([])


def test_a_point_averages_each_task_over_seeds_before_resampling_the_tasks():
    cells = [{"acc": 0.5, "flops": 10.0, "correct": "1100"},
             {"acc": 0.25, "flops": 20.0, "correct": "1000"}]
    p = point(cells)
    assert p.acc == pytest.approx(0.375) and p.flops == 15.0
    assert list(p.per_task) == [1.0, 0.5, 0.0, 0.0]
    assert p.seeds is not None and p.tasks == bootstrap_interval([1.0, 0.5, 0.0, 0.0])
    greedy = point([{"acc": 0.5, "flops": 10.0, "correct": "1100"}])
    assert greedy.seeds is None  # one run: no interval over seeds
    assert tts_report.fmt(greedy) == f"0.500 [{greedy.tasks[0]:.3f}, {greedy.tasks[1]:.3f}]"
    saved_before = point([{"acc": 0.5, "flops": 1.0}, {"acc": 0.3, "flops": 1.0}])
    assert saved_before.tasks is None and "[" not in tts_report.fmt(saved_before)


def cand(text: str, answer: str, passes: list[tuple[int, int]]) -> Candidate:
    made = sum(m for _, m in passes)
    return Candidate(text, [1] * made, [0.0] * made, "stop", answer, passes=passes)


def test_sampling_strategies_count_each_sample_with_its_attention():
    task = generate("add", "test", 1, 0)[0]
    right = f"<think>\n</think>\nAnswer: {task.answer}"
    pool = [cand("no idea", "x", [(10, 5)]), cand(right, task.answer, [(10, 7)])]
    result = tts.evaluate([task], [pool], [1, 2], CFG)
    one, two = forward_flops(CFG, 10, 5), forward_flops(CFG, 10, 7)
    # By hand: 15 positions, 2 x matmul weights each, and 1 + 2 + ... + 15 attended pairs.
    matmul = 2 * (16 * 16 + 2 * 16 * 8 + 16 * 16 + 3 * 16 * 32) + 100 * 16
    assert one == 2 * matmul * 15 + 4 * 2 * 2 * 8 * (15 * 16 // 2)
    assert result["first sample"] == {1: {"acc": 0.0, "flops": one, "correct": "0"}}
    assert result["oracle (pass@N)"][2] == {"acc": 1.0, "flops": one + two, "correct": "1"}
    assert result["self-consistency"][1]["flops"] == one
    thinking = cand(right, task.answer, [(10, 4), (16, 3)])  # reasoning pass, answer pass
    assert tts.policy_flops(CFG, thinking) == forward_flops(CFG, 10, 4) + forward_flops(CFG, 16, 3)


def write_run(run_dir: Path, tokens: int, seq_len: int, init_from: str = "") -> None:
    run_dir.mkdir(parents=True)
    model = {k: getattr(CFG, k) for k in ("size", "vocab_size", "dim", "n_layers", "n_heads",
                                          "n_kv_heads", "ffn_dim", "max_seq_len")}
    (run_dir / "summary.json").write_text(json.dumps({
        "tokens_committed": tokens,
        "config": {"model": model, "data": {"seq_len": seq_len},
                   "train": {"init_from": init_from}}}))


def test_verifier_training_follows_the_init_from_chain_and_is_amortised_per_query(tmp_path):
    write_run(tmp_path / "base", 1000, 32)
    write_run(tmp_path / "verifier", 500, 64, str(tmp_path / "base" / "model.safetensors"))
    runs = training_runs(tmp_path / "verifier")
    assert runs == {str(tmp_path / "verifier"): 500 * flops_per_token(CFG, 64),
                    str(tmp_path / "base"): 1000 * flops_per_token(CFG, 32)}
    assert training_runs(tmp_path / "missing") == {}
    head = tmp_path / "head.json"
    head.write_text(json.dumps({"info": {"samples": 1600, "distinct": 1200}}))
    assert labelling(tmp_path / "verifier", str(head)) == {"samples": 1600, "reads": 1200}
    assert labelling(tmp_path / "verifier") == {"samples": 0, "reads": 0}
    (tmp_path / "verifier" / "verifier_data.counts.json").write_text(json.dumps({"samples": 40}))
    assert labelling(tmp_path / "verifier") == {"samples": 40, "reads": 0}
    record = {"runs": runs, "samples": 1600, "reads": 1200}
    total = training_flops(record, sample_flops=2e8, read_flops=1e8)
    assert total == sum(runs.values()) + 1600 * 2e8 + 1200 * 1e8
    assert training_flops({"flops": 5e12, "runs": runs}, 2e8, 1e8) == 5e12  # given by hand
    assert amortised(1e12, 10_000) == 1e8
    with pytest.raises(ValueError, match="queries=0"):
        amortised(1e12, 0)


def synthetic(tasks: int = 40) -> dict:
    """Raw results as ``measure`` saves them: two seeds, a verifier, a larger policy."""
    def c(rate: float, flops: float) -> dict:
        bits = "".join("1" if x else "0" for x in outcomes(rate, tasks))
        return {"acc": bits.count("1") / tasks, "flops": flops, "correct": bits}
    seed = {"first sample": {"1": c(0.2, 1e8)},
            "self-consistency": {"1": c(0.2, 1e8), "4": c(0.3, 4e8)},
            "best-of-N (verifier)": {"1": c(0.2, 1.5e8), "4": c(0.35, 6e8)},
            "beam search (process verifier, width 4)": {"4": c(0.3, 2e9)},
            tts_report.THINKING: {"16": c(0.1, 5e7), "64": c(0.2, 1.2e8)}}
    meta = {"policy": "runs/tts/policy", "policy_params": 1_311_872,
            "policy_training": {"runs/tts/policy": 1e13}, "verifier": "runs/tts/verifier",
            "verifier_head": "runs/tts/head.json", "verifier_params": 698_016,
            "process_verifier": "runs/tts/line-verifier", "process_verifier_params": 698_016,
            "verifier_training": {
                "verifier": {"path": "runs/tts/verifier", "flops": None,
                             "runs": {"runs/tts/verifier": 4e12}, "samples": 1600, "reads": 0},
                "process verifier": {"path": "runs/tts/line-verifier", "flops": 6e12}},
            "amortise_queries": 10_000, "verifier_auc": [], "tasks": tasks, "families": "add",
            "seeds": 2, "temperature": 0.8, "max_new_tokens": 96, "n_max": 4, "beam_ns": [4],
            "beam_width": 4, "thinking_budgets": [16, 64], "flops": "forward_flops",
            "seconds": 10.0}
    large = {"path": "runs/tts/policy-large", "params": 5_180_672, "seconds": 5.0,
             "greedy": c(0.3, 4.1e8), "per_seed": [c(0.25, 4e8), c(0.25, 4e8)],
             "training": {"runs/tts/policy-large": 4e13}}
    return {"per_seed": [seed, seed], "greedy": c(0.25, 1.02e8), "meta": meta, "large": large}


def test_the_section_shows_greedy_both_intervals_thinking_and_amortised_matched_tables(tmp_path):
    body = section(synthetic(), "", tmp_path / "plot.png")
    assert (tmp_path / "plot.png").is_file()
    accuracy = body.split("Inference FLOPs per task:\n")[0]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in accuracy.splitlines()
            if line.startswith("| ")}
    assert rows["greedy"].count(" [") == 1 and " ± " not in rows["greedy"]  # one run
    assert " ± " in rows["self-consistency"] and " [" in rows["self-consistency"]
    assert "| 64 | " in body  # the thinking budget's table, by budget
    # Verifier training: 4e12 runs + 1,600 samples at the first sample's 1e8 FLOPs = 4.16e12.
    assert ("Verifier training (`runs/tts/verifier`): 4.16e+12 FLOPs" in body
            and "= 4.16e+08 per query over 10,000 queries" in body)
    assert "Process verifier training (`runs/tts/line-verifier`): 6e+12 FLOPs (given by hand)" \
        in body
    matched_part, amortised_part = body.split("Matched inference FLOPs")[1].split("The same with")
    for part in (matched_part, amortised_part):
        assert "| larger policy, greedy | 1 |" in part and "| larger policy, 1 sample | 1 |" in part
    assert "| self-consistency | 4 |" in matched_part
    assert "self-consistency" not in amortised_part  # no verifier: the first table has it
    # Amortised, best-of-N (verifier) at N = 1 costs 1.5e8 + 4.16e8 per query: nearest 4e8.
    assert "| best-of-N (verifier) | 1 | 5.66e+08 |" in amortised_part


def test_matched_rows_differ_from_the_larger_policy_with_a_paired_interval_over_tasks():
    data = synthetic()
    results = summarise(data["per_seed"])
    large = tts_report.large_points(data["large"])
    rows = {r[0]: r for r in matched(results, large)}
    assert set(rows) >= {"self-consistency", LARGE_GREEDY, LARGE_SAMPLE}
    assert "first sample" not in rows
    sc = rows["self-consistency"]
    assert sc[1] == 4 and sc[3] == "1.00"
    low, high = bootstrap_interval(results["self-consistency"][4].per_task
                                   - large[LARGE_GREEDY].per_task)
    assert sc[5] == f"+0.000 [{low:+.3f}, {high:+.3f}]"


def test_seeds_measured_apart_merge_and_old_results_still_format(tmp_path):
    data = synthetic()
    first = {**data, "per_seed": data["per_seed"][:1], "meta": {**data["meta"], "seeds": 1}}
    second = {**first, "greedy": {"acc": 9.0, "flops": 0.0, "correct": ""}}
    merged = merge([first, second])
    assert merged["meta"]["seeds"] == 2 and len(merged["per_seed"]) == 2
    assert merged["greedy"] == data["greedy"]  # seed-independent: the first file's
    assert len(merged["large"]["per_seed"]) == 4
    old = {"per_seed": [{"first sample": {"1": [0.1, 2e8]}, "self-consistency": {"2": [0.2, 4e8]}}],
           "meta": {**{k: v for k, v in data["meta"].items()
                       if k not in ("flops", "verifier_training")}, "seeds": 1},
           "large": {"path": "big", "params": 10, "accs": [0.3], "flops": [3e8], "seconds": 1.0}}
    body = section(merge([old]), "", tmp_path / "old.png")
    assert "attention left out" in body and "no interval over tasks" in body
    assert "| self-consistency | 2 | 4e+08 |" in body


def test_quick_runs_every_strategy_on_random_models(capsys):
    import torch
    threads = torch.get_num_threads()
    try:
        assert tts.main(["--quick"]) == 0  # one torch thread (--threads 1): seconds
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for row in ("| greedy |", "| first sample |", "| beam search (process verifier, width 2) |",
                "| thinking budget | ", "| larger policy, greedy |", "The same with"):
        assert row in out, row


def test_the_pipeline_trains_the_lifecycle_sft_recipe_and_a_four_times_larger_policy():
    from bench.lifecycle import FULL
    sizes = tts_pipeline.SIZES
    assert sizes == {**FULL, "sft_steps": tts_pipeline.SFT_STEPS}  # only the steps differ
    policy = tts_pipeline.sft_config(Path("runs/x/policy"), sizes, None)
    assert (policy.train.steps, policy.train.lr, policy.train.batch_size) == (
        tts_pipeline.SFT_STEPS, FULL["sft_lr"], FULL["sft_batch"])
    assert policy.data.seq_len == FULL["sft_seq_len"]
    assert policy.post.families == FULL["sft_families"] and policy.post.task_seed == 0
    assert policy.train.init_from == ""  # from scratch, as the larger policy and the verifier
    started = tts_pipeline.sft_config(Path("runs/x/p"), sizes, Path("runs/x/pre/m.st"))
    assert started.train.init_from == "runs/x/pre/m.st"
    scratch = tts_pipeline.sft_config(Path("runs/x/v"), sizes, None, tts_pipeline.VERIFIER_SHAPE)
    small = param_count(policy.model)
    large_sizes = tts_pipeline.LARGE_SIZES
    assert {k for k in sizes if sizes[k] != large_sizes[k]} == {"sft_steps", "sft_lr"}
    large = tts_pipeline.sft_config(Path("runs/x/l"), large_sizes, None, tts_pipeline.LARGE_SHAPE)
    assert 3.5 < param_count(large.model) / small < 4.5
    assert large.post == policy.post and large.train.init_from == ""
    assert (large.train.steps, large.train.lr) == (tts_pipeline.LARGE_SFT_STEPS,
                                                   tts_pipeline.LARGE_SFT_LR)
    assert param_count(scratch.model) < small  # the verifier commands refuse a larger one
    # the policy's families hold the studied one: it is trained on it
    assert tts_pipeline.STUDY["families"] in FULL["sft_families"].split(",")
    assert tts_pipeline.STUDY["tasks"] >= 400


@pytest.mark.slow
def test_the_pipeline_quick_builds_every_model_and_rebuilds_none_on_a_rerun(tmp_path, capsys):
    """About 80 s on 2 cores. The default tier covers its parts: the configs above, the study on
    random models (``--quick``), the section from saved results."""
    assert tts_pipeline.main(["--quick", "--workdir", str(tmp_path)]) == 0
    starts = lambda out, word: sum(line.startswith(word) for line in out.splitlines())
    first = capsys.readouterr().out
    assert starts(first, "training ") == 3 and starts(first, "$ ftlm verifier train") == 1
    assert (tmp_path / "study.json").is_file() and (tmp_path / "models.md").is_file()
    assert tts_pipeline.main(["--quick", "--workdir", str(tmp_path)]) == 0
    again = capsys.readouterr().out
    assert starts(again, "reusing ") == 4 and starts(again, "training ") == 0
    assert starts(again, "$ ftlm") == 0
