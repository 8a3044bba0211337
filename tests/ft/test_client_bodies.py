"""The coordinator's fast decoding of the client's own bodies (``ClientBodies``): every
body gets exactly the value, or the error, of the general strict path, and the client's bodies
take the fast path."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlm.ft.client import CoordinatorClient
from ftlm.ft.coordinator_requests import (MAX_DEPTH, ClientBodies, decode_body, parse_heartbeat,
                                          parse_quorum_request)
from ftlm.ft.history import GENESIS
from ftlm.ft.quorum import MAX_CLAIM, MAX_WATCH

EXAMPLES = settings(max_examples=600, deadline=None)

names = st.one_of(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", fullmatch=True),
                  st.sampled_from(["", "-a", "a" * 65, "g:0", "g 0", "é", "a\"b", "a\\b"]))
ints = st.one_of(st.integers(-3, 3), st.integers(MAX_CLAIM - 2, MAX_CLAIM + 2), st.integers(-10**20, 10**20))
seconds = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, 0.0, 1e9, 1e9 - 1, -0.0]),
                    st.integers(-2, 10**10))
chains = st.one_of(st.just(GENESIS), st.from_regex(r"[0-9a-f]{64}", fullmatch=True),
                   st.sampled_from(["", "A" * 64, "0" * 63, "0" * 65]))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=12)
metas = st.one_of(st.dictionaries(st.text(max_size=10), json_values, max_size=4),
                  st.just({"store": "10.0.0.1:29500", "transfer": ["http://10.0.0.1:29600"], "recover_request": 0}),
                  st.just({"a": {"timeout": 1, "chain": GENESIS}, "timeout": 2.0, "chain": GENESIS}),
                  json_values)
replicas = st.one_of(st.builds(lambda g, i: f"{g}:{i}", names, names), st.sampled_from(["g", "g:", ":a", "g:a:b"]))
watches = st.one_of(st.lists(replicas, max_size=4), st.lists(st.just("g0:a"), min_size=MAX_WATCH - 1,
                                                            max_size=MAX_WATCH + 2))
# Edits that keep a body close to the client's form: spacing, escapes, brackets, digits, keys.
edits = st.lists(st.tuples(st.integers(0, 400), st.integers(0, 3),
                           st.sampled_from(['"', "\\", "{", "}", "[", "]", ",", ":", " ", "\n", "0", "9", "-",
                                            ".", "e", "a", "true", '"step": 1, ', "\\u0067", "\xe9", "\x00"])),
                 max_size=3)


def _outcome(parse: Any, raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", parse(raw)
    except ValueError as e:
        return "error", str(e)


def _strict_quorum(raw: bytes) -> Any:
    return parse_quorum_request(decode_body(raw))


def _strict_heartbeat(raw: bytes) -> Any:
    return parse_heartbeat(decode_body(raw))


def _edited(raw: bytes, changes: list[tuple[int, int, str]]) -> bytes:
    text = raw.decode("utf-8")
    for at, cut, insert in changes:
        at = at % (len(text) + 1)
        text = text[:at] + insert + text[at + cut:]
    return text.encode("utf-8")


def _client(group: str, incarnation: str) -> CoordinatorClient:
    return CoordinatorClient("http://127.0.0.1:1", group, incarnation)


@EXAMPLES
@given(group=names, incarnation=names, step=ints, last=ints, failed=st.booleans(), meta=metas,
       timeout=seconds, chain=chains, watch=watches, disk=st.one_of(st.just(-1), ints),
       disk_round=st.one_of(st.just(0), ints), changes=edits)
def test_a_quorum_body_gets_the_value_or_error_of_the_strict_path(group, incarnation, step, last, failed, meta,
                                                                   timeout, chain, watch, disk, disk_round,
                                                                   changes) -> None:
    body = _client(group, incarnation).quorum_body(step, last, failed, meta, timeout, chain, watch, disk, disk_round)
    raw = _edited(json.dumps(body).encode("utf-8"), changes)
    bodies = ClientBodies()
    assert _outcome(bodies.quorum, raw) == _outcome(_strict_quorum, raw)
    assert _outcome(bodies.quorum, raw) == _outcome(_strict_quorum, raw)  # again, its meta cached


@EXAMPLES
@given(group=names, incarnation=names, step=ints, quorum_id=ints, chain=chains, age=seconds,
       known_head=ints, changes=edits)
def test_a_heartbeat_body_gets_the_value_or_error_of_the_strict_path(group, incarnation, step, quorum_id, chain,
                                                                      age, known_head, changes) -> None:
    body = _client(group, incarnation).heartbeat_body(step, quorum_id, chain, 0.0, 0)
    body.update(progress_age=age, known_head=known_head)  # unrounded and unclamped: any value
    raw = _edited(json.dumps(body).encode("utf-8"), changes)
    assert _outcome(ClientBodies().heartbeat, raw) == _outcome(_strict_heartbeat, raw)


@pytest.mark.parametrize("watch,disk", [((), -1), (("g1:a", "g2:b", "g1:a"), 7)])
def test_the_clients_own_bodies_take_the_fast_path(watch, disk) -> None:
    client = _client("g00017", "a1b2")
    meta = {"store": "10.0.0.1:29500", "transfer": ["http://10.0.0.1:29600"], "recover_request": 3}
    bodies = ClientBodies()
    for step in (0, 1, 12345, MAX_CLAIM):
        ask = json.dumps(client.quorum_body(step, step - 1, step == 1, meta, 29.87654, "ab" * 32, watch, disk))
        fast = bodies._quorum(ask.encode())
        assert fast is not None and fast == _strict_quorum(ask.encode())
        beat = json.dumps(client.heartbeat_body(step, step - 1, "cd" * 32, 12.3456, step)).encode()
        assert ClientBodies().heartbeat(beat) == _strict_heartbeat(beat)
        from ftlm.ft.coordinator_requests import _heartbeat
        assert _heartbeat(beat) is not None
    assert len(bodies._meta) == 1  # one group, one meta: decoded once


def test_a_meta_nested_to_the_limit_of_a_body_is_judged_as_the_strict_path_does() -> None:
    client = _client("g0", "a")
    for depth in (MAX_DEPTH - 2, MAX_DEPTH - 1, MAX_DEPTH):
        meta: Any = {}
        for _ in range(depth - 1):
            meta = {"k": meta}
        raw = json.dumps(client.quorum_body(1, 0, False, meta, 5.0)).encode()
        assert _outcome(ClientBodies().quorum, raw) == _outcome(_strict_quorum, raw)


BOUNDARY_INTS = [-2, -1, 0, 1, MAX_CLAIM - 1, MAX_CLAIM, MAX_CLAIM + 1, 10**16, 10**17]
BOUNDARY_SECONDS = [-1.0, -0.0, 0, 0.0, 1e-9, 1, 1e9 - 1, 1e9, 1e9 + 1, 1e308, 10**400]


@pytest.mark.parametrize("field", ["step", "last_quorum_id", "disk_checked", "disk_round", "timeout"])
def test_a_quorum_field_at_its_bounds_is_judged_as_the_strict_path_does(field) -> None:
    values = BOUNDARY_SECONDS if field == "timeout" else BOUNDARY_INTS
    for value in values:
        body = _client("g0", "a").quorum_body(5, 4, False, {"k": 1}, 5.0, GENESIS, (), 3)
        body[field] = value
        raw = json.dumps(body).encode()
        assert _outcome(ClientBodies().quorum, raw) == _outcome(_strict_quorum, raw), (field, value)


@pytest.mark.parametrize("field", ["step", "quorum_id", "known_head", "progress_age"])
def test_a_heartbeat_field_at_its_bounds_is_judged_as_the_strict_path_does(field) -> None:
    values = BOUNDARY_SECONDS if field == "progress_age" else BOUNDARY_INTS
    for value in values:
        body = _client("g0", "a").heartbeat_body(5, 4, GENESIS, 0.5, 5)
        body[field] = value
        raw = json.dumps(body).encode()
        assert _outcome(ClientBodies().heartbeat, raw) == _outcome(_strict_heartbeat, raw), (field, value)


@pytest.mark.parametrize("size", [0, 1, MAX_WATCH - 1, MAX_WATCH, MAX_WATCH + 1, MAX_WATCH + 2])
def test_a_watch_list_at_its_bound_is_judged_as_the_strict_path_does(size) -> None:
    watch = [f"g{i % 7}:a" for i in range(size)]  # with repeats: the strict path keeps the first of each
    raw = json.dumps(_client("g0", "a").quorum_body(5, 4, False, {}, 5.0, GENESIS, watch)).encode()
    assert _outcome(ClientBodies().quorum, raw) == _outcome(_strict_quorum, raw)
