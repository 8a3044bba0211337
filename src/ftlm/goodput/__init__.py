"""Goodput and cost model of large clusters: ``ftlm simulate``.

A discrete-event simulation of a training job at replica-group granularity (``engine``) over a
validated job description (``model``), the closed forms it is checked against (``analytic``),
paper presets, sweeps and plots, calibration from a real run directory (``calibrate``) and the
spot vs on-demand comparison (``spot``). It models time and cost, not the protocol: that is
``ftlm.sim``.
"""

from ftlm.goodput.engine import Estimate, SimResult, estimate, run
from ftlm.goodput.model import JobModel, job_model_from_mtbf, young_daly_interval

__all__ = ["Estimate", "JobModel", "SimResult", "estimate", "job_model_from_mtbf", "run",
           "young_daly_interval"]
