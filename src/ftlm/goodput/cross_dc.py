"""Groups in several data centres: time to a target and ETT of each synchronisation mode.

``ftlm simulate --cross-dc`` projects one job whose replica groups are spread evenly over 2-4
regions joined by slow links (1-10 Gbit/s), trained with every-step synchronisation, with
DiLoCo, or with streaming DiLoCo (``ft.sync``; docs/diloco.md). For each mode it gives the time
of one inner step with its share of the traffic between regions, the tokens per second, the ETT
under failures (``ftlm.goodput.engine`` with the mode's cost per failure) and the days to the
target number of tokens.

The assumptions, all stated in the output:

* **Compute.** One inner step of a group is ``6 x params x tokens`` FLOPs at ``mfu`` of each
  GPU's ``peak_flops`` (an H100's dense bf16 by default).
* **Network.** Within a region the groups reduce over the fast fabric first (free here); the
  regions then all-reduce over a ring of their links: each region sends and receives
  ``2 (R-1)/R`` of the payload at ``gbits`` per link, plus ``2 (R-1)`` round trips of ``rtt``.
* **Every step.** bf16 gradients each step, overlapped with the backward pass (2/3 of a step).
  **DiLoCo.** A float32 outer gradient every ``H`` inner steps, not overlapped. **Streaming.**
  One of ``F`` fragments every ``H/F`` inner steps in int8, overlapped with ``overlap`` inner
  steps (what ``ft.diloco_overlap_steps`` does).
* **Loss per token.** The same for every mode unless ``token_overhead`` says otherwise (the
  DiLoCo papers report parity at billions of parameters; the tiny models of BENCHMARKS.md's
  DiLoCo table do not show it, so pass the overhead you believe).
* **Failures.** Per-GPU MTBF of Llama 3 by default. Every step: a failure stalls everyone for
  ftlm's measured stall plus one step redone. DiLoCo, as ftlm runs it (docs/diloco.md): a
  failure fails the protocol step for everyone, and every group's inner steps since that step's
  start are redone (half a phase on average: H/2 inner steps, H/(2F) for streaming), plus the
  outer all-reduce when the failure struck it.

Not responsible for: simulating the failures (``engine``), or the network at packet level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ftlm.errors import ConfigError
from ftlm.goodput.model import LLAMA3_GPU_MTBF_HOURS, JobModel

H100_BF16_FLOPS = 989e12
"""Dense bf16 peak of one H100 SXM."""
MODES = ("every_step", "diloco", "streaming")


@dataclass(frozen=True)
class CrossDC:
    """One job spread over regions; every field can be set from ``ftlm simulate``."""

    params: float = 70e9
    groups: int = 8
    gpus_per_group: int = 512
    global_batch_tokens: float = 4 * 1024 * 1024
    peak_flops: float = H100_BF16_FLOPS
    mfu: float = 0.4
    rtt: float = 0.05
    """Seconds of one round trip between regions."""
    inner_steps: int = 100
    fragments: int = 4
    overlap: int = 1
    target_tokens: float = 0.0
    """0: 20 tokens per parameter (Chinchilla)."""
    token_overhead: float = 0.0
    """Extra tokens DiLoCo and streaming need for the target loss, as a fraction."""
    gpu_mtbf_hours: float = LLAMA3_GPU_MTBF_HOURS
    stall_beyond_step: float = 2.04
    """ftlm's measured stall per failure beyond one step (BENCHMARKS.md, ft_vs_torchft)."""
    detection: float = 1.0
    restart: float = 600.0
    days: float = 30.0

    def __post_init__(self) -> None:
        for name in ("params", "global_batch_tokens", "peak_flops", "gpu_mtbf_hours", "days"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"cross-dc {name}={value!r} must be a number > 0")
        if not 0 < self.mfu <= 1:
            raise ConfigError(f"cross-dc mfu={self.mfu!r} must be in (0, 1]")
        if self.groups < 2 or self.gpus_per_group < 1:
            raise ConfigError(f"cross-dc groups={self.groups} must be at least 2 and "
                              f"gpus_per_group={self.gpus_per_group} at least 1")
        if self.inner_steps < 1 or self.fragments < 1 or self.inner_steps % self.fragments:
            raise ConfigError(f"cross-dc inner_steps={self.inner_steps} must be a multiple of "
                              f"fragments={self.fragments} (as ft.diloco_fragments requires)")
        if not 0 <= self.overlap < self.inner_steps // self.fragments:
            raise ConfigError(f"cross-dc overlap={self.overlap} must be below inner_steps / "
                              f"fragments = {self.inner_steps // self.fragments}")
        if self.rtt < 0 or self.token_overhead < 0 or self.target_tokens < 0:
            raise ConfigError("cross-dc rtt, token_overhead and target_tokens must be >= 0")

    @property
    def target(self) -> float:
        return self.target_tokens or 20 * self.params

    @property
    def compute_seconds(self) -> float:
        """One inner step of one group."""
        tokens = self.global_batch_tokens / self.groups
        return 6 * self.params * tokens / (self.gpus_per_group * self.peak_flops * self.mfu)


