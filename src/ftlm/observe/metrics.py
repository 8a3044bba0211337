"""Every Prometheus metric ftlm exports, by name, and the per-rank exporter ``TrainingMetrics``.

Responsible for: the names, types and help texts of all metric families (training ranks and the
coordinator; dashboards and tests read them from here), recording what the trainer and the FT
manager report, sampling process and accelerator memory and GPU health (``ftlm.observe.gpu``),
the families computed when Prometheus scrapes (checkpoint age, free space of the run directory,
live ETT from ``ftlm.observe.live``, the bytes and seconds of snapshot transfers, checkpoint reads
and data reads from ``ftlm.observe.iostats``), handing the same reports to the rank's
OpenTelemetry tracer (``ftlm.observe.tracing``: the phases of a step, a recovery's transfer and
replay, a snapshot), and serving one rank's registry over HTTP.

Not responsible for: deciding when to report (the trainer and manager call the ``on_*`` methods),
the coordinator's own bookkeeping (``ftlm.ft.coordinator`` fills the coordinator families), or
the run report (``ftlm.observe.report``).

Conventions (docs/design.md, 'Metrics'): names start with ``ftlm_``, values are in base units
(``_seconds``, ``_bytes``, ``_ratio``, ``_watts``), counters end in ``_total``, and the only labels
are ``job``, ``group`` and ``rank`` (the coordinator's heartbeat age carries ``group``). Each
exporter has its own ``CollectorRegistry``, so several can live in one process (tests, threads).

Counters count per incarnation: a restarted group is a new process whose counters start at 0.
The labels do not include the incarnation, so the restarted group continues the *same* series;
Prometheus's ``rate()``/``increase()`` treat the drop to 0 as a counter reset and stay correct.
Scrape with ``honor_labels: true`` so the exported ``job`` label is kept (otherwise Prometheus
renames it ``exported_job`` in favour of the scrape job's name).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ftlm.errors import ConfigError
from ftlm.observe.config import ObserveConfig
from ftlm.observe.events import Events
from ftlm.observe.gpu import cuda_device, gpu_sampler
from ftlm.observe.iostats import IO_FAMILIES, count_io, io_totals
from ftlm.observe.live import LiveEtt, WatchedEvents
from ftlm.observe.tracing import STEP_PHASES, NullTracer, StepTracer, make_tracer

log = logging.getLogger(__name__)

# The text format would add a "<name>_created" gauge per counter and histogram: a family per metric
# that no dashboard uses and that is not in the tables below. Process-wide, as prometheus_client has it.
disable_created_metrics()

# name -> (type, help). Counters are listed with their ``_total`` suffix, histograms by their base
# name (queries use ``_bucket``/``_sum``/``_count``), exactly as PromQL refers to them.
TRAINING_METRICS: dict[str, tuple[str, str]] = {
    "ftlm_train_step": ("gauge", "Index of the last committed step"),
    "ftlm_train_loss": ("gauge", "Training loss of the last committed step"),
    "ftlm_train_steps_committed_total": ("counter", "Steps this rank committed"),
    "ftlm_train_tokens_total": ("counter", "Tokens this rank trained in committed steps"),
    "ftlm_train_step_duration_seconds": ("histogram", "Wall time of one committed step"),
    "ftlm_train_tokens_per_second": ("gauge", "Tokens per second of this rank in the last committed step"),
    "ftlm_train_mfu_ratio": ("gauge", "Model FLOPs utilisation of the last committed step (0..1)"),
    "ftlm_train_grad_norm": ("gauge", "Global gradient norm of the last committed step"),
    "ftlm_train_learning_rate": ("gauge", "Learning rate of the last committed step"),
    "ftlm_train_data_wait_seconds_total": ("counter", "Seconds spent waiting for the data loader"),
    "ftlm_eval_loss": ("gauge", "Mean cross-entropy on the held-out samples at the last evaluation (NaN before)"),
    "ftlm_process_resident_memory_bytes": ("gauge", "Resident set size of this process"),
    "ftlm_cuda_memory_allocated_bytes": ("gauge", "CUDA memory held by tensors"),
    "ftlm_cuda_memory_reserved_bytes": ("gauge", "CUDA memory reserved by the caching allocator"),
    "ftlm_cuda_memory_peak_bytes": ("gauge", "Peak CUDA memory held by tensors since start"),
    "ftlm_gpu_utilization_ratio": ("gauge", "GPU busy fraction reported by NVML (0..1)"),
    "ftlm_gpu_power_watts": ("gauge", "GPU power draw reported by NVML"),
    "ftlm_gpu_temperature_celsius": ("gauge", "GPU temperature reported by NVML"),
    "ftlm_gpu_memory_used_bytes": ("gauge", "Device memory in use on the GPU (all processes) reported by NVML"),
    "ftlm_ft_quorum_id": ("gauge", "Id of the quorum of the current step"),
    "ftlm_ft_participants": ("gauge", "Replica groups training in the current quorum"),
    "ftlm_ft_recovering": ("gauge", "Replica groups catching up in the current quorum"),
    "ftlm_ft_quorum_wait_seconds": ("histogram", "Seconds waiting for the coordinator's quorum"),
    "ftlm_ft_allreduce_seconds": ("histogram", "Seconds of the cross-group gradient all-reduce"),
    "ftlm_ft_allreduce_bytes_total": ("counter", "Gradient bytes this rank put into the cross-group all-reduce"),
    "ftlm_ft_bytes_per_token": ("gauge", "Bytes this group put on the wire between groups per token it trained, over the committed steps so far"),
    "ftlm_diloco_outer_step_seconds": ("histogram", "Seconds of one DiLoCo synchronisation: outer all-reduce, vote and outer update"),
    "ftlm_diloco_fragment_staleness_steps": ("gauge", "Inner steps between taking the last synchronised fragment's pseudo-gradient and merging its average"),
    "ftlm_ft_steps_failed_total": ("counter", "Steps this rank voted not to commit"),
    "ftlm_ft_recoveries_total": ("counter", "Completed recoveries from a healthy peer"),
    "ftlm_ft_recovery_duration_seconds": ("histogram", "Seconds of one recovery from a healthy peer"),
    "ftlm_ft_recovery_bytes_total": ("counter", "Bytes of state received while recovering"),
    "ftlm_ft_catchup_lag_steps": ("gauge", "Steps this group is behind the participants"),
    "ftlm_ft_stall_seconds": ("histogram", "Stall per failure or rejoin as seen by this group"),
    "ftlm_ft_snapshot_seconds": ("histogram", "Seconds to copy the state into a snapshot a recovering peer can fetch"),
    "ftlm_checkpoint_write_seconds": ("histogram", "Seconds to write one durable checkpoint (save to marker)"),
    "ftlm_checkpoint_written_bytes_total": ("counter", "Bytes of durable checkpoints this rank wrote"),
    "ftlm_checkpoint_last_saved_timestamp_seconds": ("gauge", "Unix time of the newest durable checkpoint"),
    "ftlm_checkpoint_age_seconds": ("gauge", "Seconds since the newest durable checkpoint"),
    "ftlm_run_dir_free_bytes": ("gauge", "Free bytes on the file system of the run directory"),
    "ftlm_train_ett_ratio": ("gauge", "Effective training time so far as this group saw it, as summary.json computes it (0..1)"),
    **{name: ("counter", help_text) for name, (_, _, help_text) in IO_FAMILIES.items()},
}

LAZY = frozenset(("ftlm_cuda_memory_allocated_bytes", "ftlm_cuda_memory_reserved_bytes",
                  "ftlm_cuda_memory_peak_bytes", "ftlm_gpu_utilization_ratio", "ftlm_gpu_power_watts",
                  "ftlm_gpu_temperature_celsius", "ftlm_gpu_memory_used_bytes"))
"""Families with a series only once a value exists: without a GPU they are not exported at all."""
AT_SCRAPE = ("ftlm_checkpoint_last_saved_timestamp_seconds", "ftlm_checkpoint_age_seconds",
             "ftlm_run_dir_free_bytes", "ftlm_train_ett_ratio")
"""Families computed when Prometheus scrapes (``_ScrapeTimeCollector``), each exported once known."""
IO_COUNTERS = tuple(IO_FAMILIES)
"""Counters read from the process's ``ftlm.observe.iostats`` tally when Prometheus scrapes
(always exported, 0 until something moved)."""
TRANSFER_DIRECTIONS = ("received", "sent")
"""``on_transfer`` directions: a snapshot fetched from a peer, or served to one."""
CHECKPOINT_MARKER = "COMPLETE"
"""The file that makes a checkpoint directory valid (``ftlm.train.checkpoint.MARKER``; observe may
not import train): its modification time is the checkpoint's time."""

