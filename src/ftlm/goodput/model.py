"""What the goodput simulator simulates: one training job at replica-group granularity.

``JobModel`` holds every parameter of a simulated job (layout, failure rate, how long each phase
of a failure takes, the recovery scheme, spot capacity) and validates them; ``failure`` anchors
and the Young/Daly checkpoint interval are the small formulas around it. This module does not
simulate anything (``ftlm.goodput.engine`` does) and does not read runs
(``ftlm.goodput.calibrate`` does).

Time is in seconds throughout. Work is measured in *full-job seconds*: one second of training
with every one of the ``groups`` groups participating; ETT is work done over wall time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from ftlm.errors import ConfigError

MODES = ("ft", "checkpoint_restart")
"""``ft``: a failed group restarts alone while the others train on (FT-HSDP, ftlm);
``checkpoint_restart``: any failure stops the whole job, which restarts from its last checkpoint."""

LLAMA3_GPU_MTBF_HOURS = 54 * 24 * 16_384 / 466
"""Per-GPU mean time between job interruptions implied by Llama 3 (466 interruptions in 54 days
on 16,384 GPUs): about 45,600 GPU-hours."""
FT_HSDP_GPU_MTBF_HOURS = 18 / 60 * 98_304
"""Per-GPU MTBF implied by the FT-HSDP paper (a failure every ~18 minutes on 98,304 GPUs):
about 29,500 GPU-hours."""


def young_daly_interval(checkpoint_cost: float, mtbf: float) -> float:
    """The checkpoint interval that minimises the expected lost time, ``sqrt(2 C M)`` (Young's
    first-order optimum; Daly's higher-order correction changes it by under 5% while ``C`` is
    under a tenth of ``M``)."""
    if checkpoint_cost <= 0 or mtbf <= 0:
        raise ConfigError(f"young_daly_interval: checkpoint_cost={checkpoint_cost} and "
                          f"mtbf={mtbf} must both be > 0")
    return math.sqrt(2.0 * checkpoint_cost * mtbf)


def _number(name: str, value: object, low: float, high: float = math.inf,
            low_open: bool = False) -> None:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if low_open else value >= low) and value <= high)
    if not ok:
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        upper = "" if high == math.inf else f" and <= {high:g}"
        raise ConfigError(f"{name}={value!r} is out of range; valid: a number {bound}{upper}")


@dataclass(frozen=True)
class JobModel:
    """One simulated training job: layout, failures, recovery, capacity."""

    groups: int = 12
    """Replica groups that train (the job's full speed needs all of them)."""
    gpus_per_group: int = 8192
    """GPUs in each replica group; any one failing takes its whole group down."""
    spares: int = 0
    """Spare groups kept started and current (they apply every committed step, as ftlm's do): a
    current spare trains in a failed group's place ``promotion`` seconds after the failure, with
    no catch-up; the repaired group catches up and becomes a spare (current ``catchup`` seconds
    after its restart)."""
    promotion: float | None = None
    """ft: seconds from a training group's failure until a current spare trains in its place
    (the next quorum); None: ``detection``."""
    gpu_mtbf_hours: float = FT_HSDP_GPU_MTBF_HOURS
    """Mean time between failures of one GPU, in hours; the job sees one failure every
    ``gpu_mtbf_hours * 3600 / allocated GPUs`` seconds (allocated: training and spare groups)."""
    mode: str = "ft"
    """Recovery scheme: ft (only the failed group restarts) or checkpoint_restart (everyone)."""
    detection: float = 60.0
    """Seconds from a failure until the job notices it (heartbeat or collective timeout)."""
    stall: float = 180.0
    """ft: seconds every group stops per failure of a training group, detection included (new
    quorum, new process group, the interrupted step redone). Must be >= ``detection``."""
    restart: float = 420.0
    """Seconds from a failure until the failed group (ft) or the whole job (checkpoint_restart)
    runs again: rescheduling, process start, model and data set-up; counted from the failure."""
    state_bytes_per_gpu: float = 0.0
    """ft: bytes of replicated state (parameters and optimizer moments) each GPU of a joining
    group fetches from a peer."""
    catchup_bandwidth: float = 10e9
    """ft: bytes per second one GPU of a joining group receives its state at."""
    catchup_extra: float = 0.0
    """ft: seconds of catch-up beyond the transfer (checksums, replaying buffered updates)."""
    rejoin_stall: float = 0.0
    """ft: seconds every group stops when a group rejoins (a quorum change, a snapshot served)."""
    checkpoint_cost: float = 10.0
    """checkpoint_restart: seconds the job stops to write one checkpoint (its blocking part)."""
    checkpoint_interval: float = 0.0
    """checkpoint_restart: seconds of training between checkpoints; 0: the Young/Daly optimum
    ``sqrt(2 * checkpoint_cost * job MTBF)``."""
    startup: float = 0.0
    """Seconds from the job's launch to its first step (counted once, as lost time)."""
    teardown: float = 0.0
    """Seconds from the last step to the end of the job (saving, exiting), counted once as lost
    time; no failure strikes then."""
    duration: float = 30 * 86400.0
    """Simulated wall time, in seconds."""
    speed_by_participants: tuple[float, ...] = ()
    """Job speed with P of ``groups`` groups training, for P = 1..groups, as a fraction of full
    speed; empty: P / groups (each group brings its own GPUs). A measured curve comes from
    ``ftlm simulate --calibrate``; up to 4, since on a loaded CPU box fewer groups can commit
    tokens faster than the calibration's reference rate."""
    protect_last: bool = False
    """Failures never strike the last training group (the local launcher's chaos spares it so
    that the job survives); off for hardware, which spares nobody."""
    failure_trace: tuple[tuple[float, int], ...] = ()
    """Replay these failures, ``(seconds from the start, group index)``, instead of drawing them
    (a real run's, from ``--calibrate``: it separates the model's error from the luck of the
    draw); empty: failures at the rate of ``gpu_mtbf_hours``."""
    spot_preemptions_per_gpu_hour: float = 0.0
    """Spot capacity: preemptions per GPU-hour (0: on-demand capacity, no preemptions)."""
    spot_notice: float = 30.0
    """Seconds of warning a spot preemption gives; with at least ``leave_time`` the group leaves
    cleanly (the others stall only ``rejoin_stall``), otherwise it is a failure."""
    leave_time: float = 10.0
    """Seconds a group needs to leave cleanly (finish or abandon its step, tell the coordinator)."""
    spot_replace: float = 600.0
    """Seconds to get replacement spot capacity after a preemption, before the group restarts."""

    def __post_init__(self) -> None:
        for name in ("groups", "gpus_per_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an integer >= 1")
        if isinstance(self.spares, bool) or not isinstance(self.spares, int) or self.spares < 0:
            raise ConfigError(f"spares={self.spares!r} must be an integer >= 0")
        if not isinstance(self.protect_last, bool):
            raise ConfigError(f"protect_last={self.protect_last!r} must be true or false")
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r}; valid: {', '.join(MODES)}")
        _number("gpu_mtbf_hours", self.gpu_mtbf_hours, 0.0, low_open=True)
        _number("duration", self.duration, 0.0, low_open=True)
        _number("catchup_bandwidth", self.catchup_bandwidth, 0.0, low_open=True)
        for name in ("detection", "stall", "restart", "state_bytes_per_gpu", "catchup_extra",
                     "rejoin_stall", "checkpoint_cost", "checkpoint_interval", "startup", "teardown",
                     "spot_preemptions_per_gpu_hour", "spot_notice", "leave_time", "spot_replace"):
            _number(name, getattr(self, name), 0.0)
        if self.startup + self.teardown >= self.duration:
            raise ConfigError(f"startup={self.startup:g} + teardown={self.teardown:g} leave no "
                              f"time to train in duration={self.duration:g}; lengthen duration")
        if self.mode == "ft" and self.stall < self.detection:
            raise ConfigError(f"stall={self.stall:g} is shorter than detection="
                              f"{self.detection:g}: the stall per failure includes detection; "
                              f"raise stall to at least {self.detection:g}")
        if self.mode == "checkpoint_restart" and self.checkpoint_cost <= 0 and \
                self.checkpoint_interval <= 0:
            raise ConfigError("checkpoint_cost=0 with checkpoint_interval=0: the Young/Daly "
                              "interval needs a checkpoint cost > 0; set either")
        for t, slot in self.failure_trace:
            if not (0 <= t <= self.duration and isinstance(slot, int)
                    and 0 <= slot < self.groups + self.spares):
                raise ConfigError(f"failure_trace has ({t!r}, {slot!r}); each failure needs a time "
                                  f"in [0, duration] and a group index in [0, "
                                  f"{self.groups + self.spares})")
        if self.promotion is not None:
            _number("promotion", self.promotion, 0.0)
        speeds = self.speed_by_participants
        if speeds:
            if len(speeds) != self.groups:
                raise ConfigError(f"speed_by_participants has {len(speeds)} values; it needs "
                                  f"one per participant count 1..{self.groups}")
            for i, s in enumerate(speeds):
                _number(f"speed_by_participants[{i}]", s, 0.0, 4.0, low_open=True)

    @property
    def allocated_gpus(self) -> int:
        """GPUs the job holds: training groups and spares."""
        return (self.groups + self.spares) * self.gpus_per_group

    @property
    def job_mtbf(self) -> float:
        """Seconds between failures of the whole allocation."""
        return self.gpu_mtbf_hours * 3600.0 / self.allocated_gpus

    @property
    def catchup(self) -> float:
        """ft: seconds a (re)joining group spends fetching state before it trains."""
        return self.state_bytes_per_gpu / self.catchup_bandwidth + self.catchup_extra

    @property
    def interval(self) -> float:
        """checkpoint_restart: training seconds between checkpoints (Young/Daly when unset)."""
        if self.checkpoint_interval > 0:
            return self.checkpoint_interval
        return young_daly_interval(self.checkpoint_cost, self.job_mtbf)

    @property
    def preemption_mtbf(self) -> float:
        """Seconds between spot preemptions of the allocation (inf on on-demand capacity)."""
        rate = self.spot_preemptions_per_gpu_hour * self.allocated_gpus / 3600.0
        return 1.0 / rate if rate > 0 else math.inf

    def speed(self, participants: int) -> float:
        """Fraction of full speed with ``participants`` groups training."""
        if participants <= 0:
            return 0.0
        participants = min(participants, self.groups)
        if self.speed_by_participants:
            return self.speed_by_participants[participants - 1]
        return participants / self.groups

    def with_changes(self, **changes: object) -> JobModel:
        """A copy with ``changes`` applied (validated again)."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ConfigError(f"unknown job model field(s): {', '.join(unknown)}; valid: "
                              f"{', '.join(f.name for f in fields(self))}")
        return replace(self, **changes)


def job_model_from_mtbf(job_mtbf_minutes: float, **kwargs: object) -> JobModel:
    """A ``JobModel`` whose allocation fails every ``job_mtbf_minutes`` on average (the per-GPU
    rate is derived from the layout in ``kwargs``)."""
    _number("job_mtbf_minutes", job_mtbf_minutes, 0.0, low_open=True)
    probe = JobModel(**kwargs)  # type: ignore[arg-type]
    return probe.with_changes(gpu_mtbf_hours=job_mtbf_minutes / 60.0 * probe.allocated_gpus)
