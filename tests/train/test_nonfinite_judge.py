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


# -- a seeded search: many jobs, the non-finite loss following a device or the data -------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _run_job(groups: int, poison_at: int | None, sick: int | None, rejoin_after: int,
             steps: int = 12) -> list[tuple[str, str]]:
    """A job of ``groups`` groups (participants in name order, slices of B positions from the
    step's cursor) whose loss is non-finite for the ``sick`` group (a device) or for any slice
    holding position ``poison_at`` (the data). Every group judges the flags all see; a group
    that raises leaves, misses ``rejoin_after`` attempts (at least one: its peers detect its exit
    and try without it before a restart is back) and comes back with a fresh judge, a good
    device and the job's state. Returns the verdicts, (group, exception name), in order."""
    judges = {g: NonFiniteJudge() for g in range(groups)}
    away: dict[int, int] = {}  # group -> attempts until it is back
    verdicts: list[tuple[str, str]] = []
    step = cursor = 0
    for _ in range(200):
        if step == steps:
            break
        for g in list(away):
            away[g] -= 1
            if away[g] <= 0:
                del away[g]
                judges[g] = NonFiniteJudge()
        members = sorted(judges)
        origins = [i for i, g in enumerate(members)
                   if g == sick or (poison_at is not None and cursor + i * B <= poison_at < cursor + (i + 1) * B)]
        if not origins:
            for j in judges.values():
                j.committed()
            step, cursor = step + 1, cursor + len(members) * B
            continue
        for i, g in enumerate(members):
            try:
                judges[g].failed(step, origins, len(members), i, cursor, B)
            except (NonFiniteReplica, TrainingDiverged) as e:
                verdicts.append((str(g), type(e).__name__))
                del judges[g]
                if isinstance(e, NonFiniteReplica):
                    away[g] = rejoin_after + 1  # (counted down before the next attempt)
                if g == sick:
                    sick = None  # restarted on a good device
        if not judges and not away:
            break
        if verdicts and verdicts[-1][1] == "TrainingDiverged":
            break  # the launch stops on the verdict (twice, in launch local)
    return verdicts


@settings(max_examples=300, deadline=None, derandomize=True)
@given(groups=st.integers(2, 6), sick=st.integers(0, 5), rejoin=st.integers(1, 8))
def test_a_faulty_device_stops_its_group_alone_in_any_job(groups, sick, rejoin) -> None:
    sick %= groups
    verdicts = _run_job(groups, None, sick, rejoin)
    assert verdicts == [(str(sick), "NonFiniteReplica")]  # nobody else, and not the run


@settings(max_examples=300, deadline=None, derandomize=True)
@given(groups=st.integers(2, 6), poison=st.integers(0, 80), rejoin=st.integers(1, 8))
def test_samples_that_break_training_end_the_job_as_the_data_in_any_job(groups, poison, rejoin) -> None:
    verdicts = _run_job(groups, poison, None, rejoin, steps=40)
    kinds = [kind for _, kind in verdicts]
    # At most one group is taken for a faulty device, then a group that saw the samples break
    # elsewhere names them: the job ends on the data, never runs past the samples.
    assert kinds[-1:] == ["TrainingDiverged"], verdicts
    assert kinds.count("NonFiniteReplica") <= 1, verdicts
