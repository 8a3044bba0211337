"""Post-training runs end to end: one group in-process (fast), and local jobs under chaos (slow).

The chaos runs check the invariants of pretraining (docs/design.md, 'Testing'): identical replicas
at the end, every row trained exactly once, no committed step lost, monotonic quorum ids.
"""

from __future__ import annotations

import json

import pytest

from ftlm.config import build_config
from ftlm.errors import ConfigError
from ftlm.observe.events import read_events
from ftlm.post import run
from ftlm.post.pairs import write_pairs
from ftlm.post_cli import launch


def _one_group(kind: str, config) -> dict:
    summary = run.run(kind, config)
    assert summary["steps_committed"] == config.train.steps
    assert summary["data"]["duplicates"] == 0 and summary["data"]["gaps"] == 0
    assert (config.run.path / "model.safetensors").is_file()
    return summary


def test_sft_then_dpo_and_grpo_from_it(post_config, tmp_path, demo_data) -> None:
    tok = {"tokenizer": str(demo_data / "tokenizer.json"), "dir": str(demo_data)}
    sft = post_config(tmp_path / "sft", data=tok, train={"eval_every": 2, "eval_batches": 1})
    summary = _one_group("sft", sft)
    evals = [e for e in read_events(sft.run.path / "events.jsonl") if e["kind"] == "eval"]
    assert evals and all(e["loss"] > 0 for e in evals)
    weights = str(sft.run.path / "model.safetensors")
    pairs = write_pairs([{"prompt": "What is 7 mod 3?", "chosen": "Answer: 1", "rejected": "Answer: 2"},
                         {"prompt": "How many a in aba?", "chosen": "Answer: 2", "rejected": "Answer: 1"},
                         {"prompt": "What is 9 mod 4?", "chosen": "Answer: 1", "rejected": "Answer: 3"}],
                        tmp_path / "pairs.jsonl")
    dpo = post_config(tmp_path / "dpo", data={**tok, "eval_samples": 1},
                      train={"init_from": weights, "steps": 1},
                      post={"data": str(pairs)})
    _one_group("dpo", dpo)
    grpo = post_config(tmp_path / "grpo", data=tok, train={"init_from": weights, "steps": 1})
    _one_group("grpo", grpo)
    assert summary["tokens_committed"] == 2 * 2 * 96


def test_dpo_without_pairs_or_reference_says_what_to_do(post_config, demo_data, tmp_path) -> None:
    tok = {"tokenizer": str(demo_data / "tokenizer.json")}
    with pytest.raises(ConfigError, match="ftlm pairs CONFIG"):
        run.build("dpo", post_config(data=tok))
    with pytest.raises(ConfigError, match="need a reference model"):
        run.build("grpo", post_config(data=tok))
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        run.build("sft", post_config(data=tok, train={"activation_checkpointing": True}))


