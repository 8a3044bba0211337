"""Closed-form ETT of the cases where one exists: the checks the simulator must pass.

* ``ft_ett_without_stall``: ft mode, no stall, no spares, linear speed. Each group is up unless
  it failed within the last ``D = restart + catchup`` seconds (a failure while restarting starts
  the restart over), so with per-group failure rate ``l`` the steady-state ETT is ``exp(-l D)``;
  with one group that is the whole job.
* ``checkpoint_restart_ett``: Daly's expected time to finish one segment of ``tau`` seconds of
  work plus a checkpoint of ``C`` when every failure costs an (interruptible) restart ``R`` and
  the segment: ``E[T] = exp(l R) (exp(l (tau + C)) - 1) / l``; ETT is ``tau / E[T]``.
* ``paper_ft_ett``: the FT-HSDP paper's own back-of-envelope, linear in the failure interval
  (failures never overlap): see the function.

They are steady-state figures: a finite simulated run differs by about ``D / duration``.
"""

from __future__ import annotations

import math

from ftlm.errors import ConfigError
from ftlm.goodput.model import JobModel


def ft_ett_without_stall(model: JobModel) -> float:
    """Steady-state ETT of an ``ft`` job with no stall, no spares and linear speed."""
    if (model.mode != "ft" or model.stall > 0 or model.rejoin_stall > 0 or model.spares
            or model.speed_by_participants or model.spot_preemptions_per_gpu_hour > 0):
        raise ConfigError("ft_ett_without_stall needs mode=ft, stall=0, rejoin_stall=0, no "
                          "spares, no preemptions and linear speed")
    per_group_rate = 1.0 / (model.job_mtbf * model.groups)
    return math.exp(-per_group_rate * (model.restart + model.catchup))


def checkpoint_restart_ett(model: JobModel) -> float:
    """Steady-state ETT of a ``checkpoint_restart`` job (Daly's exponential model)."""
    if model.mode != "checkpoint_restart":
        raise ConfigError("checkpoint_restart_ett needs mode=checkpoint_restart")
    rate, tau = 1.0 / model.job_mtbf, model.interval
    segment = math.exp(rate * model.restart) * math.expm1(rate * (tau + model.checkpoint_cost))
    return tau * rate / segment


def paper_ft_ett(mtbf: float, stall: float, down: float, groups: int) -> float:
    """The FT-HSDP paper's estimate: per failure interval ``mtbf``, every group stalls ``stall``
    seconds, then the failed group stays away for ``down - stall`` more seconds while the
    others train at ``(groups - 1) / groups`` speed: ``(mtbf - stall - (down - stall) / groups)
    / mtbf`` (``down``: seconds from the failure until the group trains again)."""
    if not 0 <= stall <= down <= mtbf or groups < 1:
        raise ConfigError(f"paper_ft_ett: need 0 <= stall ({stall}) <= down ({down}) <= mtbf "
                          f"({mtbf}) and groups ({groups}) >= 1")
    return (mtbf - stall - (down - stall) / groups) / mtbf