def allreduce_seconds(nbytes: float, regions: int, gbits: float, rtt: float) -> float:
    """A ring all-reduce of ``nbytes`` between ``regions`` over links of ``gbits`` Gbit/s."""
    if regions < 2:
        return 0.0
    share = 2 * (regions - 1) / regions
    return share * nbytes * 8 / (gbits * 1e9) + 2 * (regions - 1) * rtt


@dataclass(frozen=True)
class ModeResult:
    mode: str
    step_seconds: float
    """One inner step with its share of the synchronisation."""
    sync_seconds: float
    """One synchronisation's all-reduce between regions."""
    sync_bytes: float
    """What one synchronisation sends (its payload): the peak the links must carry at once."""
    tokens_per_second: float
    ett: float
    days_to_target: float


def step_and_sync(job: CrossDC, mode: str, regions: int, gbits: float) -> tuple[float, float, float, float]:
    """(inner step seconds, sync seconds, sync bytes, inner steps per sync) of ``mode``."""
    t = job.compute_seconds
    if mode == "every_step":
        nbytes = 2 * job.params
        sync = allreduce_seconds(nbytes, regions, gbits, job.rtt)
        return t + max(0.0, sync - 2 * t / 3), sync, nbytes, 1
    if mode == "diloco":
        nbytes = 4 * job.params
        sync = allreduce_seconds(nbytes, regions, gbits, job.rtt)
        return t + sync / job.inner_steps, sync, nbytes, job.inner_steps
    if mode == "streaming":
        every = job.inner_steps // job.fragments
        nbytes = job.params / job.fragments
        sync = allreduce_seconds(nbytes, regions, gbits, job.rtt)
        return t + max(0.0, sync - job.overlap * t) / every, sync, nbytes, every
    raise ConfigError(f"cross-dc mode {mode!r}: valid: {', '.join(MODES)}")


def failure_stall(job: CrossDC, mode: str, step: float, sync: float, per_sync: int) -> float:
    """Full-job seconds one failure costs the healthy groups (see the module docstring)."""
    if mode == "every_step":
        return job.stall_beyond_step + step
    period = per_sync * step
    redone = sync * min(1.0, sync / period)  # the outer all-reduce, when the failure struck it
    return job.stall_beyond_step + (per_sync / 2) * step + redone  # half a phase, everyone's


def project(job: CrossDC, regions: int, gbits: float, runs: int = 4, seed: int = 0) -> list[ModeResult]:
    """Every mode of ``job`` with its groups over ``regions`` regions and ``gbits`` links."""
    from ftlm.goodput.engine import estimate

    if not 2 <= regions <= job.groups:
        raise ConfigError(f"cross-dc regions={regions} must be in [2, groups={job.groups}]")
    if not (math.isfinite(gbits) and gbits > 0):
        raise ConfigError(f"cross-dc gbits={gbits!r} must be a number > 0")
    out = []
    for mode in MODES:
        step, sync, nbytes, per_sync = step_and_sync(job, mode, regions, gbits)
        stall = failure_stall(job, mode, step, sync, per_sync)
        model = JobModel(groups=job.groups, gpus_per_group=job.gpus_per_group, mode="ft",
                         gpu_mtbf_hours=job.gpu_mtbf_hours, detection=min(job.detection, stall),
                         stall=stall, restart=job.restart,
                         state_bytes_per_gpu=12 * job.params / job.gpus_per_group,
                         duration=job.days * 86400.0)
        ett = estimate(model, runs=runs, seed=seed).ett
        rate = job.global_batch_tokens / step
        tokens = job.target * (1 + (job.token_overhead if mode != "every_step" else 0.0))
        out.append(ModeResult(mode, step, sync, nbytes, rate, ett, tokens / (rate * ett) / 86400.0))
    return out


def assumptions(job: CrossDC) -> str:
    return (f"{job.params / 1e9:g}B parameters, {job.groups} groups x {job.gpus_per_group} GPUs at "
            f"{job.mfu:.0%} MFU of {job.peak_flops / 1e12:g} TFLOP/s, {job.global_batch_tokens / 2**20:g}M "
            f"tokens a step ({job.compute_seconds:.3f} s of compute), target "
            f"{job.target / 1e9:,.0f}B tokens, rtt {job.rtt * 1e3:g} ms; DiLoCo H={job.inner_steps}; "
            f"streaming H={job.inner_steps} F={job.fragments} int8 overlap {job.overlap}; token "
            f"overhead of DiLoCo modes {job.token_overhead:.0%}; GPU MTBF {job.gpu_mtbf_hours:,.0f} h")


def format_table(job: CrossDC, regions: list[int], gbits: list[float], runs: int = 4) -> str:
    """A Markdown table of every (regions, link, mode), with the assumptions above it."""
    lines = [f"cross-data-centre projection: {assumptions(job)}", "",
             "| regions | link Gbit/s | mode | step s | sync s | bytes per sync | tokens/s | ETT | days to target |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in regions:
        for g in gbits:
            for m in project(replace(job), r, g, runs=runs):
                lines.append(f"| {r} | {g:g} | {m.mode} | {m.step_seconds:.3f} | {m.sync_seconds:.1f} | "
                             f"{m.sync_bytes / 1e9:.1f} GB | {m.tokens_per_second:,.0f} | {m.ett:.1%} | "
                             f"{m.days_to_target:,.1f} |")
    return "\n".join(lines)
