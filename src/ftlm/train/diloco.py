"""DiLoCo and streaming DiLoCo: groups that synchronise every H steps instead of every step.

Each group takes ``ft.diloco_inner_steps`` (H) steps of the caller's optimizer (the *inner*
optimizer) on its own data, then the groups average their *pseudo-gradient* (outer parameters
minus the group's parameters) and apply it to the outer parameters with an outer Nesterov SGD
(DiLoCo, arXiv 2311.08105). Streaming DiLoCo (arXiv 2501.18512) cuts the parameters into
``ft.diloco_fragments`` fragments synchronised in turn, one every H / F inner steps, can start a
fragment's all-reduce ``ft.diloco_overlap_steps`` inner steps before it is needed (then merges
``alpha * local + (1 - alpha) * outer``), and can send the outer gradient as bfloat16 or int8.

The mapping onto the fault-tolerant protocol (docs/diloco.md): one protocol step is one
synchronisation. Its quorum is taken before the inner steps (it decides the group's data), the
inner steps need no coordinator, and the all-reduce and commit vote end the step. The replicated
state is the *outer* state (``outer_module`` and ``outer_optimizer``, which ``TrainState`` holds):
a recovering group pulls exactly that, replays buffered averaged pseudo-gradients through
``ftlm.train.optim.apply_update``, and loads it into the model before its next inner phase. The
inner optimizer's state and the int8 error feedback are the group's own: they are not replicated,
checkpointed or transferred (a restarted group starts them afresh).

Not here: the quorum, the transport and the vote (``ftlm.ft``), the step loop and the data
(``ftlm.train.session``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ftlm.ft.config import FTConfig
from ftlm.ft.protocol import StepPlan
from ftlm.train.grad_sync import bucket_plan
from ftlm.train.optim import apply_update

log = logging.getLogger("ftlm.train")

INT8_ROW = 4096
"""Values that share one int8 scale: a row costs 4 bytes of scale for ROW bytes of values."""


# -- the pure parts: fragments and the int8 code --------------------------------------------------
def split_fragments(sizes: list[int], count: int, how: str) -> list[list[int]]:
    """Indices of parameters (given by their byte sizes) per fragment: ``strided`` (i mod F) or
    ``contiguous`` (runs of about ``total / F`` bytes). Every fragment gets at least one."""
    if count > len(sizes):
        raise ValueError(f"ft.diloco_fragments={count} exceeds the model's {len(sizes)} trainable "
                         "parameters: use at most that many fragments")
    if how == "strided":
        return [list(range(f, len(sizes), count)) for f in range(count)]
    total, fragments, acc = sum(sizes), [[] for _ in range(count)], 0
    for i, size in enumerate(sizes):
        # Leave at least one parameter for each fragment still to fill.
        f = min(int(acc * count / max(total, 1)), count - 1, i)
        f = max(f, count - (len(sizes) - i))
        fragments[f].append(i)
        acc += size
    return fragments


def int8_levels(participants: int) -> int:
    """Largest code a group may send so that the int8 SUM of all participants cannot overflow:
    each code is at most ``L * a_g / S + 0.5`` in magnitude (``a_g`` its range, ``S`` their sum)."""
    levels = 127 - (participants + 1) // 2
    if levels < 2 * participants:
        raise ValueError(f"ft.diloco_wire_dtype=int8 cannot sum {participants} groups in int8 "
                         "without losing every bit of precision: use bfloat16 for that many")
    return levels


def int8_rows(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` padded with zeros to whole rows of ``INT8_ROW`` values, as a matrix."""
    rows = -(-flat.numel() // INT8_ROW)
    padded = torch.zeros(rows * INT8_ROW, dtype=torch.float32, device=flat.device)
    padded[:flat.numel()] = flat
    return padded.view(rows, INT8_ROW)


def int8_encode(rows: torch.Tensor, range_sum: torch.Tensor, levels: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of ``rows`` against the summed per-row range of all participants, and what they
    leave out (the error fed back into this group's next pseudo-gradient of the fragment)."""
    step = (range_sum / levels).clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
    codes = torch.round(rows / step).clamp_(-127, 127)
    return codes.to(torch.int8), rows - codes * step


def int8_decode(code_sum: torch.Tensor, range_sum: torch.Tensor, levels: int,
                participants: int) -> torch.Tensor:
    """The participants' average from the SUM of their codes."""
    step = (range_sum / levels).unsqueeze(1)
    return code_sum.float() * step / participants


# -- the model's side ----------------------------------------------------------------------------
def mirror_module(model: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """A module holding a copy of each trainable parameter of ``model`` under the same name
    (so checkpoints read as the model's), and those copies in ``model.parameters()`` order."""
    root = torch.nn.Module()
    copies = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        copy = torch.nn.Parameter(p.detach().clone())
        owner.register_parameter(leaf, copy)
        copies.append(copy)
    return root, copies


class DiLoCo:
    """The inner phases and outer synchronisations of one group (module docstring).

    ``local`` gives a tensor's local shard (FSDP2's DTensors); ``ft`` is the session's
    ``FaultTolerance``. The session calls ``begin`` after each quorum, ``inner_commit`` after
    each inner backward, ``exchange`` / ``decode`` around the step's all-reduce, then
    ``committed`` or ``failed``.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 config: FTConfig, ft: Any, local: Callable[[torch.Tensor], torch.Tensor],
                 grad_clip: float, multi_rank: bool) -> None:
        self.config = config
        self.ft = ft
        self.local = local
        self.grad_clip = grad_clip
        self.multi_rank = multi_rank
        self.inner_optimizer = inner_optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.outer_module, self.outer = mirror_module(model)
        self.outer_optimizer = torch.optim.SGD(self.outer, lr=config.diloco_outer_lr,
                                               momentum=config.diloco_outer_momentum,
                                               nesterov=config.diloco_nesterov)
        sizes = [local(p).numel() * local(p).element_size() for p in self.outer]
        self.fragments = split_fragments(sizes, config.diloco_fragments,
                                         config.diloco_fragment_split)
        self.per_sync = config.inner_steps_per_sync  # inner steps of one phase (K)
        self.overlap = config.diloco_overlap_steps
        # Whether a failed phase must restore more than the outer state: other fragments keep
        # committed local progress, and an overlapped merge keeps the local part.
        self._keep_phase_start = config.diloco_fragments > 1 or self.overlap > 0
        self._phase_start: list[torch.Tensor] = []
        self._residual: dict[int, torch.Tensor] = {}  # int8 error feedback, per fragment
        self._new_residual: torch.Tensor | None = None
        self._follows: tuple[int, str] | None = None  # the (step, chain) the model continues
        self.plan: StepPlan | None = None
        self.k = 0  # inner steps taken in this phase
        self._losses: list[torch.Tensor] = []
        self._flight: dict[str, Any] | None = None  # this step's exchange, once started
        self.wire_bytes = 0  # this group's payload of the last exchange
        self.outer_seconds = 0.0  # the last synchronisation: exchange, vote, outer update
        self.staleness = 0  # inner steps between taking the last pseudo-gradient and merging it
        self._phase_t0 = time.monotonic()
        self._warned = False  # the phase-length warning is given once

    # -- which parameters a step synchronises ------------------------------------------------------
    def fragment_of(self, step: int) -> int:
        return step % len(self.fragments)

    def params_of(self, step: int) -> list[torch.Tensor]:
        """The outer parameters synchronised at protocol step ``step`` (the recovery replays
        each buffered average into these)."""
        return [self.outer[i] for i in self.fragments[self.fragment_of(step)]]

    # -- the inner phase -------------------------------------------------------------------------
    @property
    def in_phase(self) -> bool:
        return self.plan is not None and self.k < self.per_sync

    def begin(self, plan: StepPlan, step: int, chain: str) -> None:
        """A quorum made this group a participant of ``step``: start its inner phase. A state
        the model does not continue (the first phase, a resume, a recovery, a reload) is loaded
        into the model first."""
        if self._follows != (step, chain):
            with torch.no_grad():
                for p, o in zip(self.params, self.outer):
                    self.local(p).copy_(self.local(o))
            self._residual.clear()
            self._follows = (step, chain)
        if self._keep_phase_start:
            with torch.no_grad():
                if not self._phase_start:
                    self._phase_start = [self.local(p).detach().clone() for p in self.params]
                else:
                    for keep, p in zip(self._phase_start, self.params):
                        keep.copy_(self.local(p))
        self.plan, self.k, self._losses, self._flight = plan, 0, [], None
        self._phase_t0 = time.monotonic()
        self.inner_optimizer.zero_grad(set_to_none=True)

    def alive(self) -> bool:
        """Between inner steps: report progress (a long phase is no hang) and say whether the
        step can still commit. A single-rank group abandons a phase whose quorum lost a member;
        the ranks of a larger group would each hear it at another moment, so they go on and
        fail at the all-reduce together."""
        ok = self.ft.step_alive()
        return ok or self.multi_rank

    def inner_commit(self, loss: torch.Tensor, lr: float) -> torch.Tensor | None:
        """One inner optimizer step on this group's gradient; the phase's mean loss after its
        last step, else None. With overlap, the fragment's exchange starts ``overlap`` steps
        before the phase ends."""
        self._losses.append(loss)
        apply_update(self.params, self.inner_optimizer, lr, self.grad_clip)
        self.k += 1
        if self.overlap and self.k == self.per_sync - self.overlap:
            self.exchange(self.plan)
        if self.k < self.per_sync:
            return None
        return torch.stack(self._losses).mean()

    def abandon(self) -> torch.Tensor:
        """The phase ends early (its quorum lost a member): the loss so far, for the vote that
        fails the step."""
        self.k = self.per_sync
        return torch.stack(self._losses).mean() if self._losses else torch.zeros(())

    # -- the synchronisation ---------------------------------------------------------------------
    def exchange(self, plan: StepPlan, zeros: bool = False) -> list[torch.Tensor]:
        """Start the all-reduce of the step's fragment (once): the pseudo-gradient, or zeros
        while this group recovers. Returns the outer gradients the averages land in
        (``decode``, after the session's ``allreduce`` waited for them)."""
        params = self.params_of(plan.step)
        if self._flight is not None and self._flight["plan"] is plan:
            return self._flight["grads"]
        self._flight = {"t0": time.perf_counter(), "k": self.k, "plan": plan}
        if not zeros:
            self._check_phase_length(time.monotonic() - self._phase_t0)
        with torch.no_grad():
            for i in self.fragments[self.fragment_of(plan.step)]:
                o = self.outer[i]
                o.grad = torch.zeros_like(o) if zeros else o.detach() - self.params[i].detach()
        grads = [self.local(o.grad) for o in params]
        self._flight["grads"] = grads
        wire = self.config.diloco_wire_dtype
        if wire == "int8":
            self._start_int8(grads, plan.participants)
        else:
            tensors = grads if wire == "float32" else [g.to(torch.bfloat16) for g in grads]
            self._flight["wire"] = tensors
            self._start(tensors)
            self.wire_bytes = sum(t.numel() * t.element_size() for t in tensors)
        return grads

    def _check_phase_length(self, seconds: float) -> None:
        """A joining group's zero contribution waits for the participants' whole inner phase,
        and the groups' speeds drift apart over it: both within ``ft.allreduce_timeout``."""
        limit = self.config.allreduce_timeout
        if seconds > limit / 2 and not self._warned:
            self._warned = True
            log.warning("a DiLoCo inner phase took %.1f s, over half of ft.allreduce_timeout=%.1f s: "
                        "a joining group waits a whole phase in its all-reduce; raise "
                        "ft.allreduce_timeout (and the timeouts above it) beyond the phase",
                        seconds, limit)

    def _start(self, tensors: list[torch.Tensor]) -> None:
        sizes = [(t.numel() * t.element_size(), t.dtype) for t in tensors]
        for bucket in reversed(bucket_plan(sizes, self.config.bucket_bytes)):
            self.ft.allreduce_start([tensors[i] for i in sorted(bucket)])

    def _start_int8(self, grads: list[torch.Tensor], participants: int) -> None:
        flat = torch.cat([g.reshape(-1).float() for g in grads]) if grads else torch.zeros(0)
        f = self.fragment_of(self._flight["plan"].step)
        if f in self._residual:
            flat = flat + self._residual[f]
        rows = int8_rows(flat)
        # First the participants' summed per-row range (a small all-reduce the codes need)...
        ranges = rows.abs().amax(dim=1)
        self.ft.allreduce([ranges])
        range_sum = ranges * participants
        levels = int8_levels(participants)
        codes, error = int8_encode(rows, range_sum, levels)
        self._new_residual = error.reshape(-1)[:flat.numel()]
        # ... then the codes, summed as int8 (an integer all-reduce is not divided).
        # (The padding of the last row stays home: every group pads it with zeros.)
        sent = codes.reshape(-1)[:flat.numel()]
        for piece in sent.split(max(1, self.config.bucket_bytes)):
            self.ft.allreduce_start([piece])
        self._flight.update(codes=codes, range_sum=range_sum, levels=levels,
                            participants=participants, n=flat.numel())
        self.wire_bytes = sent.numel() + ranges.numel() * ranges.element_size()

    def decode(self) -> None:
        """Write the participants' average into the outer gradients (after the wait)."""
        flight = self._flight
        wire = self.config.diloco_wire_dtype
        if flight is None or wire == "float32":
            return
        grads = flight["grads"]
        with torch.no_grad():
            if wire == "bfloat16":
                for g, w in zip(grads, flight["wire"]):
                    g.copy_(w)
                return
            avg = int8_decode(flight["codes"], flight["range_sum"], flight["levels"],
                              flight["participants"]).reshape(-1)[:flight["n"]]
            offset = 0
            for g in grads:
                g.copy_(avg[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def committed(self, step: int, chain: str) -> None:
        """The outer update of the fragment was applied (the state is at ``(step, chain)``):
        merge it into the model, keep the error fed back."""
        plan = self.plan
        assert plan is not None and self._flight is not None
        f = self.fragment_of(plan.step)
        index = self.fragments[f]
        with torch.no_grad():
            for i in index:
                p, o = self.local(self.params[i]), self.local(self.outer[i])
                if self.overlap:
                    p.lerp_(o, 1.0 - self.config.diloco_merge_alpha)
                else:
                    p.copy_(o)
        if self._new_residual is not None:
            self._residual[f] = self._new_residual
        self.staleness = self.k - self._flight["k"]
        self.outer_seconds = time.perf_counter() - self._flight["t0"]
        self._follows = (step, chain)
        self._end_phase()

    def failed(self) -> None:
        """The step did not commit: the model goes back to the phase's start (its samples are
        given out again); the error feedback of the failed exchange is dropped."""
        if self.plan is not None:
            with torch.no_grad():
                source = self._phase_start if self._keep_phase_start else \
                    [self.local(o) for o in self.outer]
                for p, keep in zip(self.params, source):
                    self.local(p).copy_(keep)
        self._end_phase()

    def _end_phase(self) -> None:
        self.plan, self.k, self._losses, self._flight = None, 0, [], None
        self._new_residual = None
        for o in self.outer:
            o.grad = None

    def load_outer_into_model(self) -> None:
        """The end of the job: the model file holds the replicated outer state, not this
        group's local progress on fragments synchronised earlier."""
        with torch.no_grad():
            for p, o in zip(self.params, self.outer):
                self.local(p).copy_(self.local(o))
