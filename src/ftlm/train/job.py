"""One replica group as a member of a fault-tolerant job (a coordinator is set).

Reads the group's place in the job from the environment (docs/design.md, 'Environment':
``FTLM_GROUP_ID``, ``FTLM_TOKEN``, ``FTLM_INCARNATION``, ``FTLM_GROUPS``, ``FTLM_FAULT``) and builds
what a ``Session`` needs to take part: this rank's metrics, its event log and the fault-tolerance
``Manager``. ``run_group`` is the commands' entry (``ftlm train``, post-training): it trains the
group through its trainer, whose session prints the ``FTLM_RESULT`` line the supervisor collects.
Not here: a group on its own (``NoFaultTolerance``), the launchers, the training loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ftlm.observe.metrics import NullMetrics, TrainingMetrics, start_rank_metrics

if TYPE_CHECKING:  # the composition root; training never imports it (nor, through it, launch)
    from ftlm.config import RunConfig
    from ftlm.train.session_config import SessionConfig


@dataclass
class Membership:
    """This group's place in the job and what reports on it."""

    group: str
    groups: int
    """Groups the job expects (the degraded LR policy's N)."""
    ft: Any
    """The ``ftlm.ft.manager.Manager``."""
    events: Any
    metrics: Any


def start_metrics(config: SessionConfig, group: str, rank: int) -> TrainingMetrics | NullMetrics:
    """This rank's metrics (Prometheus endpoint, tracer, storage gauges of the run directory and
    its checkpoints), started; the null object when ``observe.metrics`` and tracing are off."""
    checkpoints = Path(config.checkpoint.dir) if config.checkpoint.dir else config.run.path / "checkpoints"
    metrics, _ = start_rank_metrics(config.observe, config.run.name, group, rank,
                                    run_dir=config.run.path, checkpoints=checkpoints)
    return metrics


def join_job(config: SessionConfig, coordinator: str, device: torch.device, rank: int,
             metrics: Any = None) -> Membership:
    """The manager of this group in the job at ``coordinator``, with its metrics (started here
    unless given) and event log. The manager talks to the coordinator only from ``join`` on."""
    from ftlm.ft.faults import fault_from_env
    from ftlm.ft.manager import Manager
    from ftlm.observe.events import EventLog
    group = os.environ.get("FTLM_GROUP_ID", "g0")
    # Empty: the manager draws one for the group (rank 0's, shared with the other ranks).
    incarnation = os.environ.get("FTLM_INCARNATION", "")
    groups = int(os.environ.get("FTLM_GROUPS", "0")) or config.ft.groups
    token = os.environ.get("FTLM_TOKEN", "") or config.ft.read_token()
    metrics = metrics if metrics is not None else start_metrics(config, group, rank)
    events = metrics.watch_events(EventLog(config.run.path / "events.jsonl", group=group, rank=rank))
    try:
        manager = Manager(config.ft, group, incarnation, coordinator, token=token, events=events,
                          device=device, fault=fault_from_env(), total_steps=config.train.steps,
                          expected_groups=groups, metrics=metrics)
    except BaseException:
        metrics.stop()
        raise
    return Membership(group, groups, manager, events, metrics)


def run_group(config: RunConfig, coordinator: str, make_trainer: Callable[..., Any]) -> dict:
    """Train this group in the job at ``coordinator``; ``make_trainer(coordinator=)`` builds its
    ``Trainer``, whose session joins the job. Returns the group's result (its rank's state hash,
    step and incarnation), which the session printed as ``FTLM_RESULT``."""
    return make_trainer(coordinator=coordinator).train()
