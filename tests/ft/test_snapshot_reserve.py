"""The snapshot memory prepared ahead (``ftlm.ft.snapshot_reserve``): taken once, of the right
kind only, and a snapshot written into it equals one written into new memory."""

from __future__ import annotations

import os

import pytest
import torch

from ftlm.errors import ConfigError
from ftlm.ft.config import FTConfig
from ftlm.ft.framing import layout
from ftlm.ft.shared_buffer import SharedBuffer, supported
from ftlm.ft.snapshot_reserve import SnapshotReserve, allocate_snapshot_buffer
from ftlm.ft.transport import snapshot_state

needs_memfd = pytest.mark.skipif(not supported(), reason="needs Linux memfd")


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # Odd sizes: the layout pads between tensors, and the padding must be zero in either buffer.
    return {"w": torch.randn(37, 5, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16),
            "step": torch.tensor(7)}


def prepared(total: int, shared: bool) -> SnapshotReserve:
    reserve = SnapshotReserve()
    assert reserve.idle
    assert reserve.prepare(total, shared=shared, pinned=False)
    assert reserve.wait(30), "the reserve thread made no buffer"
    assert not reserve.idle
    assert not reserve.prepare(total, shared=shared, pinned=False)  # one is ready: nothing new
    return reserve


@pytest.mark.parametrize("shared", [pytest.param(True, marks=needs_memfd), False])
def test_a_snapshot_taken_into_the_reserve_equals_one_taken_into_new_memory(shared):
    tensors = state()
    total = layout(tensors)[1]
    reserve = prepared(total, shared)
    reserved = reserve._ready.buffer.data_ptr()
    fresh = snapshot_state(tensors, {"a": 1}, 3, shared=shared)
    into = snapshot_state(tensors, {"a": 1}, 3, shared=shared, reserve=reserve)
    assert into.buffer.data_ptr() == reserved  # written into the prepared pages
    assert (into.shared is not None) == shared
    assert torch.equal(into.buffer, fresh.buffer)  # same bytes, padding included
    got, meta = into.state()
    assert meta == {"a": 1} and all(torch.equal(got[k], tensors[k]) for k in tensors)
    # Handed out once: the next snapshot gets new memory, never the pages a transfer may read.
    assert reserve.idle
    again = snapshot_state(tensors, {"a": 1}, 4, shared=shared, reserve=reserve)
    assert again.buffer.data_ptr() != reserved


def test_a_reserve_of_another_size_is_dropped_not_used():
    tensors = state()
    total = layout(tensors)[1]
    reserve = prepared(total + 64, shared=False)
    snap = snapshot_state(tensors, {}, 1, reserve=reserve)
    assert snap.total_bytes == total
    assert reserve.idle  # the misfit is gone: the manager prepares one of the right size
    assert reserve.take(total + 64, shared=False, pinned=False) is None


def test_a_reserve_of_another_kind_is_not_used():
    reserve = prepared(4096, shared=False)
    assert reserve.take(4096, shared=True, pinned=False) is None
    assert reserve.idle


@needs_memfd
def test_prefaulted_shared_memory_is_allocated_zeroed_and_shareable():
    buf = SharedBuffer(1 << 20, prefault=True)
    assert os.fstat(buf.fd).st_blocks * 512 >= 1 << 20  # the pages exist before any write
    view = torch.frombuffer(buf.memory, dtype=torch.uint8)
    assert int(view.count_nonzero()) == 0
    view[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    with open(f"/proc/self/fd/{buf.fd}", "rb") as f:  # another mapping sees the same bytes
        assert f.read(4) == b"\x01\x02\x03\x04"


def test_plain_prefaulted_buffer_is_zeroed():
    b = allocate_snapshot_buffer(1 << 16, shared=False, pinned=False, prefault=True)
    assert b.memory is None and b.nbytes == 1 << 16 and int(b.buffer.count_nonzero()) == 0


def test_a_closed_reserve_prepares_nothing_and_holds_nothing():
    reserve = prepared(4096, shared=False)
    reserve.close()
    assert not reserve.ready and reserve.take(4096, shared=False, pinned=False) is None
    assert not reserve.prepare(4096, shared=False, pinned=False)


def test_a_reserve_that_cannot_be_made_leaves_snapshots_to_allocate(monkeypatch, caplog):
    import ftlm.ft.snapshot_reserve as module

    def no_memory(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(module, "allocate_snapshot_buffer", no_memory)
    reserve = SnapshotReserve()
    assert reserve.prepare(4096, shared=False, pinned=False)
    assert not reserve.wait(30)
    assert "could not reserve 4096 bytes" in caplog.text
    assert not reserve.idle and not reserve.prepare(4096, shared=False, pinned=False)  # once
    monkeypatch.undo()
    tensors = state()
    assert snapshot_state(tensors, {}, 1, reserve=reserve).total_bytes == layout(tensors)[1]


def test_snapshot_reserve_must_be_a_boolean():
    assert FTConfig().snapshot_reserve is False  # opt-in: hosts with idle cores
    with pytest.raises(ConfigError, match="snapshot_reserve='yes' must be true or false"):
        FTConfig(snapshot_reserve="yes")


def test_no_reserve_where_the_memory_available_is_under_twice_its_size(monkeypatch, caplog):
    """A reserve is one more host copy of the state: where it would leave less than its own size
    free (a pod's cgroup limit), none is made, and the process says why once."""
    import ftlm.ft.snapshot_reserve as module
    monkeypatch.setattr(module, "available_memory", lambda: 8191)
    reserve = SnapshotReserve()
    assert not reserve.prepare(4096, shared=False, pinned=False)
    assert "needs 4096 bytes and only 8191 are available" in caplog.text
    assert not reserve.idle and not reserve.ready  # not tried again every step
    monkeypatch.setattr(module, "available_memory", lambda: 8192)
    assert SnapshotReserve().prepare(4096, shared=False, pinned=False)


def test_available_memory_reads_the_host():
    from ftlm.ft.snapshot_reserve import available_memory
    got = available_memory()
    assert got is None or got > 0
