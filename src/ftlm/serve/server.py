"""The OpenAI-compatible HTTP server: routes, the bearer key, errors and SSE streaming.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both
with ``stream`` over server-sent events and ``n`` > 1), ``GET /metrics`` (Prometheus) and
``GET /health`` (no key: liveness only). With a token configured every other request needs
``Authorization: Bearer <token>`` (the job token; the ``openai`` client sends its ``api_key``
so). Every failure is an OpenAI-style JSON error (``{"error": {"message", "type", "param",
"code"}}``): 400 bad input (malformed JSON, a body nested deeper than 32 levels, a lone
surrogate, a bad field, a prompt longer than the context, ``n`` too large), 401 wrong key, 403 a
request from another site (an ``Origin`` not the server's own, ``Sec-Fetch-Site: cross-site``)
or, on a loopback server, a ``Host`` that is not this machine (DNS rebinding), 404 unknown model
or route, 408 a body slower than ``read_timeout``, 413 body too large, 415 a POST that is not
``application/json`` (a cross-site form or ``text/plain`` fetch), 429 queue full, 503 shutting
down or over ``max_connections``, 500 a bug (logged at most once per interval; the server keeps
serving). A client that disconnects before its answer cancels its sequences.

The HTTP shell is the coordinator's (``ftlm.ft.connection_gate``, ``ftlm.ft.http_guard``): a cap
on open connections, a deadline for every request's headers, aiohttp's bounds on lines and
headers, and one summary log line per interval about misbehaving clients instead of a traceback
per connection.

Responsible for: HTTP and turning requests into engine sequences (tokenising, the chat
template) and sequences back into OpenAI responses. Not responsible for: batching or the decode
loop (``ftlm.serve.runner``), validation rules (``ftlm.serve.protocol``).

The aiohttp event loop runs in a thread of its own (``start``/``stop``), the engine in another.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import sys
import threading
import time
from dataclasses import replace
from typing import Any

from aiohttp import web

from ftlm.data.tokenizer import Tokenizer
from ftlm.errors import ConfigError
from ftlm.ft.config import is_loopback
from ftlm.ft.connection_gate import AbuseLog, ConnectionGate, CountingLogger, fd_budget, loop_exception_handler
from ftlm.ft.coordinator_address import LOCAL_ALIAS, describe_address, url_of
from ftlm.ft.coordinator_requests import decode_body
from ftlm.ft.http_guard import foreign_request, non_json_post
from ftlm.infer.chat import chat_stop_ids, render_chat
from ftlm.infer.engine import Engine
from ftlm.infer.prompt_logprobs import prompt_logprobs
from ftlm.infer.text import TextStream, cut_at_stop
from ftlm.serve import protocol
from ftlm.serve.config import ServeConfig
from ftlm.serve.metrics import ServeMetrics
from ftlm.serve.protocol import APIError
from ftlm.serve.runner import EngineRunner, Overloaded, Stopped, Update
from ftlm.until_signal import wait_until_signalled

log = logging.getLogger(__name__)

_START_TIMEOUT = 30.0
_LOG_INTERVAL = 10.0
"""Seconds between two summary lines about refused connections and requests."""
_BACKLOG = 512


class Server:
    """Serves ``engine`` (with ``tokenizer``) on ``config.host:config.port``."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, config: ServeConfig,
                 scorer: Any = None) -> None:
        """``scorer`` rates samples for the ``best-of-n`` and ``weighted-best-of-n`` strategies
        (a ``Scorer`` of ``ftlm.infer.strategies``, e.g. a ``Verifier``); None: the policy's
        own confidence."""
        if not is_loopback(config.host) and not config.token and not config.insecure:
            raise ConfigError(f"serving on {config.host} without a token lets anyone who reaches "
                              "the port use the model: set FTLM_TOKEN (or ft.token_file) or pass "
                              "--insecure")
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.scorer = scorer
        self.metrics = ServeMetrics(config.model_name)
        self.runner = EngineRunner(engine, config.max_queue, self.metrics)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._stopping: asyncio.Event | None = None
        self.abuse = AbuseLog(log, _LOG_INTERVAL)
        self._gate: ConnectionGate | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """A URL this machine reaches the server at (loopback for a wildcard bind)."""
        return url_of("http", LOCAL_ALIAS.get(self.config.host, self.config.host), self.port)

    def address(self) -> str:
        """Where people can reach the server: its URL, or every address of a wildcard bind."""
        return describe_address("http", self.config.host, self.port)

    # -- life cycle ---------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard],
                              client_max_size=self.config.max_request_bytes)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    def start(self) -> str:
        """Start the engine thread and the HTTP server; returns the base URL."""
        self.runner.start()
        self._thread = threading.Thread(target=self._run_loop, name="ftlm-serve-http", daemon=True)
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT):
            raise RuntimeError(f"the server did not start within {_START_TIMEOUT} s")
        if self._start_error is not None:
            self.runner.stop()
            raise ConfigError(f"cannot listen on {self.config.host}:{self.config.port}: "
                              f"{self._start_error} (choose another --port, or 0 for any free "
                              "port)") from self._start_error
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, end the sequences in flight, join both threads (bounded)."""
        self.runner.stop(timeout)
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(self._stopping.set)  # type: ignore[union-attr]
            thread.join(timeout)

    def serve_forever(self) -> None:
        """Serve until SIGINT or SIGTERM (for ``ftlm serve``)."""
        def start() -> None:
            self.start()
            where = self.address()
            where = f"{where}/v1" if where.startswith("http") else f"{where} (API under /v1)"
            print(f"ftlm serve: {self.config.model_name!r} on {where} (Ctrl-C to stop)", flush=True)
            if not self.config.token:
                print("ftlm serve: warning: no token (FTLM_TOKEN or ft.token_file): any process that "
                      "reaches the port can use the model", file=sys.stderr, flush=True)
        wait_until_signalled(lambda: self._thread is not None and self._thread.is_alive(), self.stop, start)

    def _run_loop(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._start_error = e
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        cfg = self.config
        self._stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(loop_exception_handler(self.abuse))
        limit = fd_budget(cfg.max_connections)
        if limit < cfg.max_connections:
            log.warning("serve max_connections=%d lowered to %d: the process may open no more "
                        "files (raise `ulimit -n`)", cfg.max_connections, limit)
        self._gate = ConnectionGate(limit, cfg.read_timeout, self.abuse)
        # handler_cancellation: a client that hangs up cancels its handler, whose finally
        # cancels the sequences (generation stops instead of running on for nobody).
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=False,
                               handler_cancellation=True, shutdown_timeout=1.0,
                               keepalive_timeout=cfg.read_timeout,
                               lingering_time=min(1.0, cfg.read_timeout), max_line_size=8190,
                               max_field_size=8190, max_headers=64,
                               logger=CountingLogger(self.abuse))
        await runner.setup()
        assert runner.server is not None  # set by setup()
        server = None
        try:
            server = await loop.create_server(self._gate.factory(runner.server), cfg.host,
                                              cfg.port, backlog=_BACKLOG)
            self.port = int(server.sockets[0].getsockname()[1])
            self._ready.set()
            sweeper = loop.create_task(self._sweep())
            await self._stopping.wait()
            sweeper.cancel()
        finally:
            if server is not None:
                server.close()
            await runner.cleanup()
            self._gate.close_all()
            self.abuse.flush(force=True)
            await asyncio.sleep(0)  # let the closed transports release their sockets

    async def _sweep(self) -> None:
        """Close connections past their header deadline; write the abuse summary when due."""
        while True:
            await asyncio.sleep(min(0.5, self.config.read_timeout / 4))
            self._gate.sweep()  # type: ignore[union-attr]
            self.abuse.flush()

    # -- the guard ----------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        gate = self._gate
        conn = gate.started(request.transport) if gate is not None else None
        try:
            response = await self._checked(request, handler)
        finally:
            if conn is not None:
                gate.finished(conn)  # type: ignore[union-attr]
        if 400 <= response.status < 500 and response.status != 429:
            self.abuse.note(f"HTTP {response.status}", f"{request.method} {request.path[:60]}")
        return response

    async def _checked(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            self._refuse(request)
            return await handler(request)
        except APIError as e:
            if e.status == 429 or e.status == 503:
                self.metrics.on_rejected()
            elif 400 <= e.status < 500:
                self.metrics.on_error()
            response = web.json_response(e.body(), status=e.status)
            if e.status == 408:
                response.force_close()
            return response
        except web.HTTPRequestEntityTooLarge:
            self.metrics.on_error()
            return _error(413, f"the request body is larger than "
                               f"{self.config.max_request_bytes} bytes")
        except web.HTTPException as e:  # unknown route, wrong method
            if e.status < 400:
                raise
            return _error(e.status, f"{e.reason}: {request.method} {request.path[:100]}")
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - a bug: answer 500, keep serving, log it (rate-limited)
            self.abuse.bug(f"failed answering {request.method} {request.path[:100]}", e)
            return _error(500, "internal error; see the server's log", "server_error")

    def _refuse(self, request: web.Request) -> None:
        """Raise the ``APIError`` a request must get before any handler sees it, if any."""
        cfg = self.config
        foreign = foreign_request(request.method, request.headers, bound=cfg.host, scheme="http",
                                  who="the server", url=self.url)
        if foreign is not None:
            raise APIError(*foreign, code="cross_site")
        if request.path != "/health" and cfg.token:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode("utf-8", "replace"),
                                       f"Bearer {cfg.token}".encode()):
                raise APIError(401, "invalid API key: send 'Authorization: Bearer <job "
                                    "token>' (the openai client's api_key)",
                               code="invalid_api_key")
        not_json = non_json_post(request.method, request.content_type)
        if not_json is not None:
            raise APIError(*not_json, code="unsupported_media_type")
        size = request.content_length
        if size is not None and size > cfg.max_request_bytes:
            raise APIError(413, f"the request body ({size} bytes) is larger than "
                                f"{cfg.max_request_bytes} bytes")

    # -- routes -------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "ftlm",
             "max_model_len": self.engine.max_seq_len}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        started = time.perf_counter()
        cfg = self.config
        try:
            raw = await asyncio.wait_for(request.read(), cfg.read_timeout)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {cfg.read_timeout:g} s"
                           ) from None
        try:
            body = decode_body(raw)
        except ValueError as e:
            raise APIError(400, f"{e}; send a JSON object") from None
        req = protocol.parse_request(body, kind, cfg.model_name, cfg.max_n, cfg.default_max_tokens)
        prompts = self._encode(req)
        params = req.params
        if kind == "chat":
            params = replace(params, stop_ids=chat_stop_ids(self.tokenizer))
        # Sample j of a seeded request uses seed + j: n samples differ, and repeat exactly.
        items = [(prompt, replace(params, seed=None if params.seed is None else params.seed + j))
                 for prompt in prompts for j in range(req.n)]
        queue: asyncio.Queue = asyncio.Queue()
        try:
            handles = self.runner.submit(asyncio.get_running_loop(), queue, items)
        except Overloaded as e:
            raise APIError(429, str(e), "rate_limit_exceeded", code="queue_full") from None
        except Stopped as e:
            raise APIError(503, str(e), "server_error", code="shutting_down") from None
        self.metrics.on_request()
        rid = protocol.new_id(kind)
        prompt_tokens = sum(len(p) for p in prompts)  # each prompt once, whatever n
        try:
            if req.stream:  # past the headers: a timeout is reported in-band
                return await self._stream(request, req, rid, queue, len(items), prompt_tokens)
            async with asyncio.timeout(cfg.request_timeout):
                return await self._whole(req, rid, queue, prompts, prompt_tokens)
        except TimeoutError:
            raise APIError(503, f"the request took longer than {cfg.request_timeout:g} s",
                           "server_error", code="timeout") from None
        finally:
            self.runner.cancel(handles)  # a no-op for finished sequences
            self.metrics.on_request_done(time.perf_counter() - started)

    def _encode(self, req: protocol.Request) -> list[list[int]]:
        limit = self.engine.max_seq_len - 1
        if req.kind == "chat":
            prompts = [render_chat(req.messages, self.tokenizer)]
        else:
            prompts = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]
        vocab = self.engine.model.cfg.vocab_size
        for i, p in enumerate(prompts):
            where = "messages" if req.kind == "chat" else "prompt"
            if not p:
                raise protocol.bad(where, "the prompt is empty")
            if len(p) > limit:
                raise protocol.bad(where, f"the prompt has {len(p)} tokens but this model's "
                                          f"context is {self.engine.max_seq_len} tokens; "
                                          f"shorten it to at most {limit}",
                                   "context_length_exceeded")
            if any(not 0 <= t < vocab for t in p):
                raise protocol.bad(where, f"prompt {i} has a token id outside [0, {vocab})")
        return prompts

    def _text(self, req: protocol.Request, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)

    async def _whole(self, req, rid, queue, prompts, prompt_tokens) -> web.Response:
        count = len(prompts) * req.n
        final: dict[int, Update] = {}
        while len(final) < count:
            update: Update = await queue.get()
            if update.error:
                raise APIError(500, update.error, "server_error")
            if update.finish_reason is not None:
                final[update.index] = update
        texts, reasons, generated = [], [], 0
        for i in range(count):
            u = final[i]
            texts.append(cut_at_stop(self._text(req, u.tokens), req.params.stop)[0])
            reasons.append(u.finish_reason)
            generated += len(u.tokens)
        if req.strategy is not None:
            # A verifier runs a model: off the event loop, so other requests keep streaming.
            texts, reasons = await asyncio.to_thread(
                _pick, req, texts, reasons, [final[i] for i in range(count)], self.scorer)
        logprobs = None
        if req.echo or req.logprobs is not None:
            texts, logprobs = await self._echo_and_score(req, prompts, texts, final)
        return web.json_response(protocol.response(req, rid, texts, reasons, prompt_tokens,
                                                   generated, logprobs))

    async def _echo_and_score(self, req: protocol.Request, prompts: list[list[int]],
                              texts: list[str], final: dict[int, Update]
                              ) -> tuple[list[str], list[dict | None] | None]:
        """Each choice's text with its prompt in front (``echo``) and its logprobs object."""
        top = req.logprobs or 0
        echoed: list[protocol.TokenScores] = []
        for index, prompt in enumerate(prompts):
            if req.echo and req.logprobs is not None:
                # One full forward per prompt, off the event loop (and outside the KV cache).
                lps, alts = await asyncio.to_thread(prompt_logprobs, self.engine.model, prompt,
                                                    top)
                echoed.append(self._scores(prompt, lps, alts))
            else:
                echoed.append(protocol.TokenScores([], [], []))
        out_texts: list[str] = []
        out_logprobs: list[dict | None] = []
        for i, text in enumerate(texts):
            prompt_index = i // req.n
            source = req.prompts[prompt_index] if req.kind == "completion" else ""
            prefix = ""
            if req.echo:
                prefix = source if isinstance(source, str) else self._text(req, prompts[prompt_index])
            out_texts.append(prefix + text)
            if req.logprobs is None:
                out_logprobs.append(None)
                continue
            u = final[i]
            scores = self._scores(u.tokens, u.logprobs or [], u.top_logprobs or [])
            if req.echo:
                head = echoed[prompt_index]
                scores = protocol.TokenScores(head.tokens + scores.tokens,
                                              head.logprobs + scores.logprobs,
                                              head.top + scores.top)
            out_logprobs.append(protocol.chat_logprobs(scores) if req.kind == "chat"
                                else protocol.completion_logprobs(scores))
        return out_texts, out_logprobs

    def _scores(self, ids: list[int], logprobs: list, alternatives: list) -> protocol.TokenScores:
        piece = self._piece
        return protocol.TokenScores([piece(t) for t in ids], list(logprobs),
                                    [[(piece(a), lp) for a, lp in alts] for alts in alternatives]
                                    + [[] for _ in range(len(ids) - len(alternatives))])

    def _piece(self, token: int) -> str:
        """The text of one token (special tokens by name), as logprobs report it."""
        return self.tokenizer.decode([token])

    async def _stream(self, request, req, rid, queue, count, prompt_tokens
                      ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        streams = [TextStream(lambda ids: self._text(req, ids), req.params.stop)
                   for _ in range(count)]
        started = [False] * count
        done, generated = 0, 0

        async def send(obj: dict) -> None:
            await response.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        try:
            async with asyncio.timeout(self.config.request_timeout):
                while done < count:
                    update: Update = await queue.get()
                    i = update.index
                    if update.error:  # the status is sent already: report in-band
                        await send(APIError(500, update.error, "server_error").body())
                        break
                    final = update.finish_reason is not None
                    delta = streams[i].update(update.tokens, final=final)
                    if delta or not started[i] or final:
                        await send(protocol.chunk(req, rid, i, delta, update.finish_reason,
                                                  first=not started[i]))
                        started[i] = True
                    if final:
                        done += 1
                        generated += len(update.tokens)
        except TimeoutError:
            await send(APIError(503, f"the request took longer than "
                                     f"{self.config.request_timeout:g} s", "server_error",
                                code="timeout").body())
        if req.include_usage:
            await send(protocol.usage_chunk(req, rid, prompt_tokens, generated))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _question(req: protocol.Request, index: int) -> str:
    """The text a verifier is asked about: the prompt, or the chat's last user message."""
    if req.kind == "chat":
        return next((m["content"] for m in reversed(req.messages) if m["role"] == "user"), "")
    prompt = req.prompts[index]
    return prompt if isinstance(prompt, str) else ""


def _pick(req: protocol.Request, texts: list[str], reasons: list[str | None],
          updates: list[Update], scorer: Any = None) -> tuple[list[str], list[str | None]]:
    """One choice per prompt out of its ``n`` samples, by ``req.strategy`` and ``scorer``."""
    from ftlm.infer import strategies as st
    from ftlm.tasks import extract_answer
    scorer = scorer or st.confidence
    picked_texts, picked_reasons = [], []
    for start in range(0, len(texts), req.n):
        cands = [st.Candidate(texts[i], updates[i].tokens, updates[i].logprobs or [],
                              reasons[i] or "stop", extract_answer(texts[i]))
                 for i in range(start, start + req.n)]
        question = _question(req, start // req.n)
        if req.strategy != "self-consistency" and hasattr(scorer, "score_all"):
            scorer.score_all(question, cands)  # one batched pass of the verifier
        if req.strategy == "self-consistency":
            choice = st.self_consistency(cands)
        elif req.strategy == "best-of-n":
            choice = st.best_of_n(cands, question, scorer)
        else:
            choice = st.weighted_best_of_n(cands, question, scorer)
        index = next(i for i, c in enumerate(cands) if c.text == choice.text)
        picked_texts.append(choice.text)
        picked_reasons.append(cands[index].finish_reason)
    return picked_texts, picked_reasons


def _error(status: int, message: str, type: str = "invalid_request_error") -> web.Response:
    return web.json_response(APIError(status, message, type).body(), status=status)
