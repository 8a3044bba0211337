"""A rank's GPU health (NVML), storage, live ETT and OpenTelemetry spans."""

from __future__ import annotations

import os
import shutil
import sys
import time
import types

import pytest

from ftlm.errors import ConfigError
from ftlm.observe.config import ObserveConfig
from ftlm.observe.events import EventLog, NullEvents, read_events
from ftlm.observe.gpu import NvmlSampler, cuda_device, gpu_sampler
from ftlm.observe.live import LiveEtt, WatchedEvents
from ftlm.observe.metrics import (
    CHECKPOINT_MARKER,
    LAZY,
    NullMetrics,
    TrainingMetrics,
    start_rank_metrics,
)
from ftlm.observe.summary import build_summary
from ftlm.observe.tracing import SPAN_NAMES, NullTracer, StepTracer, make_tracer


def fake_nvml(temperature: int = 71, power_mw: int = 312_000, util: int = 87,
              used: int = 40 << 30, no_power: bool = False) -> types.ModuleType:
    """A stand-in for pynvml with one device: what NvmlSampler calls, and nothing else."""
    nvml = types.ModuleType("pynvml")
    calls: list[str] = []

    def power(handle):
        if no_power:
            raise RuntimeError("NVMLError_NotSupported")
        return power_mw

    nvml.nvmlInit = lambda: calls.append("init")
    nvml.nvmlShutdown = lambda: calls.append("shutdown")
    nvml.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=util, memory=10)
    nvml.nvmlDeviceGetPowerUsage = power
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: temperature if sensor == 0 else -1
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=used, total=141 << 30)
    nvml.calls = calls
    return nvml


# ----------------------------------------------------------------------------------- NVML

def test_nvml_sampler_reads_utilisation_power_temperature_and_memory_in_base_units() -> None:
    nvml = fake_nvml()
    sampler = NvmlSampler(3, nvml=nvml)
    assert sampler.handle == ("handle", 3)
    assert sampler.sample() == {"ftlm_gpu_utilization_ratio": 0.87, "ftlm_gpu_power_watts": 312.0,
                                "ftlm_gpu_temperature_celsius": 71.0,
                                "ftlm_gpu_memory_used_bytes": float(40 << 30)}
    sampler.close()
    assert nvml.calls == ["init", "shutdown"]


def test_a_reading_the_board_refuses_is_left_out_not_zero() -> None:
    got = NvmlSampler(0, nvml=fake_nvml(no_power=True)).sample()
    assert "ftlm_gpu_power_watts" not in got and got["ftlm_gpu_temperature_celsius"] == 71.0


def test_gpu_families_are_exported_once_nvml_has_read_them() -> None:
    m = TrainingMetrics("j", "g0", 0)
    names = lambda: {f.name for f in m.registry.collect() for s in f.samples}
    m.sample_memory()
    assert not (names() & {"ftlm_gpu_temperature_celsius", "ftlm_gpu_power_watts"})
    m._gpu = NvmlSampler(0, nvml=fake_nvml())  # what sample_memory finds on a CUDA rank
    got = m.sample_memory()
    assert got["ftlm_gpu_temperature_celsius"] == 71.0
    gpu = {"ftlm_gpu_temperature_celsius", "ftlm_gpu_utilization_ratio", "ftlm_gpu_power_watts",
           "ftlm_gpu_memory_used_bytes"}
    assert gpu <= names() and gpu <= LAZY
    m.stop()
    assert m._gpu is False  # NVML shut down with the exporter


def test_without_pynvml_or_cuda_there_is_no_sampler(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(_get_nvml_device_index=lambda d: d))
    assert gpu_sampler(fake_torch, 0) is None
    if "torch" in sys.modules and not sys.modules["torch"].cuda.is_available():
        assert cuda_device() is None


# -------------------------------------------------------------------------------- storage

