"""Spot vs on-demand capacity: what spot saves and what its preemptions cost in goodput.

The same job runs twice: on on-demand capacity (no preemptions, the on-demand price) and on
spot capacity (preemptions at a rate, each with a notice, replaced after a delay, the spot
price). Preempted capacity is not paid for while it is gone; everything else allocated
(spares included) is. The figure of merit is the price of one *effective* GPU-hour: paid
GPU-hours over GPU-hours that turned into progress. It does not model price changes over time
or capacity that cannot be found at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftlm.errors import ConfigError
from ftlm.goodput.engine import estimate
from ftlm.goodput.model import JobModel


@dataclass(frozen=True)
class CapacityCost:
    """One capacity kind's outcome for a job."""

    capacity: str
    price_per_gpu_hour: float
    ett: float
    paid_gpu_hours: float
    effective_gpu_hours: float
    preemptions: float
    """Mean preemptions per run."""

    @property
    def total(self) -> float:
        return self.paid_gpu_hours * self.price_per_gpu_hour

    @property
    def per_effective_gpu_hour(self) -> float:
        return self.total / self.effective_gpu_hours if self.effective_gpu_hours else float("inf")


def compare_spot(model: JobModel, on_demand_price: float, spot_price: float,
                 preemptions_per_gpu_hour: float, notice: float | None = None,
                 runs: int = 4) -> tuple[CapacityCost, CapacityCost]:
    """``(on_demand, spot)`` outcomes of ``model`` (whose own spot settings are replaced)."""
    if on_demand_price <= 0 or spot_price <= 0:
        raise ConfigError(f"prices must be > 0 (on-demand {on_demand_price}, spot {spot_price}); "
                          "set both, e.g. --on-demand-price 4 --spot-price 1.5")
    if preemptions_per_gpu_hour < 0:
        raise ConfigError(f"preemptions_per_gpu_hour={preemptions_per_gpu_hour} must be >= 0")
    on_demand = model.with_changes(spot_preemptions_per_gpu_hour=0.0)
    spot = model.with_changes(spot_preemptions_per_gpu_hour=preemptions_per_gpu_hour,
                              **({} if notice is None else {"spot_notice": notice}))
    out = []
    for name, m, price in (("on-demand", on_demand, on_demand_price), ("spot", spot, spot_price)):
        est = estimate(m, runs=runs)
        hours = est.mean("gpu_hours")
        paid = sum(v for k, v in hours.items() if k != "preempted")
        effective = est.ett * m.groups * m.gpus_per_group * m.duration / 3600.0
        out.append(CapacityCost(name, price, est.ett, paid, effective,
                                sum(r.preemptions for r in est.results) / len(est.results)))
    return out[0], out[1]
