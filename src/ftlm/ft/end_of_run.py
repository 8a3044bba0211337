"""Who may write the job's final weights when a group exits: a pure rule.

Every group of a job writes the job's model file into the one run directory as it exits. The
file must end holding the job's newest state, whatever order the groups exit in and whatever
happened to them on the way (restarted after the job finished, stopped while recovering, killed
before ever joining a quorum). Two rules decide it:

* a group writes only a state it knows to be the job's: it took part in a quorum in this
  incarnation and is not behind the step of the last one it was in (the job's head as it knows
  it), or it holds the job's final step (restored from the final checkpoint);
* a file is never replaced by a state behind the one it holds. A rollback past the file's state
  is an explicit, logged act of the launcher (the file is moved aside), never a side effect of a
  group's exit.

Not responsible for: reading or writing the file (``ftlm.train.model_file``), nor deciding what
the job's head is (the coordinator's quorum does).
"""

from __future__ import annotations


def may_write_model(held_step: int | None, step: int, joined: bool, final_step: int,
                    head: int = 0) -> tuple[bool, str]:
    """Whether a group whose state is at ``step`` may write the job's model file, which holds
    ``held_step`` now (None: no file, or one without a stamp); with the reason when it may not.

    ``joined``: the group was in a quorum in this incarnation, the last of them at step ``head``;
    ``final_step``: the job's last step (``train.steps``)."""
    if held_step is not None and held_step > step:
        return False, f"it holds step {held_step}, newer than this group's step {step}"
    if step >= final_step:
        return True, ""
    if not joined:
        return False, (f"this group never took part in a quorum (its step {step} is not known to "
                       "be the job's)")
    if step < head:
        return False, f"this group stopped at step {step}, behind the job's step {head}"
    return True, ""
