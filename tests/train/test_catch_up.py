"""A recovering group's catch-up inside the trainer: load a peer's snapshot, replay the buffered
updates, apply the current step's average, and end with the peer's exact state.

The fault tolerance is scripted (no coordinator, no process group): a source trains alone and
its per-step gradient averages are handed to the recovering group as its all-reduce results.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from ftlm.ft.history import GENESIS, extend_chain
from ftlm.ft.protocol import NoFaultTolerance, Recovered, StepPlan, StopRequested
from ftlm.train.trainer import Trainer

STEPS = 9


class Recording(NoFaultTolerance):
    """A lone group that keeps each step's gradient average (its own gradients) and state."""

    def __init__(self) -> None:
        super().__init__()
        self.grads: dict[int, list[torch.Tensor]] = {}
        self.snapshots: dict[int, tuple[dict, dict]] = {}
        self.chains: dict[int, str] = {}
        self.step = 0

    def start_step(self, step, chain, snapshot):
        self.chains[step] = chain
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

    def __init__(self, source: Recording, chains: dict[int, str], snapshot_step: int,
                 transfer_steps: int = 1, peers_busy_for: int = 0) -> None:
        super().__init__()
        self.source, self.chains, self.snapshot_step = source, chains, snapshot_step
        self.transfer_steps = transfer_steps  # steps the participants commit while it arrives
        self.peers_busy_for = peers_busy_for  # replays per step before the all-reduce completes
        self.head = snapshot_step  # the step the participants compute
        self.recovering, self.calls, self.asked = True, [], []
        self._asked = 0

    def allreduce_in_flight(self):
        self._asked += 1
        return self._asked <= self.peers_busy_for

    def start_step(self, step, chain, snapshot):
        self.calls.append("start_step")
        if not self.recovering:
            self.head = step
            return super().start_step(step, chain, snapshot)
        q = _quorum(self.head, self.chains[self.head])
        return StepPlan(quorum_id=0, step=self.head, participant_index=None, participants=1,
                        recovering=True, quorum=q)

    def allreduce_start(self, tensors):
        self._asked = 0
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
        if self.head != self.snapshot_step + self.transfer_steps:
            return None
        tensors, meta = self.source.snapshots[self.snapshot_step]
        return Recovered(step=self.snapshot_step, tensors=tensors, meta=meta, source="g0",
                         seconds=0.1, nbytes=1)

    def caught_up(self, step, chain):
        self.calls.append(f"caught_up {step}")
        self.recovering = False

    def ask(self, step, chain):
        self.calls.append(f"ask {step}")
        self.asked.append((step, chain))
        return False  # no early answer: start_step answers as scripted

    def restart_recovery(self, reason):
        raise AssertionError(f"the catch-up should not restart: {reason}")


def _source(tiny_config, tmp_path) -> tuple[Trainer, Recording, dict[int, str]]:
    source_ft = Recording()
    source = Trainer.for_run(tiny_config(tmp_path / "source", train={"steps": STEPS}), ft=source_ft)
    source.train()
    chains = dict(source_ft.chains)
    chains[source.state.step] = source.state.chain
    return source, source_ft, chains


def _catch_up(tiny_config, tmp_path, source: Trainer, ft: "Recovering") -> Trainer:
    joiner = Trainer.for_run(tiny_config(tmp_path / "joiner", train={"steps": STEPS}), ft=ft)
    joiner.train()  # recovering steps run inside the session's next(); then it trains
    assert joiner.state_hash() == source.state_hash()
    assert (joiner.state.step, joiner.state.cursor, joiner.state.chain) == (
        source.state.step, source.state.cursor, source.state.chain)
    return joiner


def test_a_recovering_group_catches_up_while_its_all_reduce_waits_and_ends_with_the_source_state(
        tiny_config, tmp_path) -> None:
    source, source_ft, chains = _source(tiny_config, tmp_path)
    ft = Recovering(source_ft, chains, snapshot_step=2)
    _catch_up(tiny_config, tmp_path, source, ft)
    # Step 2 is buffered while the snapshot is on its way; at step 3 the group starts its zero
    # buckets first (the participants never wait for its catch-up), then loads the snapshot and
    # replays step 2 while they compute, and after the vote applies step 3 itself.
    calls = ft.calls
    third = [i for i, c in enumerate(calls) if c == "start_step"][1]
    step3 = calls[third:calls.index("caught_up 4") + 1]
    assert step3[0] == "start_step" and step3[-3:] == ["commit", "ask 4", "caught_up 4"]
    assert step3.index("allreduce") < step3.index("poll")
    # It asks for its next quorum right after its vote, as a participant does, with the state
    # the step leaves: before, in step 2, its own (fresh) state; here the head's successor.
    assert ft.asked[:2] == [(0, GENESIS), (4, chains[4])]


