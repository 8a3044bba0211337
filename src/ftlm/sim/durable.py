"""What a simulated job keeps on disk: its durable checkpoints and its model file.

``Storage`` holds the checkpoints by step (one valid checkpoint per step: which group wrote it
does not matter, since equal steps of one history are equal states) and the job's model file.
A periodic checkpoint is written by participant 0 of the step's quorum (``checkpoint.every``:
10, or 0 on every third seed); the job's last step is saved whatever ``checkpoint.every`` says,
once (the session's ``Durability.save_final``); a group stopped by SIGTERM that wrote its last step's
checkpoints saves that step on its way out (``checkpoint.on_stop``); each group's process
writes the model file as it exits when the real rule ``ftlm.ft.end_of_run.may_write_model``
lets it.

Not responsible for judging the model file (``Invariants.check_model_write`` and ``check_end``),
for when a group loads a checkpoint (``ftlm.sim.processes``, ``ftlm.sim.recovery``), nor for
files, bytes or partial writes: a save either happened at its moment or did not. The trainer's
rules written here (``Checkpointer.due``, ``Durability.saves_on_stop``, ``Durability.save_final``) live in
``ftlm.train``, which ``ftlm.sim`` may not import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftlm.ft.durable_rules import checkpoint_due, keeps_final_on_disk, saves_on_stop
from ftlm.ft.end_of_run import may_write_model
from ftlm.ft.group import Role
from ftlm.sim.job import Incarnation, State, copy_state

if TYPE_CHECKING:
    from ftlm.sim.world import Simulation


class Storage:
    """Durable checkpoints and the model file of one ``Simulation``."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.c = sim.c
        every = self.c.checkpoint_every
        self.checkpoint_every = every if every is not None else 0 if sim.seed % 3 == 2 else 10
        self.disk: dict[int, State] = {}
        self.model: State | None = None  # what the job's model file holds (each group writes it as it exits)
        self.model_at = 0.0  # when it was written

    def checkpoint_due(self, step: int) -> bool:
        """``Checkpointer.due``: a periodic checkpoint of ``step``."""
        return checkpoint_due(step, self.checkpoint_every)

    def committed(self, inc: Incarnation, role: Role) -> None:
        """``inc`` committed a step as a participant: its writer (participant 0) saves the job's
        last step at once, or a step due for a periodic checkpoint."""
        if role.participant_index == 0 and inc.state.step == self.c.steps:
            self.save_final(inc, finishing=False)  # at once by its writer (and by any group that finishes)
        elif role.participant_index == 0 and self.checkpoint_due(inc.state.step):
            self.disk[inc.state.step] = copy_state(inc.state)

    def set_aside(self, inc: Incarnation, suspect: object) -> None:
        """A process retired for a suspect state (``quorum.Convicted.suspect_state``) moves that
        state's checkpoint aside (``Checkpointer.set_aside``) before it exits."""
        if not isinstance(suspect, (list, tuple)) or not inc.alive:
            return
        step, chain = suspect
        on_disk = self.disk.get(step)
        if on_disk is not None and on_disk.chain == chain:
            del self.disk[step]
            self.sim.log(f"{inc.replica_id} sets the checkpoint of step {step} aside")

    def saves_on_stop(self, inc: Incarnation) -> bool:
        """The trainer's ``_saves_on_stop``: a group stopped by SIGTERM that wrote its last step's
        checkpoints saves that step on its way out unless it is on disk (periodic or not)."""
        return saves_on_stop(inc.writer, self.c.checkpoint_on_stop, self.checkpoint_due(inc.state.step))

    def save_final(self, inc: Incarnation, finishing: bool) -> None:
        """The session's ``Durability.save_final``: the job's last step is made durable whatever
        ``checkpoint.every`` says, once (by its writer at the commit, or by whichever group
        finishes first, ``finishing``): a group started after the others left resumes there.
        A finishing group whose last quorum stood at its state (``holds_head``: the coordinator
        confirmed that history as the job's) replaces a final checkpoint of another history
        (``Checkpointer.save_once(job_history=True)``)."""
        st = inc.state
        if st.step < self.c.steps:
            return
        on_disk = self.disk.get(st.step)
        q = inc.quorum
        confirmed = finishing and q is not None and q.step == st.step and q.chain == st.chain
        if not keeps_final_on_disk([on_disk.chain] if on_disk is not None else [], st.chain, confirmed):
            if on_disk is not None:
                self.sim.log(f"{inc.replica_id} replaces the final checkpoint of another history")
            self.disk[st.step] = copy_state(st)

    def may_write_model(self, inc: Incarnation) -> tuple[bool, str]:
        """The trainer's rule for replacing the job's model file with ``inc``'s state as its
        process exits (``ftlm.ft.end_of_run.may_write_model``)."""
        head = inc.quorum.step if inc.quorum is not None else None
        held = self.model.step if self.model is not None else None
        return may_write_model(held, inc.state.step, head is not None, self.c.steps, head or 0)

    def write_model(self, inc: Incarnation) -> None:
        """``inc``'s process exits after it finished or left: it writes the job's model file if the
        rule lets it (``Invariants.check_model_write`` judges what it writes)."""
        ok, why = self.may_write_model(inc)
        st = inc.state
        if not ok:
            self.sim.log(f"{inc.replica_id} does not write the model at step {st.step}: {why}")
            return
        self.sim.invariants.check_model_write(inc)
        self.model, self.model_at = copy_state(st), self.sim.now
        self.sim.log(f"{inc.replica_id} writes the model at step {st.step}")
