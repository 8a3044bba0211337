"""The coordinator's request bodies: strict JSON decoding and the validation of each endpoint's
fields, as pure functions from bytes to typed values.

Every function raises ``ValueError`` with a one-line reason that the server answers as a 400;
nothing here touches state, so a refused body changes nothing. Decoding is stricter than
``json.loads``: the body must be UTF-8 (no UTF-16/32 guessing, no BOM), nesting is bounded,
``NaN``/``Infinity`` and numbers beyond the float range are refused (they would be sent on as
non-standard JSON that browsers cannot parse), and a key given twice is refused (two parsers
reading the same body must never disagree on what it says).

Not responsible for: HTTP (auth, content types, sizes: ``ftlm.ft.coordinator``), or whether a
claim is plausible given the job's state (``ftlm.ft.quorum`` validates claims against it).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from ftlm.ft.history import GENESIS, is_chain
from ftlm.ft.quorum import MAX_CLAIM, MAX_WATCH

__all__ = ["ClientBodies", "HeartbeatBody", "MemberBody", "QuorumBody", "decode_body", "parse_heartbeat",
           "parse_kill", "parse_member", "parse_quorum_request"]

MAX_DEPTH = 32
"""Deepest nesting of arrays and objects accepted in a body (the protocol needs 3)."""
MAX_TIMEOUT = 1e9
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_NAME_RULE = "1-64 letters, digits, '_', '.' or '-' (no ':')"
_MAX_TEXT = 200
_DIGEST = re.compile(r"[0-9a-f]{32,64}")
_REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}:[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass
class QuorumBody:
    group: str
    incarnation: str
    step: int
    last_quorum_id: int
    failed: bool
    meta: dict[str, Any]
    timeout: float
    chain: str
    watch: tuple[str, ...] = ()
    disk_checked: int = -1
    disk_round: int = 0
    integrity: tuple[int, str, str] | None = None


@dataclass
class HeartbeatBody:
    group: str
    incarnation: str
    step: int
    quorum_id: int
    chain: str
    progress_age: float
    known_head: int


@dataclass
class MemberBody:
    """A leave or a reported death: which replica, and why."""

    group: str
    incarnation: str
    reason: str
    at: tuple[int, str] | None = None
    """A leave's state (step, chain): where the group finished (None: not said)."""


# ------------------------------------------------------------------------------------- decoding


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send finite numbers only")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is beyond the range of a float")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for key, value in pairs:
        if key in body:
            raise ValueError(f"key {key[:40]!r} appears more than once")
        body[key] = value
    return body


def _depth(value: Any) -> int:
    """Nesting depth of arrays and objects, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float,
                            object_pairs_hook=_no_duplicates)
"""One strict decoder for every body (``json.loads`` with hooks builds a new one per call)."""


def decode_body(raw: bytes) -> Any:
    """Strict JSON of a request body; ``ValueError`` naming the problem otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"body is not UTF-8 (byte {e.start}); send UTF-8 JSON") from None
    try:
        body = _DECODER.decode(text)
    except RecursionError:
        raise ValueError(f"body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, the int digit limit and the hooks' own errors
        raise ValueError(f"body is not valid JSON: {_one_line(str(e))}") from None
    # Nesting cannot exceed the opening brackets (a count is far cheaper than the walk: the walk
    # was 6% of the coordinator's time at 1,000 groups).
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth(body) > MAX_DEPTH:
        raise ValueError(f"body nests deeper than {MAX_DEPTH} levels")
    return body


def _one_line(text: str, limit: int = 160) -> str:
    return " ".join(text.split())[:limit]


# --------------------------------------------------------------------------------------- fields


def _show(value: Any) -> str:
    """A bounded, one-line rendering of a bad value for an error message."""
    if isinstance(value, str):
        return _one_line(repr(value[:80]), 90)
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return _one_line(text[:200], 80)


def _field(body: Any, name: str) -> Any:
    if not isinstance(body, dict):
        raise ValueError(f"body must be a JSON object, got {type(body).__name__}")
    if name not in body:
        raise ValueError(f"missing field {name!r}")
    return body[name]


def _name_field(body: Any, name: str) -> str:
    value = _field(body, name)
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"{name}={_show(value)} must be {_NAME_RULE}")
    return value


def _text_field(body: Any, name: str, default: str = "") -> str:
    value = body.get(name, default) if isinstance(body, dict) else default
    if not isinstance(value, str) or len(value) > _MAX_TEXT or not value.isprintable():
        raise ValueError(f"{name} must be a string of at most {_MAX_TEXT} printable characters "
                         f"(no line breaks or control characters)")
    return value


def _int_field(body: Any, name: str, lowest: int) -> int:
    value = _field(body, name)
    if not isinstance(value, int) or isinstance(value, bool) or not lowest <= value <= MAX_CLAIM:
        raise ValueError(f"{name}={_show(value)} must be an integer in [{lowest}, 2**53]")
    return value


