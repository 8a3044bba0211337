"""The single-group training loop: learning, run-directory contracts, accumulation, bad input.

One 40-step run of the tiny model is shared by the tests that only read its outputs.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ftlm.config import load_config
from ftlm.data.tokenizer import train_tokenizer
from ftlm.errors import ConfigError, DataError
from ftlm.ft.protocol import NoFaultTolerance
from ftlm.observe.events import read_events
from ftlm.train.model_file import read_stamp
from ftlm.train.trainer import Trainer, load_weights

STEPS = 40
BATCH = 4
SEQ = 64


@pytest.fixture(scope="module")
def trained(make_tiny_config, tmp_path_factory):
    """(trainer, summary) of one finished 40-step run."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    config = make_tiny_config(run_dir, train={"steps": STEPS, "batch_size": BATCH,
                                              "warmup_steps": 3, "lr": 3e-3})
    trainer = Trainer.for_run(config)
    return trainer, trainer.train()


def test_loss_falls_within_a_few_dozen_steps(trained) -> None:
    trainer, _ = trained
    losses = trainer.losses
    assert len(losses) == STEPS
    first, last = statistics.fmean(losses[:5]), statistics.fmean(losses[-5:])
    # Uniform guessing over 1024 tokens is ln(1024) = 6.93; the model must clearly beat its start.
    assert first > 6.5
    assert last < first - 0.5, (first, last)


