"""Every Prometheus metric ftlm exports, by name, and the per-rank exporter ``TrainingMetrics``.

Responsible for: the names, types and help texts of all metric families (training ranks and the
coordinator; dashboards and tests read them from here), recording what the trainer and the FT
manager report, sampling process and accelerator memory, and serving one rank's registry over HTTP.

Not responsible for: deciding when to report (the trainer and manager call the ``on_*`` methods),
the coordinator's own bookkeeping (``ftlm.ft.coordinator`` fills the coordinator families), or
the run report (``ftlm.observe.report``).

Conventions (DESIGN.md section 10): names start with ``ftlm_``, values are in base units
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

import logging
import os
import resource
import sys
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, start_http_server

from ftlm.errors import ConfigError

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
    "ftlm_ft_quorum_id": ("gauge", "Id of the quorum of the current step"),
    "ftlm_ft_participants": ("gauge", "Replica groups training in the current quorum"),
    "ftlm_ft_recovering": ("gauge", "Replica groups catching up in the current quorum"),
    "ftlm_ft_quorum_wait_seconds": ("histogram", "Seconds waiting for the coordinator's quorum"),
    "ftlm_ft_allreduce_seconds": ("histogram", "Seconds of the cross-group gradient all-reduce"),
    "ftlm_ft_steps_failed_total": ("counter", "Steps this rank voted not to commit"),
    "ftlm_ft_recoveries_total": ("counter", "Completed recoveries from a healthy peer"),
    "ftlm_ft_recovery_duration_seconds": ("histogram", "Seconds of one recovery from a healthy peer"),
    "ftlm_ft_recovery_bytes_total": ("counter", "Bytes of state received while recovering"),
    "ftlm_ft_catchup_lag_steps": ("gauge", "Steps this group is behind the participants"),
    "ftlm_ft_stall_seconds": ("histogram", "Stall per failure or rejoin as seen by this group"),
}

COORDINATOR_METRICS: dict[str, tuple[str, str]] = {
    "ftlm_coordinator_quorum_id": ("gauge", "Id of the latest issued quorum"),
    "ftlm_coordinator_members": ("gauge", "Replica groups with a fresh heartbeat"),
    "ftlm_coordinator_members_participating": ("gauge", "Members training in the latest quorum"),
    "ftlm_coordinator_members_recovering": ("gauge", "Members catching up in the latest quorum"),
    "ftlm_coordinator_members_joining": ("gauge", "Live members not in the latest quorum yet"),
    "ftlm_coordinator_members_dead": ("gauge", "Members declared dead or replaced recently"),
    "ftlm_coordinator_participants": ("gauge", "Participants in the latest issued quorum"),
    "ftlm_coordinator_heartbeat_age_seconds": ("gauge", "Seconds since a group's last heartbeat"),
    "ftlm_coordinator_quorums_issued_total": ("counter", "Quorums issued (one per step)"),
    "ftlm_coordinator_member_failures_total": ("counter", "Members declared dead or replaced"),
    "ftlm_coordinator_kill_requests_total": ("counter", "Chaos kills requested through POST /v1/kill"),
    "ftlm_coordinator_quorum_latency_seconds": ("histogram", "Seconds from a round's first request to its quorum"),
}

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

    def __init__(self, job: str, group: str, rank: int | str, port: int = 0, host: str = "127.0.0.1") -> None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ConfigError(f"metrics port={port!r} must be an integer in [0, 65535] (0: any free port)")
        self.job, self.group, self.rank = str(job), str(group), str(rank)
        self.host, self._want_port = host, port
        self.registry = CollectorRegistry(auto_describe=True)
        values = (self.job, self.group, self.rank)
        buckets = {"ftlm_train_step_duration_seconds": STEP_BUCKETS,
                   "ftlm_ft_recovery_duration_seconds": RECOVERY_BUCKETS,
                   "ftlm_ft_stall_seconds": RECOVERY_BUCKETS}
        # One child per family: the label values are fixed for the life of this exporter.
        self._m: dict[str, Any] = {
            name: make_metric(name, self.registry, LABELS, buckets.get(name, WAIT_BUCKETS)).labels(*values)
            for name in TRAINING_METRICS
        }
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._gpu_failed = False  # NVML missing or broken: stop asking (and logging) every sample
        self._m["ftlm_eval_loss"].set(float("nan"))  # no evaluation yet; 0 would read as a loss

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
        """Stop serving and join the server thread (bounded); safe to call twice."""
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

    def on_step_failed(self) -> None:
        self._m["ftlm_ft_steps_failed_total"].inc()

    def on_eval(self, loss: float) -> None:
        """The held-out loss of the model just evaluated (ftlm.train.evaluate)."""
        self._m["ftlm_eval_loss"].set(loss)

    # ---------------------------------------------------------------------- fault tolerance

    def on_quorum(self, quorum_id: int, participants: int, recovering: int, wait_seconds: float) -> None:
        """The quorum of a step arrived after ``wait_seconds``; counts of groups, not lists."""
        self._m["ftlm_ft_quorum_id"].set(quorum_id)
        self._m["ftlm_ft_participants"].set(participants)
        self._m["ftlm_ft_recovering"].set(recovering)
        self._m["ftlm_ft_quorum_wait_seconds"].observe(max(wait_seconds, 0.0))

    def on_allreduce(self, seconds: float) -> None:
        self._m["ftlm_ft_allreduce_seconds"].observe(max(seconds, 0.0))

    def on_recovery(self, seconds: float, nbytes: int) -> None:
        """A recovery from a healthy peer completed, receiving ``nbytes`` in ``seconds``."""
        self._m["ftlm_ft_recoveries_total"].inc()
        self._m["ftlm_ft_recovery_duration_seconds"].observe(max(seconds, 0.0))
        self._m["ftlm_ft_recovery_bytes_total"].inc(max(nbytes, 0))

    def on_catchup_lag(self, steps: int) -> None:
        self._m["ftlm_ft_catchup_lag_steps"].set(max(steps, 0))

    def on_stall(self, seconds: float) -> None:
        """This (healthy) group waited ``seconds`` longer than a normal step because of a failure."""
        self._m["ftlm_ft_stall_seconds"].observe(max(seconds, 0.0))

    # -------------------------------------------------------------------------------- memory

    def sample_memory(self) -> dict[str, float]:
        """Read RSS, and on CUDA the allocator and NVML figures; returns what was set, by name.

        Cheap enough to call once per step (NVML adds about a millisecond on a GPU machine).
        """
        got: dict[str, float] = {"ftlm_process_resident_memory_bytes": float(_rss_bytes())}
        torch = sys.modules.get("torch")  # never import torch just for metrics
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            dev = torch.cuda.current_device()
            got["ftlm_cuda_memory_allocated_bytes"] = float(torch.cuda.memory_allocated(dev))
            got["ftlm_cuda_memory_reserved_bytes"] = float(torch.cuda.memory_reserved(dev))
            got["ftlm_cuda_memory_peak_bytes"] = float(torch.cuda.max_memory_allocated(dev))
            got.update(self._nvml(torch, dev))
        for name, value in got.items():
            self._m[name].set(value)
        return got

    def _nvml(self, torch: Any, dev: int) -> dict[str, float]:
        # torch maps the device through CUDA_VISIBLE_DEVICES to NVML's index for us; it needs
        # pynvml (package nvidia-ml-py), which is optional, so its absence only disables these two.
        if self._gpu_failed:
            return {}
        try:
            return {"ftlm_gpu_utilization_ratio": torch.cuda.utilization(dev) / 100.0,
                    "ftlm_gpu_power_watts": torch.cuda.power_draw(dev) / 1000.0}  # NVML reports mW
        except Exception as e:  # noqa: BLE001 - ModuleNotFoundError, NVML errors: both mean "not here"
            self._gpu_failed = True
            log.info("GPU utilisation and power not exported (install nvidia-ml-py for them): %s", e)
            return {}


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

    def on_step_failed(self) -> None:
        pass

    def on_eval(self, loss: float) -> None:
        pass

    def on_quorum(self, quorum_id: int, participants: int, recovering: int, wait_seconds: float) -> None:
        pass

    def on_allreduce(self, seconds: float) -> None:
        pass

    def on_recovery(self, seconds: float, nbytes: int) -> None:
        pass

    def on_catchup_lag(self, steps: int) -> None:
        pass

    def on_stall(self, seconds: float) -> None:
        pass

    def sample_memory(self) -> dict[str, float]:
        return {}
