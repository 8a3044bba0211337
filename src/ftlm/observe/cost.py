"""GPU-hours by state and the cost of a run: the ``[cost]`` section and the figures it prices.

``gpu_hours_by_state`` reads a run's events and splits every group's wall time into five states:

* ``training``: up to one median step before each of the group's commits;
* ``stalled``: the rest of a gap between two of its commits (waiting for a quorum, a step
  redone after a failure), and the time from its last commit to a failure (that work was lost);
* ``starting``: from the job's start, or a failure of the group, until it commits or begins
  catching up (process start, model and data set-up, joining);
* ``recovering``: from ``recovery_start`` to ``recovery_end`` (fetching state from a peer);
* ``idle``: after the group's last commit when nothing failed (finished, waiting for the others).

A group's GPUs are ``ranks_per_group x gpus_per_rank`` (``CostConfig``). ``cost_summary`` prices
those GPU-hours per committed token, on-demand and spot, when prices are set. This module does
not simulate capacity (``ftlm.goodput`` does) and renders nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from ftlm.errors import ConfigError
from ftlm.observe.events import NOT_FAILURES

STATES = ("training", "stalled", "recovering", "starting", "idle")
"""GPU-hour states of a run, in the order reports show them."""
_FAILURE_KINDS = ("failure_injected", "member_dead", "member_killed")


@dataclass
class CostConfig:
    """The ``[cost]`` section: what GPU time costs, to price a run's committed tokens."""

    on_demand_per_gpu_hour: float = 0.0
    """Price of one on-demand GPU-hour (0: not set, no on-demand cost is reported)."""
    spot_per_gpu_hour: float = 0.0
    """Price of one spot GPU-hour (0: not set, no spot cost is reported)."""
    currency: str = "USD"
    """Currency the prices are in (a label for reports)."""
    ranks_per_group: int = 0
    """Ranks in each replica group, for GPU-hours; 0: from the run (the ``run_start`` event's
    ``ranks_per_group``, else ``cluster.ranks_per_group``)."""
    gpus_per_rank: int = 1
    """GPUs each rank holds, for GPU-hours (a CPU rank counts as one)."""

    def __post_init__(self) -> None:
        for name in ("on_demand_per_gpu_hour", "spot_per_gpu_hour"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0):
                raise ConfigError(f"cost.{name}={value!r} must be a price >= 0 (0: not set)")
        if not isinstance(self.currency, str) or not self.currency.strip() or len(self.currency) > 16:
            raise ConfigError(f"cost.currency={self.currency!r} must be a short non-empty label, "
                              "e.g. USD")
        if isinstance(self.ranks_per_group, bool) or not isinstance(self.ranks_per_group, int) \
                or not 0 <= self.ranks_per_group <= 1_000_000:
            raise ConfigError(f"cost.ranks_per_group={self.ranks_per_group!r} must be an integer "
                              "in [0, 1000000] (0: from the run)")
        if isinstance(self.gpus_per_rank, bool) or not isinstance(self.gpus_per_rank, int) \
                or not 1 <= self.gpus_per_rank <= 64:
            raise ConfigError(f"cost.gpus_per_rank={self.gpus_per_rank!r} must be an integer "
                              "in [1, 64]")

    @property
    def priced(self) -> bool:
        """Whether any price is set."""
        return self.on_demand_per_gpu_hour > 0 or self.spot_per_gpu_hour > 0