def _chaos_config(tmp_path, demo_data, kind: str, steps: int, heartbeat_timeout: float = 1.0,
                  **post):
    return build_config({
        "run": {"name": kind, "dir": str(tmp_path / kind), "seed": 3},
        "model": {"size": "tiny", "vocab_size": 1024, "dim": 32, "n_layers": 2, "n_heads": 4,
                  "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 128},
        "data": {"dir": str(demo_data), "seq_len": 96, "prefetch": 2, "eval_samples": 0},
        "train": {"steps": steps, "batch_size": 2, "lr": 1e-3, "warmup_steps": 2, "threads": 1,
                  "eval_every": 0, **post.pop("train", {})},
        "ft": {"heartbeat_interval": 0.1, "heartbeat_timeout": heartbeat_timeout, "join_timeout": 2.0,
               "allreduce_timeout": 5.0, "quorum_timeout": 30.0, "give_up_seconds": 120.0,
               "restart_delay": 0.2, "bucket_bytes": 65536, "lr_policy": "sqrt"},
        "observe": {"progress": False},
        "post": {"families": "mod,count", "train_tasks": 400, "heldout_tasks": 0, **post},
    })


def _check_invariants(summary: dict, config, groups: int) -> None:
    events = read_events(config.run.path / "events.jsonl")
    assert summary["problems"] == [], summary["problems"]
    assert summary["replicas_identical"], summary["state_hashes"]
    assert len(summary["state_hashes"]) == groups
    assert summary["data"]["duplicates"] == 0 and summary["data"]["gaps"] == 0, summary["data"]
    committed = {e["step"] for e in events if e["kind"] == "commit"}
    assert committed == set(range(config.train.steps)), "a committed step was lost"
    ids = [e["quorum_id"] for e in sorted(events, key=lambda e: e["ts"]) if e["kind"] == "quorum"]
    assert ids == sorted(ids), "quorum ids went backwards"
    assert summary["failures_injected"] >= 1, "chaos injected nothing: the test proved nothing"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sft_under_chaos_ends_with_identical_replicas_and_exactly_once(tmp_path, demo_data) -> None:
    config = _chaos_config(tmp_path, demo_data, "sft", steps=400)
    summary = launch("sft", config, groups=3, chaos_mtbf=8.0, chaos_seed=1)
    _check_invariants(summary, config, 3)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_under_chaos_ends_with_identical_replicas_and_exactly_once(tmp_path, demo_data) -> None:
    sft = _chaos_config(tmp_path, demo_data, "base", steps=2)
    run.run("sft", sft)  # a starting model (and the reference) for GRPO
    # A GRPO group takes longer to start (tasks, reference model) and its steps are
    # Python-heavy (sampling): a heartbeat timeout that a loaded 2-core machine does not trip on
    # its own. Sampling on the KV-cache engine made the steps short (150 steps in under a
    # minute), so the job is long enough for chaos to strike at its rate. Chaos seed 12 draws
    # its first failure 6.4 s after the launch (seed 2 drew 31 s: on a quiet machine the 300
    # steps ended in 25 s, before it, and the test proved nothing).
    config = _chaos_config(tmp_path, demo_data, "grpo", steps=300, heartbeat_timeout=2.0,
                           group_size=2, max_new_tokens=8,
                           train={"init_from": str(sft.run.path / "model.safetensors")})
    summary = launch("grpo", config, groups=3, chaos_mtbf=10.0, chaos_seed=12)
    _check_invariants(summary, config, 3)
    assert json.loads((config.run.path / "summary.json").read_text())["replicas_identical"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_with_two_passes_per_rollout_under_chaos_ends_with_identical_replicas(
        tmp_path, demo_data) -> None:
    """GRPO with ``post.ppo_epochs=2`` (each group keeps its last step's rollouts for a second
    pass), the token-level loss and both filters, as 3 groups under SIGKILLs: a restarted group
    starts with no earlier rollouts while its peers train theirs, and the replicas still end
    identical, every row exactly once. Default tier: ``tests/post/test_grpo.py`` covers the passes
    and filters in one group (``test_grpo_with_every_option_trains_one_group_to_the_end``)."""
    sft = _chaos_config(tmp_path, demo_data, "base", steps=2)
    run.run("sft", sft)
    config = _chaos_config(tmp_path, demo_data, "grpo", steps=300, heartbeat_timeout=2.0,
                           group_size=2, max_new_tokens=8, ppo_epochs=2, grpo_loss="dapo",
                           filter_zero_variance=True, mask_truncated=True,
                           train={"init_from": str(sft.run.path / "model.safetensors")})
    summary = launch("grpo", config, groups=3, chaos_mtbf=10.0, chaos_seed=12)
    _check_invariants(summary, config, 3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grpo_in_a_group_of_two_ranks_samples_and_trains_to_the_end(tmp_path, demo_data) -> None:
    """GRPO with the model sharded over 2 ranks (FSDP2): each rank samples its own prompt, whose
    completions end at other tokens than its peer's; the ranks must still run the model the same
    number of times (``ftlm.post.rollout``), or the group crashes on mismatched collectives."""
    sft = _chaos_config(tmp_path, demo_data, "base", steps=2)
    run.run("sft", sft)
    # Completions run to the model's context (a near-random model rarely ends one): with the
    # context at 64 tokens, each rank's budget is 64 minus its own prompt's length.
    config = _chaos_config(tmp_path, demo_data, "grpo", steps=12, heartbeat_timeout=2.0,
                           group_size=2, max_new_tokens=60,
                           train={"init_from": str(sft.run.path / "model.safetensors")})
    config.model.max_seq_len = config.data.seq_len = 64
    summary = launch("grpo", config, groups=1, ranks_per_group=2)
    events = read_events(config.run.path / "events.jsonl")
    assert summary["problems"] == [] and summary["crashes"] == [], summary["problems"]
    assert {e["step"] for e in events if e["kind"] == "commit"} == set(range(12))
    assert summary["restarts"]["g0"] == 0
