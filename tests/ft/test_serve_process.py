"""Serving snapshots from a child process (ftlm.ft.serve_process): same protocol, shared memory,
no leaks, and the child never outlives its parent."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ftlm.errors import ConfigError
from ftlm.ft import shared_buffer
from ftlm.ft.config import FTConfig
from ftlm.ft.serve_process import ProcessSnapshotServer, make_snapshot_server
from ftlm.ft.tls import client_context
from ftlm.ft.transport import (
    SnapshotServer, TransferError, expected_layout, fetch_snapshot, list_snapshots,
    snapshot_state, state_digest,
)
from ftlm.observe.iostats import io_totals

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not shared_buffer.supported(), reason="needs memfd (Linux)")]

META = {"step": 7, "cursor": [3, 1024], "lr": 3e-4}


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(300, 17, generator=g), "b": torch.randn(5, generator=g).half(),
            "n": torch.randint(-2**62, 2**62, (9,), generator=g), "e": torch.zeros(0, 3),
            "m": torch.tensor([True, False, True])}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].contiguous().reshape(-1).view(torch.uint8),
                           b[name].contiguous().reshape(-1).view(torch.uint8)), name


def memfd_mappings(pid: int) -> list[str]:
    """The snapshot memory files ``pid`` maps (each mapping also holds a descriptor of its own)."""
    return [x for x in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if shared_buffer.NAME in x]


def memfd_descriptors(pid: int) -> list[str]:
    """The snapshot memory files ``pid`` holds open."""
    fds = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            fds.append(os.readlink(fd))
        except OSError:  # closed meanwhile
            pass
    return [x for x in fds if shared_buffer.NAME in x]


def exited(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (its parent has not reaped it yet)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return status.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture
def make_server(make_server):
    """The conftest fixture, making process servers (at nice 0 unless told otherwise)."""
    return lambda **kwargs: make_server(ProcessSnapshotServer, **{"nice": 0, **kwargs})


def test_a_pull_from_the_process_server_equals_the_snapshot_bit_for_bit(make_server):
    served: list[int] = []
    server = make_server(chunk_bytes=512, token="s3cret",
                         on_chunk=lambda step, index: served.append(index))
    live = state()
    snapshot = snapshot_state(live, META, step=7, shared=True)
    server.publish(snapshot)

    tensors, meta = fetch_snapshot(server.url, 7, token="s3cret", parallel=3, timeout=5,
                                   expected=expected_layout(live))
    assert_bitwise_equal(tensors, live)
    assert meta == META and state_digest(tensors, meta) == state_digest(live, META)
    chunks = -(-snapshot.total_bytes // 512)
    assert chunks > 10 and sorted(served) == list(range(chunks))  # the hook ran in this process
    server.sync()
    assert list_snapshots(server.url, token="s3cret") == [7] == server.steps()


def test_the_child_serves_the_parents_pages_without_a_copy(make_server):
    """A byte changed in this process's snapshot after its first serve is served changed, and
    caught by the digest the child kept: both processes map the same memory."""
    server = make_server(chunk_bytes=256)
    snapshot = snapshot_state(state(), META, step=7, shared=True)
    server.publish(snapshot)
    fetch_snapshot(server.url, 7, timeout=5)

    snapshot.buffer[300] ^= 0xFF
    with pytest.raises(TransferError, match=r"checksum mismatch in chunk 1 "):
        fetch_snapshot(server.url, 7, timeout=5)


def test_retain_and_keep_drop_snapshots_and_unmap_their_memory(make_server):
    server = make_server(keep=2)
    for step in (1, 2, 3):
        server.publish(snapshot_state({"x": torch.full((1000,), float(step))}, {"step": step},
                                      step, shared=True))
    gc.collect()  # this process's snapshots are gone: only the child holds the memory
    server.sync()
    assert list_snapshots(server.url) == [2, 3] and len(memfd_mappings(server.pid)) == 2
    with pytest.raises(TransferError, match=r"step 1 .*available steps: \[2, 3\]"):
        fetch_snapshot(server.url, 1, timeout=5, wait_available=0)

    server.retain({3})
    server.sync()
    assert list_snapshots(server.url) == [3] and len(memfd_mappings(server.pid)) == 1
    with pytest.raises(TransferError, match=r"HTTP 404: snapshot of step 2 is not available"):
        fetch_snapshot(server.url, 2, timeout=5, wait_available=0)
    server.retain(set())
    server.sync()
    assert list_snapshots(server.url) == [] and memfd_mappings(server.pid) == []
    assert memfd_descriptors(server.pid) == []


def test_a_wrong_token_gets_401_and_tls_round_trips(make_server, tls_files):
    live = state()
    server = make_server(token="s3cret", tls_cert=str(tls_files.cert), tls_key=str(tls_files.key))
    server.publish(snapshot_state(live, META, step=7, shared=True))
    assert server.url.startswith("https://127.0.0.1:")
    client = client_context(tls_files.ca)

    with pytest.raises(TransferError, match="401"):
        fetch_snapshot(server.url, 7, token="wrong", timeout=5, ssl_context=client)
    tensors, _ = fetch_snapshot(server.url, 7, token="s3cret", timeout=5, ssl_context=client)
    assert_bitwise_equal(tensors, live)


def test_stop_cuts_a_slow_transfer_and_joins_the_child(make_server):
    reached = threading.Event()
    server = make_server(chunk_bytes=32 << 10, throttle_bytes_per_s=200_000,
                         on_chunk=lambda step, index: index == 1 and reached.set())
    server.publish(snapshot_state({"big": torch.zeros(100_000)}, {}, step=1, shared=True))
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(fetch_snapshot, server.url, 1, parallel=2, timeout=5)
        assert reached.wait(10)
        start = time.monotonic()
        server.stop()
        assert time.monotonic() - start < 5 and exited(server.pid)
        with pytest.raises(TransferError, match="step 1"):
            future.result(timeout=10)
    with pytest.raises(TransferError, match="connection refused"):
        fetch_snapshot(server.url, 1, timeout=5, wait_available=0)
    with pytest.raises(RuntimeError, match="is stopped"):
        server.publish(snapshot_state({"x": torch.ones(2)}, {}, step=2, shared=True))


def test_a_serving_process_that_died_is_reported_by_publish(make_server):
    server = make_server()
    os.kill(server.pid, signal.SIGKILL)
    assert wait_until(lambda: exited(server.pid))
    snapshot = snapshot_state({"x": torch.ones(2)}, {}, step=2, shared=True)
    with pytest.raises(RuntimeError, match=r"process \(pid \d+\) exited \(status -9\)"):
        server.publish(snapshot)


@pytest.mark.parametrize("sig,level", [(signal.SIGTERM, "INFO"), (signal.SIGKILL, "ERROR")])
def test_a_serving_process_stopped_on_request_is_logged_at_info(make_server, caplog, sig, level):
    """A graceful stop (SIGTERM from Slurm or torchrun) reaches the serving process too:
    that is no error. Killed otherwise (SIGKILL, the OOM killer, a crash), it is."""
    server = make_server()
    with caplog.at_level("INFO", logger="ftlm.ft.serve_process"):
        os.kill(server.pid, sig)
        assert wait_until(lambda: any("snapshot server process" in r.getMessage()
                                      for r in caplog.records))
    (record,) = [r for r in caplog.records if "snapshot server process" in r.getMessage()]
    assert record.levelname == level, record.getMessage()
    assert f"status -{int(sig)}" in record.getMessage()


def test_a_transfer_is_counted_as_sent_in_the_parent(make_server):
    before = io_totals()["transfer_sent"]
    server = make_server(chunk_bytes=4096)
    server.publish(snapshot_state({"w": torch.ones(10_000)}, {"step": 1}, 1, shared=True))
    fetch_snapshot(server.url, 1, parallel=2, timeout=5)
    server.stop()
    after = io_totals()["transfer_sent"]
    assert after[0] - before[0] == 40_000 and after[1] > before[1]


def test_the_child_runs_at_the_asked_priority(make_server):
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    server = make_server(nice=min(mine + 5, 19))
    server.publish(snapshot_state({"x": torch.ones(4)}, {}, step=1, shared=True))
    fetch_snapshot(server.url, 1, timeout=5)  # answered: the child set its priority first
    threads = list(Path(f"/proc/{server.pid}/task").iterdir())
    assert len(threads) > 1  # the accept and connection threads inherited it too
    assert {os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in threads} == {min(mine + 5, 19)}


PARENT = r"""
import sys, threading, torch
from ftlm.ft.serve_process import ProcessSnapshotServer
from ftlm.ft.transport import snapshot_state
server = ProcessSnapshotServer(nice=0)
if sys.argv[1] == "main":  # PR_SET_PDEATHSIG applies
    server.start()
