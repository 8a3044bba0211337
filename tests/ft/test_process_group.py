"""The abortable collective contract of ``ReconfigurablePG``, on fakes that behave like NCCL and
gloo when a peer hangs, and on a real pair of gloo groups."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from ftlm.ft.process_group import CollectiveError, ReconfigurablePG, await_work


class _HungWork:
    """An all-reduce whose peer never shows up. ``wait()`` behaves like NCCL's (returns once the
    kernel is queued) unless ``blocking``, then like gloo's (blocks until released)."""

    def __init__(self, blocking: bool) -> None:
        self.blocking = blocking
        self.release = threading.Event()

    def is_completed(self) -> bool:
        return self.release.is_set()

    def wait(self) -> bool:
        if self.blocking:
            self.release.wait(60)
        return True


class _FakeGroup:
    def __init__(self, blocking: bool) -> None:
        self.work = _HungWork(blocking)
        self.aborted = threading.Event()
        self.issued: list[torch.Tensor] = []

    def allreduce(self, tensors):
        self.issued.append(tensors[0])
        return self.work

    def abort(self) -> None:
        self.aborted.set()
        self.work.release.set()


def _pg_with(fake: _FakeGroup, timeout: float) -> ReconfigurablePG:
    pg = ReconfigurablePG("nccl", timeout)
    pg.pg, pg.world, pg.key = fake, 2, "q1.0/r0"
    return pg


@pytest.mark.parametrize("blocking", [False, True], ids=["nccl-like", "gloo-like"])
def test_a_hung_allreduce_times_out_and_the_caller_can_abort_the_group(blocking) -> None:
    fake = _FakeGroup(blocking)
    pg = _pg_with(fake, timeout=0.3)
    grads = [torch.ones(4), torch.ones(3)]
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="timed out after 0.3 s"):
        pg.allreduce_mean(grads, 2, threading.Event())
    assert time.monotonic() - t0 < 10  # bounded by the deadline, not by the hung peer
    assert all(torch.equal(g, torch.ones_like(g)) for g in grads)  # nothing half-applied
    pg.abort_current()
    assert fake.aborted.is_set() and pg.pg is None


@pytest.mark.parametrize("blocking", [False, True], ids=["nccl-like", "gloo-like"])
def test_the_abort_event_ends_a_hung_allreduce_at_once(blocking) -> None:
    fake = _FakeGroup(blocking)
    pg = _pg_with(fake, timeout=120)
    abort = threading.Event()
    threading.Timer(0.05, abort.set).start()
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="aborted"):
        pg.allreduce_mean([torch.ones(8)], 2, abort)
    assert time.monotonic() - t0 < 60


def test_a_bucket_of_an_abandoned_allreduce_is_never_reused() -> None:
    fake = _FakeGroup(blocking=False)
    pg = _pg_with(fake, timeout=0.05)
    with pytest.raises(CollectiveError):
        pg.allreduce_mean([torch.ones(8)], 2, threading.Event())
    abandoned = fake.issued[-1]
    fake.work = _HungWork(False)
    fake.work.release.set()  # the next all-reduce completes (a fake: sum of one member)
    pg.allreduce_mean([torch.ones(8)], 1, threading.Event())
    assert fake.issued[-1].data_ptr() != abandoned.data_ptr()


def test_a_failed_collective_surfaces_its_error() -> None:
    class Failing:
        def is_completed(self) -> bool:
            return True

        def wait(self):
            raise RuntimeError("connection reset by peer")

    with pytest.raises(CollectiveError, match="connection reset by peer"):
        await_work(Failing(), 1.0, threading.Event(), "all-reduce")


def test_real_gloo_pairs_average_and_reuse_one_bucket(tmp_path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{store.port}"
    out: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            pg = ReconfigurablePG("gloo", timeout=30)
            pg.configure(addr, "q1.0/r0", rank, 2, threading.Event())
            ptrs = set()
            for step in range(3):
                grads = [torch.full((5,), float(rank + step)), torch.full((2, 2), 2.0 * rank)]
                pg.allreduce_mean(grads, 2, threading.Event())
                ptrs.add(pg._flats[0].data_ptr())
            out[rank] = grads
            assert len(ptrs) == 1  # one bucket allocated once, reused every step
            pg.abort_current()
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for rank in (0, 1):
        assert torch.equal(out[rank][0], torch.full((5,), 2.5))  # mean of 2 and 3 (step 2)
        assert torch.equal(out[rank][1], torch.full((2, 2), 1.0))




def test_an_aborted_group_with_work_in_flight_is_kept_until_its_work_ended() -> None:
    """Destroying a gloo group joins its worker threads: with an operation in flight that froze
    the training thread (GIL held) until the operation's own timeout."""
    class AbortLeavesWorkRunning(_FakeGroup):  # as gloo: the operation ends at its timeout
        def abort(self) -> None:
            self.aborted.set()

    fake = AbortLeavesWorkRunning(blocking=False)
    pg = _pg_with(fake, timeout=0.05)
    pg.allreduce_start([torch.ones(4)], 2, slot=0)
    pg.allreduce_start([torch.ones(4)], 2, slot=1)  # several buckets may be in flight
    assert len(fake.issued) == 2
    pg.abort_current()
    assert fake.aborted.is_set() and pg.pg is None
    assert [g for g, _ in pg._graveyard] == [fake]  # aborted, but not destroyed yet
    fake.work.release.set()  # its operations ended
    pg.abort_current()
    assert pg._graveyard == []
