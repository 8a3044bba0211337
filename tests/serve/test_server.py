"""The OpenAI-compatible server, driven by the real ``openai`` client and by raw HTTP."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
from serve_helpers import TOKEN, start_server

openai = pytest.importorskip("openai")


def client(server, key: str = TOKEN):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=30)


def raw(server, path: str, body: bytes | None = None, key: str | None = TOKEN,
        method: str | None = None) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(server.url + path, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def test_models_and_a_greedy_completion_match_the_engine(server, tokenizer):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    out = c.completions.create(model="tiny", prompt="the quick", max_tokens=8, temperature=0,
                               extra_body={"ignore_eos": True})
    from ftlm.infer import Engine, SamplingParams
    want = Engine(server.engine.model, max_batch=1).generate(
        [tokenizer.encode("the quick")], SamplingParams(max_new_tokens=8, temperature=0,
                                                         ignore_eos=True))[0]
    # Special tokens are left out of the text by default (as vLLM), kept on request.
    assert out.choices[0].text == tokenizer.decode(want.tokens, skip_special_tokens=True)
    assert any(t < 7 for t in want.tokens)  # this model draws a special token: the test bites
    kept = c.completions.create(model="tiny", prompt="the quick", max_tokens=8, temperature=0,
                                extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert kept.choices[0].text == tokenizer.decode(want.tokens)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == len(tokenizer.encode("the quick"))


def test_streaming_chat_with_n_samples_reassembles_the_whole_answer(server):
    c = client(server)
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "What is 12 + 30?"}],
                  max_tokens=10, temperature=0.9, seed=5, n=3)
    whole = c.chat.completions.create(**kwargs)
    assert len(whole.choices) == 3
    parts = {i: "" for i in range(3)}
    reasons = {}
    for ch in c.chat.completions.create(stream=True, **kwargs):
        for choice in ch.choices:
            parts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert [parts[i] for i in range(3)] == [ch.message.content for ch in whole.choices]
    assert set(reasons) == {0, 1, 2}
    assert len({ch.message.content for ch in whole.choices}) > 1  # seeds seed+j differ


def test_concurrent_streaming_clients_are_batched_together(server):
    results: dict[int, str] = {}

    def one(i: int) -> None:
        text = ""
        for ch in client(server).completions.create(model="tiny", prompt=f"the lazy dog {i}",
                                                    max_tokens=12, temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True}):
            text += ch.choices[0].text
        results[i] = text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(6))
    c = client(server)
    for i in range(6):  # batched output equals each prompt alone
        alone = c.completions.create(model="tiny", prompt=f"the lazy dog {i}", max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})
        assert results[i] == alone.choices[0].text
    status, metrics = raw(server, "/metrics")
    assert status == 200
    for name in ("ftlm_serve_time_to_first_token_seconds_count", "ftlm_serve_tokens_per_second",
                 "ftlm_serve_queue_depth", "ftlm_serve_batch_size",
                 "ftlm_serve_tokens_generated_total"):
        assert name in metrics
    assert "ftlm_serve_batch_size" in metrics


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(server):
    c = client(server)
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").models.list()
    assert raw(server, "/v1/models", key=None)[0] == 401
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model="tiny", prompt="fox " * 200, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="n="):
        c.completions.create(model="tiny", prompt="fox", n=50)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-9", prompt="fox")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model="tiny", prompt="fox", temperature=7)
    status, body = raw(server, "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert status == 400 and "JSON" in body["error"]["message"]
    status, body = raw(server, "/v1/completions", b'{"model": "tiny", "prompt": "x", "echo": 1}')
    assert status == 400 and body["error"]["param"] == "echo"
    status, body = raw(server, "/v1/completions", b'[1, 2]')
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = raw(server, "/v1/chat/completions",
                       json.dumps({"model": "tiny", "messages": [{"role": "robot"}]}).encode())
    assert status == 400 and "role" in body["error"]["message"]
    status, body = raw(server, "/v1/nowhere", b"{}")
    assert status == 404 and "error" in body
    big = json.dumps({"model": "tiny", "prompt": "x" * (2 << 20)}).encode()
    assert raw(server, "/v1/completions", big)[0] == 413
    # still serving
    assert c.completions.create(model="tiny", prompt="fox", max_tokens=2).choices


def test_a_full_queue_answers_429_and_the_queued_request_still_completes(tokenizer):
    from ftlm.infer import Engine

    entered, release = threading.Event(), threading.Event()

    class GatedEngine(Engine):  # holds its first step until the test has filled the queue
        def step(self):
            entered.set()
            release.wait(30)
            return super().step()

    server = start_server(tokenizer, engine_cls=GatedEngine, max_batch=1, max_queue=1, max_n=1)
    body = json.dumps({"model": "tiny", "prompt": "fox", "max_tokens": 3}).encode()
    statuses: list[int] = []
    requests = [threading.Thread(target=lambda: statuses.append(
        raw(server, "/v1/completions", body)[0])) for _ in range(2)]
    try:
        requests[0].start()
        assert entered.wait(30)  # the first request holds the only slot
        requests[1].start()  # the second waits in the queue
        for _ in range(3000):  # bounded: at most 30 s
            if server.runner.in_flight() == 2:
                break
            threading.Event().wait(0.01)
        assert server.runner.in_flight() == 2
        status, answer = raw(server, "/v1/completions", body)
        assert status == 429 and answer["error"]["code"] == "queue_full"
        release.set()
        for t in requests:
            t.join(60)
        assert statuses == [200, 200]
        status, metrics = raw(server, "/metrics")
        assert "ftlm_serve_requests_rejected_total{job=\"tiny\"} 1.0" in metrics
    finally:
        release.set()
        server.stop()


def test_a_strategy_turns_n_samples_into_one_choice(server):
    c = client(server)
    kwargs = dict(model="tiny", prompt=["What is 12 + 30?", "the lazy"], max_tokens=8,
                  temperature=1.0, seed=3, n=2)
    samples = c.completions.create(**kwargs)
    picked = c.completions.create(extra_body={"strategy": "best-of-n"}, **kwargs)
    assert len(samples.choices) == 4 and len(picked.choices) == 2
    assert picked.choices[0].text in {ch.text for ch in samples.choices[:2]}
    assert picked.choices[1].text in {ch.text for ch in samples.choices[2:]}
    assert picked.usage.completion_tokens == samples.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="strategy"):
        c.completions.create(model="tiny", prompt="x", stream=True,
                             extra_body={"strategy": "self-consistency"})


def test_a_verifier_given_to_the_server_picks_the_best_of_n_sample(tokenizer):
    class ShortestIsBest:
        """A scorer that prefers short completions and records what it was asked about."""

        def __init__(self) -> None:
            self.asked: list[tuple[str, str]] = []

        def __call__(self, prompt, candidate) -> float:
            self.asked.append((prompt, candidate.text))
            return 1.0 / (1 + len(candidate.text))

    scorer = ShortestIsBest()
    server = start_server(tokenizer, max_n=4, scorer=scorer)
    try:
        c = client(server)
        kwargs = {"model": "tiny", "messages": [{"role": "user", "content": "What is 1 + 2?"}],
                  "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 4}
        samples = [ch.message.content for ch in c.chat.completions.create(**kwargs).choices]
        picked = c.chat.completions.create(extra_body={"strategy": "best-of-n"}, **kwargs)
        assert picked.choices[0].message.content == min(samples, key=len)
        assert {p for p, _ in scorer.asked} == {"What is 1 + 2?"}  # the user's question
        assert sorted(t for _, t in scorer.asked) == sorted(samples)
    finally:
        server.stop()


def test_a_streaming_client_that_disconnects_frees_its_slot(tokenizer):
    import socket

    from ftlm.infer import Engine

    added = []

    class RecordingEngine(Engine):
        def add(self, prompt, params=None):
            seq = super().add(prompt, params)
            added.append(seq)
            return seq

    server = start_server(tokenizer, engine_cls=RecordingEngine, max_batch=1, max_n=1)
    try:
        body = json.dumps({"model": "tiny", "prompt": "fox", "max_tokens": 50, "stream": True,
                           "ignore_eos": True}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nAuthorization: Bearer " + TOKEN.encode()
                     + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)
        sock.close()
        for _ in range(3000):  # bounded: at most 30 s
            if server.runner.in_flight() == 0:
                break
            threading.Event().wait(0.01)
        assert server.runner.in_flight() == 0 and added[0].done
        # Either it was cut short, or it raced to its end first; the server serves on.
        assert added[0].finish_reason in ("abort", "length"), added[0].finish_reason
        assert client(server).completions.create(model="tiny", prompt="dog", max_tokens=2).choices
    finally:
        server.stop()