else:  # started from a thread that ends: only the control channel's end of file tells
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join()
server.publish(snapshot_state({"w": torch.ones(1 << 20)}, {}, 1, shared=True))
server.sync()
print(server.pid, server.url, flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("started_from", ["main", "thread"])
def test_the_child_dies_with_its_parent_and_leaves_no_shared_memory(started_from):
    shm = Path("/dev/shm")
    before = set(shm.iterdir()) if shm.is_dir() else set()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, started_from], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        pid, url = parent.stdout.readline().split()
        assert memfd_mappings(int(pid))  # the child maps the snapshot
        fetch_snapshot(url, 1, timeout=10)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_until(lambda: exited(int(pid)), 10), "the serving process outlived its parent"
    finally:
        parent.kill()
        parent.wait(10)
    assert (set(shm.iterdir()) if shm.is_dir() else set()) == before
    with pytest.raises(TransferError, match="connection refused"):
        fetch_snapshot(url, 1, timeout=5, wait_available=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_snapshot_in_shared_memory_round_trips(make_server):
    live = state()
    cuda_state = {name: t.cuda() for name, t in live.items()}
    snapshot = snapshot_state(cuda_state, META, step=7, shared=True)
    for t in cuda_state.values():  # training resumes right away on the GPU
        t.zero_()
    server = make_server()
    server.publish(snapshot)
    tensors, _ = fetch_snapshot(server.url, 7, timeout=5, expected=expected_layout(cuda_state))
    assert_bitwise_equal(tensors, live)


def test_a_snapshot_not_in_shared_memory_is_refused_with_the_fix(make_server):
    server = make_server()
    with pytest.raises(ValueError, match=r"snapshot_state\(\.\.\., shared=True\)"):
        server.publish(snapshot_state({"x": torch.ones(4)}, {}, step=1))


def test_the_config_names_the_server_kinds_and_builds_each():
    with pytest.raises(ConfigError, match=r"ft\.snapshot_server='fork'; valid: process, thread"):
        FTConfig(snapshot_server="fork")
    with pytest.raises(ConfigError, match=r"ft\.serve_nice=20 must be an integer from 0"):
        FTConfig(serve_nice=20)
    thread = make_snapshot_server(FTConfig(snapshot_server="thread", transfer_nice=3),
                                  host="127.0.0.1", token="")
    assert isinstance(thread, SnapshotServer) and not thread.shared_memory
    process = make_snapshot_server(FTConfig(), host="127.0.0.1", token="")  # the default
    assert isinstance(process, ProcessSnapshotServer) and process.shared_memory
    process.start()
    try:
        process.sync()  # the child set its priority before it answers anything
        assert os.getpriority(os.PRIO_PROCESS, process.pid) == 19 == FTConfig().serve_nice
    finally:
        process.stop()
