"""Live state transfer: snapshot -> SnapshotServer -> fetch_snapshot, and its failure modes."""

from __future__ import annotations

import http.server
import json
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ftlm.ft import snapshot_routes, transport
from ftlm.ft.framing import DTYPES, FramingError, chunk_digest, decode_header, parse_header
from ftlm.ft.tls import client_context, server_context
from ftlm.ft.transport import (
    SnapshotServer, TransferError, expected_layout, fetch_snapshot, list_snapshots,
    snapshot_state, state_digest,
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


def framed(body: bytes) -> bytes:
    """A header answer: safetensors' 8-byte little-endian length, then ``body``."""
    return struct.pack("<Q", len(body)) + body


def wire_header(tensors: dict[str, tuple[str, list[int], int, int]], step: int = 7,
                chunk_bytes: int = 1, meta: str = "{}") -> dict:
    """A safetensors header as a source sends it: name -> (dtype, shape, begin, end)."""
    out: dict = {"__metadata__": {"step": str(step), "meta": meta, "chunk_bytes": str(chunk_bytes),
                                  "digest": "xxh3_128"}}
    for name, (dtype, shape, begin, end) in tensors.items():
        out[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
    return out


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        raw_a = a[name].contiguous().reshape(-1).view(torch.uint8)
        raw_b = b[name].contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(raw_a, raw_b), name


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

        def _header(self, step_text):
            response = super()._header(step_text)
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


def test_the_header_is_answered_before_any_digest_and_each_chunk_is_hashed_once(
        make_server, monkeypatch):
    """The header is answered at once, without waiting for a hash of the whole state, and a
    chunk's digest is computed when the chunk is first served."""
    hashed: list[int] = []
    real = transport.chunk_digest
    for module in (transport, snapshot_routes):  # the receiver's and the source's
        monkeypatch.setattr(module, "chunk_digest",
                            lambda data: hashed.append(len(data)) or real(data))
    server = make_server(chunk_bytes=256)
    state = mixed_state()
    snapshot = snapshot_state(state, META, step=7)
    server.publish(snapshot)
    with urllib.request.urlopen(f"{server.url}/v1/snapshot/7/header", timeout=10) as answer:
        header = decode_header(answer.read())
    assert answer.status == 200 and hashed == []  # nothing hashed to answer the header
    assert header.chunk_bytes == 256 and header.step == 7 and header.meta == META
    chunks = -(-snapshot.total_bytes // 256)

    tensors, _ = fetch_snapshot(server.url, 7, parallel=3, timeout=5)
    assert_bitwise_equal(tensors, state)
    assert len(hashed) == 2 * chunks  # the source once per chunk, the receiver once per chunk
    fetch_snapshot(server.url, 7, parallel=3, timeout=5)
    assert len(hashed) == 3 * chunks  # the source's digests are kept: only the receiver hashes


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


def test_the_header_and_chunks_make_a_file_that_safetensors_reads(make_server):
    from safetensors.torch import load, save
    state = {name: t.contiguous() for name, t in mixed_state().items()}
    server = make_server(chunk_bytes=100)
    snapshot = snapshot_state(state, META, step=7)
    server.publish(snapshot)
    with urllib.request.urlopen(f"{server.url}/v1/snapshot/7/header", timeout=10) as answer:
        header = answer.read()
    chunks = b"".join(urllib.request.urlopen(f"{server.url}/v1/snapshot/7/chunk/{i}",
                                             timeout=10).read()
                      for i in range(-(-snapshot.total_bytes // 100)))

    loaded = load(header + chunks)
    assert_bitwise_equal({name: loaded[name] for name in state}, state)
    # The same layout as safetensors' own writer: the data section is byte for byte its own.
    reference = save(state)
    assert chunks == reference[8 + struct.unpack_from("<Q", reference)[0]:]
    assert len(header) % 8 == 0  # the data of the file starts aligned


def test_a_header_written_by_safetensors_is_read():
    from safetensors.torch import save
    state = {name: t.contiguous() for name, t in mixed_state().items()}
    raw = save(state, metadata={"step": "7", "meta": json.dumps(META), "chunk_bytes": "64",
                                "digest": "xxh3_128"})
    header = decode_header(raw[:8 + struct.unpack_from("<Q", raw)[0]],
                           expected=expected_layout(state))
    assert (header.step, header.meta, header.chunk_bytes) == (7, META, 64)
    assert header.total_bytes == len(raw) - 8 - struct.unpack_from("<Q", raw)[0]


def test_tensors_lie_larger_dtypes_first_without_holes_and_an_empty_state_round_trips(
        make_server):
    snapshot = snapshot_state({"a": torch.full((3,), 255, dtype=torch.uint8),
                               "b": torch.ones(2)}, {}, step=1)
    assert [(t.name, t.offset, t.nbytes) for t in snapshot.tensors] == [("a", 8, 3), ("b", 0, 8)]
    assert snapshot.total_bytes == 11
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


def test_retain_frees_the_snapshots_no_peer_pulls(make_server):
    server = make_server(keep=2)
    for step in (1, 2):
        server.publish(snapshot_state({"x": torch.full((4,), float(step))}, {"step": step}, step))
    server.retain({2})
    assert list_snapshots(server.url) == [2]
    server.retain(set())
    assert list_snapshots(server.url) == []


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
    return wire_header({"a": ("F32", [2], 8, 16), "b": ("I64", [], 0, 8)}, step=1,
                       chunk_bytes=10)


def _tensor(name: str, **fields):
    return lambda h: h[name].update(fields)


def _metadata(**fields):
    return lambda h: h["__metadata__"].update(fields)


@pytest.mark.parametrize("corrupt, problem", [
    (_tensor("a", dtype="complex64"), "unknown"),
    (_tensor("a", dtype="float32"), "unknown"),  # torch's name, not safetensors'
    (_tensor("a", shape=[3]), r"hold 8 bytes but shape \[3\] of F32 needs 12"),
    (_tensor("a", shape=[-2]), "shape must be"),
    (_tensor("a", data_offsets=[12, 20]), r"leaves a hole: bytes \[8, 12\)"),
    (_tensor("a", data_offsets=[4, 12]), "overlaps"),
    (_tensor("a", data_offsets=[True, 8]), "data_offsets must be"),
    (_tensor("a", data_offsets=[16, 8]), "data_offsets must be"),
    (_tensor("a", data_offsets=[8]), "data_offsets must be"),
    (lambda h: h.update(a=[1]), "must be an object"),
    (lambda h: h.update({"": h.pop("a")}), "name must not be empty"),
    (lambda h: h.pop("__metadata__"), "__metadata__ must be an object of strings"),
    (_metadata(chunk_bytes=10), "__metadata__ must be an object of strings"),
    (lambda h: h["__metadata__"].pop("chunk_bytes"), "chunk_bytes must be a decimal integer >= 1"),
    (_metadata(chunk_bytes="0"), "chunk_bytes must be a decimal integer >= 1"),
    (_metadata(chunk_bytes="010"), "chunk_bytes must be a decimal integer >= 1"),
    (_metadata(chunk_bytes=" 10"), "chunk_bytes must be a decimal integer >= 1"),
    (_metadata(step="-1"), "step must be a decimal integer >= 0"),
    (_metadata(step="9" * 30), "step must be a decimal integer >= 0"),
    (lambda h: h.update(a={"dtype": "F32", "shape": [2**27], "data_offsets": [8, 8 + 2**29]},
                        __metadata__={**h["__metadata__"], "chunk_bytes": "1"}),
     "more than 16777216 chunks"),
    (_metadata(digest="sha256"), "digest must be 'xxh3_128'"),
    (lambda h: h["__metadata__"].pop("digest"), "digest must be 'xxh3_128', got None"),
    (_tensor("a", shape=[2**48], data_offsets=[8, 8 + 2**50]), "beyond the limit"),
    (_metadata(meta="[]"), "meta must hold a JSON object"),
    (_metadata(meta='{"lr": NaN}'), "NaN, which is not JSON"),
    (_metadata(meta='{"a": 1, "a": 2}'), "names 'a' twice"),
    (lambda h: h["__metadata__"].pop("meta"), "has no meta"),
])
def test_header_from_the_network_is_validated_strictly(corrupt, problem):
    parse_header(_valid_header())
    header = _valid_header()
    corrupt(header)
    with pytest.raises(FramingError, match=problem):
        parse_header(header)


@pytest.mark.parametrize("data, problem", [
    (b"\x01\x02", "shorter than its 8-byte length prefix"),
    (struct.pack("<Q", 2**63) + b"{}", "exceeds the limit"),
    (struct.pack("<Q", 3) + b"{}", "says 3 bytes but 2 follow it"),
    (framed(b'{"w": {}, "w": {}}'), "names 'w' twice"),
    (framed('{"é": 1}'.encode("utf-16")), "not valid UTF-8 JSON"),
])
def test_an_encoded_header_is_validated_strictly(data, problem):
    with pytest.raises(FramingError, match=problem):
        decode_header(data)


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
    # A CUDA receiver describes its own state without copying it off the device.
    tensors, meta = fetch_snapshot(server.url, 7, timeout=5,
                                   expected=expected_layout(cuda_state))
    assert_bitwise_equal(tensors, cpu_state)
    assert state_digest(tensors, meta) == state_digest(cpu_state, META)


# ---------------------------------------------------------------------------------------------
# A lying peer: what it can make a receiver allocate is bounded by the receiver's own state


class LyingPeer:
    """A stdlib HTTP server that answers every request with fixed bytes and status."""

    def __init__(self, body: bytes, status: int = 200) -> None:
        peer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                peer.paths.append(self.path)
                self.send_response(peer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(peer.body)))
                self.end_headers()
                self.wfile.write(peer.body)

            def log_message(self, *args) -> None:
                pass

        self.body, self.status, self.paths = body, status, []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def lying_peer():
    peers: list[LyingPeer] = []

    def make(body: bytes | dict | list, status: int = 200) -> LyingPeer:
        """A peer answering ``body``: bytes as they are, JSON data as a framed header."""
        raw = body if isinstance(body, bytes) else framed(json.dumps(body).encode())
        peers.append(LyingPeer(raw, status))
        return peers[-1]

    yield make
    for peer in peers:
        peer.close()


def claim(nbytes: int, name: str = "w", step: int = 7, dtype: str = "U8",
          meta: str = "{}") -> dict:
    """A well-formed header for one uint8 tensor of `nbytes` bytes in one chunk."""
    return wire_header({name: (dtype, [nbytes], 0, nbytes)}, step, max(nbytes, 1), meta)


def with_tensor(header: dict, name: str, **fields) -> dict:
    return {**header, name: {**header[name], **fields}}


OWN_STATE = {"w": torch.zeros(1000, dtype=torch.uint8)}


def test_header_claiming_a_tebibyte_hits_the_hard_cap_not_memory_error(lying_peer):
    peer = lying_peer(claim(1 << 40))
    assert len(peer.body) < 320  # "a 300-byte header"

    with pytest.raises(TransferError, match=r"data_offsets end at 1099511627776, beyond the "
                                            r"limit") as e:
        fetch_snapshot(peer.url, 7, timeout=5, wait_available=0)
    assert peer.url in str(e.value) and "\n" not in str(e.value)
    assert not any("/chunk/" in path for path in peer.paths)


def test_header_claiming_a_tebibyte_is_refused_by_the_receivers_own_layout(lying_peer):
    peer = lying_peer(claim(1 << 40))

    with pytest.raises(TransferError, match=r"does not match this group's: header\['w'\]: "
                                            r"tensor 'w' is U8 \[1099511627776\] in the header "
                                            r"but U8 \[1000\] in this receiver") as e:
        fetch_snapshot(peer.url, 7, timeout=5, wait_available=0,
                       expected=expected_layout(OWN_STATE))
    assert peer.url in str(e.value)


@pytest.mark.parametrize("lie, problem", [
    (claim(1001), r"'w' is U8 \[1001\]"),
    (claim(2000), r"'w' is U8 \[2000\]"),
    (claim(1000, name="v"), "'v' is not part of this receiver's state"),
    (claim(1000, dtype="I8"), r"'w' is I8 \[1000\] in the header but U8 \[1000\] in this receiver"),
    ({"__metadata__": claim(1000)["__metadata__"]},
     "describes 0 tensors but this receiver expects 1"),
    ({**claim(1000), "v": {"dtype": "U8", "shape": [2**40], "data_offsets": [1000, 1000 + 2**40]}},
     "describes 2 tensors but this receiver expects 1"),
])
def test_a_header_unlike_the_receivers_state_is_refused_before_allocating(
        lying_peer, monkeypatch, lie, problem):
    allocations: list[int] = []
    real_allocate = transport._allocate
    monkeypatch.setattr(transport, "_allocate",
                        lambda n: allocations.append(n) or real_allocate(n))
    peer = lying_peer(lie)

    with pytest.raises(TransferError, match=problem):
        fetch_snapshot(peer.url, 7, timeout=5, wait_available=0,
                       expected=expected_layout(OWN_STATE))
    assert allocations == []


def _deep(depth: int) -> dict:
    value: object = 0
    for _ in range(depth):
        value = [value]
    return claim(8, meta=json.dumps({"deep": value}))


MALFORMED = {
    "not framed": b"<html>gateway timeout</html>",
    "shorter than the length": b"\x08\x00",
    "length beyond the body": struct.pack("<Q", 100) + b"{}",
    "length over the limit": struct.pack("<Q", 2**64 - 1) + b"{}",
    "not utf-8": framed(b"\xff\xfe{\x00\x00}"),
    "not json": framed(b"<html>gateway timeout</html>"),
    "NaN": claim(8, meta='{"lr": NaN}'),
    "nested past the decoder": framed(b"[" * 200_000 + b"]" * 200_000),
    "nested past the meta limit": _deep(500),
    "int of 5000 digits": framed(b'{"w": {"data_offsets": [0, ' + b"9" * 5000 + b"]}}"),
    "a key twice": framed(b'{"w": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}, '
                          b'"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}'),
    "a list": [1, 2, 3],
    "missing fields": {},
    "metadata not strings": {**claim(8), "__metadata__": {**claim(8)["__metadata__"], "step": 7}},
    "missing shape": {**claim(8), "w": {"dtype": "U8", "data_offsets": [0, 8]}},
    "dtype a list": with_tensor(claim(8), "w", dtype=["U8"]),
    "dtype an object": with_tensor(claim(8), "w", dtype={}),
    "offsets strings": with_tensor(claim(8), "w", data_offsets=["0", "8"]),
    "negative offsets": with_tensor(claim(8), "w", data_offsets=[-8, 0]),
    "offsets past int64": with_tensor(claim(8), "w", data_offsets=[2**64, 2**64 + 8]),
    "negative chunk size": {**claim(8), "__metadata__": {**claim(8)["__metadata__"],
                                                         "chunk_bytes": "-8"}},
    "shape overflowing int64": with_tensor(claim(0), "w", shape=[2**70, 0]),
    "shape overflowing strides": with_tensor(claim(0), "w", shape=[2**40, 2**40, 0]),
    "too many dims": with_tensor(claim(0), "w", shape=[0] * 65),
    "another digest": {**claim(8), "__metadata__": {**claim(8)["__metadata__"],
                                                    "digest": "sha256"}},
    "another step": claim(8, step=8),
}


@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_headers_raise_transfer_error_with_and_without_expected(lying_peer, body):
    peer = lying_peer(body)
    for expected in (None, expected_layout({"w": torch.zeros(8, dtype=torch.uint8)})):
        with pytest.raises(TransferError) as e:
            fetch_snapshot(peer.url, 7, timeout=5, wait_available=0, expected=expected)
        message = str(e.value)
        assert peer.url in message and "step 7" in message and "\n" not in message
        assert len(message) < 600


@pytest.mark.parametrize("status, body", [
    (404, b"[" * 200_000), (500, b"\xff" * 100), (401, b'{"error": ["not", "a", "string"]}'),
    (404, b'{"error": "multi\\nline\\r\\nmessage"}'),
], ids=["deep json", "not utf-8", "error not a string", "multi-line error"])
def test_malformed_error_answers_raise_transfer_error(lying_peer, status, body):
    peer = lying_peer(body, status=status)
    with pytest.raises(TransferError, match=f"HTTP {status}") as e:
        fetch_snapshot(peer.url, 7, timeout=5, wait_available=0)
    assert "\n" not in str(e.value)


def test_a_header_larger_than_the_header_limit_is_refused(lying_peer, monkeypatch):
    monkeypatch.setattr(transport, "_MAX_HEADER_BYTES", 1 << 20)
    peer = lying_peer(claim(8, meta=json.dumps({"pad": "x" * (2 << 20)})))
    with pytest.raises(TransferError, match="exceeds 1048576 bytes"):
        fetch_snapshot(peer.url, 7, timeout=5, wait_available=0)


def test_the_receivers_own_layout_accepts_the_peers_snapshot(make_server):
    state = mixed_state()
    server = make_server(chunk_bytes=128)
    server.publish(snapshot_state(state, META, step=7))
    own = {name: torch.empty_like(t) for name, t in reversed(state.items())}  # order is free

    tensors, meta = fetch_snapshot(server.url, 7, timeout=5, expected=expected_layout(own))
    assert_bitwise_equal(tensors, state)
    assert meta == META


@pytest.mark.parametrize("change, problem", [
    (lambda s: s.update(extra=torch.zeros(1)), "describes 14 tensors but this receiver expects 15"),
    (lambda s: s.pop("empty"), "describes 14 tensors but this receiver expects 13"),
    (lambda s: s.update({"w.float32": torch.zeros(17, 33)}),
     r"'w.float32' is F32 \[33, 17\] in the header but F32 \[17, 33\]"),
    (lambda s: s.update({"n.int8": torch.zeros(2, 2, dtype=torch.uint8)}), "'n.int8' is I8"),
])
def test_a_peer_with_another_model_is_refused_before_any_chunk(make_server, change, problem):
    served: list[int] = []
    server = make_server(on_chunk=lambda step, index: served.append(index))
    server.publish(snapshot_state(mixed_state(), META, step=7))
    own = mixed_state()
    change(own)

    with pytest.raises(TransferError, match="does not match this group's") as e:
        fetch_snapshot(server.url, 7, timeout=5, expected=expected_layout(own))
    assert e.match(problem)
    assert served == []


# ---------------------------------------------------------------------------------------------
# TLS


def test_transfer_over_tls_round_trips(make_server, tls_files):
    state = mixed_state()
    server = make_server(token="s3cret", chunk_bytes=256,
                         ssl_context=server_context(tls_files.cert, tls_files.key))
    server.publish(snapshot_state(state, META, step=7))
    assert server.url.startswith("https://127.0.0.1:")
    client = client_context(tls_files.ca)

    tensors, meta = fetch_snapshot(server.url, 7, token="s3cret", timeout=5, ssl_context=client,
                                   expected=expected_layout(state))
    assert_bitwise_equal(tensors, state)
    assert meta == META
    assert list_snapshots(server.url, token="s3cret", ssl_context=client) == [7]


def test_megabyte_chunks_over_tls_round_trip_in_parallel(make_server, tls_files):
    state = {"w": torch.randn(3 << 20, generator=torch.Generator().manual_seed(1))}  # 12 MiB
    server = make_server(chunk_bytes=1 << 20,
                         ssl_context=server_context(tls_files.cert, tls_files.key))
    server.publish(snapshot_state(state, {}, step=3))

    tensors, _ = fetch_snapshot(server.url, 3, parallel=4, timeout=10,
                                ssl_context=client_context(tls_files.ca))
    assert_bitwise_equal(tensors, state)


def test_client_without_the_ca_fails_with_a_clear_error(make_server, tls_files):
    server = make_server(ssl_context=server_context(tls_files.cert, tls_files.key))
    server.publish(snapshot_state(mixed_state(), META, step=7))

    for context in (None, client_context(tls_files.other_ca)):  # the system's CAs, another CA
        with pytest.raises(TransferError, match=r"certificate did not verify .*ft.tls_ca") as e:
            fetch_snapshot(server.url, 7, timeout=5, wait_available=0, ssl_context=context)
        assert server.url in str(e.value)


def test_plain_http_client_against_a_tls_server_fails_clearly(make_server, tls_files):
    server = make_server(ssl_context=server_context(tls_files.cert, tls_files.key))
    server.publish(snapshot_state(mixed_state(), META, step=7))
    plain = server.url.replace("https://", "http://")

    start = time.monotonic()
    with pytest.raises(TransferError, match=r"without answering.*use its https:// URL"):
        fetch_snapshot(plain, 7, timeout=5, wait_available=0)
    assert time.monotonic() - start < 5  # refused at once, not after the read timeout


def test_tls_client_refuses_a_plain_source_instead_of_downgrading(make_server, tls_files):
    server = make_server()
    server.publish(snapshot_state(mixed_state(), META, step=7))
    client = client_context(tls_files.ca)

    with pytest.raises(TransferError, match="requires TLS .*plain http://"):
        fetch_snapshot(server.url, 7, timeout=5, ssl_context=client)
    https = server.url.replace("http://", "https://")
    with pytest.raises(TransferError, match="TLS handshake failed"):
        fetch_snapshot(https, 7, timeout=5, wait_available=0, ssl_context=client)


def test_hostname_is_checked_unless_the_client_opts_out(make_server, tls_files):
    server = make_server(ssl_context=server_context(tls_files.cert_without_ip, tls_files.key))
    server.publish(snapshot_state(mixed_state(), META, step=7))

    with pytest.raises(TransferError, match="certificate did not verify .*127.0.0.1"):
        fetch_snapshot(server.url, 7, timeout=5, wait_available=0,
                       ssl_context=client_context(tls_files.ca))
    tensors, _ = fetch_snapshot(server.url, 7, timeout=5,
                                ssl_context=client_context(tls_files.ca, check_hostname=False))
    assert_bitwise_equal(tensors, mixed_state())


# ---------------------------------------------------------------------------------------------
# A source that breaks the chunk protocol: every failure is one clear TransferError, in bounded
# time, naming the chunk


class BrokenSource:
    """A raw-socket source: a valid header for PAYLOAD in chunks of CHUNK bytes; each chunk
    request is answered by ``behave(conn, index, data)``, which may send anything."""

    CHUNK = 4096
    PAYLOAD = bytes(range(256)) * 64  # 16 KiB: four chunks

    def __init__(self, behave) -> None:
        self.behave, self.release = behave, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def header(self) -> bytes:
        n = len(self.PAYLOAD)
        return framed(json.dumps(wire_header({"w": ("U8", [n], 0, n)}, 7, self.CHUNK)).encode())

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as requests:
            while True:
                line = requests.readline()
                while requests.readline() not in (b"\r\n", b""):
                    pass
                if not line:
                    return
                path = line.split()[1].decode()
                if path.endswith("/header"):
                    body = self.header()
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(body), body))
                    continue
                index = int(path.rsplit("/", 1)[1])
                data = self.PAYLOAD[index * self.CHUNK:(index + 1) * self.CHUNK]
                if not self.behave(self, conn, index, data):
                    return

    @staticmethod
    def answer(conn: socket.socket, data: bytes, digest: str | None, body: bytes | None = None):
        extra = b"" if digest is None else b"X-Ftlm-Digest: %s\r\n" % digest.encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s"
                     % (len(data), extra, data if body is None else body))

    def close(self) -> None:
        self.release.set()
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self.listener.close()
        for thread in self.threads:
            thread.join(5)


def good(data: bytes) -> str:
    return f"xxh3_128={chunk_digest(data)}"


def at_chunk_2(misbehave):
    """Serve chunks 0, 1 and 3 correctly and break chunk 2 with ``misbehave(source, conn, data)``."""
    def behave(source, conn, index, data):
        if index != 2:
            BrokenSource.answer(conn, data, good(data))
            return True
        return misbehave(source, conn, data)
    return behave


def truncate(source, conn, data):
    BrokenSource.answer(conn, data, good(data), body=data[:1000])  # and close
    return False


def flip_a_bit(source, conn, data):
    BrokenSource.answer(conn, data, good(data), body=bytes([data[0] ^ 1]) + data[1:])
    return True


def no_digest(source, conn, data):
    BrokenSource.answer(conn, data, None)
    return True


def malformed_digest(source, conn, data):
    BrokenSource.answer(conn, data, "sha256=" + "0" * 64)
    return True


def stall(source, conn, data):
    BrokenSource.answer(conn, data, good(data), body=data[:1000])
    source.release.wait(30)  # alive but silent: the receiver's timeout must fire
    return False


def reset(source, conn, data):
    BrokenSource.answer(conn, data, good(data), body=data[:1000])
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return False  # closing with SO_LINGER 0 sends RST


@pytest.mark.parametrize("misbehave, problem", [
    (truncate, r"chunk 2: truncated body, 1000 of 4096 bytes arrived"),
    (flip_a_bit, (r"checksum mismatch in chunk 2 \(bytes \[8192, 12288\)\): xxh3_128 [0-9a-f]{32}, "
                  r"the source says [0-9a-f]{32}")),
    (no_digest, r"chunk 2: the source sent no valid digest \(X-Ftlm-Digest: ''"),
    (malformed_digest, r"chunk 2: the source sent no valid digest \(X-Ftlm-Digest: 'sha256="),
    (stall, r"chunk 2: timed out: no progress for 1.0s"),
    (reset, r"chunk 2: connection closed by the source mid-transfer \(ConnectionResetError\)"),
], ids=["truncated", "wrong digest", "no digest", "malformed digest", "stalled", "died (reset)"])
def test_a_source_that_breaks_a_chunk_gives_one_clear_bounded_error(misbehave, problem):
    source = BrokenSource(at_chunk_2(misbehave))
    try:
        start = time.monotonic()
        with pytest.raises(TransferError, match=problem) as e:
            fetch_snapshot(source.url, 7, parallel=2, timeout=1.0, wait_available=0)
        assert time.monotonic() - start < 10  # every wait is bounded by the 1 s timeout
        message = str(e.value)
        assert source.url in message and "step 7" in message and "\n" not in message
    finally:
        source.close()


def test_a_source_that_serves_every_chunk_correctly_round_trips():
    source = BrokenSource(lambda src, conn, index, data: BrokenSource.answer(conn, data, good(data))
                          or True)
    try:
        tensors, meta = fetch_snapshot(source.url, 7, parallel=2, timeout=5, wait_available=0)
        assert tensors["w"].numpy().tobytes() == BrokenSource.PAYLOAD and meta == {}
    finally:
        source.close()


DYING_SOURCE = r"""
import json, socket, struct, time
n = 1 << 20
header = json.dumps({"__metadata__": {"step": "7", "meta": "{}", "chunk_bytes": str(n),
                                      "digest": "xxh3_128"},
                     "w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
header = struct.pack("<Q", len(header)) + header
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
while True:  # the header and the chunks come on separate connections
    conn, _ = listener.accept()
    requests = conn.makefile("rb")
    line = requests.readline()
    while requests.readline() not in (b"\r\n", b""):
        pass
    if b"/header" in line:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (len(header), header))
        conn.close()
        continue
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Ftlm-Digest: xxh3_128=%s\r\n\r\n"
                 % (n, b"0" * 32) + bytes(n // 2))
    print("half sent", flush=True)
    time.sleep(60)  # until SIGKILL
"""


def test_a_source_process_killed_mid_chunk_gives_a_clear_error_at_once():
    source = subprocess.Popen([sys.executable, "-c", DYING_SOURCE], stdout=subprocess.PIPE,
                              text=True)
    try:
        port = int(source.stdout.readline())
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(fetch_snapshot, f"http://127.0.0.1:{port}", 7, parallel=1,
                                 timeout=30, wait_available=0)
            assert source.stdout.readline() == "half sent\n"
            source.kill()  # SIGKILL: the kernel closes its sockets, nothing else happens
            start = time.monotonic()
            with pytest.raises(TransferError, match=r"chunk 0: (truncated body|connection closed"
                                                    r" by the source mid-transfer)"):
                future.result(timeout=20)
            assert time.monotonic() - start < 10  # noticed at once, not after the 30 s timeout
    finally:
        source.kill()
        source.wait(10)


def test_a_transfer_is_counted_on_both_ends_for_the_network_metrics() -> None:
    """``ftlm_ft_transfer_{received,sent}_bytes_total`` come from these tallies (GB/s per link)."""
    from ftlm.observe.iostats import io_totals
    before = io_totals()
    server = SnapshotServer(chunk_bytes=4096)
    url = server.start()
    try:
        server.publish(snapshot_state({"w": torch.ones(10_000)}, {"step": 1}, 1))
        fetch_snapshot(url, 1, parallel=2)
    finally:
        server.stop()
    after = io_totals()
    for kind in ("transfer_received", "transfer_sent"):
        assert after[kind][0] - before[kind][0] == 40_000
        assert after[kind][1] > before[kind][1]


def test_a_source_on_this_host_is_told_from_one_on_another() -> None:
    """``on_this_host`` picks ``ft.transfer_parallel_local`` (groups side by side on one machine,
    where more connections only take the cores the others train on) or ``ft.transfer_parallel``."""
    from ftlm.ft.transport import on_this_host
    assert on_this_host("http://127.0.0.1:29500/snapshot/1")
    assert on_this_host("http://localhost:29500/")
    assert on_this_host("http://[::1]:29500/") or not socket.has_ipv6
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("198.51.100.7", 9))  # no packet is sent: it only picks the outgoing address
        mine = probe.getsockname()[0]
    except OSError:
        mine = ""
    finally:
        probe.close()
    if mine:
        assert on_this_host(f"http://{mine}:29500/")  # one of this machine's interfaces
    assert not on_this_host("http://198.51.100.7:29500/")  # TEST-NET-2: nobody's here
    assert not on_this_host("http://no-such-host.invalid:29500/")
