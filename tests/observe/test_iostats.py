"""Bytes and seconds of transfers and storage reads: the process tally, its Prometheus counters,
and the two storage call sites (a checkpoint restore, a data shard read) that feed it."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftlm.observe.iostats import IO_FAMILIES, KINDS, count_io, io_totals, timed_io
from ftlm.observe.metrics import (
    IO_COUNTERS,
    TRAINING_METRICS,
    NullMetrics,
    TrainingMetrics,
)


def _grew(before: dict, kind: str) -> tuple[int, float]:
    after = io_totals()[kind]
    return after[0] - before[kind][0], after[1] - before[kind][1]


def test_count_io_adds_bytes_and_seconds_per_kind_and_refuses_an_unknown_kind() -> None:
    before = io_totals()
    count_io("transfer_received", 1000, 0.5)
    count_io("transfer_received", -5, -1.0)  # nonsense counts as nothing, never backwards
    assert _grew(before, "transfer_received") == (1000, pytest.approx(0.5))
    assert set(io_totals()) == set(KINDS)
    with pytest.raises(ValueError, match="kind='disk' is not one of transfer_received"):
        count_io("disk", 1, 1.0)


def test_timed_io_counts_a_call_with_its_size_and_not_a_call_that_raises() -> None:
    @timed_io("data_read", lambda result, n: len(result))
    def read(n: int) -> bytes:
        if n < 0:
            raise OSError("gone")
        return b"x" * n

    before = io_totals()
    assert read(300) == b"x" * 300
    with pytest.raises(OSError):
        read(-1)
    grown_bytes, grown_seconds = _grew(before, "data_read")
    assert grown_bytes == 300 and grown_seconds >= 0
    assert read(0) == b"" and _grew(before, "data_read") == (grown_bytes, grown_seconds)  # moved nothing
    assert read.__name__ == "read"


def test_the_tally_is_exported_as_counters_with_job_group_rank_and_gb_per_second_reads_off() -> None:
    m = TrainingMetrics("spot", "g2", 0)
    port = m.start()
    try:
        m.on_transfer("received", 3 << 30, 2.0, peer="g0")
        m.on_transfer("sent", 1 << 30, 0.5, peer="g1")
        with pytest.raises(ValueError, match="direction='up'"):
            m.on_transfer("up", 1, 1.0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            families = {f.name + "_total": f for f in text_string_to_metric_families(r.read().decode())
                        if f.type == "counter"}
    finally:
        m.stop()
    assert set(IO_COUNTERS) <= set(families) and set(IO_COUNTERS) <= set(TRAINING_METRICS)
    values = {}
    for name in IO_COUNTERS:
        (sample,) = [s for s in families[name].samples if s.name == name]
        assert sample.labels == {"job": "spot", "group": "g2", "rank": "0"}
        values[name] = sample.value
    assert values == m.io_counters()
    # The tally is the process's (earlier tests add to it too): compare what this test added.
    assert values["ftlm_ft_transfer_received_bytes_total"] >= 3 << 30
    assert {kind for kind, _, _ in IO_FAMILIES.values()} == set(KINDS)
    assert NullMetrics().io_counters() == {}


def test_restoring_a_checkpoint_counts_its_bytes_as_a_checkpoint_read(tmp_path: Path) -> None:
    import torch

    from ftlm.config import build_config
    from ftlm.train.checkpoint import Checkpointer, checkpoint_dir
    from ftlm.train.optim import build_optimizer
    from ftlm.train.state import TrainState
    from ftlm.train.trainer import build_model

    def state() -> TrainState:
        cfg = build_config({"model": {"size": "tiny", "vocab_size": 256, "dim": 32, "n_layers": 1,
                                      "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64, "max_seq_len": 32}})
        model = build_model(cfg, torch.device("cpu"))
        return TrainState(model, build_optimizer(model, cfg.train), 0)

    saved = state()
    saved.step = 4
    ck = Checkpointer(tmp_path, every=4, keep=1, async_save=False)
    ck.save(saved)
    ck.wait()
    on_disk = sum(f.stat().st_size for f in checkpoint_dir(tmp_path, 4).iterdir()
                  if f.suffix in (".distcp", ".metadata") or f.name == ".metadata"
                  or f.name.startswith("state-digest-"))  # (the resume checks the state's digest)
    before = io_totals()
    assert Checkpointer(tmp_path, every=4, keep=1).restore_latest(state()) == 4
    grown_bytes, grown_seconds = _grew(before, "checkpoint_read")
    assert grown_bytes == on_disk > 0 and grown_seconds > 0


def test_reading_a_data_shard_counts_its_file_bytes_once(demo_data: Path) -> None:
    from ftlm.data.loader import PackedDataset

    ds = PackedDataset(demo_data, 64)
    before = io_totals()
    ds.samples([0, 1])
    ds.samples([0, 1])  # the shard is cached now: no second read from storage
    grown_bytes, grown_seconds = _grew(before, "data_read")
    assert grown_bytes == ds._files[0].stat().st_size > 0  # sample 0 lies in the first shard
    assert grown_seconds > 0
