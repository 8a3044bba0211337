"""The trainer's durability rules shared with the simulator (``ftlm.ft.durable_rules``)."""

from __future__ import annotations

from ftlm.ft.durable_rules import checkpoint_due, keeps_final_on_disk, saves_on_stop


def test_a_periodic_checkpoint_is_due_at_multiples_of_every_after_step_zero():
    assert [s for s in range(0, 31) if checkpoint_due(s, 10)] == [10, 20, 30]
    assert not any(checkpoint_due(s, 0) for s in range(50))


def test_a_stopping_group_saves_only_as_the_writer_with_on_stop_and_no_periodic_save():
    assert saves_on_stop(writer=True, on_stop=True, due=False)
    assert not saves_on_stop(writer=False, on_stop=True, due=False)
    assert not saves_on_stop(writer=True, on_stop=False, due=False)
    assert not saves_on_stop(writer=True, on_stop=True, due=True)


def test_the_final_step_is_saved_once_per_history_and_the_jobs_replaces_another():
    assert not keeps_final_on_disk([], "c1", job_history=False)  # nothing there: save
    assert keeps_final_on_disk(["c1"], "c1", job_history=True)  # the same history: keep
    assert keeps_final_on_disk(["c0"], "c1", job_history=False)  # unconfirmed: never replace
    assert not keeps_final_on_disk(["c0"], "c1", job_history=True)  # the job's replaces another
    assert keeps_final_on_disk(["c0", None], "c1", job_history=True)  # unknown history: keep
