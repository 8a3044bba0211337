"""The OpenAI wire format: validating request bodies and shaping responses (pure functions).

Responsible for: turning a decoded JSON body of ``/v1/completions`` or ``/v1/chat/completions``
into a ``Request`` (prompts, ``SamplingParams``, ``n``, streaming) or an ``APIError`` that names
the bad field and what would be valid; the OpenAI error body; completion, chat and streaming
chunk objects; usage.

Not responsible for: HTTP, auth or tokenisation (``ftlm.serve.server``), or generation.

Supported request fields: ``model``, ``prompt`` (a string, a list of strings, a list of token ids
or a list of such lists; at most ``max_n`` prompts, counted before anything is tokenised) or
``messages`` (roles system/user/assistant, string content or a list of ``{"type": "text"}``
parts), ``max_tokens`` (chat: also ``max_completion_tokens``), ``temperature`` [0, 2],
``top_p``, ``n``, ``stream``, ``stream_options.include_usage``, ``stop`` (a string or up to 4),
``seed``; ``logprobs`` (completions: an integer, the alternatives per position; chat: true, with
``top_logprobs``) and, on completions, ``echo`` (the prompt comes back before the completion,
with its own logprobs when ``logprobs`` is set: ``echo`` with ``max_tokens=0`` scores a text, as
lm-eval's loglikelihood does); the extensions ``top_k``, ``min_p``, ``ignore_eos``,
``skip_special_tokens`` (default true, as vLLM: special tokens are left out of the text) and
``strategy`` (one of ``STRATEGIES``: the ``n`` samples of each prompt become one choice, picked
by ``ftlm.infer.strategies`` with the policy's confidence as the score; not with ``stream``).
OpenAI fields that only label or route a request (``IGNORED_FIELDS``: ``user``, ``store``,
``metadata``, ``service_tier``, ...) are accepted and ignored. Penalties are accepted only at 0;
``suffix``, ``best_of`` > 1, ``logit_bias``, tools, logprobs with ``stream`` and any unknown
field are refused with 400 (naming every unknown field) rather than silently ignored. Every
string must be valid Unicode (a lone surrogate from a ``\\ud800`` escape is a 400).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from ftlm.errors import ConfigError
from ftlm.infer.sampling import MAX_TOP_LOGPROBS, SamplingParams

IGNORED_FIELDS = frozenset({"user", "store", "metadata", "service_tier", "parallel_tool_calls",
                            "prompt_cache_key", "safety_identifier"})
"""OpenAI request fields that label, store or route a request: accepted, and without effect here."""
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
           "seed", "top_k", "min_p", "ignore_eos", "presence_penalty", "frequency_penalty",
           "strategy", "logprobs", "skip_special_tokens", *IGNORED_FIELDS}
STRATEGIES = ("self-consistency", "best-of-n", "weighted-best-of-n")
COMPLETION_FIELDS = _COMMON | {"prompt", "best_of", "echo", "suffix", "logit_bias"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "logit_bias", "tools",
                         "tool_choice", "response_format"}


class APIError(Exception):
    """An error answered to the client as OpenAI does: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type,
                                                                       param, code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class Request:
    """A validated generation request."""

    kind: str
    """``"completion"`` or ``"chat"``."""
    prompts: list[str | list[int]]
    """Prompt texts or token-id lists (chat: one)."""
    messages: list[dict[str, str]] = field(default_factory=list)
    """Chat messages with string contents."""
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    model: str = ""
    strategy: str | None = None
    """Pick one of the ``n`` samples per prompt (``STRATEGIES``); None returns all ``n``."""
    logprobs: int | None = None
    """Return the tokens' log-probabilities with this many alternatives each; None: none."""
    echo: bool = False
    """Completions: the prompt's text (and logprobs) come first in each choice."""
    skip_special_tokens: bool = True
    """Leave special tokens (``<|eos|>``, role markers) out of the text."""


