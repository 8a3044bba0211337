"""A group told that no live group holds the job's newest state loads a newer durable checkpoint
before the coordinator rolls the job back (``ReloadCheckpoint``, the trainer's side)."""

from __future__ import annotations

import json

import pytest

from ftlm.ft.group import TooManyFailures
from ftlm.ft.protocol import NoFaultTolerance, ReloadCheckpoint
from ftlm.train.trainer import Trainer

STEPS = 6


class ToldToReload(NoFaultTolerance):
    """A lone group whose next ``start_step`` calls raise ``ReloadCheckpoint`` (``times`` of them)."""

    def __init__(self, head: int, times: int = 1) -> None:
        super().__init__()
        self.head, self.times = head, times
        self.asked_with: list[int] = []
        self.restarted: list[str] = []

    def start_step(self, step, chain, snapshot):
        self.asked_with.append(step)
        if self.times:
            self.times -= 1
            raise ReloadCheckpoint(self.head, f"no live group holds step {self.head}")
        return super().start_step(step, chain, snapshot)

    def restart_recovery(self, reason):
        self.restarted.append(reason)


def _events(run_dir, kind: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def test_a_group_behind_loads_the_newest_checkpoint_then_asks_with_it(tiny_config, tmp_path) -> None:
    ckpt = {"every": 2, "keep": 3, "dir": str(tmp_path / "shared"), "async_save": False}
    # A group started before the writer's checkpoints existed (or from an older one) is at step 0.
    ft = ToldToReload(head=STEPS + 1)
    behind = Trainer.for_run(tiny_config(tmp_path / "behind", train={"steps": STEPS + 2},
                                         checkpoint={**ckpt, "resume": True}), ft=ft)
    writer = Trainer.for_run(tiny_config(tmp_path / "writer", train={"steps": STEPS}, checkpoint=ckpt))
    writer.train()
    assert behind.state.step == 0
    step = next(behind.session)  # told: loads the checkpoint of step 6, then asks again
    assert (behind.state.step, behind.state.chain, behind.state.cursor) == (
        writer.state.step, writer.state.chain, writer.state.cursor)
    assert behind.state_hash() == writer.state_hash()
    assert ft.restarted == [f"loaded the durable checkpoint of step {STEPS}"]  # a pull in flight is dropped
    [event] = _events(tmp_path / "behind", "checkpoint_reloaded")
    assert (event["step"], event["from_step"], event["head"]) == (STEPS, 0, STEPS + 1)
    assert step.step == STEPS and ft.asked_with == [0, STEPS]  # asked with the state it loaded
    behind.train_step(step)  # and trains on from there
    assert behind.state.step == STEPS + 1
    for t in (writer, behind):
        t.loader.close()


def test_nothing_newer_on_disk_or_resume_off_leaves_the_state_alone(tiny_config, tmp_path) -> None:
    ckpt = {"every": 2, "dir": str(tmp_path / "shared"), "async_save": False}
    writer = Trainer.for_run(tiny_config(tmp_path / "writer", train={"steps": 2}, checkpoint=ckpt))
    writer.train()
    ahead = Trainer.for_run(tiny_config(tmp_path / "ahead", train={"steps": 4}), ft=ToldToReload(head=9))
    told = ahead.session.ft
    for _ in range(3):  # step 3 is newer than the checkpoint of step 2
        told.times = 0
        ahead.train_step(next(ahead.session))
    ahead.session.disk.checkpointer = writer.checkpointer
    told.times = 1
    before = ahead.state_hash()
    next(ahead.session)  # told, but the newest checkpoint (step 2) is older than its state
    assert told.asked_with[-2:] == [3, 3] and told.times == 0
    assert ahead.state.step == 3 and ahead.state_hash() == before and told.restarted == []
    off = Trainer.for_run(tiny_config(tmp_path / "off", train={"steps": 4},
                                      checkpoint={**ckpt, "resume": False}), ft=ToldToReload(head=9))
    next(off.session)  # checkpoint.resume=false: nothing is ever loaded from the directory
    assert off.state.step == 0 and _events(tmp_path / "off", "checkpoint_reloaded") == []
    for t in (writer, ahead, off):
        t.loader.close()


class GivesUpAt(NoFaultTolerance):
    """A lone group whose ``start_step`` of step ``at`` raises ``TooManyFailures`` (its steps
    kept failing with the same members, or no quorum came)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def start_step(self, step, chain, snapshot):
        if step == self.at:
            raise TooManyFailures("20 consecutive steps failed with the same members")
        return super().start_step(step, chain, snapshot)


def test_a_group_giving_up_saves_the_step_it_wrote_first(tiny_config, tmp_path) -> None:
    """Every group gives up at the same quorum when one group's link is bad: the one that wrote
    the last step saves it on its way out (as on a stop), so the job resumes there instead of at
    its newest periodic checkpoint."""
    ckpt = {"every": 4, "keep": 3, "async_save": False}
    config = tiny_config(tmp_path / "run", train={"steps": 10}, checkpoint=ckpt)
    trainer = Trainer.for_run(config, ft=GivesUpAt(7))
    with pytest.raises(TooManyFailures):
        trainer.train()
    assert [e["step"] for e in _events(tmp_path / "run", "checkpoint_saved")] == [4, 7]
    again = Trainer.for_run(tiny_config(tmp_path / "run", train={"steps": 10}, checkpoint=ckpt))
    again.train()  # resumes at step 7
    assert len(again.losses) == 3
    # checkpoint.on_stop off: nothing but the periodic checkpoint.
    other = Trainer.for_run(tiny_config(tmp_path / "off", train={"steps": 10},
                                        checkpoint={**ckpt, "on_stop": False}), ft=GivesUpAt(7))
    with pytest.raises(TooManyFailures):
        other.train()
    assert [e["step"] for e in _events(tmp_path / "off", "checkpoint_saved")] == [4]