def test_checkpoint_age_counts_from_the_newest_marker_in_the_shared_directory(tmp_path) -> None:
    m = TrainingMetrics("j", "g2", 0)
    assert "ftlm_checkpoint_age_seconds" not in m.at_scrape()  # none yet: not exported
    m.watch_storage(tmp_path, tmp_path / "ck")
    old = tmp_path / "ck" / "step-00000050"
    old.mkdir(parents=True)
    (old / CHECKPOINT_MARKER).write_text("{}")
    then = time.time() - 300
    os.utime(old / CHECKPOINT_MARKER, (then, then))  # written by another group 5 minutes ago
    got = m.at_scrape()
    assert got["ftlm_checkpoint_last_saved_timestamp_seconds"] == pytest.approx(then)
    assert 300 <= got["ftlm_checkpoint_age_seconds"] < 360
    assert got["ftlm_run_dir_free_bytes"] == pytest.approx(shutil.disk_usage(tmp_path).free, rel=0.01)
    m.on_checkpoint(60, 2.0, old)  # this rank saved now
    assert m.at_scrape()["ftlm_checkpoint_age_seconds"] < 60


def test_checkpoint_marker_name_is_the_trainers() -> None:
    checkpoint = pytest.importorskip("ftlm.train.checkpoint")
    assert CHECKPOINT_MARKER == checkpoint.MARKER


# ----------------------------------------------------------------------------------- live ETT

