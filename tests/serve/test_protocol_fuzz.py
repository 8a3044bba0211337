"""Fuzzing request validation: whatever JSON a client sends, ``parse_request`` returns a
``Request`` or raises an ``APIError`` with a 4xx status, never another exception.

Examples per test: a tenth of ``FTLM_FUZZ_EXAMPLES`` (the ``fuzz`` profile of tests/conftest.py;
200 by default): the parser is plain Python, a longer fuzz is one environment variable away.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlm.serve.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    APIError,
    Request,
    parse_request,
)

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(parent=settings.get_profile("fuzz"),
                max_examples=max(50, settings.get_profile("fuzz").max_examples // 10))

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 70),
                    st.sampled_from([2**63, -2**63, 10**30]),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                    st.sampled_from(["tiny", "self-consistency", "user", "system", "text"]))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage", "x"]),
                    inner, max_size=3)), max_leaves=12)
KEYS = st.sampled_from(sorted(COMPLETION_FIELDS | CHAT_FIELDS | {"bogus"}))


def _check(body, kind: str) -> None:
    try:
        req = parse_request(body, kind, "tiny", max_n=4, default_max_tokens=16)
    except APIError as e:
        assert 400 <= e.status < 500 and e.message
        assert set(e.body()["error"]) == {"message", "type", "param", "code"}
        return
    assert isinstance(req, Request) and 1 <= req.n <= 4 and req.model == "tiny"
    assert req.prompts and all(p for p in req.prompts) or kind == "chat"


@FUZZ
@given(body=st.dictionaries(KEYS, JSON, max_size=6), kind=st.sampled_from(["completion", "chat"]))
def test_any_json_object_is_a_request_or_a_4xx(body, kind):
    _check(body, kind)


@FUZZ
@given(body=st.fixed_dictionaries({"model": st.just("tiny"), "prompt": JSON,
                                   "messages": JSON}, optional={k: JSON for k in (
                                       "n", "max_tokens", "temperature", "top_p", "top_k",
                                       "min_p", "stop", "seed", "stream", "strategy")}),
       kind=st.sampled_from(["completion", "chat"]))
def test_near_valid_requests_are_a_request_or_a_4xx(body, kind):
    body.pop("messages" if kind == "completion" else "prompt")
    _check(body, kind)


@FUZZ
@given(body=JSON)
def test_any_json_value_is_a_request_or_a_4xx(body):
    _check(body, "completion")
