"""The OpenAI fields lm-eval and the openai client rely on: usage, special tokens, logprobs,
echo (loglikelihood scoring), ignored and unknown fields, and a non-streaming client that
hangs up."""

from __future__ import annotations

import json
import socket
import threading

import pytest
from serve_helpers import TOKEN, start_server
from test_server import client, raw

openai = pytest.importorskip("openai")


def post(server, path: str, body: dict) -> tuple[int, dict]:
    return raw(server, path, json.dumps(body).encode())


def test_usage_counts_each_prompt_once_whatever_n(server, tokenizer):
    out = client(server).completions.create(model="tiny", prompt=["the quick", "the lazy dog"],
                                            max_tokens=3, n=2, temperature=1.0, seed=1)
    assert out.usage.prompt_tokens == (len(tokenizer.encode("the quick"))
                                       + len(tokenizer.encode("the lazy dog")))
    chat = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "fox"}], max_tokens=2, n=3,
        temperature=1.0, seed=1)
    from ftlm.infer.chat import render_chat
    assert chat.usage.prompt_tokens == len(render_chat([{"role": "user", "content": "fox"}],
                                                       tokenizer))


def test_known_openai_fields_are_ignored_and_unknown_ones_are_named(server):
    extra = {"store": False, "metadata": {"run": "a"}, "user": "u1", "service_tier": "auto",
             "parallel_tool_calls": True}
    status, body = post(server, "/v1/chat/completions",
                        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 2, **extra})
    assert status == 200, body
    status, body = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi",
                                                    "max_tokens": 2, "user": "u1", "store": True})
    assert status == 200, body
    status, body = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi",
                                                    "frobnicate": 1, "zorch": 2})
    assert status == 400
    assert "'frobnicate'" in body["error"]["message"] and "'zorch'" in body["error"]["message"]


def test_completion_logprobs_match_the_engine_and_echo_scores_the_prompt(server, tokenizer):
    from ftlm.infer import Engine, SamplingParams
    prompt = tokenizer.encode("the quick brown")
    want = Engine(server.engine.model, max_batch=1).generate(
        [prompt], SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))[0]
    status, out = post(server, "/v1/completions",
                       {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0,
                        "ignore_eos": True, "logprobs": 3})
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([t]) for t in want.tokens]
    assert lp["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-4)
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        # 3 alternatives, fewer when two decode to the same text; greedy: the best is drawn.
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-4)
    # lm-eval's loglikelihood: echo the whole text with max_tokens=0 and read the prompt's
    # logprobs; the full forward must agree with what the KV-cached decode drew.
    status, scored = post(server, "/v1/completions",
                          {"model": "tiny", "prompt": prompt + want.tokens, "max_tokens": 0,
                           "echo": True, "logprobs": 1, "temperature": 0})
    assert status == 200, scored
    choice = scored["choices"][0]
    assert choice["text"] == tokenizer.decode(prompt + want.tokens, skip_special_tokens=True)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 5 and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][len(prompt):] == pytest.approx(want.logprobs, abs=1e-3)
    assert lp["top_logprobs"][0] is None and all(len(t) == 1 for t in lp["top_logprobs"][1:])
    assert scored["usage"]["completion_tokens"] == 0
    status, body = post(server, "/v1/completions", {"model": "tiny", "prompt": "x",
                                                    "logprobs": 99})
    assert status == 400 and body["error"]["param"] == "logprobs"


def test_echo_without_logprobs_puts_the_prompt_in_front(server):
    status, out = post(server, "/v1/completions", {"model": "tiny", "prompt": "the lazy",
                                                   "max_tokens": 3, "echo": True})
    assert status == 200 and out["choices"][0]["text"].startswith("the lazy")
    assert out["choices"][0]["logprobs"] is None


def test_chat_logprobs_and_top_logprobs(server):
    out = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "fox"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "fox"}], top_logprobs=2)


def test_a_non_streaming_client_that_disconnects_stops_its_generation(tokenizer):
    from ftlm.infer import Engine

    added, stepping = [], threading.Event()
    never = threading.Event()

    class PacedEngine(Engine):  # a slow model: each step takes 50 ms
        def add(self, prompt, params=None):
            seq = super().add(prompt, params)
            added.append(seq)
            return seq

        def step(self):
            stepping.set()
            never.wait(0.05)
            return super().step()

    server = start_server(tokenizer, engine_cls=PacedEngine, max_batch=1, max_n=1)
    try:
        body = json.dumps({"model": "tiny", "prompt": "fox", "max_tokens": 60,
                           "ignore_eos": True}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nAuthorization: Bearer " + TOKEN.encode()
                     + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert stepping.wait(30)
        sock.close()
        for _ in range(3000):  # bounded: at most 30 s
            if server.runner.in_flight() == 0:
                break
            never.wait(0.01)
        assert server.runner.in_flight() == 0
        assert added[0].finish_reason == "abort" and len(added[0].tokens) < 60
    finally:
        server.stop()
