"""A recovering group's catch-up inside the trainer: load a peer's snapshot, replay the buffered
updates, apply the current step's average, and end with the peer's exact state.

The fault tolerance is scripted (no coordinator, no process group): a source trains alone and
its per-step gradient averages are handed to the recovering group as its all-reduce results.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from ftlm.ft.history import extend_chain
from ftlm.ft.protocol import NoFaultTolerance, Recovered, StepPlan
from ftlm.train.trainer import Trainer

STEPS = 6


class Recording(NoFaultTolerance):
    """A lone group that keeps each step's gradient average (its own gradients) and state."""

    def __init__(self) -> None:
        super().__init__()
        self.grads: dict[int, list[torch.Tensor]] = {}
        self.snapshots: dict[int, tuple[dict, dict]] = {}
        self.step = 0

    def start_step(self, step, chain, snapshot):
        tensors, meta = snapshot()
        self.snapshots[step] = ({k: v.clone() for k, v in tensors.items()}, copy.deepcopy(meta))
        self.step = step
        return super().start_step(step, chain, snapshot)

    def allreduce_start(self, tensors):
        self.grads.setdefault(self.step, []).extend(t.clone() for t in tensors)


def _quorum(step: int, chain: str) -> SimpleNamespace:
    return SimpleNamespace(step=step, chain=chain, participants=["g0"], quorum_id=0,
                           next_chain=lambda: extend_chain(chain, step, 0, ["g0"]))


class Recovering(NoFaultTolerance):
    """Recovers from ``source``: the snapshot of ``snapshot_step`` arrives while the step after
    it is computed; every all-reduce delivers the source's average of that step."""

    def __init__(self, source: Recording, chains: dict[int, str], snapshot_step: int) -> None:
        super().__init__()
        self.source, self.chains, self.snapshot_step = source, chains, snapshot_step
        self.head = snapshot_step  # the step the participants compute
        self.recovering, self.calls = True, []

    def start_step(self, step, chain, snapshot):
        self.calls.append("start_step")
        if not self.recovering:
            self.head = step
            return super().start_step(step, chain, snapshot)
        q = _quorum(self.head, self.chains[self.head])
        return StepPlan(quorum_id=0, step=self.head, participant_index=None, participants=1,
                        recovering=True, quorum=q)

    def allreduce_start(self, tensors):
        self.calls.append("allreduce")
        for t, avg in zip(tensors, self.source.grads[self.head][:len(tensors)]):
            t.copy_(avg)  # the participants' average, as a real all-reduce delivers it
        self.source.grads[self.head] = self.source.grads[self.head][len(tensors):]

    def commit(self):
        self.calls.append("commit")
        ok = super().commit()
        if self.recovering:
            self.head += 1
        return ok

    def poll_recovery(self):
        self.calls.append("poll")
        if self.head != self.snapshot_step + 1:  # the transfer takes one step
            return None
        tensors, meta = self.source.snapshots[self.snapshot_step]
        return Recovered(step=self.snapshot_step, tensors=tensors, meta=meta, source="g0",
                         seconds=0.1, nbytes=1)

    def caught_up(self, step, chain):
        self.calls.append(f"caught_up {step}")
        self.recovering = False


def test_a_recovering_group_catches_up_before_the_all_reduce_and_ends_with_the_source_state(
        tiny_config, tmp_path) -> None:
    source_ft = Recording()
    source = Trainer.for_run(tiny_config(tmp_path / "source", train={"steps": STEPS}), ft=source_ft)
    chains = {}
    for _ in range(STEPS):
        chains[source.state.step] = source.state.chain
        source.step()
    chains[source.state.step] = source.state.chain
    ft = Recovering(source_ft, chains, snapshot_step=2)
    joiner = Trainer.for_run(tiny_config(tmp_path / "joiner", train={"steps": STEPS}), ft=ft)
    while joiner.state.step < STEPS:
        joiner.step()
    assert joiner.state_hash() == source.state_hash()
    assert (joiner.state.step, joiner.state.cursor, joiner.state.chain) == (
        source.state.step, source.state.cursor, source.state.chain)
    # Step 2 is buffered while the snapshot is on its way; at step 3 the group loads it and
    # replays step 2 before the all-reduce (while the participants compute), and after the vote
    # applies step 3 itself: its next quorum request is not delayed by the catch-up.
    calls = ft.calls
    third = [i for i, c in enumerate(calls) if c == "start_step"][1]
    step3 = calls[third:calls.index("caught_up 4") + 1]
    assert step3[:2] == ["start_step", "poll"] and step3[-2:] == ["commit", "caught_up 4"]
    assert "allreduce" in step3[2:-2]
    source.loader.close()
    joiner.loader.close()