def parse_request(body: Any, kind: str, model_name: str, max_n: int,
                  default_max_tokens: int) -> Request:
    """Validate the JSON ``body`` of a ``kind`` request (``"completion"`` or ``"chat"``)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    allowed = COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        names = ", ".join(repr(u[:40]) for u in unknown[:8]) + (" ..." if len(unknown) > 8 else "")
        raise bad(unknown[0][:40], f"unknown field{'s' if len(unknown) > 1 else ''} {names}; "
                                   f"supported: {', '.join(sorted(allowed - IGNORED_FIELDS))} "
                                   f"(and, ignored: {', '.join(sorted(IGNORED_FIELDS))})",
                  "unsupported_field")
    _check_unicode(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", f"'model' is required: use {model_name!r} (see GET /v1/models)")
    if model != model_name:
        raise APIError(404, f"the model {model[:100]!r} does not exist; this server serves "
                            f"{model_name!r}", param="model", code="model_not_found")
    _refuse_unsupported(body, kind)
    n = _int(body, "n", 1, 1, max_n)
    max_tokens = body.get("max_tokens")
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        max_tokens = body["max_completion_tokens"]
    if max_tokens is None:
        max_tokens = default_max_tokens
    if not _is_int(max_tokens) or max_tokens < 0:
        raise bad("max_tokens", f"max_tokens={max_tokens!r} must be an integer >= 0")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > 4
            or not all(isinstance(s, str) and s for s in stop)):
        raise bad("stop", "stop must be a non-empty string or a list of up to 4 of them")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        raise bad("seed", f"seed={seed!r} must be an integer in [0, 2**63)")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("ignore_eos", "ignore_eos must be true or false")
    try:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                                top_k=_int(body, "top_k", 0, 0, 1 << 30),
                                top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
                                min_p=_number(body, "min_p", 0.0, 0.0, 1.0), stop=tuple(stop),
                                seed=seed, ignore_eos=ignore_eos)
    except ConfigError as e:
        raise bad(str(e).split("=")[0], str(e)) from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "stream must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("stream_options", "stream_options supports only include_usage")
    include_usage = bool(options.get("include_usage", False))
    strategy = body.get("strategy")
    if strategy is not None:
        if strategy not in STRATEGIES:
            raise bad("strategy", f"strategy={str(strategy)[:40]!r} is not known; valid: "
                                  f"{', '.join(STRATEGIES)}")
        if stream:
            raise bad("strategy", "a strategy picks among finished samples: use stream=false")
    logprobs = _logprobs(body, kind)
    echo = body.get("echo", False) if kind == "completion" else False
    if not isinstance(echo, bool):
        raise bad("echo", "echo must be true or false")
    skip = body.get("skip_special_tokens", True)
    if not isinstance(skip, bool):
        raise bad("skip_special_tokens", "skip_special_tokens must be true or false")
    if stream and (logprobs is not None or echo):
        raise bad("logprobs" if logprobs is not None else "echo",
                  "logprobs and echo are answered whole: use stream=false")
    if strategy is not None and (logprobs is not None or echo):
        raise bad("strategy", "a strategy returns one picked text per prompt: drop logprobs "
                              "and echo, or the strategy")
    params = replace(params, top_logprobs=logprobs or 0)
    if kind == "chat":
        messages = _messages(body.get("messages"))
        return Request(kind, [""], messages, params, n, stream, include_usage, model, strategy,
                       logprobs=logprobs, skip_special_tokens=skip)
    prompts = _prompts(body.get("prompt"))
    if len(prompts) * n > max_n:  # counted before any prompt is tokenised
        raise bad("n", f"{len(prompts)} prompts x n={n} asks for {len(prompts) * n} "
                       f"completions; at most {max_n} per request", "integer_out_of_range")
    return Request(kind, prompts, [], params, n, stream, include_usage, model, strategy,
                   logprobs=logprobs, echo=echo, skip_special_tokens=skip)


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per token a request asks for; None: no logprobs at all."""
    value = body.get("logprobs")
    if kind == "completion":
        if value is None:
            return None
        if not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
            raise bad("logprobs", f"logprobs={str(value)[:40]} must be an integer in "
                                  f"[0, {MAX_TOP_LOGPROBS}] (alternatives per token)")
        return value
    if value not in (None, True, False):
        raise bad("logprobs", "logprobs must be true or false (top_logprobs sets alternatives)")
    top = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top and not value:
        raise bad("top_logprobs", "top_logprobs needs logprobs=true")
    return top if value else None


