"""Named job models: the FT-HSDP paper's two configurations and ftlm's projection at its scale.

The paper (REFERENCES.md) gives, at 98,304 GPUs in 12 groups of 8,192 with a failure every ~18
minutes: synchronous training with checkpoint-restart ~44% ETT with ~10 minutes lost per
failure, and FT-HSDP ~80% with a ~3 minute stall per failure and ~7 more minutes before the
failed group trains again. It does not break the 10 minutes down; ``paper_sync`` picks a
plausible split (60 s detection and 9 minutes of relaunch in ``restart``, 30 s blocking
checkpoints at the Young/Daly interval) whose mean loss per failure is ~10 minutes.

``ftlm_projection`` keeps the paper's hardware (layout, failure rate, how long a node takes to
come back) and replaces the stall with ftlm's: its measured stall beyond one step (detection by
heartbeat plus reconfiguration) plus one step redone at that scale. This module does not
measure anything (``calibrate`` does).
"""

from __future__ import annotations

from ftlm.goodput.model import FT_HSDP_GPU_MTBF_HOURS, JobModel

PAPER_GROUPS = 12
PAPER_GPUS_PER_GROUP = 8192
PAPER_ETT = {"checkpoint_restart": 0.44, "ft": 0.80}
"""The paper's published ETTs."""
PAPER_STEP_RERUN_SECONDS = 20.0
"""The paper's time to re-run the interrupted step at that scale."""
LLAMA_405B_STATE_BYTES = 405e9 * 12
"""Replicated state of a 405B-parameter model trained with AdamW in fp32 (parameters and two
moments, 12 bytes per parameter): what one group fetches, spread over its GPUs."""
DAYS = 86400.0


def paper_sync(duration: float = 30 * DAYS) -> JobModel:
    """Synchronous training with checkpoint-restart at the paper's scale."""
    return JobModel(groups=PAPER_GROUPS, gpus_per_group=PAPER_GPUS_PER_GROUP,
                    gpu_mtbf_hours=FT_HSDP_GPU_MTBF_HOURS, mode="checkpoint_restart",
                    detection=60.0, restart=600.0, checkpoint_cost=30.0, duration=duration)


def paper_ft(duration: float = 30 * DAYS) -> JobModel:
    """FT-HSDP as the paper measured it: a 3-minute stall, the failed group back 10 minutes
    after the failure (3 stalled + 7 at 11/12 speed)."""
    return JobModel(groups=PAPER_GROUPS, gpus_per_group=PAPER_GPUS_PER_GROUP,
                    gpu_mtbf_hours=FT_HSDP_GPU_MTBF_HOURS, mode="ft", detection=60.0,
                    stall=180.0, restart=600.0, duration=duration)


def ftlm_projection(stall_beyond_step: float, detection: float, rejoin_stall: float = 0.0,
                    step_seconds: float = PAPER_STEP_RERUN_SECONDS, spares: int = 0,
                    catchup_bandwidth: float = 10e9,
                    duration: float = 30 * DAYS) -> JobModel:
    """ftlm at the paper's scale: its stall per failure is ``stall_beyond_step`` (what a run
    measures: the longest commit gap minus one median step) plus one step of ``step_seconds``
    redone; a (re)joining group fetches a 405B model's state per GPU at ``catchup_bandwidth``
    without stopping anyone, and restarts as slowly as the paper's nodes did (the failed
    group's hardware is not faster to replace under ftlm)."""
    return JobModel(groups=PAPER_GROUPS, gpus_per_group=PAPER_GPUS_PER_GROUP, spares=spares,
                    gpu_mtbf_hours=FT_HSDP_GPU_MTBF_HOURS, mode="ft", detection=detection,
                    stall=max(stall_beyond_step + step_seconds, detection),
                    restart=600.0, state_bytes_per_gpu=LLAMA_405B_STATE_BYTES / PAPER_GPUS_PER_GROUP,
                    catchup_bandwidth=catchup_bandwidth, rejoin_stall=rejoin_stall,
                    duration=duration)
