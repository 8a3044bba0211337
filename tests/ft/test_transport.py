"""Live state transfer: snapshot -> SnapshotServer -> fetch_snapshot, and its failure modes."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ftlm.ft.framing import DTYPES, FramingError, parse_header
from ftlm.ft.transport import (
    SnapshotServer, TransferError, fetch_snapshot, list_snapshots, snapshot_state, state_digest,
)

pytestmark = pytest.mark.timeout(60)

META = {"step": 7, "cursor": [3, 1024], "rng": [12345, 0, 2**40], "lr": 3e-4}


def mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {
        "w.float32": torch.randn(33, 17, generator=g),
        "w.float16": torch.randn(5, 3, generator=g).half(),
        "w.bfloat16": torch.randn(19, generator=g).bfloat16(),
        "w.float64": torch.randn(4, 4, generator=g).double(),
        "n.int64": torch.randint(-2**62, 2**62, (9,), generator=g),
        "n.int32": torch.randint(-2**31, 2**31 - 1, (3, 2), generator=g, dtype=torch.int32),
        "n.int16": torch.tensor([-32768, 0, 32767], dtype=torch.int16),
        "n.int8": torch.tensor([[-128, 5], [127, 0]], dtype=torch.int8),
        "n.uint8": torch.arange(256, dtype=torch.uint8),
        "mask.bool": torch.tensor([True, False, True]),
        "scalar.0d": torch.tensor(2.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 8),
        # Special values must survive bit for bit, not merely compare equal.
        "special": torch.tensor([float("nan"), float("inf"), -0.0, 1e-45]),
        "noncontiguous": torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),
    }
    assert {t.dtype for t in state.values()} == set(DTYPES.values())
    return state


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        raw_a = a[name].contiguous().reshape(-1).view(torch.uint8)
        raw_b = b[name].contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(raw_a, raw_b), name


@pytest.fixture
def make_server():
    servers: list[SnapshotServer] = []

    def make(cls: type[SnapshotServer] = SnapshotServer, **kwargs) -> SnapshotServer:
        server = cls(**kwargs)
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.stop()


def http_status(url: str, token: str = "") -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def test_round_trip_mixed_dtypes_is_bitwise_equal(make_server):
    state = mixed_state()
    server = make_server()
    server.publish(snapshot_state(state, META, step=7))

    tensors, meta = fetch_snapshot(server.url, 7, timeout=5)

    assert_bitwise_equal(tensors, state)
    assert meta == META
    assert state_digest(tensors, meta) == state_digest(state, META)
    assert all(t.is_contiguous() for t in tensors.values())


def test_tensors_spanning_chunks_download_in_parallel(make_server):
    state = mixed_state()
    served: list[int] = []
    server = make_server(chunk_bytes=100, on_chunk=lambda step, index: served.append(index))
    snapshot = snapshot_state(state, META, step=7)
    server.publish(snapshot)
    reports: list[tuple[int, int]] = []

    tensors, meta = fetch_snapshot(server.url, 7, parallel=4, timeout=5,
                                   progress=lambda done, total: reports.append((done, total)))

    assert_bitwise_equal(tensors, state)
    chunks = -(-snapshot.total_bytes // 100)
    assert chunks > 20 and sorted(served) == list(range(chunks))
    assert [done for done, _ in reports] == sorted(done for done, _ in reports)
    assert reports[-1] == (snapshot.total_bytes, snapshot.total_bytes)


def test_corrupted_chunk_is_rejected_by_checksum(make_server):
    server = make_server(chunk_bytes=256)
    snapshot = snapshot_state(mixed_state(), META, step=7)
    server.publish(snapshot)
    fetch_snapshot(server.url, 7, timeout=5)  # the header, hence the hashes, now exist

    snapshot.buffer[300] ^= 0xFF  # what a bad NIC or a bad memory page would do
    with pytest.raises(TransferError, match=r"checksum mismatch in chunk 1 ") as info:
        fetch_snapshot(server.url, 7, timeout=5)
    assert server.url in str(info.value) and "step 7" in str(info.value)


def test_server_stopped_mid_transfer_raises_without_hanging(make_server):
    holder: list[SnapshotServer] = []

    def stop_at_third_chunk(step: int, index: int) -> None:
        if index == 2:
            holder[0].stop()

    server = make_server(chunk_bytes=64, on_chunk=stop_at_third_chunk)
    holder.append(server)
    server.publish(snapshot_state(mixed_state(), META, step=7))

    start = time.monotonic()
    with pytest.raises(TransferError, match="step 7"):
        fetch_snapshot(server.url, 7, parallel=2, timeout=5)
    assert time.monotonic() - start < 5
    server.stop()  # joins the server thread that the hook asked to stop
    with pytest.raises(TransferError, match="connection refused"):
        fetch_snapshot(server.url, 7, timeout=5, wait_available=0)


def test_server_stopped_from_another_thread_cuts_slow_transfers(make_server):
    reached = threading.Event()
    server = make_server(chunk_bytes=32 << 10, throttle_bytes_per_s=200_000,
                         on_chunk=lambda step, index: index == 1 and reached.set())
    server.publish(snapshot_state({"big": torch.zeros(100_000)}, {}, step=1))

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(fetch_snapshot, server.url, 1, parallel=2, timeout=5)
        assert reached.wait(10)
        start = time.monotonic()
        server.stop()
        assert time.monotonic() - start < 5
        with pytest.raises(TransferError, match="step 1"):
            future.result(timeout=10)


def test_wrong_or_missing_token_gets_401(make_server):
    server = make_server(token="s3cret")
    server.publish(snapshot_state(mixed_state(), META, step=7))

    for token in ("wrong", ""):
        with pytest.raises(TransferError, match="401"):
            fetch_snapshot(server.url, 7, token=token, timeout=5)
    assert http_status(server.url + "/v1/snapshots", token="wrong") == 401
    tensors, _ = fetch_snapshot(server.url, 7, token="s3cret", timeout=5)
    assert_bitwise_equal(tensors, mixed_state())


def test_unknown_step_fails_after_the_bounded_wait(make_server):
    server = make_server()
    server.publish(snapshot_state(mixed_state(), META, step=7))

    start = time.monotonic()
    with pytest.raises(TransferError, match=r"step 8 .*not available after waiting 0.3s"):
        fetch_snapshot(server.url, 8, timeout=5, wait_available=0.3)
    assert 0.3 <= time.monotonic() - start < 5


def test_joiner_asking_before_publication_waits_for_it(make_server):
    class RecordsMisses(SnapshotServer):
        misses = threading.Event()

        async def _header(self, request):
            response = await super()._header(request)
            if response.status == 404:
                self.misses.set()
            return response

    server = make_server(RecordsMisses)
    state = mixed_state()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(fetch_snapshot, server.url, 7, timeout=5, wait_available=10)
        assert server.misses.wait(10)  # the joiner asked before the source published
        server.publish(snapshot_state(state, META, step=7))
        tensors, meta = future.result(timeout=15)
    assert_bitwise_equal(tensors, state)
    assert meta == META


def test_snapshot_is_isolated_from_later_mutation(make_server):
    state = mixed_state()
    meta = {"step": 7, "rng": [1, 2, 3]}
    expected_digest = state_digest(state, meta)
    snapshot = snapshot_state(state, meta, step=7)

    for t in state.values():  # training continues and updates the live tensors in place
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.is_floating_point():
            t.add_(1)
        else:
            t.bitwise_not_()
    meta["rng"].append(4)
    assert state_digest(state, meta) != expected_digest

    server = make_server()
    server.publish(snapshot)
    tensors, fetched_meta = fetch_snapshot(server.url, 7, timeout=5)
    assert state_digest(tensors, fetched_meta) == expected_digest
    assert state_digest(*snapshot.state()) == expected_digest


def test_alignment_padding_is_zeroed_and_an_empty_state_round_trips(make_server):
    snapshot = snapshot_state({"a": torch.full((3,), 255, dtype=torch.uint8),
                               "b": torch.ones(2)}, {}, step=1)
    assert snapshot.tensors[1].offset == 8
    assert snapshot.buffer[3:8].tolist() == [0] * 5
    server = make_server()
    server.publish(snapshot)
    server.publish(snapshot_state({}, {"note": "nothing yet"}, step=2))
    assert fetch_snapshot(server.url, 2, timeout=5) == ({}, {"note": "nothing yet"})


def test_keep_two_evicts_the_oldest_steps(make_server):
    server = make_server(keep=2)
    for step in (1, 2, 3):
        server.publish(snapshot_state({"x": torch.full((4,), float(step))}, {"step": step}, step))

    assert list_snapshots(server.url) == [2, 3]
    with pytest.raises(TransferError, match=r"step 1 .*available steps: \[2, 3\]"):
        fetch_snapshot(server.url, 1, timeout=5, wait_available=0)
    tensors, meta = fetch_snapshot(server.url, 2, timeout=5)
    assert meta == {"step": 2} and torch.equal(tensors["x"], torch.full((4,), 2.0))


def test_throttle_makes_a_transfer_take_at_least_bytes_over_rate(make_server):
    rate = 1_000_000.0
    server = make_server(chunk_bytes=64 << 10, throttle_bytes_per_s=rate)
    snapshot = snapshot_state({"x": torch.ones(75_000)}, {}, step=1)  # 300 kB
    server.publish(snapshot)

    start = time.monotonic()
    tensors, _ = fetch_snapshot(server.url, 1, parallel=4, timeout=5)
    assert time.monotonic() - start >= 0.99 * snapshot.total_bytes / rate
    assert torch.equal(tensors["x"], torch.ones(75_000))


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(make_server):
    server = make_server(chunk_bytes=1024)
    server.publish(snapshot_state(mixed_state(), META, step=7))
    base = server.url

    assert http_status(base + "/v1/snapshot/abc/header") == 400
    assert http_status(base + "/v1/snapshot/-7/header") == 400
    assert http_status(base + "/v1/snapshot/7/chunk/-1") == 400
    assert http_status(base + "/v1/snapshot/7/chunk/1.5") == 400
    assert http_status(base + "/v1/snapshot/7/chunk/" + "9" * 400) == 400
    assert http_status(base + "/v1/snapshot/7/chunk/100000") == 404
    assert http_status(base + "/v1/snapshot/8/chunk/0") == 404
    assert http_status(base + "/v1/nothing") == 404
    tensors, _ = fetch_snapshot(server.url, 7, timeout=5)
    assert_bitwise_equal(tensors, mixed_state())


def test_digest_changes_with_any_bit_name_dtype_or_meta():
    state = {"a": torch.zeros(4), "b": torch.ones(2, dtype=torch.int32)}
    base = state_digest(state, {"step": 1})
    flipped = {**state, "a": torch.tensor([0.0, -0.0, 0.0, 0.0])}
    assert state_digest(flipped, {"step": 1}) != base
    assert state_digest({"a2": state["a"], "b": state["b"]}, {"step": 1}) != base
    assert state_digest({**state, "b": state["b"].float()}, {"step": 1}) != base
    assert state_digest({**state, "a": state["a"].reshape(2, 2)}, {"step": 1}) != base
    assert state_digest(state, {"step": 2}) != base
    assert state_digest(dict(reversed(state.items())), {"step": 1}) == base


def test_snapshot_rejects_meta_that_is_not_json():
    with pytest.raises(FramingError, match="meta must be JSON"):
        snapshot_state({"a": torch.zeros(1)}, {"bad": object()}, step=0)


def _valid_header() -> dict:
    return {"step": 1, "meta": {}, "total_bytes": 16,
            "tensors": [{"name": "a", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8},
                        {"name": "b", "dtype": "int64", "shape": [], "offset": 8, "nbytes": 8}],
            "chunks": [{"index": 0, "offset": 0, "nbytes": 10, "sha256": "0" * 64},
                       {"index": 1, "offset": 10, "nbytes": 6, "sha256": "f" * 64}]}


@pytest.mark.parametrize("corrupt, problem", [
    (lambda h: h["tensors"][0].update(dtype="complex64"), "unknown"),
    (lambda h: h["tensors"][1].update(name="a"), "unique"),
    (lambda h: h["tensors"][0].update(shape=[3]), "nbytes=8 but shape"),
    (lambda h: h["tensors"][0].update(shape=[-2]), "shape must be"),
    (lambda h: h["tensors"][1].update(offset=12), "outside the buffer"),
    (lambda h: h["tensors"][1].update(offset=4), "overlaps"),
    (lambda h: h["tensors"][0].update(offset=True), "offset must be an integer"),
    (lambda h: h["chunks"].pop(), "cover 10 bytes"),
    (lambda h: h["chunks"][1].update(offset=9), "contiguous"),
    (lambda h: h["chunks"][0].update(sha256="xyz"), "sha256"),
    (lambda h: h.update(total_bytes=2**50), "exceeds the limit"),
    (lambda h: h.update(meta=[]), "meta must be"),
])
def test_header_from_the_network_is_validated_strictly(corrupt, problem):
    parse_header(_valid_header())
    header = _valid_header()
    corrupt(header)
    with pytest.raises(FramingError, match=problem):
        parse_header(header)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned-memory path)")
def test_cuda_snapshot_goes_through_pinned_memory(make_server):
    cpu_state = mixed_state()
    cuda_state = {name: t.cuda() for name, t in cpu_state.items()}
    snapshot = snapshot_state(cuda_state, META, step=7)
    for t in cuda_state.values():  # training resumes right away on the GPU
        t.zero_()
    assert snapshot.buffer.is_pinned()
    server = make_server()
    server.publish(snapshot)
    tensors, meta = fetch_snapshot(server.url, 7, timeout=5)
    assert_bitwise_equal(tensors, cpu_state)
    assert state_digest(tensors, meta) == state_digest(cpu_state, META)