COORDINATOR_METRICS: dict[str, tuple[str, str]] = {
    "ftlm_coordinator_quorum_id": ("gauge", "Id of the latest issued quorum"),
    "ftlm_coordinator_members": ("gauge", "Replica groups with a fresh heartbeat"),
    "ftlm_coordinator_members_participating": ("gauge", "Members training in the latest quorum"),
    "ftlm_coordinator_members_spare": ("gauge", "Hot spares in the latest quorum: current, training nothing"),
    "ftlm_coordinator_members_recovering": ("gauge", "Members catching up in the latest quorum"),
    "ftlm_coordinator_members_joining": ("gauge", "Live members not in the latest quorum yet"),
    "ftlm_coordinator_members_dead": ("gauge", "Members declared dead or replaced recently"),
    "ftlm_coordinator_participants": ("gauge", "Participants in the latest issued quorum"),
    "ftlm_coordinator_heartbeat_age_seconds": ("gauge", "Seconds since a group's last heartbeat"),
    "ftlm_coordinator_quorums_issued_total": ("counter", "Quorums issued (one per step)"),
    "ftlm_coordinator_member_failures_total": ("counter", "Members declared dead or replaced"),
    "ftlm_coordinator_kill_requests_total": ("counter", "Chaos kills requested through POST /v1/kill"),
    "ftlm_coordinator_state_mismatches_total": ("counter", "Groups whose state digest differed from the others' (retired)"),
    "ftlm_coordinator_spare_promotions_total": ("counter", "Spares that took a failed participant's place"),
    "ftlm_coordinator_spare_promotion_seconds": ("gauge", "Seconds from the coordinator knowing a participant gone to its spare's promotion (latest)"),
    "ftlm_coordinator_quorum_latency_seconds": ("histogram", "Seconds from a round's first request to its quorum"),
}