def _seconds_field(value: Any, name: str, *, zero_ok: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (0 <= value if zero_ok else 0 < value) and value < MAX_TIMEOUT
    if not ok:
        bound = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"{name}={_show(value)} must be a number of seconds {bound} and below 1e9")
    return float(value)


def _chain_field(body: Any) -> str:
    value = body.get("chain", GENESIS) if isinstance(body, dict) else GENESIS
    if not is_chain(value):
        raise ValueError(f"chain={_show(value)} must be 64 lowercase hex digits")
    return value


# ------------------------------------------------------------------------------------ endpoints


def parse_heartbeat(body: Any) -> HeartbeatBody:
    """``POST /v1/heartbeat``: {group, incarnation, step, quorum_id[, chain, progress_age, known_head]}."""
    group, incarnation = _name_field(body, "group"), _name_field(body, "incarnation")
    step, quorum_id = _int_field(body, "step", 0), _int_field(body, "quorum_id", -1)
    chain = _chain_field(body)
    age = _seconds_field(body.get("progress_age", 0.0), "progress_age", zero_ok=True)
    known_head = _int_field(body, "known_head", 0) if "known_head" in body else 0
    return HeartbeatBody(group, incarnation, step, quorum_id, chain, age, known_head)


def parse_quorum_request(body: Any) -> QuorumBody:
    """``POST /v1/quorum``: {group, incarnation, step, last_quorum_id, failed, meta, timeout[, chain, watch,
    disk_checked, disk_round, integrity]}."""
    group, incarnation = _name_field(body, "group"), _name_field(body, "incarnation")
    step, last_quorum_id = _int_field(body, "step", 0), _int_field(body, "last_quorum_id", -1)
    failed, meta = _field(body, "failed"), _field(body, "meta")
    if not isinstance(failed, bool):
        raise ValueError(f"failed={_show(failed)} must be true or false")
    if not isinstance(meta, dict):
        raise ValueError(f"meta must be a JSON object, got {type(meta).__name__}")
    timeout = _seconds_field(_field(body, "timeout"), "timeout", zero_ok=False)
    disk_checked = _int_field(body, "disk_checked", -1) if "disk_checked" in body else -1
    disk_round = _int_field(body, "disk_round", 0) if "disk_round" in body else 0
    return QuorumBody(group, incarnation, step, last_quorum_id, failed, meta, timeout, _chain_field(body),
                      _watch_field(body), disk_checked, disk_round, _integrity_field(body))


def _integrity_field(body: dict[str, Any]) -> tuple[int, str, str] | None:
    """``integrity``: {step, chain, digest}, the digest of the state the group held at
    ``(step, chain)`` (``ftlm.ft.quorum.integrity``)."""
    if "integrity" not in body:
        return None
    value = body["integrity"]
    if not isinstance(value, dict) or set(value) != {"step", "chain", "digest"}:
        raise ValueError(f"integrity={_show(value)} must be an object with exactly step, chain and digest")
    digest = value["digest"]
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ValueError(f"integrity.digest={_show(digest)} must be 32 to 64 lowercase hex digits")
    return _int_field(value, "step", 0), _chain_field(value), digest


