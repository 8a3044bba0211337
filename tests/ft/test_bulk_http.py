"""The snapshot server's HTTP layer: a connection cap, deadlines, limits, and stopping that cuts
every connection, each bounded in time (ftlm.ft.bulk_http)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

import pytest

from ftlm.ft.bulk_http import BulkHTTPServer, Request, Response, json_response

pytestmark = pytest.mark.timeout(60)

BIG = memoryview(bytes(64 << 20))  # far more than loopback's socket buffers hold


def handle(request: Request) -> Response:
    if request.path == "/big":
        return Response(200, BIG, "application/octet-stream")
    if request.path == "/boom":
        raise RuntimeError("a bug in the handler")
    return json_response(200, {"path": request.path})


@pytest.fixture
def serve():
    servers: list[BulkHTTPServer] = []

    def make(**kwargs) -> tuple[BulkHTTPServer, tuple[str, int]]:
        server = BulkHTTPServer(handle, **kwargs)
        servers.append(server)
        return server, server.start()

    yield make
    for server in servers:
        server.stop()


def request(address: tuple[str, int], raw: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes on a new connection and read until the server closes it."""
    with socket.create_connection(address, timeout=timeout) as conn:
        conn.sendall(raw)
        return read_all(conn)


def read_all(conn: socket.socket) -> bytes:
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def answer_one(conn: socket.socket, path: str) -> bytes:
    """One keep-alive request on ``conn``; returns the head of its answer."""
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(4096)
    return data


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_keep_alive_serves_several_requests_on_one_connection(serve):
    _, address = serve()
    with socket.create_connection(address, timeout=5) as conn:
        for path in ("/a", "/b", "/c"):
            head = answer_one(conn, path)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b'{"path": "/x"}' in request(address, b"GET /x?q=1 HTTP/1.1\r\nConnection: close\r\n\r\n")


def test_connections_over_the_cap_get_503_and_those_admitted_keep_working(serve, caplog):
    server, address = serve(max_connections=2)
    admitted = [socket.create_connection(address, timeout=5) for _ in range(2)]
    try:
        for conn in admitted:  # answered, hence admitted and held open (keep-alive)
            assert answer_one(conn, "/a").startswith(b"HTTP/1.1 200")
        with socket.create_connection(address, timeout=5) as conn:
            refused = read_all(conn)  # answered at once, before any request
        assert refused.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert b"connection limit" in refused
        assert answer_one(admitted[0], "/b").startswith(b"HTTP/1.1 200")
    finally:
        for conn in admitted:
            conn.close()
    assert wait_until(lambda: server.open_connections == 0)
    with caplog.at_level(logging.WARNING):
        server.abuse.flush(force=True)
    assert "connections over the limit of 2 x1" in caplog.text


def test_a_client_that_never_completes_its_request_is_closed_after_the_deadline(serve):
    server, address = serve(read_timeout=0.3)
    with socket.create_connection(address, timeout=10) as conn:
        conn.sendall(b"GET /a HTT")  # ... and nothing more (slowloris)
        start = time.monotonic()
        assert read_all(conn) == b""  # closed by the server, without an answer
        assert 0.25 <= time.monotonic() - start < 5
    assert wait_until(lambda: server.open_connections == 0)


@pytest.mark.parametrize("raw, status", [
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", b"400"),  # a TLS ClientHello
    (b"GET /a HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", b"400"),
    (b"GET /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", b"400"),
    (b"GET a HTTP/1.1\r\n\r\n", b"400"),
    (b"GET /a HTTP/2\r\n\r\n", b"400"),
    (b"GET /a HTTP/1.1\r\nno colon\r\n\r\n", b"400"),
    (b"GET /a HTTP/1.1\r\n" + b"X: y\r\n" * 65 + b"\r\n", b"431"),
    (b"GET /" + b"a" * (20 << 10) + b" HTTP/1.1\r\n\r\n", b"431"),
], ids=["tls hello", "a body", "chunked body", "no slash", "http/2", "bad header", "65 headers",
        "huge head"])
def test_malformed_requests_are_answered_at_once_and_closed(serve, raw, status):
    _, address = serve(read_timeout=30)
    start = time.monotonic()
    answer = request(address, raw)
    assert answer.startswith(b"HTTP/1.1 " + status) and b"Connection: close" in answer
    assert time.monotonic() - start < 5  # not after the 30 s read deadline
    assert request(address, b"GET /ok HTTP/1.1\r\nConnection: close\r\n\r\n").startswith(
        b"HTTP/1.1 200")


def test_a_handler_bug_is_a_500_and_the_server_keeps_serving(serve, caplog):
    _, address = serve()
    with caplog.at_level(logging.ERROR):
        answer = request(address, b"GET /boom HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 500") and b"RuntimeError" in answer
    assert "a bug in the handler" in caplog.text
    assert request(address, b"GET /ok HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 200")


def test_a_client_that_stops_reading_is_cut_after_the_write_timeout(serve):
    server, address = serve(write_timeout=0.5)
    with socket.create_connection(address, timeout=10) as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.sendall(b"GET /big HTTP/1.1\r\n\r\n")  # and never read
        assert wait_until(lambda: server.open_connections == 1)
        assert wait_until(lambda: server.open_connections == 0, timeout=15)


def test_stop_cuts_a_transfer_in_flight_and_joins_every_thread(serve):
    server, address = serve()
    with socket.create_connection(address, timeout=10) as conn:
        conn.sendall(b"GET /big HTTP/1.1\r\n\r\n")
        conn.recv(65536)  # the answer has started; the rest waits in sendall
        start = time.monotonic()
        server.stop(timeout=5)
        assert time.monotonic() - start < 5
        received = 0
        with contextlib.suppress(ConnectionResetError):  # a cut may arrive as a reset
            while chunk := conn.recv(1 << 20):
                received += len(chunk)
        assert received < BIG.nbytes  # cut, not finished
    assert not [t for t in threading.enumerate() if t.name.startswith("ftlm-bulk-http")]
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=2).close()



def test_stop_cuts_a_tls_handshake_in_progress(serve, tls_files):
    from ftlm.ft.tls import server_context

    server, address = serve(read_timeout=30,
                            ssl_context=server_context(tls_files.cert, tls_files.key))
    with socket.create_connection(address, timeout=10):  # connects, never says hello
        assert wait_until(lambda: server.open_connections == 1)
        start = time.monotonic()
        server.stop(timeout=5)  # raises TimeoutError if the handshake were not cut
        assert time.monotonic() - start < 5