def test_summary_has_the_contract_fields_with_sensible_values(trained) -> None:
    trainer, summary = trained
    on_disk = json.loads((trainer.run_dir / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert summary["steps_committed"] == STEPS
    assert summary["steps_failed"] == 0
    assert summary["tokens_committed"] == STEPS * BATCH * SEQ
    assert 0 < summary["wall_seconds"] < 120
    assert 0 < summary["ett"] <= 1.5
    assert summary["failures_injected"] == summary["failures_detected"] == 0
    assert summary["recoveries"] == 0
    assert summary["stall_seconds"] == []
    assert summary["final_loss"] == trainer.losses[-1]
    assert summary["state_hashes"] == {"g0": trainer.state_hash()}
    assert summary["replicas_identical"] is True
    data = summary["data"]
    assert data["samples_committed"] == STEPS * BATCH
    assert data["duplicates"] == data["gaps"] == 0
    assert summary["groups"] == ["g0"]
    assert summary["config"] == json.loads(json.dumps(trainer.config.resolved))


def test_events_have_one_commit_per_step_with_contiguous_samples(trained) -> None:
    trainer, _ = trained
    events = read_events(trainer.run_dir / "events.jsonl")
    for e in events:
        assert {"ts", "kind", "group", "step"} <= set(e)
        assert e["group"] == "g0"
    commits = [e for e in events if e["kind"] == "commit"]
    assert [e["step"] for e in commits] == list(range(STEPS))
    assert [e["samples"] for e in commits] == [[s * BATCH, (s + 1) * BATCH] for s in range(STEPS)]
    assert [e["loss"] for e in commits] == trainer.losses
    for e in commits:
        assert e["participants"] == 1
        assert e["tokens"] == BATCH * SEQ
        assert "quorum_id" in e
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "group_start" and kinds[-1] == "group_exit"
    assert "step_failed" not in kinds


def test_run_dir_holds_resolved_config_and_final_weights(trained) -> None:
    trainer, _ = trained
    assert load_config(trainer.run_dir / "config.toml").to_dict() == trainer.config.resolved
    weights = load_file(str(trainer.run_dir / "model.safetensors"))
    live = trainer.model.state_dict()
    assert weights and set(weights) <= set(live)
    for name, tensor in weights.items():
        assert torch.equal(tensor, live[name]), name


def test_grad_accum_two_matches_one_at_equal_batch(tiny_config, tmp_path: Path) -> None:
    runs = {}
    for accum in (1, 2):
        trainer = Trainer.for_run(tiny_config(run_dir=tmp_path / f"accum{accum}",
                                      train={"steps": 8, "batch_size": 4, "grad_accum": accum}))
        trainer.train()
        runs[accum] = trainer.losses
    one, two = runs[1], runs[2]
    assert two[0] == pytest.approx(one[0], abs=1e-5)  # same weights, same samples: same loss
    assert two[-1] == pytest.approx(one[-1], abs=1e-4)  # only summation order differs


def test_keyboard_interrupt_still_writes_the_summary(tiny_config) -> None:
    trainer = Trainer.for_run(tiny_config(train={"steps": 10}))
    step_once = trainer.train_step

    def step_then_interrupt(step) -> bool:
        ok = step_once(step)
        if trainer.state.step == 3:
            raise KeyboardInterrupt
        return ok

    trainer.train_step = step_then_interrupt
    summary = trainer.train()
    assert summary["steps_committed"] == 3
    on_disk = json.loads((trainer.run_dir / "summary.json").read_text())
    assert on_disk["steps_committed"] == 3 and on_disk["data"]["gaps"] == 0
    assert (trainer.run_dir / "model.safetensors").is_file()


class _BehindTheJob(NoFaultTolerance):
    """A group whose last quorum was far ahead of its state (it was recovering, or restarted from
    an older checkpoint) when it stopped."""

    def head_step(self) -> int:
        return 10**6


def test_a_group_stopped_behind_the_job_leaves_the_jobs_model_alone(tiny_config) -> None:
    """Every group of a job writes ``model.safetensors`` into the one run directory as it exits: a
    straggler preempted while catching up, exiting after the groups that finished, replaced the
    job's final weights with its older ones."""
    finished = Trainer.for_run(tiny_config(train={"steps": 3}))
    finished.train()  # at its head (a lone group): writes the model
    path = finished.run_dir / "model.safetensors"
    written = path.read_bytes()
    straggler = Trainer.for_run(tiny_config(train={"steps": 1}, checkpoint={"resume": False}),
                                ft=_BehindTheJob())
    straggler.train()
    assert straggler.state.step == 1 and path.read_bytes() == written
    for t in (finished, straggler):
        t.loader.close()


class _NeverJoined(NoFaultTolerance):
    """A group that never took part in a quorum in its incarnation (restarted after the job
    finished, it waited for a quorum that never came and was stopped)."""

    def head_step(self) -> int | None:
        return None


def test_a_group_that_never_joined_a_quorum_writes_no_model(tiny_config) -> None:
    """A group restarted after the job finished, stopped at step 0 while it waited for a quorum,
    wrote its untrained weights over the job's final model: a group that knows no quorum writes
    no job model (unless it holds the final step), and a file is never replaced by a state behind
    the one it holds, whoever writes it, whenever it started."""
    finished = Trainer.for_run(tiny_config(train={"steps": 3}))
    finished.train()
    path = finished.run_dir / "model.safetensors"
    written = path.read_bytes()
    assert (read_stamp(path).step, read_stamp(path).chain) == (3, finished.state.chain)
    late = Trainer.for_run(tiny_config(train={"steps": 3}, checkpoint={"resume": False}),
                           ft=_NeverJoined())
    late.request_stop()  # SIGTERM while it waits for its first quorum
    late.train()
    assert late.state.step == 0 and path.read_bytes() == written
    assert not list(path.parent.glob(".model.safetensors.*"))  # no temporary file left
    behind = Trainer.for_run(tiny_config(train={"steps": 1}, checkpoint={"resume": False}))
    behind.train()  # a lone group at its own head, but behind the file: it keeps the file
    assert behind.state.step == 1 and path.read_bytes() == written
    for t in (finished, late, behind):
        t.loader.close()


def test_a_group_holding_the_final_step_writes_the_model_without_a_quorum(tiny_config) -> None:
    """Restored from the final checkpoint after every other group left, a group ends at once
    holding the job's final state: that state is the job's, quorum or not."""
    trainer = Trainer.for_run(tiny_config(train={"steps": 2}), ft=_NeverJoined())
    trainer.state.step = 2  # as restored from the checkpoint of the last step
    trainer.train()
    path = trainer.run_dir / "model.safetensors"
    assert read_stamp(path).step == 2
    load_weights(trainer.model, path)
    trainer.loader.close()


def test_a_model_file_without_a_stamp_is_replaced(tiny_config, tmp_path) -> None:
    """A model file of ``ftlm convert`` or an older ftlm (no stamp), or not a safetensors file at
    all, holds no known state: the group's model replaces it."""
    trainer = Trainer.for_run(tiny_config(train={"steps": 1}))
    path = trainer.run_dir / "model.safetensors"
    path.write_bytes(b"not a safetensors file")
    assert read_stamp(path) is None
    trainer.train()
    assert read_stamp(path).step == 1
    trainer.loader.close()


@pytest.mark.parametrize("content", [b"", b"\x05", (2**40).to_bytes(8, "little") + b"{}",
                                     (9).to_bytes(8, "little") + b"not json!",
                                     (2).to_bytes(8, "little") + b"[]",
                                     (23).to_bytes(8, "little") + b'{"__metadata__": "x"}  ',
                                     (40).to_bytes(8, "little") + b'{"__metadata__": {"ftlm.step": "x"}}    '])
def test_a_damaged_model_file_holds_no_known_state(tmp_path, content) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    assert read_stamp(path) is None
    assert read_stamp(tmp_path / "missing.safetensors") is None


def test_max_seconds_stops_early_and_still_summarises(tiny_config) -> None:
    trainer = Trainer.for_run(tiny_config(train={"steps": 1000, "max_seconds": 1e-6}))
    summary = trainer.train()
    assert summary["steps_committed"] < 1000
    assert (trainer.run_dir / "summary.json").is_file()


def test_a_stop_noted_during_set_up_is_honoured_by_the_trainer(tiny_config) -> None:
    """``ftlm.cli`` notes a SIGTERM that reached a rank of a group during its set-up on its
    handler (``requested``); the trainer, taking SIGTERM over, stops as if signalled then."""
    import signal

    def noted(signum, frame):  # the set-up handler of a rank that got SIGTERM
        pass
    noted.requested = True
    before = signal.signal(signal.SIGTERM, noted)
    try:
        trainer = Trainer.for_run(tiny_config(train={"steps": 1000}))
        summary = trainer.train()
    finally:
        signal.signal(signal.SIGTERM, before)
    assert summary["steps_committed"] == 0 and (trainer.run_dir / "model.safetensors").is_file()


# -- bad input ----------------------------------------------------------------------------------

def _refused(config, error: type[Exception]) -> str:
    with pytest.raises(error) as err:
        Trainer.for_run(config)
    return str(err.value)


def test_data_dir_without_manifest(tiny_config, demo_data: Path, tmp_path: Path) -> None:
    empty = tmp_path / "no-data"
    empty.mkdir()
    shutil.copy(demo_data / "tokenizer.json", empty / "tokenizer.json")
    msg = _refused(tiny_config(data={"dir": str(empty)}), DataError)
    assert str(empty / "manifest.json") in msg and "ftlm data prepare" in msg


def test_missing_tokenizer(tiny_config, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "tokenizer.json"
    msg = _refused(tiny_config(data={"tokenizer": str(missing)}), DataError)
    assert str(missing) in msg


def test_tokenizer_that_differs_from_the_data(tiny_config, tmp_path: Path) -> None:
    text = tmp_path / "other.txt"
    text.write_text("a completely different corpus for another tokenizer\n" * 200)
    other = tmp_path / "other-tokenizer.json"
    train_tokenizer([text], other, vocab_size=300)
    msg = _refused(tiny_config(data={"tokenizer": str(other)}), DataError)
    assert "another tokenizer" in msg and "ftlm data prepare" in msg


def test_seq_len_differs_from_the_manifest(tiny_config) -> None:
    msg = _refused(tiny_config(data={"seq_len": 32}), DataError)
    assert "seq_len=64" in msg and "seq_len=32" in msg


def test_model_vocab_smaller_than_the_tokenizer(tiny_config) -> None:
    msg = _refused(tiny_config(model={"vocab_size": 512}), ConfigError)
    assert "model.vocab_size=512" in msg and "1024" in msg


def test_seq_len_longer_than_the_model_context(tiny_config) -> None:
    msg = _refused(tiny_config(model={"max_seq_len": 32}), ConfigError)
    assert "data.seq_len=64" in msg and "model.max_seq_len=32" in msg


def test_a_catchup_budget_below_one_gradient_shard_is_refused_at_start(tiny_config) -> None:
    """The catch-up budget is in bytes too, checked at start against one real gradient shard."""
    with pytest.raises(ConfigError, match=r"ft\.catchup_max_bytes=1000 cannot hold one step"):
        Trainer.for_run(tiny_config(ft={"catchup_max_bytes": 1000}), standalone=False)


def test_the_catchup_buffer_overflows_on_bytes_as_well_as_steps() -> None:
    from ftlm.train.catchup import CatchUpBuffer
    buf = CatchUpBuffer(max_steps=10, max_bytes=3 * 400)
    for step in range(3):
        buf.record(step, [torch.zeros(100)], 0.1, 8)
    assert not buf.overflowing
    buf.record(3, [torch.zeros(100)], 0.1, 8)
    assert buf.overflowing and "ft.catchup_max_bytes" in buf.limit()


def test_bf16_autocast_trains_on_cpu(tiny_config) -> None:
    """bf16 autocast works on CPU: matmuls run in bf16, the state stays fp32."""
    trainer = Trainer.for_run(tiny_config(train={"steps": 2, "eval_every": 0, "dtype": "bfloat16"}))
    seen: list[torch.dtype] = []
    trainer.model.output.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    summary = trainer.train()
    assert summary["steps_committed"] == 2 and seen and set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_the_last_step_is_always_checkpointed(tiny_config) -> None:
    """A group restarted after the others finished and left must resume at the end, not from an
    older checkpoint: the final step is saved even when ``checkpoint.every`` does not divide it."""
    trainer = Trainer.for_run(tiny_config(train={"steps": 5, "eval_every": 0},
                                  checkpoint={"every": 2, "async_save": False}))
    trainer.train()
    saved = sorted(p.name for p in (trainer.run_dir / "checkpoints").iterdir() if p.is_dir())
    assert saved[-1] == "step-00000005", saved
    again = Trainer.for_run(tiny_config(train={"steps": 5, "eval_every": 0}, checkpoint={"every": 2}))
    assert again.checkpointer.restore_latest(again.state) == 5


def test_training_never_imports_the_composition_root_or_the_launchers() -> None:
    """The trainer gets only its own sections (``TrainerConfig``): importing the training code
    loads neither ``ftlm.config`` (which composes every section) nor anything of ``ftlm.launch``."""
    code = ("import sys, ftlm.train.trainer, ftlm.train.job; "
            "print(sorted(m for m in sys.modules if m == 'ftlm.config' or m.startswith('ftlm.launch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.strip() == "[]"
    from ftlm.train.config import TrainerConfig
    assert {f.name for f in dataclasses.fields(TrainerConfig)} == {
        "run", "model", "data", "train", "checkpoint", "ft", "observe", "resolved"}


_UNEVEN_WORKER = """
import json, sys
import torch, torch.distributed as dist
rank, store, config_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
from ftlm.config import load_config
from ftlm.train.trainer import Trainer
t = Trainer.for_run(load_config(config_path), standalone=False)
shards = [torch.zeros_like(p.to_local()) for p in t.params]
mine = sum(g.numel() * g.element_size() for g in shards)
full = []  # whether the buffer is full after each step a recovering group records
for step in range(4):
    t.catchup.record(step, shards, 0.1, 8)
    full.append(t.catchup.overflowing)
print(json.dumps({"mine": mine, "full": full, "limit": t.catchup.limit()}))
t.loader.close()
dist.destroy_process_group()
"""


def test_the_ranks_of_a_group_with_uneven_shards_bound_their_catchup_buffers_alike(tiny_config, tmp_path,
                                                                                   two_ranks) -> None:
    """A vocabulary of 1,025 rows splits 513 / 512 over two ranks, so rank 0's gradient shard is
    the larger one. With a byte budget of three of rank 1's steps, rank 1 alone would hold three
    steps and rank 0 two: when a catch-up lagged three steps, rank 0 would drop its recovery and
    rank 1 not, and the two would wait in different collectives. Both hold two."""
    from ftlm.config import save_config
    from ftlm.train.trainer import build_model
    probe = tiny_config(model={"vocab_size": 1025})
    rows = [0, 0]
    for p in build_model(probe.trainer_config(), torch.device("cpu")).parameters():  # FSDP2 splits dim 0 as torch.chunk
        first = -(-p.shape[0] // 2)
        for r, n in enumerate((first, p.shape[0] - first)):
            rows[r] += n * (p.numel() // p.shape[0]) * p.element_size()
    assert rows[0] > rows[1]
    budget = 3 * rows[1] + 1  # three of rank 1's steps, two of rank 0's
    config = tiny_config(model={"vocab_size": 1025}, ft={"catchup_max_bytes": budget,
                                                           "catchup_max_steps": 64})
    path = tmp_path / "run.toml"
    save_config(config, path)
    got = two_ranks(_UNEVEN_WORKER, str(path))
    assert [g["mine"] for g in got] == rows
    assert [g["full"] for g in got] == [[False, False, True, True]] * 2, got
    assert all("ft.catchup_max_bytes" in g["limit"] for g in got)
