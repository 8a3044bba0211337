"""A group's state digest (``ftlm.ft.integrity``) and the bit-flip fault that breaks it; the
coordinator's comparison is tests/ft/test_membership_integrity.py."""

from __future__ import annotations

import pytest
import torch

from ftlm.errors import ConfigError
from ftlm.ft.faults import FaultSchedule
from ftlm.ft.history import GENESIS
from ftlm.ft.integrity import StateDigester, combine, flip_bit, state_fingerprint


def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"model.w": torch.randn(4, 3), "model.b": torch.randn(3, dtype=torch.bfloat16),
            "optim.state.w.exp_avg": torch.randn(4, 3), "optim.state.w.exp_avg_sq": torch.rand(4, 3),
            "progress": torch.tensor([5, 40, 3])}


def test_equal_states_have_equal_digests_and_one_flipped_bit_changes_it():
    a, b = state(), state()
    assert state_fingerprint(a) == state_fingerprint(b)
    assert len(state_fingerprint(a)) == 32
    assert flip_bit(b, "param") == "model.b"  # the first parameter in name order
    assert state_fingerprint(a) != state_fingerprint(b)
    assert torch.isfinite(b["model.b"]).all() and (b["model.b"] != a["model.b"]).sum() == 1
    c = state()
    assert flip_bit(c, "moment") == "optim.state.w.exp_avg_sq"
    assert (c["optim.state.w.exp_avg_sq"] > 0).all()  # sign and exponent kept: still a valid moment
    assert state_fingerprint(a) != state_fingerprint(c)


def test_the_digest_covers_names_and_shapes_not_only_bytes():
    a = state()
    renamed = {("model.v" if k == "model.w" else k): v for k, v in a.items()}
    reshaped = {**a, "model.w": a["model.w"].reshape(3, 4)}
    assert len({state_fingerprint(a), state_fingerprint(renamed), state_fingerprint(reshaped)}) == 3


def test_a_group_digest_combines_its_ranks_in_rank_order():
    assert combine(["a" * 32]) == "a" * 32
    assert combine(["a" * 32, "b" * 32]) != combine(["b" * 32, "a" * 32])


def test_digester_runs_on_a_helper_thread_every_n_steps_once_per_state():
    digester = StateDigester(every=5)
    assert [s for s in range(12) if digester.due(s)] == [5, 10]
    assert not StateDigester(every=0).due(5)
    tensors = state()
    assert digester.start(tensors, 5, GENESIS)
    assert not digester.start(tensors, 5, GENESIS)  # in flight
    step, chain, digest = digester.wait()
    assert (step, chain, digest) == (5, GENESIS, state_fingerprint(tensors))
    assert digester.wait() is None  # nothing more begun
    assert not digester.start(tensors, 5, GENESIS)  # this state was digested already (a retry)
    assert digester.start(tensors, 10, GENESIS) and digester.wait()[0] == 10


def test_bitflip_fault_fires_once_at_its_step_or_the_first_after():
    schedule = FaultSchedule.parse("bitflip@7,bitflip_moment@9")
    events = []
    emit = lambda kind, step, **f: events.append((kind, step, f))  # noqa: E731
    assert schedule.bitflip(6, emit) is None
    assert schedule.bitflip(8, emit) == "param"  # (not a participant at 7)
    assert schedule.bitflip(9, emit) == "moment"
    assert schedule.bitflip(10, emit) is None
    assert [(s, f["point"], f["how"]) for _, s, f in events] == [(8, "bitflip", "bitflip"),
                                                                 (9, "bitflip_moment", "bitflip")]
    with pytest.raises(ConfigError, match="condition"):
        FaultSchedule.parse("hang:bitflip@3")
