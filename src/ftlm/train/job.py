"""One replica group as a member of a fault-tolerant job (``FTLM_COORDINATOR`` is set).

Shared by ``ftlm train`` and the post-training commands: read the group's place in the job from
the environment (DESIGN.md section 10: ``FTLM_GROUP_ID``, ``FTLM_TOKEN``, ``FTLM_INCARNATION``,
``FTLM_GROUPS``), build the trainer, attach the fault-tolerance manager once the model and data
are ready, train, and print the ``FTLM_RESULT`` line the supervisor collects final state hashes
from. Not here: a group on its own (the commands train and report directly), the launchers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from ftlm.config import RunConfig


def run_group(config: RunConfig, coordinator: str, make_trainer: Callable[..., Any]) -> dict:
    """Train this group in the job at ``coordinator``; ``make_trainer(group=, groups=,
    standalone=False)`` builds its ``Trainer``. Returns the group's result (rank's state hash)."""
    from ftlm.ft.faults import fault_from_env
    from ftlm.ft.manager import Manager
    from ftlm.observe.events import EventLog
    from ftlm.train.trainer import resolve_device
    group = os.environ.get("FTLM_GROUP_ID", "g0")
    # Empty: the manager draws one for the group (rank 0's, shared with the other ranks).
    incarnation = os.environ.get("FTLM_INCARNATION", "")
    groups = int(os.environ.get("FTLM_GROUPS", "0")) or config.ft.groups
    token = os.environ.get("FTLM_TOKEN", "") or config.ft.read_token()
    rank = int(os.environ.get("RANK", "0"))
    events = EventLog(config.run.path / "events.jsonl", group=group, rank=rank)
    trainer = make_trainer(group=group, groups=groups, standalone=False)
    # Join the job only once the model and data are ready: from the first heartbeat on, the
    # other groups count on this one answering within the heartbeat timeout.
    trainer.ft = Manager(config.ft, group, incarnation, coordinator, token=token, events=events,
                         device=resolve_device(config.train.device), fault=fault_from_env(),
                         total_steps=config.train.steps, expected_groups=groups)
    trainer.ft.metrics = trainer.metrics
    result = trainer.train()
    result["incarnation"] = trainer.ft.incarnation
    # The supervisor collects each group's final state hash from this line.
    print("FTLM_RESULT " + json.dumps(result), flush=True)
    return result