def cost_config_of(config: dict) -> CostConfig:
    """The ``CostConfig`` of a resolved config dict (defaults when it has no ``cost`` table)."""
    table = (config or {}).get("cost") or {}
    if not isinstance(table, dict):
        raise ConfigError(f"cost: expected a table, got {type(table).__name__}")
    known = {f.name for f in fields(CostConfig)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"cost: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    return CostConfig(**table)


def gpus_per_group(events: list[dict], config: dict, cost: CostConfig) -> int:
    """GPUs of one replica group: ranks per group (``cost``, the run, or the cluster section)
    times ``cost.gpus_per_rank``."""
    ranks = cost.ranks_per_group
    if not ranks:
        starts = [e.get("ranks_per_group") for e in events if e.get("kind") == "run_start"]
        ranks = next((r for r in starts if isinstance(r, int) and r > 0), 0)
    if not ranks:
        cluster = (config or {}).get("cluster") or {}
        value = cluster.get("ranks_per_group") if isinstance(cluster, dict) else None
        ranks = value if isinstance(value, int) and value > 0 else 1
    return ranks * cost.gpus_per_rank


def _group(name: object) -> str:
    return str(name or "").partition(":")[0]


def _about(event: dict) -> str:
    return _group(event.get("target") or event.get("group"))


def _between_launches(events: list[dict]) -> list[tuple[float, float]]:
    """``(run_end, next run_start)`` times of a record that several launches appended to (a
    relaunch that resumed from a checkpoint): no GPU was held in between."""
    gaps, ended = [], None
    for e in events:
        if e["kind"] == "run_end":
            ended = e["ts"] if ended is None else max(ended, e["ts"])
        elif e["kind"] == "run_start" and ended is not None:
            gaps.append((ended, e["ts"]))
            ended = None
    return gaps


def _held(since: float, until: float, gaps: Sequence[tuple[float, float]]) -> float:
    """Seconds of ``[since, until]`` outside ``gaps``."""
    return until - since - sum(max(0.0, min(b, until) - max(a, since)) for a, b in gaps)


def _group_seconds(events: list[dict], group: str, begin: float, end: float,
                   median_step: float, gaps: Sequence[tuple[float, float]] = ()) -> dict[str, float]:
    """Seconds ``group`` spent in each state between ``begin`` and ``end`` (events in time order),
    leaving out ``gaps`` (between two launches)."""
    seconds = dict.fromkeys(STATES, 0.0)
    state, since = "starting", begin

    def close(ts: float, as_state: str) -> None:
        nonlocal since
        if ts > since:
            seconds[as_state] += _held(since, ts, gaps)
            since = ts

    for e in events:
        kind, ts = e["kind"], e["ts"]
        if kind == "run_start" and ts > begin:  # a relaunch: every group starts again
            close(ts, {"up": "idle"}.get(state, state))
            state = "starting"
            continue
        if ts < begin or _about(e) != group:
            continue
        if kind == "commit":
            if state in ("starting", "recovering"):
                step = min(median_step, ts - since)
                close(ts - step, state)
                close(ts, "training")
            else:  # up (or idle that commits again): a step, and any wait beyond it
                step = min(median_step, ts - since)
                close(ts - step, "stalled")
                close(ts, "training")
            state = "up"
        elif kind == "recovery_start":
            close(ts, "stalled" if state in ("up", "idle") else state)
            state = "recovering"
        elif kind == "recovery_end" and state == "recovering":
            close(ts, "recovering")
            state = "up"
        elif kind in _FAILURE_KINDS or (kind == "group_exit" and e.get("ok") is False):
            if kind == "failure_injected" and (e.get("signal") or e.get("how")) in NOT_FAILURES:
                continue  # a slowdown or a preemption (its leave and exit say the rest)
            close(ts, {"up": "stalled", "idle": "idle"}.get(state, state))
            state = "starting"
        elif kind == "member_left" or (kind == "group_exit" and e.get("ok") is True):
            close(ts, "idle" if state == "up" else state)
            state = "idle"
    close(end, {"up": "idle"}.get(state, state))
    return seconds


def gpu_hours_by_state(events: list[dict], groups: list[str], gpus: int,
                       median_step: float) -> dict[str, float]:
    """GPU-hours of the run by state (``STATES``) plus ``total``, over ``groups`` of ``gpus``
    GPUs each, from the job's start (``run_start``, else the first event) to its last event,
    without the time between the launches of a resumed job (no GPU was held then)."""
    ordered = sorted(events, key=lambda e: e["ts"])
    if not ordered:
        return {**dict.fromkeys(STATES, 0.0), "total": 0.0}
    starts = [e["ts"] for e in ordered if e["kind"] == "run_start"]
    begin, end = (starts[0] if starts else ordered[0]["ts"]), ordered[-1]["ts"]
    names = list(groups) or sorted({_group(e["group"]) for e in ordered if e["kind"] == "commit"})
    gaps = _between_launches(ordered)
    total = dict.fromkeys(STATES, 0.0)
    for name in names:
        for state, s in _group_seconds(ordered, name, begin, end, median_step, gaps).items():
            total[state] += s
    hours = {state: round(s * gpus / 3600.0, 6) for state, s in total.items()}
    hours["total"] = round(sum(total.values()) * gpus / 3600.0, 6)
    return hours


def cost_summary(gpu_hours: dict[str, float], tokens: int, cost: CostConfig) -> dict | None:
    """The run's cost on on-demand and on spot capacity, in total and per million committed
    tokens (every GPU-hour of the allocation is paid, whatever its state); None without prices."""
    if not cost.priced:
        return None
    out: dict[str, object] = {"currency": cost.currency}
    billed = gpu_hours.get("total", 0.0)
    for name, price in (("on_demand", cost.on_demand_per_gpu_hour),
                        ("spot", cost.spot_per_gpu_hour)):
        if price <= 0:
            continue
        total = billed * price
        out[f"{name}_per_gpu_hour"] = price
        out[f"{name}_total"] = round(total, 6)
        out[f"{name}_per_million_tokens"] = round(total / tokens * 1e6, 6) if tokens else None
    return out
