"""The rule of who may write the job's model file at a group's exit (``ftlm.ft.end_of_run``)."""

from __future__ import annotations

from hypothesis import given, strategies as st

from ftlm.ft.end_of_run import may_write_model


def test_a_group_that_never_joined_a_quorum_writes_no_model() -> None:
    ok, why = may_write_model(None, 0, joined=False, final_step=200)
    assert not ok and "never took part in a quorum" in why


def test_the_final_step_is_the_jobs_quorum_or_not() -> None:
    assert may_write_model(None, 200, joined=False, final_step=200) == (True, "")
    assert may_write_model(200, 200, joined=False, final_step=200) == (True, "")


def test_a_straggler_behind_the_head_writes_nothing() -> None:
    ok, why = may_write_model(None, 40, joined=True, final_step=200, head=55)
    assert not ok and "behind the job's step 55" in why


@given(held=st.none() | st.integers(0, 500), step=st.integers(0, 500), joined=st.booleans(),
       final=st.integers(1, 500), head=st.integers(0, 500))
def test_a_model_file_never_goes_back(held, step, joined, final, head) -> None:
    ok, why = may_write_model(held, step, joined, final, head)
    if ok:
        assert held is None or held <= step
        assert step >= final or (joined and step >= head)
    else:
        assert why
