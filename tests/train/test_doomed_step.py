"""A step that can no longer commit is abandoned where the session learns it (forward or
backward), not computed to its end: the step fails, nothing of it reaches the state, and the
job's result is the one it would have had."""

from __future__ import annotations

import pytest
import torch

from ftlm.ft.protocol import NoFaultTolerance
from ftlm.observe.events import read_events
from ftlm.train import StepDoomed
from ftlm.train.session import Session
from ftlm.train.trainer import Trainer

BUCKET = 64 * 1024  # small buckets: the tiny model's backward starts many


class LostPeerAt(NoFaultTolerance):
    """A group whose peer is lost during step ``step``: ``step_alive`` turns False at its
    ``after``-th call of that step (0: before the forward pass's first block). Counts the
    buckets each step started (``started``), and those started when the step was failed
    (``at_fail``)."""

    def __init__(self, step: int, after: int) -> None:
        super().__init__()
        self.step, self.after = step, after
        self.current, self.asked, self.started = -1, 0, {}
        self.in_commit = False
        self.attempts = 0  # of ``step``: only its first attempt loses the peer
        self.at_fail: int | None = None

    def start_step(self, step, *rest):
        self.current, self.asked, self.in_commit = step, 0, False
        self.attempts += step == self.step
        self.started.pop(step, None)  # (a retried step counts afresh)
        return super().start_step(step, *rest)

    def step_alive(self) -> bool:
        if self.current == self.step and self.attempts == 1 and self.asked >= self.after:
            self._failed = True
        self.asked += 1
        return super().step_alive()

    def allreduce_start(self, tensors) -> None:
        if not self.in_commit:
            self.started[self.current] = self.started.get(self.current, 0) + 1

    def allreduce(self, tensors) -> None:
        self.in_commit = True

    def fail_step(self, reason: str) -> None:
        if self.at_fail is None:
            self.at_fail = self.started.get(self.current, 0)
        super().fail_step(reason)


def run(config, ft) -> Trainer:
    trainer = Trainer.for_run(config, ft=ft, standalone=False)
    trainer.train()
    return trainer


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_doomed_step_is_abandoned_mid_pass_and_changes_nothing(tiny_config, tmp_path, where):
    settings = {"train": {"steps": 6, "eval_every": 0}, "ft": {"bucket_bytes": BUCKET}}
    clean = run(tiny_config(tmp_path / "clean", **settings), NoFaultTolerance())
    # ``step_alive`` is asked before each block of the forward pass, then as each bucket is ready.
    blocks = len(clean.model.layers)
    after = 0 if where == "forward" else blocks + 2
    ft = LostPeerAt(step=3, after=after)
    doomed = run(tiny_config(tmp_path / "doomed", **settings), ft)
    events = read_events(doomed.run_dir / "events.jsonl")
    failed = [e for e in events if e["kind"] == "step_failed"]
    assert [(e["step"], e.get("abandoned")) for e in failed] == [(3, where)]
    assert where in failed[0]["reason"]
    assert [e["step"] for e in events if e["kind"] == "commit"] == list(range(6))
    # The pass stopped where the peer was lost: before any bucket (forward), or after the
    # buckets ``step_alive`` allowed (backward), where a whole step starts them all.
    full = ft.started[2]
    assert full > 4
    if where == "forward":
        assert ft.at_fail == 0
    else:
        assert 2 <= ft.at_fail < full
    # The abandoned pass left nothing behind: the same samples, the same final state.
    assert doomed.state_hash() == clean.state_hash()


def test_a_loop_that_opts_in_catches_step_doomed_and_commits(tmp_path):
    """The public API: ``abandon_doomed_steps=True`` raises ``StepDoomed`` into the loop, which
    commits as usual; the step fails and is handed out again."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)]))

    def forward(x):
        for layer in model[0]:
            x = torch.tanh(layer(x))
        return x

    ft = LostPeerAt(step=1, after=0)
    session = Session(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=3, batch_size=2,
                      run_dir=tmp_path / "run", ft=ft, standalone=False, abandon_doomed_steps=True)
    seen, outcomes = [], []
    with session:
        for step in session:
            seen.append(step.samples.start)
            try:
                loss = forward(torch.ones(2, 4) * step.step).pow(2).mean()
                loss.backward()
            except StepDoomed:
                loss = 0.0
            outcomes.append(session.commit(loss))
    assert outcomes == [True, False, True, True]
    assert seen == [0, 2, 2, 4]  # the failed step's samples came again


def test_without_opting_in_nothing_is_raised(tmp_path):
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4)]))
    ft = LostPeerAt(step=0, after=0)
    session = Session(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=1, batch_size=2,
                      run_dir=tmp_path / "run", ft=ft, standalone=False)
    with session:
        for step in session:
            model[0][0](torch.ones(2, 4)).sum().backward()
            assert session.commit(1.0)
    assert ft.asked == 0  # never asked: the loop's passes run to their end


def test_only_the_loops_thread_is_interrupted(tmp_path):
    """A forward pass on another thread during a doomed step (a thread of the caller's own:
    an evaluator, say) runs to its end: ``StepDoomed`` is raised into the loop's thread alone."""
    import threading

    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)]))
    ft = LostPeerAt(step=0, after=0)
    session = Session(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=1, batch_size=2,
                      run_dir=tmp_path / "run", ft=ft, standalone=False, abandon_doomed_steps=True)
    other: list[BaseException | None] = []

    def elsewhere() -> None:
        try:
            for layer in model[0]:
                layer(torch.ones(1, 4))
            other.append(None)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            other.append(e)

    with session:
        for step in session:
            thread = threading.Thread(target=elsewhere)
            thread.start()
            thread.join(timeout=30)
            with pytest.raises(StepDoomed, match="forward pass was abandoned"):
                model[0][0](torch.ones(2, 4))
            assert not session.commit(0.0)
            break
    assert other == [None]