CHECKPOINT_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
RECOVERY_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

LABELS = ("job", "group", "rank")


def metric_names() -> set[str]:
    """Every family ftlm exports (training ranks and coordinator), as PromQL names them."""
    return set(TRAINING_METRICS) | set(COORDINATOR_METRICS)


def make_metric(name: str, registry: CollectorRegistry, labels: tuple[str, ...] = (),
                buckets: tuple[float, ...] = WAIT_BUCKETS) -> Any:
    """Create the family ``name`` (looked up in the tables above) in ``registry``."""
    table = TRAINING_METRICS if name in TRAINING_METRICS else COORDINATOR_METRICS
    kind, help_text = table[name]
    if kind == "counter":
        return Counter(name.removesuffix("_total"), help_text, labels, registry=registry)
    if kind == "histogram":
        return Histogram(name, help_text, labels, buckets=buckets, registry=registry)
    return Gauge(name, help_text, labels, registry=registry)


def _rss_bytes() -> int:
    """Current resident set size; /proc on Linux, else the peak from getrusage (best available)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


class TrainingMetrics:
    """The metrics of one rank of one replica group, served on ``host:port`` once started.

    ``job``, ``group`` and ``rank`` become the labels of every series. Methods may be called from
    any thread; each updates a few prometheus_client values (lock-free reads for the scraper).
    """

    def __init__(self, job: str, group: str, rank: int | str, port: int = 0, host: str = "127.0.0.1",
                 tracer: NullTracer | StepTracer | None = None) -> None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ConfigError(f"metrics port={port!r} must be an integer in [0, 65535] (0: any free port)")
        self.job, self.group, self.rank = str(job), str(group), str(rank)
        self.host, self._want_port = host, port
        self.registry = CollectorRegistry(auto_describe=True)
        self._values = (self.job, self.group, self.rank)
        buckets = {"ftlm_train_step_duration_seconds": STEP_BUCKETS,
                   "ftlm_ft_recovery_duration_seconds": RECOVERY_BUCKETS,
                   "ftlm_ft_stall_seconds": RECOVERY_BUCKETS,
                   "ftlm_ft_snapshot_seconds": RECOVERY_BUCKETS,
                   "ftlm_diloco_outer_step_seconds": STEP_BUCKETS,
                   "ftlm_checkpoint_write_seconds": CHECKPOINT_BUCKETS}
        self._families = {name: make_metric(name, self.registry, LABELS, buckets.get(name, WAIT_BUCKETS))
                          for name in TRAINING_METRICS if name not in AT_SCRAPE + IO_COUNTERS}
        # One child per family: the label values are fixed for the life of this exporter. The
        # LAZY families get theirs on their first value (see _set).
        self._m: dict[str, Any] = {name: family.labels(*self._values)
                                   for name, family in self._families.items() if name not in LAZY}
        self.tracer = tracer if tracer is not None else NullTracer()
        self.live = LiveEtt()
        self._storage: tuple[Path, Path | None] | None = None  # (run dir, checkpoints dir)
        self._saved_at: float | None = None  # unix time of this process's newest checkpoint
        self.registry.register(_ScrapeTimeCollector(self))
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._gpu: Any = None  # None: not tried yet (no CUDA in use yet); False: unavailable
        self._step_started: float | None = None  # monotonic end of the previous step (tracing)
        self._last_step = -1  # the last committed step: a failed attempt is of the one after it
        self._wire = [0, 0]  # bytes put on the wire between groups, tokens trained (committed)
        self._m["ftlm_eval_loss"].set(float("nan"))  # no evaluation yet; 0 would read as a loss

    def _set(self, name: str, value: float) -> None:
        child = self._m.get(name)
        if child is None:
            child = self._m[name] = self._families[name].labels(*self._values)
        child.set(value)

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("TrainingMetrics is not started; call start() first")
        return int(self._server.server_port)

    def start(self) -> int:
        """Serve ``/metrics`` from a daemon thread; returns the port (the chosen one if 0 was given)."""
        if self._server is not None:
            raise RuntimeError("TrainingMetrics.start() called twice; create a new one instead")
        try:
            self._server, self._thread = start_http_server(self._want_port, self.host, registry=self.registry)
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {self.host}:{self._want_port}: {e} "
                              "(choose another observe metrics port, or 0 for any free port)") from e
        return self.port

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and join the server thread (bounded), flush the tracer; safe to call twice."""
        tracer, self.tracer = self.tracer, NullTracer()
        tracer.shutdown()
        if self._gpu:
            self._gpu.close()
            self._gpu = False
        server, thread = self._server, self._thread
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("metrics server thread of %s/%s did not stop in %.1f s", self.group, self.rank, timeout)
        self._server = self._thread = None

    # ------------------------------------------------------------------------------ training

    def on_commit(self, step: int, loss: float | None, tokens: int, step_seconds: float, lr: float,
                  grad_norm: float | None = None, mfu: float | None = None,
                  data_wait_seconds: float = 0.0) -> None:
        """A step was committed: ``tokens`` trained by this rank in ``step_seconds`` wall seconds."""
        m = self._m
        m["ftlm_train_step"].set(step)
        if loss is not None:
            m["ftlm_train_loss"].set(loss)
        m["ftlm_train_steps_committed_total"].inc()
        m["ftlm_train_tokens_total"].inc(max(tokens, 0))
        m["ftlm_train_step_duration_seconds"].observe(max(step_seconds, 0.0))
        if step_seconds > 0:
            m["ftlm_train_tokens_per_second"].set(tokens / step_seconds)
        m["ftlm_train_learning_rate"].set(lr)
        if grad_norm is not None:
            m["ftlm_train_grad_norm"].set(grad_norm)
        if mfu is not None:
            m["ftlm_train_mfu_ratio"].set(mfu)
        m["ftlm_train_data_wait_seconds_total"].inc(max(data_wait_seconds, 0.0))
        self.tracer.end_step(step, step_seconds, "commit", tokens=tokens)
        self._step_started, self._last_step = time.monotonic(), step

    def on_wire(self, nbytes: int, tokens: int) -> None:
        """A committed step put ``nbytes`` on the wire between groups for ``tokens`` this group
        trained in it (every step: its gradient; DiLoCo: one outer gradient per inner phase)."""
        self._wire[0] += max(nbytes, 0)
        self._wire[1] += max(tokens, 0)
        if self._wire[1]:
            self._m["ftlm_ft_bytes_per_token"].set(self._wire[0] / self._wire[1])

    def on_outer_step(self, seconds: float, staleness: int) -> None:
        """A DiLoCo synchronisation committed after ``seconds`` (exchange, vote, outer update);
        its average was merged ``staleness`` inner steps after its pseudo-gradient was taken."""
        self._m["ftlm_diloco_outer_step_seconds"].observe(max(seconds, 0.0))
        self._m["ftlm_diloco_fragment_staleness_steps"].set(staleness)

    def on_step_failed(self, step: int | None = None) -> None:
        """Step ``step`` failed (default: the one after the last committed step)."""
        self._m["ftlm_ft_steps_failed_total"].inc()
        now = time.monotonic()
        seconds = now - self._step_started if self._step_started is not None else 0.0
        self.tracer.end_step(self._last_step + 1 if step is None else step, seconds, "failed")
        self._step_started = now

    def on_recovering_step(self, step: int, seconds: float, committed: bool) -> None:
        """Step ``step``, which this group took part in while recovering (no data of its own:
        its all-reduce and vote), ended after ``seconds``; ``committed``: the participants'
        vote. Its span carries ``recovering``; it counts as neither a commit of this group nor
        a failed step (the participants count theirs)."""
        self.tracer.end_step(step, seconds, "commit" if committed else "failed", recovering=True)
        self._step_started = time.monotonic()

    def on_eval(self, loss: float) -> None:
        """The held-out loss of the model just evaluated (ftlm.train.evaluate)."""
        self._m["ftlm_eval_loss"].set(loss)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase ``name`` of the current step (``STEP_PHASES``: forward_backward,
        vote, commit); its span is exported with the step. Wraps the trainer's own lines:
        ``with metrics.phase("forward_backward"): loss = ...``."""
        if name not in STEP_PHASES:
            raise ValueError(f"phase name={name!r} is not one of {', '.join(STEP_PHASES)}")
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.tracer.phase(name, time.monotonic() - t0)

    # ---------------------------------------------------------------------- fault tolerance

    def on_quorum(self, quorum_id: int, participants: int, recovering: int, wait_seconds: float) -> None:
        """The quorum of a step arrived after ``wait_seconds``; counts of groups, not lists."""
        self._m["ftlm_ft_quorum_id"].set(quorum_id)
        self._m["ftlm_ft_participants"].set(participants)
        self._m["ftlm_ft_recovering"].set(recovering)
        self._m["ftlm_ft_quorum_wait_seconds"].observe(max(wait_seconds, 0.0))
        self.tracer.phase("quorum", wait_seconds, quorum_id=quorum_id, participants=participants,
                          recovering=recovering)

    def on_allreduce(self, seconds: float, nbytes: int = 0) -> None:
        """The cross-group all-reduce of a step took ``seconds`` for ``nbytes`` of this rank's
        gradient (bytes over seconds is the rate per link that dashboards show)."""
        self._m["ftlm_ft_allreduce_seconds"].observe(max(seconds, 0.0))
        self._m["ftlm_ft_allreduce_bytes_total"].inc(max(nbytes, 0))
        self.tracer.phase("allreduce", seconds, bytes=max(nbytes, 0))

    def on_recovery(self, seconds: float, nbytes: int, replay_seconds: float = 0.0,
                    source: str = "") -> None:
        """A recovery from a healthy peer (``source``) completed: ``nbytes`` of its snapshot
        arrived ``seconds`` after the fetch started, then the buffered updates were replayed in
        ``replay_seconds``. Its span has the ``transfer`` and ``replay`` spans as children."""
        seconds, replay_seconds = max(seconds, 0.0), max(replay_seconds, 0.0)
        self._m["ftlm_ft_recoveries_total"].inc()
        self._m["ftlm_ft_recovery_duration_seconds"].observe(seconds + replay_seconds)
        self._m["ftlm_ft_recovery_bytes_total"].inc(max(nbytes, 0))
        self.tracer.span("recovery", seconds + replay_seconds,
                         children=(("transfer", seconds), ("replay", replay_seconds)),
                         bytes=max(nbytes, 0), source=source)

    def on_transfer(self, direction: str, nbytes: int, seconds: float, peer: str = "") -> None:
        """A snapshot transfer ended: ``nbytes`` ``received`` from or ``sent`` to ``peer`` in
        ``seconds`` (the process's ``iostats`` tally, exported as
        ``ftlm_ft_transfer_{direction}_{bytes,seconds}_total``; the peer is not a label)."""
        if direction not in TRANSFER_DIRECTIONS:
            raise ValueError(f"on_transfer direction={direction!r} is not one of "
                             f"{', '.join(TRANSFER_DIRECTIONS)}")
        count_io(f"transfer_{direction}", nbytes, seconds)

    def on_snapshot(self, seconds: float, nbytes: int) -> None:
        """This group copied ``nbytes`` of its state into a snapshot for a recovering peer in
        ``seconds`` (a helper thread, overlapping a step: a span of its own, not a step phase)."""
        self._m["ftlm_ft_snapshot_seconds"].observe(max(seconds, 0.0))
        self.tracer.span("snapshot", seconds, bytes=max(nbytes, 0))

    def on_catchup_lag(self, steps: int) -> None:
        self._m["ftlm_ft_catchup_lag_steps"].set(max(steps, 0))

    def on_stall(self, seconds: float) -> None:
        """This (healthy) group waited ``seconds`` longer than a normal step because of a failure."""
        self._m["ftlm_ft_stall_seconds"].observe(max(seconds, 0.0))

    # ----------------------------------------------------------------- storage and the record

    def on_checkpoint(self, step: int, seconds: float, path: Path | str) -> None:
        """A durable checkpoint of ``step`` is complete in ``path`` after ``seconds``; its bytes
        are the files in ``path`` (this rank's share when several ranks write)."""
        nbytes = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        self._m["ftlm_checkpoint_write_seconds"].observe(max(seconds, 0.0))
        self._m["ftlm_checkpoint_written_bytes_total"].inc(nbytes)
        self._saved_at = time.time()
        self.tracer.span("checkpoint", seconds, step=step, bytes=nbytes)

    def watch_storage(self, run_dir: Path | str, checkpoints: Path | str | None = None) -> None:
        """Export the free space of ``run_dir``'s file system and, from ``checkpoints`` (the
        durable checkpoints' root, shared or not), the time and age of the newest one; both are
        read when Prometheus scrapes."""
        self._storage = (Path(run_dir), Path(checkpoints) if checkpoints is not None else None)

    def watch_events(self, events: Events) -> Events:
        """``events``, wrapped so that every event emitted also feeds the live ETT gauge."""
        return WatchedEvents(events, self.live)

    def _newest_checkpoint(self) -> float | None:
        times = [self._saved_at] if self._saved_at is not None else []
        root = self._storage[1] if self._storage else None
        if root is not None:
            for marker in root.glob(f"*/{CHECKPOINT_MARKER}"):
                try:
                    times.append(marker.stat().st_mtime)
                except OSError:
                    continue  # rotated away meanwhile
        return max(times, default=None)

    def at_scrape(self) -> dict[str, float]:
        """The ``AT_SCRAPE`` families that have a value now, by name."""
        got: dict[str, float] = {}
        newest = self._newest_checkpoint()
        if newest is not None:
            got["ftlm_checkpoint_last_saved_timestamp_seconds"] = newest
            got["ftlm_checkpoint_age_seconds"] = max(0.0, time.time() - newest)
        if self._storage is not None:
            try:
                got["ftlm_run_dir_free_bytes"] = float(shutil.disk_usage(self._storage[0]).free)
            except OSError:
                pass  # the directory is gone (end of a test, an unmounted volume): not known
        ett = self.live.value()
        if ett is not None:
            got["ftlm_train_ett_ratio"] = ett
        return got

    @staticmethod
    def io_counters() -> dict[str, float]:
        """The ``IO_COUNTERS`` families now, by name (the process's ``iostats`` tally)."""
        totals = io_totals()
        return {name: float(totals[kind][0 if unit == "bytes" else 1])
                for name, (kind, unit, _) in IO_FAMILIES.items()}

    # -------------------------------------------------------------------------------- memory

    def sample_memory(self) -> dict[str, float]:
        """Read RSS, and on CUDA the allocator and NVML figures; returns what was set, by name.

        Cheap enough to call once per step (NVML adds about a millisecond on a GPU machine).
        """
        got: dict[str, float] = {"ftlm_process_resident_memory_bytes": float(_rss_bytes())}
        cuda = cuda_device()
        if cuda is not None:
            torch, dev = cuda
            got["ftlm_cuda_memory_allocated_bytes"] = float(torch.cuda.memory_allocated(dev))
            got["ftlm_cuda_memory_reserved_bytes"] = float(torch.cuda.memory_reserved(dev))
            got["ftlm_cuda_memory_peak_bytes"] = float(torch.cuda.max_memory_allocated(dev))
            if self._gpu is None:  # first sample with CUDA in use: find NVML once
                self._gpu = gpu_sampler(torch, dev) or False
        if self._gpu:
            got.update(self._gpu.sample())
        for name, value in got.items():
            self._set(name, value)
        return got


class _ScrapeTimeCollector:
    """Yields a rank's ``AT_SCRAPE`` families, computed when Prometheus asks."""

    def __init__(self, metrics: TrainingMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        return ([GaugeMetricFamily(name, TRAINING_METRICS[name][1], labels=LABELS) for name in AT_SCRAPE]
                + [CounterMetricFamily(name.removesuffix("_total"), TRAINING_METRICS[name][1], labels=LABELS)
                   for name in IO_COUNTERS])

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        values = self.metrics.at_scrape()
        labels = list(self.metrics._values)
        for name in AT_SCRAPE:
            if name in values:
                family = GaugeMetricFamily(name, TRAINING_METRICS[name][1], labels=LABELS)
                family.add_metric(labels, values[name])
                yield family
        for name, value in self.metrics.io_counters().items():
            counter = CounterMetricFamily(name.removesuffix("_total"), TRAINING_METRICS[name][1],
                                          labels=LABELS)
            counter.add_metric(labels, value)
            yield counter


class NullMetrics:
    """The metrics of a run that exports none: every method does nothing."""

    port = 0

    def start(self) -> int:
        return 0

    def stop(self, timeout: float = 5.0) -> None:
        pass

    def on_commit(self, step: int, loss: float | None, tokens: int, step_seconds: float, lr: float,
                  grad_norm: float | None = None, mfu: float | None = None,
                  data_wait_seconds: float = 0.0) -> None:
        pass

    def on_wire(self, nbytes: int, tokens: int) -> None:
        pass

    def on_outer_step(self, seconds: float, staleness: int) -> None:
        pass

    def on_step_failed(self, step: int | None = None) -> None:
        pass

    def on_recovering_step(self, step: int, seconds: float, committed: bool) -> None:
        pass

    def on_eval(self, loss: float) -> None:
        pass

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def on_quorum(self, quorum_id: int, participants: int, recovering: int, wait_seconds: float) -> None:
        pass

    def on_allreduce(self, seconds: float, nbytes: int = 0) -> None:
        pass

    def on_recovery(self, seconds: float, nbytes: int, replay_seconds: float = 0.0,
                    source: str = "") -> None:
        pass

    def on_transfer(self, direction: str, nbytes: int, seconds: float, peer: str = "") -> None:
        pass

    def on_snapshot(self, seconds: float, nbytes: int) -> None:
        pass

    def on_catchup_lag(self, steps: int) -> None:
        pass

    def on_stall(self, seconds: float) -> None:
        pass

    def on_checkpoint(self, step: int, seconds: float, path: Path | str) -> None:
        pass

    def watch_storage(self, run_dir: Path | str, checkpoints: Path | str | None = None) -> None:
        pass

    def watch_events(self, events: Events) -> Events:
        return events

    def at_scrape(self) -> dict[str, float]:
        return {}

    @staticmethod
    def io_counters() -> dict[str, float]:
        return {}

    def sample_memory(self) -> dict[str, float]:
        return {}


def start_rank_metrics(config: ObserveConfig, job: str, group: str, rank: int,
                       run_dir: Path | str | None = None, checkpoints: Path | str | None = None,
                       ) -> tuple[TrainingMetrics | NullMetrics, int]:
    """The metrics (and tracer) of one training rank as ``config`` asks, started; returns them
    with the port they serve on (0 when not serving).

    Metrics on: served on ``FTLM_METRICS_PORT`` (what the launchers set), else
    ``observe.metrics_port + rank`` when a base port is configured, else a free port. Tracing on
    and metrics off: the same reports feed the tracer, nothing is served. Both off: ``NullMetrics``.
    ``run_dir`` and ``checkpoints`` turn on the storage families (``TrainingMetrics.watch_storage``).
    """
    if not config.metrics and not config.tracing:
        return NullMetrics(), 0
    tracer = make_tracer(config.tracing, config.otlp_endpoint, job, group, rank)
    from_env = os.environ.get("FTLM_METRICS_PORT", "")
    try:
        port = int(from_env or 0) or (config.metrics_port + rank if config.metrics_port else 0)
    except ValueError:
        raise ConfigError(f"FTLM_METRICS_PORT={from_env!r} must be a port number") from None
    metrics = TrainingMetrics(job=job, group=group, rank=rank, port=port, host=config.metrics_host,
                              tracer=tracer)
    if run_dir is not None:
        metrics.watch_storage(run_dir, checkpoints)
    return metrics, metrics.start() if config.metrics else 0
