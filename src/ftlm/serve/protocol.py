"""The OpenAI wire format: validating request bodies and shaping responses (pure functions).

Responsible for: turning a decoded JSON body of ``/v1/completions`` or ``/v1/chat/completions``
into a ``Request`` (prompts, ``SamplingParams``, ``n``, streaming) or an ``APIError`` that names
the bad field and what would be valid; the OpenAI error body; completion, chat and streaming
chunk objects; usage.

Not responsible for: HTTP, auth or tokenisation (``ftlm.serve.server``), or generation.

Supported request fields: ``model``, ``prompt`` (a string, a list of strings, a list of token ids
or a list of such lists) or ``messages`` (roles system/user/assistant, string content or a list
of ``{"type": "text"}`` parts), ``max_tokens`` (chat: also ``max_completion_tokens``),
``temperature`` [0, 2], ``top_p``, ``n``, ``stream``, ``stream_options.include_usage``, ``stop``
(a string or up to 4), ``seed``, ``user``; the extensions ``top_k``, ``min_p`` and
``ignore_eos``, and ``strategy`` (one of ``STRATEGIES``: the ``n`` samples of each prompt
become one choice, picked by ``ftlm.infer.strategies`` with the policy's confidence as the
score; not with ``stream``). Penalties are accepted only at 0; ``echo``, ``logprobs``, ``suffix``,
``best_of`` > 1, ``logit_bias``, tools and any unknown field are refused with 400 rather than
silently ignored.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ftlm.errors import ConfigError
from ftlm.infer.sampling import SamplingParams

_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
           "seed", "user", "top_k", "min_p", "ignore_eos", "presence_penalty",
           "frequency_penalty", "strategy"}
STRATEGIES = ("self-consistency", "best-of-n", "weighted-best-of-n")
COMPLETION_FIELDS = _COMMON | {"prompt", "best_of", "echo", "logprobs", "suffix", "logit_bias"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                         "logit_bias", "tools", "tool_choice", "response_format"}


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


def parse_request(body: Any, kind: str, model_name: str, max_n: int,
                  default_max_tokens: int) -> Request:
    """Validate the JSON ``body`` of a ``kind`` request (``"completion"`` or ``"chat"``)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    allowed = COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(unknown[0], f"unknown field {unknown[0]!r}; supported: "
                              f"{', '.join(sorted(allowed))}", "unsupported_field")
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
    if kind == "chat":
        messages = _messages(body.get("messages"))
        return Request(kind, [""], messages, params, n, stream, include_usage, model, strategy)
    return Request(kind, _prompts(body.get("prompt")), [], params, n, stream, include_usage,
                   model, strategy)


def _refuse_unsupported(body: dict, kind: str) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0):
            raise bad(name, f"{name} is not supported (only 0)", "unsupported_value")
    if body.get("echo"):
        raise bad("echo", "echo is not supported", "unsupported_value")
    if body.get("logprobs") not in (None, False, 0):
        raise bad("logprobs", "logprobs are not supported yet", "unsupported_value")
    if body.get("suffix") is not None:
        raise bad("suffix", "suffix (insertion) is not supported", "unsupported_value")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of", "best_of is not supported; use n and pick client-side",
                  "unsupported_value")
    for name in ("logit_bias", "tools", "tool_choice", "response_format", "top_logprobs"):
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


def response(req: Request, rid: str, texts: list[str], reasons: list[str | None],
             prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The whole (non-streamed) answer."""
    created = int(time.time())
    if req.kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": t},
                    "logprobs": None, "finish_reason": finish(r)}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
        obj = "chat.completion"
    else:
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": finish(r)}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
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
