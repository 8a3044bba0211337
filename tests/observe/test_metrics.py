"""TrainingMetrics exports what the trainer reports, in the design's vocabulary, over HTTP."""

from __future__ import annotations

import inspect
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftlm.errors import ConfigError
from ftlm.observe.events import NullEvents
from ftlm.observe.metrics import (
    COORDINATOR_METRICS,
    LAZY,
    TRAINING_METRICS,
    NullMetrics,
    TrainingMetrics,
    metric_names,
)


def scrape(port: int) -> dict[str, dict[str, float]]:
    """family name as PromQL names it -> {sample name: value} for the first label set."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = {"labels": [s.labels for s in family.samples],
                     **{s.name + (f"{{le={s.labels['le']}}}" if "le" in s.labels else ""): s.value
                        for s in family.samples}}
    return out


@pytest.fixture
def exporter():
    made: list[TrainingMetrics] = []

    def _make(*args, **kwargs) -> TrainingMetrics:
        m = TrainingMetrics(*args, **kwargs)
        made.append(m)
        m.start()
        return m

    yield _make
    for m in made:
        m.stop()


def feed(m: TrainingMetrics, steps: int) -> None:
    for step in range(steps):
        m.on_quorum(quorum_id=3, participants=2, recovering=1, wait_seconds=0.02)
        m.on_allreduce(0.03, nbytes=4096)
        m.on_commit(step, loss=4.0 - step, tokens=1024, step_seconds=0.5, lr=1e-3, grad_norm=0.7,
                    mfu=0.41, data_wait_seconds=0.05)


def test_every_family_in_the_table_is_exported_with_only_job_group_rank(exporter, tmp_path) -> None:
    m = exporter("chaos", "g0", 1)
    m.watch_storage(tmp_path, tmp_path / "checkpoints")
    events = m.watch_events(NullEvents("g0"))
    for step in range(3):
        events.emit("commit", step=step, samples=[8 * step, 8 * step + 8], tokens=1024)
    feed(m, 3)
    m.on_step_failed()
    m.on_recovery(seconds=2.5, nbytes=4096)
    m.on_catchup_lag(7)
    m.on_stall(1.25)
    (tmp_path / "checkpoints" / "step-3").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-3" / "data.distcp").write_bytes(b"x" * 1000)
    m.on_checkpoint(3, 0.75, tmp_path / "checkpoints" / "step-3")
    got = scrape(m.port)
    ftlm = {name for name in got if name.startswith("ftlm_")}
    assert ftlm == set(TRAINING_METRICS), ftlm ^ set(TRAINING_METRICS)
    for name in set(TRAINING_METRICS) - LAZY:
        for labels in got[name]["labels"]:
            assert {k: v for k, v in labels.items() if k != "le"} == {"job": "chaos", "group": "g0", "rank": "1"}
    assert got["ftlm_train_step"]["ftlm_train_step"] == 2
    assert got["ftlm_train_loss"]["ftlm_train_loss"] == 2.0
    assert got["ftlm_train_steps_committed_total"]["ftlm_train_steps_committed_total"] == 3
    assert got["ftlm_train_tokens_total"]["ftlm_train_tokens_total"] == 3 * 1024
    assert got["ftlm_train_tokens_per_second"]["ftlm_train_tokens_per_second"] == 2048
    assert got["ftlm_train_mfu_ratio"]["ftlm_train_mfu_ratio"] == pytest.approx(0.41)
    assert got["ftlm_train_data_wait_seconds_total"]["ftlm_train_data_wait_seconds_total"] == pytest.approx(0.15)
    step = got["ftlm_train_step_duration_seconds"]
    assert step["ftlm_train_step_duration_seconds_count"] == 3
    assert step["ftlm_train_step_duration_seconds_sum"] == pytest.approx(1.5)
    assert step["ftlm_train_step_duration_seconds_bucket{le=0.25}"] == 0
    assert step["ftlm_train_step_duration_seconds_bucket{le=0.5}"] == 3
    assert got["ftlm_ft_participants"]["ftlm_ft_participants"] == 2
    assert got["ftlm_ft_recovering"]["ftlm_ft_recovering"] == 1
    assert got["ftlm_ft_quorum_id"]["ftlm_ft_quorum_id"] == 3
    assert got["ftlm_ft_allreduce_seconds"]["ftlm_ft_allreduce_seconds_count"] == 3
    assert got["ftlm_ft_steps_failed_total"]["ftlm_ft_steps_failed_total"] == 1
    assert got["ftlm_ft_recoveries_total"]["ftlm_ft_recoveries_total"] == 1
    assert got["ftlm_ft_recovery_bytes_total"]["ftlm_ft_recovery_bytes_total"] == 4096
    assert got["ftlm_ft_recovery_duration_seconds"]["ftlm_ft_recovery_duration_seconds_sum"] == 2.5
    assert got["ftlm_ft_catchup_lag_steps"]["ftlm_ft_catchup_lag_steps"] == 7
    assert got["ftlm_ft_stall_seconds"]["ftlm_ft_stall_seconds_sum"] == 1.25
    assert got["ftlm_ft_allreduce_bytes_total"]["ftlm_ft_allreduce_bytes_total"] == 3 * 4096
    assert got["ftlm_checkpoint_written_bytes_total"]["ftlm_checkpoint_written_bytes_total"] == 1000
    assert got["ftlm_checkpoint_write_seconds"]["ftlm_checkpoint_write_seconds_sum"] == 0.75
    assert 0 <= got["ftlm_checkpoint_age_seconds"]["ftlm_checkpoint_age_seconds"] < 60
    assert got["ftlm_run_dir_free_bytes"]["ftlm_run_dir_free_bytes"] > 0
    assert 0 < got["ftlm_train_ett_ratio"]["ftlm_train_ett_ratio"] <= 1
    # No GPU in use: the GPU and CUDA families have no series at all (not zeros).
    for name in LAZY:
        assert got[name]["labels"] == [], name


def test_names_follow_the_design_conventions() -> None:
    assert metric_names() == set(TRAINING_METRICS) | set(COORDINATOR_METRICS)
    units = ("_seconds", "_bytes", "_ratio", "_watts", "_total", "_steps")
    for name, (kind, help_text) in {**TRAINING_METRICS, **COORDINATOR_METRICS}.items():
        assert name.startswith("ftlm_") and name == name.lower(), name
        assert help_text, name
        assert name.endswith("_total") == (kind == "counter"), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name
        assert not any(bad in name for bad in ("_milliseconds", "_ms", "_mb", "_kb", "_percent")), name
        assert name.endswith(units) or kind == "gauge", name


def test_sample_memory_reports_the_resident_set_and_no_cuda_on_cpu(exporter) -> None:
    m = exporter("j", "g0", 0)
    ballast = bytearray(64 << 20)  # 64 MiB touched: RSS must see it
    ballast[:: 4096] = b"\1" * len(ballast[:: 4096])
    got = m.sample_memory()
    rss = got["ftlm_process_resident_memory_bytes"]
    assert rss > 64 << 20
    assert scrape(m.port)["ftlm_process_resident_memory_bytes"]["ftlm_process_resident_memory_bytes"] == rss
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        assert set(got) == {"ftlm_process_resident_memory_bytes"}
    del ballast


def test_restarted_group_continues_the_same_series_with_counters_from_zero(exporter) -> None:
    old = exporter("j", "g1", 0)
    port = old.port
    feed(old, 5)
    before = scrape(port)
    assert before["ftlm_train_steps_committed_total"]["ftlm_train_steps_committed_total"] == 5
    old.stop()
    # The new incarnation is a new process: same labels, same configured port, counters from 0.
    new = exporter("j", "g1", 0, port=port)
    assert new.port == port
    feed(new, 1)
    after = scrape(port)
    assert after["ftlm_train_steps_committed_total"]["ftlm_train_steps_committed_total"] == 1
    assert after["ftlm_train_tokens_total"]["ftlm_train_tokens_total"] == 1024
    # One series per family, and the very label set the old incarnation used: nothing tells
    # incarnations apart, so Prometheus sees one series with a counter reset.
    for name in ("ftlm_train_steps_committed_total", "ftlm_train_loss", "ftlm_ft_participants"):
        assert after[name]["labels"] == before[name]["labels"]
        assert len(after[name]["labels"]) == 1


def test_start_on_a_busy_port_names_the_problem_and_stop_is_idempotent(exporter) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        m = TrainingMetrics("j", "g0", 0, port=busy.getsockname()[1])
        with pytest.raises(ConfigError, match="cannot serve metrics"):
            m.start()
    with pytest.raises(ConfigError, match="port"):
        TrainingMetrics("j", "g0", 0, port=70000)
    m = exporter("j", "g0", 0)
    port = m.port
    m.stop()
    m.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_null_metrics_has_every_method_with_the_same_signature() -> None:
    public = {n for n, f in inspect.getmembers(TrainingMetrics, inspect.isfunction) if not n.startswith("_")}
    assert public <= set(dir(NullMetrics))
    for name in public:
        assert inspect.signature(getattr(NullMetrics, name)) == inspect.signature(getattr(TrainingMetrics, name))
    null = NullMetrics()
    assert null.start() == 0
    null.on_commit(0, 1.0, 10, 0.1, 1e-3)
    assert null.sample_memory() == {}