def _record(events, clock) -> None:
    """A 3-group job as group g0 records it: steady 1 s steps, a failed step and a 6 s stall
    while a peer died, then steady again with one group fewer (fewer tokens per step)."""
    for step in range(10):
        clock.now += 1.0
        events.emit("commit", step=step, samples=[step * 24, step * 24 + 24], tokens=3000, quorum_id=1)
    clock.now += 1.0
    events.emit("step_failed", step=10, quorum_id=1, reason="peer died")
    clock.now += 6.0
    for step in range(10, 20):
        events.emit("commit", step=step, samples=[240 + (step - 10) * 16, 256 + (step - 10) * 16],
                    tokens=2000, quorum_id=2)
        clock.now += 1.0


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_live_ett_is_the_summary_ett_of_the_same_record(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr("ftlm.observe.events.time.time", clock)
    live = LiveEtt(clock=clock)
    events = WatchedEvents(NullEvents("g0"), live)
    started = clock.now
    assert live.value() is None  # nothing committed yet
    _record(events, clock)
    records = [dict(r) for r in live._events]
    value = live.value()
    summary = build_summary(records, wall_seconds=clock.now - started, state_hashes={},
                            config={}, groups=["g0"])
    assert value == pytest.approx(summary["ett"], abs=1e-4)
    assert 0.3 < value < 0.9  # the stall and the lost group cost something, not everything


def test_live_ett_drops_while_the_job_stalls_and_is_cached_between_scrapes(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr("ftlm.observe.events.time.time", clock)
    live = LiveEtt(clock=clock)
    events = WatchedEvents(NullEvents("g0"), live)
    for step in range(10):
        clock.now += 1.0
        events.emit("commit", step=step, samples=[step, step + 1], tokens=100)
    before = live.value()
    clock.now += 1.0
    assert live.value() == before  # within MIN_REFRESH_SECONDS: the cached value
    clock.now += 30.0  # no commit for 30 s
    assert live.value() < before * 0.5


def test_live_ett_keeps_a_bounded_window_of_events(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr("ftlm.observe.events.time.time", clock)
    live = LiveEtt(clock=clock, max_events=20)
    events = WatchedEvents(NullEvents("g0"), live)
    clock.now += 1000.0  # a long start-up that the window forgets
    for step in range(50):
        clock.now += 1.0
        events.emit("commit", step=step, samples=[step, step + 1], tokens=100, loss=1.0)
        events.emit("eval", step=step, loss=1.0)  # not kept: ETT does not depend on it
    assert len(live._events) == 20 and set(live._events[0]) <= {"ts", "kind", "group", "step",
                                                                "samples", "tokens"}
    assert live.value() == pytest.approx(1.0, abs=0.06)


def test_watched_events_write_what_they_show(tmp_path) -> None:
    live = LiveEtt()
    with WatchedEvents(EventLog(tmp_path / "events.jsonl", group="g1"), live) as events:
        record = events.emit("commit", step=0, samples=[0, 8], tokens=64)
        assert events.path == tmp_path / "events.jsonl"
    assert read_events(tmp_path / "events.jsonl") == [record]
    assert list(live._events) == [{k: record[k] for k in ("ts", "kind", "group", "step", "samples",
                                                          "tokens")}]


# ---------------------------------------------------------------------- rank metrics set-up

def test_start_rank_metrics_follows_the_config(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("FTLM_METRICS_PORT", raising=False)
    metrics, port = start_rank_metrics(ObserveConfig(), "j", "g0", 0)
    assert isinstance(metrics, NullMetrics) and port == 0
    assert metrics.watch_events(events := NullEvents()) is events
    metrics, port = start_rank_metrics(ObserveConfig(metrics=True), "j", "g0", 1, run_dir=tmp_path)
    try:
        assert port > 0 and metrics.port == port
        assert "ftlm_run_dir_free_bytes" in metrics.at_scrape()
    finally:
        metrics.stop()
    monkeypatch.setenv("FTLM_METRICS_PORT", "nine")
    with pytest.raises(ConfigError, match="FTLM_METRICS_PORT='nine'"):
        start_rank_metrics(ObserveConfig(metrics=True), "j", "g0", 0)


def test_observe_config_refuses_an_endpoint_that_is_not_a_url() -> None:
    with pytest.raises(ConfigError, match="observe.otlp_endpoint='collector:4318'"):
        ObserveConfig(otlp_endpoint="collector:4318")
    ObserveConfig(tracing=True, otlp_endpoint="http://127.0.0.1:4318")


# ------------------------------------------------------------------------------------ tracing

def test_tracing_off_is_the_null_tracer_and_on_without_the_sdk_names_the_fix(monkeypatch) -> None:
    assert isinstance(make_tracer(False, "", "j", "g0", 0), NullTracer)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.resources", None)
    with pytest.raises(ConfigError, match=r"observe.tracing=true needs .*ftlm\[otel\]"):
        make_tracer(True, "", "j", "g0", 0)


def test_a_step_is_one_span_with_its_quorum_and_allreduce_as_children() -> None:
    pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk is not installed (ftlm[otel])")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
        InMemorySpanExporter,
    )
    from opentelemetry.trace import StatusCode

    exporter = InMemorySpanExporter()
    tracer = make_tracer(True, "", "tiny", "g1", 0, exporter=exporter)
    assert isinstance(tracer, StepTracer)
    m = TrainingMetrics("tiny", "g1", 0, tracer=tracer)
    m.on_quorum(quorum_id=7, participants=3, recovering=0, wait_seconds=0.05)
    m.on_allreduce(0.2, nbytes=1 << 20)
    m.on_commit(41, loss=2.0, tokens=512, step_seconds=0.5, lr=1e-3)
    m.on_quorum(quorum_id=7, participants=3, recovering=0, wait_seconds=0.01)
    m.on_step_failed()
    m.on_recovery(seconds=3.0, nbytes=1 << 24)
    m.on_checkpoint(42, 1.5, "/nonexistent")
    m.stop()
    spans = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    assert sorted(by_name) == ["allreduce", "checkpoint", "quorum", "recovery", "replay", "step", "transfer"]
    ok, failed = sorted(by_name["step"], key=lambda s: s.start_time)
    assert ok.attributes["step"] == 41 and ok.attributes["outcome"] == "commit"
    assert failed.attributes["step"] == 42 and failed.status.status_code == StatusCode.ERROR
    children = [s for s in spans if s.parent is not None and s.name in ("quorum", "allreduce")]
    assert {(s.name, s.parent.span_id) for s in children} == {
        ("quorum", ok.context.span_id), ("allreduce", ok.context.span_id),
        ("quorum", failed.context.span_id)}
    first_quorum = next(s for s in children if s.parent.span_id == ok.context.span_id and s.name == "quorum")
    assert first_quorum.attributes["quorum_id"] == 7
    assert (first_quorum.end_time - first_quorum.start_time) == pytest.approx(0.05e9, rel=0.01)
    assert ok.start_time <= first_quorum.start_time and ok.end_time >= first_quorum.end_time
    assert by_name["recovery"][0].attributes["bytes"] == 1 << 24
    assert by_name["recovery"][0].resource.attributes["ftlm.group"] == "g1"


def test_an_unreachable_collector_does_not_hold_up_the_ranks_exit() -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http",
                        reason="the OTLP exporter is not installed (ftlm[otel])")
    from ftlm.observe.tracing import EXPORT_TIMEOUT_SECONDS

    tracer = make_tracer(True, "http://127.0.0.1:9", "j", "g0", 0)  # port 9: nobody listens
    tracer.span("checkpoint", 1.0, step=1)
    t0 = time.monotonic()
    tracer.shutdown()
    assert time.monotonic() - t0 < EXPORT_TIMEOUT_SECONDS + 2.0


def _spans(run) -> list:
    """The spans ``run(metrics)`` makes a rank export, through the SDK's in-memory exporter."""
    pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk is not installed (ftlm[otel])")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
        InMemorySpanExporter,
    )

    exporter = InMemorySpanExporter()
    m = TrainingMetrics("tiny", "g1", 0, tracer=make_tracer(True, "", "tiny", "g1", 0, exporter=exporter))
    run(m)
    m.stop()
    return list(exporter.get_finished_spans())


def test_a_step_has_every_phase_in_order_inside_it() -> None:
    """A step's spans are quorum wait, forward/backward, all-reduce, vote, commit."""
    def step(m: TrainingMetrics) -> None:
        m.on_quorum(quorum_id=2, participants=2, recovering=0, wait_seconds=0.01)
        with m.phase("forward_backward"):
            time.sleep(0.02)  # the phase's own duration is what the span must show
        m.on_allreduce(0.005, nbytes=4096)
        with m.phase("vote"):
            pass
        with m.phase("commit"):
            pass
        m.on_commit(5, loss=1.0, tokens=64, step_seconds=0.1, lr=1e-3)

    spans = _spans(step)
    (parent,) = [s for s in spans if s.name == "step"]
    phases = sorted((s for s in spans if s.parent is not None), key=lambda s: s.start_time)
    assert [s.name for s in phases] == ["quorum", "forward_backward", "allreduce", "vote", "commit"]
    assert all(s.parent.span_id == parent.context.span_id for s in phases)
    assert all(parent.start_time <= s.start_time <= s.end_time <= parent.end_time for s in phases)
    fb = phases[1]
    assert (fb.end_time - fb.start_time) >= 0.02e9
    assert {s.name for s in spans} <= set(SPAN_NAMES)


def test_a_phase_outside_the_list_is_refused() -> None:
    with pytest.raises(ValueError, match="forward_backward, vote, commit"), \
            TrainingMetrics("j", "g0", 0).phase("backward"):
        pass


def test_a_recovery_is_its_transfer_then_its_replay_and_a_snapshot_is_a_span() -> None:
    """A recovery's spans are the snapshot (at the source), the transfer, the replay."""
    def recover(m: TrainingMetrics) -> None:
        m.on_snapshot(0.25, nbytes=1 << 20)
        m.on_recovery(seconds=2.0, nbytes=1 << 20, replay_seconds=0.5, source="g0")

    spans = {s.name: s for s in _spans(recover)}
    recovery, transfer, replay = spans["recovery"], spans["transfer"], spans["replay"]
    assert recovery.attributes["source"] == "g0" and recovery.attributes["bytes"] == 1 << 20
    assert transfer.parent.span_id == replay.parent.span_id == recovery.context.span_id
    assert transfer.start_time == recovery.start_time and replay.end_time == recovery.end_time
    assert transfer.end_time == replay.start_time
    assert (transfer.end_time - transfer.start_time) == pytest.approx(2.0e9, rel=1e-6)
    assert (replay.end_time - replay.start_time) == pytest.approx(0.5e9, rel=1e-6)
    assert spans["snapshot"].parent is None and spans["snapshot"].attributes["bytes"] == 1 << 20