def _watch_field(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("watch", [])
    if (not isinstance(value, list) or len(value) > MAX_WATCH
            or not all(isinstance(r, str) and _REPLICA_ID.fullmatch(r) for r in value)):
        raise ValueError(f"watch={_show(value)} must be a list of at most {MAX_WATCH} replica ids "
                         "('<group>:<incarnation>')")
    return tuple(dict.fromkeys(value))


def parse_member(body: Any) -> MemberBody:
    """``POST /v1/leave`` and ``POST /v1/dead``: {group, incarnation[, reason][, step, chain]}
    (a leave's step and chain: the state it finished at)."""
    group, incarnation = _name_field(body, "group"), _name_field(body, "incarnation")
    at = (_int_field(body, "step", 0), _chain_field(body)) if isinstance(body, dict) and "step" in body else None
    return MemberBody(group, incarnation, _text_field(body, "reason"), at)


def parse_kill(body: Any) -> str:
    """``POST /v1/kill``: {group}; returns the group."""
    return _name_field(body, "group")


# ------------------------------------------------------------------ the client's own bodies, fast

_F_NAME = rb"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_F_STEP = rb"0|[1-9][0-9]{0,15}"
_F_ID = rb"-1|0|[1-9][0-9]{0,15}"
_F_NUMBER = rb"-?(?:0|[1-9][0-9]{0,30})(?:\.[0-9]{1,30})?(?:[eE][-+]?[0-9]{1,3})?"
_F_CHAIN = rb"[0-9a-f]{64}"
_F_REPLICA = rb'"' + _F_NAME + rb":" + _F_NAME + rb'"'
_FAST_QUORUM = re.compile(
    rb'\{"group": "(' + _F_NAME + rb')", "incarnation": "(' + _F_NAME + rb')", "step": (' + _F_STEP
    + rb'), "last_quorum_id": (' + _F_ID + rb'), "failed": (true|false), "meta": (\{.*\}), "timeout": ('
    + _F_NUMBER + rb'), "chain": "(' + _F_CHAIN + rb')"(?:, "watch": \[((?:' + _F_REPLICA + rb'(?:, '
    + _F_REPLICA + rb')*)?)\])?(?:, "disk_checked": (' + _F_ID + rb'))?\}', re.S)
_FAST_HEARTBEAT = re.compile(
    rb'\{"group": "(' + _F_NAME + rb')", "incarnation": "(' + _F_NAME + rb')", "step": (' + _F_STEP
    + rb'), "quorum_id": (' + _F_ID + rb'), "chain": "(' + _F_CHAIN + rb')", "progress_age": ('
    + _F_NUMBER + rb'), "known_head": (' + _F_STEP + rb')\}')


class ClientBodies:
    """Heartbeat and quorum bodies from bytes, fast for the bytes ``CoordinatorClient`` sends
    (the general strict decoding was about a fifth of the coordinator's time per
    message at 2,000 groups).

    The client's bodies are ``json.dumps`` of its dicts: the keys always in the same order, the
    names and the chain plain ASCII. A body of exactly that form is cut by one compiled pattern;
    its ``meta`` object is decoded strictly (``decode_body``) the first time its bytes are seen
    and reused after (a group sends the same ``meta`` every step). Everything else (another key
    order, spacing or escape, a value out of range, a body that is not JSON) takes the general
    path, ``parse_*(decode_body(raw))``, which gives its answer or its error. So each body gets the
    value, or the error, of the general path: a body the pattern accepts is a JSON object with
    exactly those keys once each (the meta it encloses was decoded on its own and the pattern fixes
    the rest), and the range checks below are the general path's. The meta dicts are shared by
    the requests that sent the same bytes: read-only, as every request's fields.
    """

    META_CACHE = 4096
    """Distinct meta objects kept (about one per group); the cache starts over beyond."""

    def __init__(self) -> None:
        self._meta: dict[bytes, dict[str, Any]] = {}

    def quorum(self, raw: bytes) -> QuorumBody:
        """``parse_quorum_request(decode_body(raw))``; ``ValueError`` as it."""
        fast = self._quorum(raw)
        return fast if fast is not None else parse_quorum_request(decode_body(raw))

    def heartbeat(self, raw: bytes) -> HeartbeatBody:
        """``parse_heartbeat(decode_body(raw))``; ``ValueError`` as it."""
        fast = _heartbeat(raw)
        return fast if fast is not None else parse_heartbeat(decode_body(raw))

    def _quorum(self, raw: bytes) -> QuorumBody | None:
        m = _FAST_QUORUM.fullmatch(raw)
        if m is None:
            return None
        group, incarnation, step, last_id, failed, meta_raw, timeout, chain, watch, disk = m.groups()
        step_n, last_n, seconds = int(step), int(last_id), float(timeout)
        disk_n = int(disk) if disk is not None else -1
        if step_n > MAX_CLAIM or last_n > MAX_CLAIM or disk_n > MAX_CLAIM or not 0 < seconds < MAX_TIMEOUT:
            return None
        meta = self._meta.get(meta_raw)
        if meta is None:
            meta = _meta_object(meta_raw)
            if meta is None:
                return None
            if len(self._meta) >= self.META_CACHE:
                self._meta.clear()
            self._meta[meta_raw] = meta
        replicas: tuple[str, ...] = ()
        if watch:
            names = watch.decode("ascii")[1:-1].split('", "')
            if len(names) > MAX_WATCH:
                return None
            replicas = tuple(dict.fromkeys(names))
        return QuorumBody(group.decode("ascii"), incarnation.decode("ascii"), step_n, last_n,
                          failed == b"true", meta, seconds, chain.decode("ascii"), replicas, disk_n)


def _heartbeat(raw: bytes) -> HeartbeatBody | None:
    m = _FAST_HEARTBEAT.fullmatch(raw)
    if m is None:
        return None
    group, incarnation, step, quorum_id, chain, age, known_head = m.groups()
    step_n, id_n, age_s, head_n = int(step), int(quorum_id), float(age), int(known_head)
    if step_n > MAX_CLAIM or id_n > MAX_CLAIM or head_n > MAX_CLAIM or not 0 <= age_s < MAX_TIMEOUT:
        return None
    return HeartbeatBody(group.decode("ascii"), incarnation.decode("ascii"), step_n, id_n,
                         chain.decode("ascii"), age_s, head_n)


def _meta_object(raw: bytes) -> dict[str, Any] | None:
    """``raw`` strictly decoded if it is a JSON object that may sit one level down in a body."""
    try:
        meta = decode_body(raw)
    except ValueError:
        return None
    if not isinstance(meta, dict):
        return None
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH - 1 and _depth(meta) > MAX_DEPTH - 1:
        return None
    return meta
