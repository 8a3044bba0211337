"""One replica group as a member of a fault-tolerant job (``FTLM_COORDINATOR`` is set).

Shared by ``ftlm train`` and the post-training commands: read the group's place in the job from the
environment (docs/design.md, 'Environment': ``FTLM_GROUP_ID``, ``FTLM_TOKEN``, ``FTLM_INCARNATION``,
``FTLM_GROUPS``), build the trainer, attach the fault-tolerance manager once the model and data are
ready, train, and print the ``FTLM_RESULT`` line the supervisor collects final state hashes from.
Not here: a group on its own (the commands train and report directly), the launchers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the composition root; training never imports it (nor, through it, launch)
    from ftlm.config import RunConfig


def run_group(config: RunConfig, coordinator: str, make_trainer: Callable[..., Any]) -> dict:
    """Train this group in the job at ``coordinator``; ``make_trainer(group=, groups=,
    standalone=False, ft=, metrics=)`` builds its ``Trainer``. Returns the group's result (rank's
    state hash)."""
    import torch.distributed as dist

    from ftlm.ft.faults import fault_from_env
    from ftlm.ft.manager import Manager
    from ftlm.observe.events import EventLog
    from ftlm.train.trainer import resolve_device, start_metrics
    group = os.environ.get("FTLM_GROUP_ID", "g0")
    # Empty: the manager draws one for the group (rank 0's, shared with the other ranks).
    incarnation = os.environ.get("FTLM_INCARNATION", "")
    groups = int(os.environ.get("FTLM_GROUPS", "0")) or config.ft.groups
    token = os.environ.get("FTLM_TOKEN", "") or config.ft.read_token()
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    metrics = start_metrics(config.trainer_config(), group, rank)
    events = metrics.watch_events(EventLog(config.run.path / "events.jsonl", group=group, rank=rank))
    # The manager only talks to the coordinator from ``join`` on, which the trainer calls once the
    # model and data are ready: from the first heartbeat on, the other groups count on this one
    # answering within the heartbeat timeout.
    manager = Manager(config.ft, group, incarnation, coordinator, token=token, events=events,
                      device=resolve_device(config.train.device), fault=fault_from_env(),
                      total_steps=config.train.steps, expected_groups=groups, metrics=metrics)
    try:
        trainer = make_trainer(group=group, groups=groups, standalone=False, ft=manager, metrics=metrics)
    except BaseException:
        manager.close()
        metrics.stop()
        raise
    result = trainer.train()
    result["incarnation"] = manager.incarnation
    # The supervisor collects each group's final state hash from this line.
    print("FTLM_RESULT " + json.dumps(result), flush=True)
    return result
