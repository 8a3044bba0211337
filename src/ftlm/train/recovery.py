"""A recovering group's side of a step: load a peer's snapshot, replay the buffered averaged
updates, and reach the head without holding the participants up (docs/design.md, 'Joining and
catching up').

While the snapshot is on its way the group takes part in every all-reduce with zero gradients
and records each committed average (``CatchUpBuffer``). Once the snapshot is loaded it replays the
backlog while its own contribution waits for the participants' gradients (at least
``REPLAY_AT_LEAST`` updates a step), recording the new averages behind it, until it holds the
head's state; at the job's last step (drain) it replays everything at once.

Not here: the pull itself (``ftlm.ft``), the participants' step and the vote
(``ftlm.train.session``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ftlm.ft.group import REPLAY_AT_LEAST, check_replay
from ftlm.ft.history import extend_chain
from ftlm.ft.protocol import Recovered, StepPlan
from ftlm.train.catchup import CatchUpBuffer, unflatten_into
from ftlm.train.optim import apply_update
from ftlm.train.state import TrainState

"""Buffered updates a recovering group replays per step at least, even when its all-reduce
completed at once: the backlog grows by one a step, so it shrinks by at least one."""


@dataclass
class _Catching:
    """A peer's snapshot loaded, its backlog of buffered updates being replayed."""

    recovered: Recovered
    replayed: int = 0
    seconds: float = 0.0


