"""The threads that move a snapshot run below the training thread's CPU priority."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ftlm.errors import ConfigError
from ftlm.ft.config import FTConfig
from ftlm.ft.priority import background_priority
from ftlm.ft.transport import SnapshotServer, fetch_snapshot, snapshot_state

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priority")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_thread(fn) -> list:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(timeout=30)
    return out


def test_lowers_only_the_calling_thread_and_never_raises_a_priority() -> None:
    before = _nice()
    assert _in_thread(lambda: (background_priority(before + 7), _nice())[1]) == [before + 7]
    assert _nice() == before  # the caller's own thread (the training thread) is untouched
    # A thread already below the asked priority stays there (raising one needs privileges).
    assert _in_thread(lambda: (background_priority(before + 9), background_priority(before + 3),
                               _nice())[2]) == [before + 9]
    assert _in_thread(lambda: (background_priority(0), _nice())[1]) == [before]


def test_serving_and_pulling_threads_run_at_transfer_nice() -> None:
    seen: list[int] = []
    pulled: list[int] = []
    server = SnapshotServer(chunk_bytes=1024, thread_nice=_nice() + 5,
                            on_chunk=lambda step, index: seen.append(_nice()))
    url = server.start()
    try:
        state = {"w": torch.arange(4096, dtype=torch.float32)}
        server.publish(snapshot_state(state, {"step": 3}, 3))
        tensors, _ = fetch_snapshot(url, 3, parallel=2, thread_nice=_nice() + 5,
                                    progress=lambda done, total: pulled.append(_nice()))
        assert torch.equal(tensors["w"], state["w"])
    finally:
        server.stop()
    assert seen and set(seen) == {_nice() + 5}  # the server's connection threads
    assert pulled and set(pulled) == {_nice() + 5}  # the puller's workers


@pytest.mark.parametrize("bad", [-1, 20, 2.5, True])
def test_transfer_nice_is_checked(bad) -> None:
    with pytest.raises(ConfigError, match=r"ft\.transfer_nice=.* from 0 .* to 19"):
        FTConfig(transfer_nice=bad)
