"""Whose fault a non-finite loss is (``ftlm.train.nonfinite``): every group judges from the
per-participant flags of the all-reduce. One group's faulty device stops that group only (the job
goes on); samples that break training stop the job once a second group meets them; a diverged
training (every participant non-finite) stops the job as before."""

from __future__ import annotations

import pytest

from ftlm.errors import FaultError
from ftlm.train.nonfinite import NONFINITE_LIMIT, NonFiniteJudge, NonFiniteReplica, TrainingDiverged

B = 4  # samples per participant


def attempts(judge: NonFiniteJudge, n: int, origins: list[int], mine: int | None, P: int = 3,
             cursor: int = 24, step: int = 3) -> None:
    for _ in range(n):
        judge.failed(step, origins, P, mine, cursor, B)


def test_a_group_alone_non_finite_stops_as_a_fault_and_its_peers_do_not() -> None:
    sick, peers = NonFiniteJudge(), [NonFiniteJudge(), NonFiniteJudge()]
    attempts(sick, NONFINITE_LIMIT - 1, [2], mine=2)
    for i, peer in enumerate(peers):
        attempts(peer, 20, [2], mine=i)  # however long: not their fault
    with pytest.raises(NonFiniteReplica, match=r"3 attempts in a row at step 3 \(samples at "
                                               r"positions \[32, 36\)\) while 2 of its 2 peers"):
        attempts(sick, 1, [2], mine=2)
    assert issubclass(NonFiniteReplica, FaultError)  # exit status 1: restarted, not the job's end


def test_every_participant_non_finite_is_divergence_as_before() -> None:
    judges = [NonFiniteJudge() for _ in range(3)]
    for i, judge in enumerate(judges):
        attempts(judge, NONFINITE_LIMIT - 1, [0, 1, 2], mine=i)
        with pytest.raises(TrainingDiverged, match="not finite in 3 attempts in a row at step 3.*lower train.lr"):
            attempts(judge, 1, [0, 1, 2], mine=i)
    assert not issubclass(TrainingDiverged, FaultError)  # status 2: a restart repeats it
    alone = NonFiniteJudge()  # one group: nothing to compare with
    attempts(alone, NONFINITE_LIMIT - 1, [0], mine=0, P=1)
    with pytest.raises(TrainingDiverged):
        attempts(alone, 1, [0], mine=0, P=1)


def test_samples_that_break_training_in_a_second_group_stop_the_job_naming_them() -> None:
    """The first group to meet them is taken for a faulty device and restarts; the samples then
    go to a survivor (the slices are fixed ranges of positions), which recognises them."""
    survivor = NonFiniteJudge()
    attempts(survivor, NONFINITE_LIMIT, [1], mine=0, P=2, cursor=24)  # the other group: [28, 32)
    survivor.committed()  # alone now (P=1): step 3 is [24, 28), fine
    with pytest.raises(TrainingDiverged, match=r"positions \[28, 32\) made the loss or gradient "
                                               r"non-finite here at step 4 after positions \[28, 32\) "
                                               r"did in another group: the data"):
        survivor.failed(4, [0], 1, 0, 28, B)


def test_a_recovering_group_remembers_nothing_and_a_finite_commit_resets_the_count() -> None:
    recovering = NonFiniteJudge()
    attempts(recovering, 5, [1], mine=None)  # its cursor is not the step's: nothing remembered
    recovering.failed(4, [0], 1, 0, 28, B)  # then non-finite itself on [28, 32): one attempt
    assert recovering.in_a_row == 1
    judge = NonFiniteJudge()
    attempts(judge, NONFINITE_LIMIT - 1, [0], mine=0)
    judge.committed()
    attempts(judge, NONFINITE_LIMIT - 1, [0], mine=0)  # not in a row: no verdict
    judge.failed(3, [], 3, 0, 24, B)  # a failure of another kind breaks the run too
    attempts(judge, NONFINITE_LIMIT - 1, [0], mine=0)
    assert judge.in_a_row == NONFINITE_LIMIT - 1


def test_a_lone_participant_waits_for_a_member_catching_up_before_any_verdict() -> None:
    """A group alone non-finite while another catches up from it: no divergence verdict (the
    other would lose its source); once the other trains too, the comparison decides at once."""
    sick = NonFiniteJudge()
    for _ in range(2 * NONFINITE_LIMIT):
        sick.failed(10, [0], 1, 0, 40, B, recovering=1)
    with pytest.raises(NonFiniteReplica):
        sick.failed(10, [0], 2, 0, 40, B)  # the other is a participant now, and finite
    diverged = NonFiniteJudge()
    for _ in range(NONFINITE_LIMIT):
        diverged.failed(10, [0], 1, 0, 40, B, recovering=1)
    with pytest.raises(TrainingDiverged):
        diverged.failed(10, [0, 1], 2, 0, 40, B)  # both non-finite: the run