class Recovery:
    """The catch-up of one group: its buffer of averaged updates and the snapshot it replays."""

    def __init__(self, state: TrainState, params: list[torch.Tensor], ft: Any, events: Any,
                 metrics: Any, buffer: CatchUpBuffer, grad_clip: float, ranks: int,
                 tokens_per_sample: int,
                 params_of: Callable[[int], list[torch.Tensor]] | None = None) -> None:
        self.state = state
        self.params = params
        # The parameters a step's average updates: all of them, or (streaming DiLoCo) the
        # fragment that step synchronised.
        self.params_of = params_of or (lambda step: params)
        self.ft = ft
        self.events = events
        self.metrics = metrics
        self.buffer = buffer
        self.grad_clip = grad_clip
        self.ranks = ranks
        self.tokens_per_sample = tokens_per_sample
        self._catching: _Catching | None = None  # a loaded snapshot not yet at the head

    def drop(self) -> None:
        """Forget a pull in flight and a snapshot being replayed (a newer state was loaded)."""
        self._catching = None
        self.buffer.clear()

    def while_waiting(self, plan: StepPlan) -> None:
        """The work while this group's zero contribution waits for the participants' gradients:
        load the peer's snapshot if it arrived, then replay buffered updates until the all-reduce
        completes (at least ``REPLAY_AT_LEAST``), so the catch-up never holds the participants
        up, however large the state."""
        # The buckets in flight write this step's average into these gradients, and the
        # replay needs the parameters' .grad for its own updates: set them aside meanwhile.
        held = [p.grad for p in self.params]
        try:
            self._poll()
            if self._catching is not None:
                self._replay(plan, until_head=False)
        finally:
            for p, g in zip(self.params, held):
                p.grad = g

    def _poll(self) -> None:
        if self._catching is None and (rec := self.ft.poll_recovery()) is not None:
            self.state.load_flat(rec.tensors, rec.meta, copy=False)  # received: ours alone
            self._catching = _Catching(rec)

    def _replay(self, plan: StepPlan, until_head: bool) -> bool:
        """Replay buffered updates toward the head of ``plan``, checked against the quorum's
        history first; all of them with ``until_head`` or in a group of several ranks (their
        ranks must stay at one step). False (and the recovery restarts) when the snapshot plus
        the buffer does not lead to the head."""
        state, catching = self.state, self._catching
        assert catching is not None
        updates = self.buffer.run_from(state.step)
        check = (check_replay(state.step, state.chain,
                              [(u.step, u.quorum_id, u.participants) for u in updates],
                              plan.quorum, committed_now=False)
                 if updates is not None else None)
        if check is None or not check.ok:
            # The snapshot stays loaded; the group reports its step and recovers again.
            self.drop()
            self.ft.restart_recovery(check.reason if check is not None
                                     else f"a buffered update after step {state.step} is missing")
            return False
        t0 = time.perf_counter()
        everything = until_head or self.ranks > 1
        for n, u in enumerate(updates[:check.apply]):
            if not everything and n >= REPLAY_AT_LEAST and not self.ft.allreduce_in_flight():
                break
            params = self.params_of(u.step)
            unflatten_into(u.grads, params)
            apply_update(params, state.optimizer, u.lr, self.grad_clip)
            state.chain = extend_chain(state.chain, u.step, u.quorum_id, u.participants)
            state.step += 1
            state.cursor += u.samples
            self.buffer.drop(u.step)
            catching.replayed += 1
            self.ft.fire("during_replay")
        catching.seconds += time.perf_counter() - t0
        self.metrics.on_catchup_lag(plan.step - state.step)
        return True

    def after_vote(self, plan: StepPlan, ok: bool, grads: list[torch.Tensor], lr: float,
                   samples: int, loss: float, stopping: bool) -> bool:
        """The end of a recovering step: apply its average if this group reached the head, else
        record it for the replay. Returns whether the next quorum was asked for (``ft.ask``)."""
        at_head = self._catching is not None and self.state.step == plan.step
        # Ask for the next quorum now, as the participants do right after their vote, with the
        # state this step leaves (the head's successor once it caught up here): the next
        # quorum waits for every member of this one, and the bookkeeping below (a copy of the
        # whole gradient, or the update) would make this group late for it.
        after = ((plan.step + 1, plan.quorum.next_chain()) if at_head and ok
                 else (self.state.step, self.state.chain))
        asked = not stopping and self.ft.ask(*after)
        if at_head:
            # At this step's head: apply its average, if committed (the participants may still
            # have failed it after the all-reduce completed here, as for any participant).
            self._finish(plan, lr if ok else None, samples, loss)
        else:
            if ok:  # behind the backlog, or before the snapshot arrived: kept for the replay
                self.buffer.record(plan.step, grads, lr, samples, plan.quorum_id,
                                   plan.quorum.participants if plan.quorum is not None else [])
            self.metrics.on_catchup_lag(plan.step + 1 - self.state.step if self._catching
                                        else len(self.buffer))
            if self.buffer.overflowing:
                reason = f"catch-up buffer exceeded {self.buffer.limit()}"  # before it is emptied
                self.drop()
                self.ft.restart_recovery(reason)
        for p in self.params:
            p.grad = None
        return asked

    def drain(self, plan: StepPlan) -> None:
        """The job reached its last step: a recovering group only catches up, nobody trains."""
        if plan.recovering:
            self._poll()
            if self._catching is not None and self._replay(plan, until_head=True):
                self._finish(plan, None, 0, None)
                return
        time.sleep(0.1)  # the snapshot is on its way; ask again shortly

    def _finish(self, plan: StepPlan, lr: float | None, samples: int, loss: float | None) -> None:
        """At the head of ``plan`` after its vote: apply that step's average (``lr`` set: it
        committed here) and report the head."""
        state, catching = self.state, self._catching
        assert catching is not None
        self._catching = None
        t0 = time.perf_counter()
        if lr is not None:
            start = state.cursor
            grad_norm = apply_update(self.params_of(plan.step), state.optimizer, lr, self.grad_clip)
            state.step += 1
            state.cursor += samples
            state.chain = plan.quorum.next_chain()
            catching.replayed += 1
            self.events.emit("commit", step=plan.step, quorum_id=plan.quorum_id,
                             participants=plan.participants, samples=[start, start + samples],
                             loss=loss, tokens=samples * self.tokens_per_sample,
                             lr=lr, grad_norm=grad_norm, chain=state.chain,
                             parent=plan.quorum.chain, replayed=True)
            self.ft.fire("during_replay")
        self.buffer.clear()
        rec = catching.recovered
        self.ft.caught_up(state.step, state.chain)
        replay_seconds = catching.seconds + time.perf_counter() - t0
        self.metrics.on_recovery(rec.seconds, rec.nbytes, replay_seconds=replay_seconds,
                                 source=rec.source)
        self.metrics.on_catchup_lag(0)
        self.events.emit("recovery_end", step=state.step, ok=True, source=rec.source,
                         snapshot_step=rec.step, replayed=catching.replayed, bytes=rec.nbytes,
                         transfer_seconds=rec.seconds, chain=state.chain,
                         replay_seconds=replay_seconds)
