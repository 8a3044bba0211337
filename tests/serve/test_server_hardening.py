"""``ftlm serve`` against hostile clients: slowloris connections, bodies that break parsers,
cross-site browsers and a foreign ``Host`` (the coordinator's defences, shared)."""

from __future__ import annotations

import json
import logging
import socket
import urllib.request

import pytest
from serve_helpers import start_server
from test_server import raw


def test_partial_header_connections_are_capped_and_cut_without_tracebacks(tokenizer, caplog):
    server = start_server(tokenizer, max_connections=16, read_timeout=0.5)
    caplog.set_level(logging.DEBUG)
    socks = []
    try:
        for _ in range(300):  # slowloris: headers that never finish
            s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-a: ")
            socks.append(s)
        assert server._gate.open <= 16
        for s in socks:  # every one is answered 503 (over the cap) or closed (too slow)
            data = s.recv(4096)
            while data and b"503" not in data:
                data = s.recv(4096)
        status, _ = raw(server, "/v1/models")
        assert status == 200  # the server still serves
        server.abuse.flush(force=True)
    finally:
        for s in socks:
            s.close()
        server.stop()
    assert not [r for r in caplog.records if r.exc_info]  # no traceback per connection
    summary = [r.getMessage() for r in caplog.records if "refused in the last" in r.getMessage()]
    assert summary and "over the limit of 16" in " ".join(summary)


@pytest.mark.parametrize("body, param", [
    (b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    (b'{"model": "tiny", "prompt": "x", "stop": ["\\ud83d"]}', "stop"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, body, param):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, answer = raw(server, path, body)
    assert status == 400, answer
    assert param in answer["error"]["param"] and "surrogate" in answer["error"]["message"]


def test_a_deeply_nested_body_is_a_400(server):
    body = b'{"model": "tiny", "prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}"
    status, answer = raw(server, "/v1/completions", body)
    assert status == 400 and "nests deeper" in answer["error"]["message"]


def test_200k_prompts_are_refused_by_count_before_tokenising(server, tokenizer, monkeypatch):
    calls = []
    monkeypatch.setattr(tokenizer, "encode", lambda text: calls.append(text) or [1])
    body = json.dumps({"model": "tiny", "prompt": ["a"] * 200_000}).encode()
    status, answer = raw(server, "/v1/completions", body)
    assert status == 400 and "200000 prompts" in answer["error"]["message"]
    assert calls == []


def _request(server, path: str, headers: dict, body: bytes | None = None) -> int:
    req = urllib.request.Request(server.url + path, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_tokenless_server_refuses_cross_site_posts_and_foreign_hosts(tokenizer):
    server = start_server(tokenizer, token="")
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1}).encode()
    try:
        # A page on another site can send text/plain without a preflight; JSON it cannot.
        assert _request(server, "/v1/completions", {"Content-Type": "text/plain"}, body) == 415
        assert _request(server, "/v1/completions", {"Content-Type": "application/json",
                                                    "Origin": "http://evil.example"}, body) == 403
        assert _request(server, "/v1/completions", {"Content-Type": "application/json",
                                                    "Sec-Fetch-Site": "cross-site"}, body) == 403
        # DNS rebinding: evil.example resolved to 127.0.0.1 still sends its own name.
        assert _request(server, "/v1/models", {"Host": "evil.example"}) == 403
        assert _request(server, "/v1/completions", {"Content-Type": "application/json"},
                        body) == 200
    finally:
        server.stop()


def test_a_wildcard_bind_prints_a_reachable_url(tokenizer):
    server = start_server(tokenizer, host="0.0.0.0", token="", insecure=True)
    try:
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert f"http://127.0.0.1:{server.port}" in server.address()
        assert "0.0.0.0:" not in server.address().split(": ", 1)[1]
        with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
            assert r.status == 200
    finally:
        server.stop()