def test_a_long_backlog_is_replayed_over_several_steps_without_holding_the_peers_up(
        tiny_config, tmp_path) -> None:
    """The snapshot of step 1 arrives four steps later: the group replays two buffered updates a
    step (the all-reduce completes at once here), records the new averages behind them, and
    reaches the head two steps later, with the source's exact state."""
    source, source_ft, chains = _source(tiny_config, tmp_path)
    ft = Recovering(source_ft, chains, snapshot_step=1, transfer_steps=4)
    _catch_up(tiny_config, tmp_path, source, ft)
    assert "caught_up 8" in ft.calls  # 1..4 buffered; at 5 replays 1,2; at 6: 3,4; at 7: 5,6
    assert ft.calls.count("poll") == 5  # at steps 1 to 5, until it arrived; never after


def test_the_backlog_is_replayed_for_as_long_as_the_peers_compute(tiny_config, tmp_path) -> None:
    source, source_ft, chains = _source(tiny_config, tmp_path)
    ft = Recovering(source_ft, chains, snapshot_step=1, transfer_steps=4, peers_busy_for=3)
    _catch_up(tiny_config, tmp_path, source, ft)
    assert "caught_up 6" in ft.calls  # at 5: replays 1..4 (3 while busy, then the minimum)


def test_an_overflowing_backlog_restarts_the_recovery_naming_the_limit_it_exceeded(
        tiny_config, tmp_path) -> None:
    source, source_ft, chains = _source(tiny_config, tmp_path)
    step_bytes = sum(p.numel() * p.element_size() for p in source.params)
    ft = StoppedAfter(3, source_ft, chains, snapshot_step=1, transfer_steps=6)
    reasons: list[str] = []
    ft.restart_recovery = reasons.append
    joiner = Trainer.for_run(tiny_config(tmp_path / "joiner", train={"steps": STEPS},
                                         ft={"catchup_max_bytes": 2 * step_bytes}), ft=ft)
    joiner.train()  # three buffered steps: one more than the bytes allow
    assert len(reasons) == 1 and "ft.catchup_max_bytes" in reasons[0], reasons


class StoppedAfter(Recovering):
    """``Recovering``, stopped (SIGTERM) while it waits for the quorum after ``steps`` steps."""

    def __init__(self, steps: int, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.left = steps

    def start_step(self, step, chain, snapshot):
        if not self.left:
            raise StopRequested("stopped by the test")
        self.left -= 1
        return super().start_step(step, chain, snapshot)


def test_steps_taken_while_recovering_get_their_own_step_spans(tiny_config, tmp_path) -> None:
    """Tracing on: every step the recovering group took part in is a ``step`` span of its own
    (``recovering``), with its phases as children carrying its number; none of them end up
    under the first step it trains. Before, they had no span and their phases joined step 4."""
    import pytest
    pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk is not installed (ftlm[otel])")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ftlm.observe.metrics import TrainingMetrics
    from ftlm.observe.tracing import make_tracer

    source, source_ft, chains = _source(tiny_config, tmp_path)
    exporter = InMemorySpanExporter()
    metrics = TrainingMetrics("tiny", "g1", 0, tracer=make_tracer(True, "", "tiny", "g1", 0,
                                                                  exporter=exporter))
    joiner = Trainer.for_run(tiny_config(tmp_path / "joiner", train={"steps": STEPS}),
                             ft=Recovering(source_ft, chains, snapshot_step=2), metrics=metrics)
    joiner.train()
    metrics.stop()
    spans = exporter.get_finished_spans()
    steps = {s.context.span_id: s for s in spans if s.name == "step"}
    numbers = sorted(s.attributes["step"] for s in steps.values())
    assert numbers == list(range(2, STEPS)), numbers  # 2, 3 recovering; 4.. trained
    recovering = sorted(s.attributes["step"] for s in steps.values() if s.attributes.get("recovering"))
    assert recovering == [2, 3]
    for child in (s for s in spans if s.parent is not None and s.parent.span_id in steps):
        assert child.attributes["step"] == steps[child.parent.span_id].attributes["step"], child.name
    votes = [steps[s.parent.span_id].attributes["step"] for s in spans if s.name == "vote"]
    assert sorted(votes) == list(range(2, STEPS))  # one vote per step, under its own step
