"""Sweeps: ETT of several job models as one parameter varies, and the plots of them.

A sweep applies the same change to every model of a comparison (for example ftlm, the paper's
FT-HSDP and checkpoint-restart) and simulates each point with a few seeds. Plots are PNG files
drawn with matplotlib's Agg backend (no display needed). It does not choose the models
(``presets`` does) and prints nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ftlm.errors import ConfigError
from ftlm.goodput.engine import SimResult, estimate
from ftlm.goodput.model import JobModel

Change = Callable[[JobModel, float], JobModel]


def _scale(m: JobModel, gpus: float) -> JobModel:
    return m.with_changes(groups=max(1, round(gpus / m.gpus_per_group)))


def _group_size(m: JobModel, size: float) -> JobModel:
    total = m.groups * m.gpus_per_group
    return m.with_changes(gpus_per_group=int(size), groups=max(1, round(total / size)))


def _mtbf(m: JobModel, minutes: float) -> JobModel:
    return m.with_changes(gpu_mtbf_hours=minutes / 60.0 * m.allocated_gpus)


def _stall(m: JobModel, seconds: float) -> JobModel:
    if m.mode != "ft":
        return m
    return m.with_changes(stall=seconds, detection=min(m.detection, seconds))


def _spares(m: JobModel, spares: float) -> JobModel:
    return m.with_changes(spares=int(spares)) if m.mode == "ft" else m


SWEEPS: dict[str, tuple[str, Change, tuple[float, ...]]] = {
    "scale": ("GPUs (groups of the model's size)", _scale,
              (8192, 16384, 32768, 65536, 98304, 131072, 196608)),
    "group-size": ("GPUs per group (same total)", _group_size,
                   (1024, 2048, 4096, 8192, 16384, 32768)),
    "mtbf": ("job MTBF (minutes)", _mtbf, (5, 10, 18, 30, 60, 120)),
    "stall": ("stall per failure (s), ft only", _stall, (5, 20, 60, 120, 180, 300, 600)),
    "spares": ("spare groups, ft only", _spares, (0, 1, 2, 3, 4)),
}
"""Sweep name -> (axis label, change, default values)."""


@dataclass
class Sweep:
    """ETT of each named model at each value of one parameter."""

    name: str
    label: str
    values: tuple[float, ...]
    ett: dict[str, list[float]]
    """Model name -> mean ETT at each value."""


def run_sweep(name: str, models: dict[str, JobModel], runs: int = 3,
              values: tuple[float, ...] | None = None) -> Sweep:
    """Simulate every model of ``models`` at every value of the sweep ``name`` (``SWEEPS``)."""
    if name not in SWEEPS:
        raise ConfigError(f"unknown sweep {name!r}; valid: {', '.join(SWEEPS)}")
    label, change, default = SWEEPS[name]
    values = tuple(values or default)
    ett = {key: [estimate(change(model, v), runs=runs).ett for v in values]
           for key, model in models.items()}
    return Sweep(name, label, values, ett)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_sweep(sweep: Sweep, path: Path) -> Path:
    """Draw ETT against the sweep's parameter, one line per model; returns ``path``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, etts in sweep.ett.items():
        ax.plot(sweep.values, [100 * e for e in etts], marker="o", label=key)
    ax.set_xlabel(sweep.label)
    ax.set_ylabel("ETT (%)")
    ax.set_ylim(0, 100)
    if sweep.name in ("scale", "group-size", "mtbf"):
        ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(f"ETT vs {sweep.name}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeline(results: dict[str, SimResult], path: Path, hours: float = 3.0) -> Path:
    """Job speed over the first ``hours`` of each recorded run (``run(..., record=True)``), one
    panel per job; returns ``path``."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(results), 1, figsize=(8, 1.6 * len(results) + 0.6), sharex=True,
                             squeeze=False)
    limit = hours * 3600.0
    for ax, (key, result) in zip(axes[:, 0], results.items()):
        points = [(t, s) for t, s in result.timeline if t <= limit]
        if points:
            xs = [t / 60.0 for t, _ in points] + [limit / 60.0]
            ys = [s for _, s in points] + [points[-1][1]]
            ax.step(xs, ys, where="post", linewidth=1)
        ax.set_title(f"{key} (ETT {result.ett:.0%})", fontsize=9, loc="left")
        ax.set_ylim(-0.05, 1.05)
        ax.set_ylabel("speed")
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("minutes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