def _check_unicode(value: Any, where: str = "") -> None:
    """Refuse a lone surrogate anywhere in the body (the tokenizer cannot encode one)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad(where or "body", f"{where or 'a string'} holds a lone surrogate "
                                       f"(\\u{ord(value[e.start]):04x}) at character {e.start}; "
                                       "send valid Unicode text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, where or "a field name")
            _check_unicode(item, f"{where}.{key}" if where else str(key)[:40])
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{where}[{i}]")


def _refuse_unsupported(body: dict, kind: str) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0):
            raise bad(name, f"{name} is not supported (only 0)", "unsupported_value")
    if body.get("suffix") is not None:
        raise bad("suffix", "suffix (insertion) is not supported", "unsupported_value")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of", "best_of is not supported; use n and pick client-side",
                  "unsupported_value")
    for name in ("logit_bias", "tools", "tool_choice", "response_format"):
        if body.get(name):
            raise bad(name, f"{name} is not supported", "unsupported_value")


def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str) and prompt:
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) and p for p in prompt):
            return list(prompt)
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise bad("prompt", "prompt must be a non-empty string, a list of them, a list of token ids "
                        "or a list of such lists")


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "each message must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise bad(f"messages[{i}].role", f"role {str(role)[:40]!r} is not supported; use "
                                             "system, user or assistant")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", "content must be a string or text parts")
        out.append({"role": role, "content": content})
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, name: str, default: int, low: int, high: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or not low <= value <= high:
        raise bad(name, f"{name}={str(value)[:40]} must be an integer in [{low}, {high}]",
                  "integer_out_of_range" if _is_int(value) else None)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or not low <= value <= high):
        raise bad(name, f"{name}={str(value)[:40]} must be a number in [{low:g}, {high:g}]")
    return float(value)


# ------------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish(reason: str | None) -> str | None:
    """The OpenAI finish reason of an engine's (``abort`` never reaches a client as such)."""
    return None if reason is None else ("length" if reason == "length" else "stop")


@dataclass
class TokenScores:
    """The scored tokens of one choice: their texts, log-probabilities and alternatives."""

    tokens: list[str]
    logprobs: list[float | None]
    """None where a token has no context (the first token of an echoed prompt)."""
    top: list[list[tuple[str, float]]]
    """Per token, its most likely alternatives (text, log-probability), most likely first."""


def completion_logprobs(scores: TokenScores, offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object (``tokens``, ``token_logprobs``,
    ``top_logprobs`` as ``{token: logprob}`` dicts, ``text_offset``); offsets start at ``offset``."""
    offsets, at = [], offset
    for token in scores.tokens:
        offsets.append(at)
        at += len(token)
    # Two byte tokens can decode to the same text ("\ufffd"): the key keeps the likelier one.
    top = [None if lp is None else dict(reversed(alts))
           for lp, alts in zip(scores.logprobs, scores.top)]
    return {"tokens": scores.tokens, "token_logprobs": scores.logprobs, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(scores: TokenScores) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
                        for t, lp, alts in zip(scores.tokens, scores.logprobs, scores.top)
                        if lp is not None]}


def response(req: Request, rid: str, texts: list[str], reasons: list[str | None],
             prompt_tokens: int, completion_tokens: int,
             logprobs: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """The whole (non-streamed) answer; ``logprobs``: each choice's logprobs object, if asked."""
    created = int(time.time())
    logprobs = logprobs or [None] * len(texts)
    if req.kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": t},
                    "logprobs": lp, "finish_reason": finish(r)}
                   for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))]
        obj = "chat.completion"
    else:
        choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": finish(r)}
                   for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))]
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk(req: Request, rid: str, index: int, text: str | None, reason: str | None,
          first: bool = False) -> dict[str, Any]:
    """One streamed piece of choice ``index``."""
    base = {"id": rid, "created": int(time.time()), "model": req.model}
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        return {**base, "object": "chat.completion.chunk",
                "choices": [{"index": index, "delta": delta, "logprobs": None,
                             "finish_reason": finish(reason)}]}
    return {**base, "object": "text_completion",
            "choices": [{"index": index, "text": text or "", "logprobs": None,
                         "finish_reason": finish(reason)}]}


def usage_chunk(req: Request, rid: str, prompt_tokens: int, completion_tokens: int
                ) -> dict[str, Any]:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": req.model,
            "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
