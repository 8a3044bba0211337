"""Fuzzing the run config (docs/design.md, 'Testing'): any input is a valid config or a ConfigError.

Three inputs reach ``build_config`` from outside: ``--set section.key=value`` strings, the tables
of a parsed TOML file, and the bytes of the file itself. Properties: no exception other than a
one-line ``ConfigError``; every float of an accepted config is finite and every string holds no
NUL and is valid UTF-8; the sections an input changed survive the TOML round trip of
``save_config``.

Inputs are biased towards the real section and key names and towards the values that broke the
config before (inf, nan, integers beyond the float range, lone surrogates from undecodable argv
bytes, NUL characters). Each example is one hypothesis ``binary`` draw that :class:`Choices`
turns into an input (as libFuzzer's FuzzedDataProvider does): a draw per choice would cost
several times more, and shrinking the bytes still shrinks the input (shorter, earlier menu
entries). Three tests of ``FTLM_FUZZ_EXAMPLES`` examples each (default 2000, the ``fuzz``
profile of tests/conftest.py); a failure prints the decoded input.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import tomllib
import typing
from pathlib import Path

import pytest
import tomli_w
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

from ftlm.config import RunConfig, build_config, load_config
from ftlm.errors import ConfigError
from ftlm.testing import fuzz

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(parent=settings.get_profile("fuzz"))
BYTES = st.binary(min_size=1, max_size=160)

FIELDS: dict[str, list[str]] = {
    f.name: [g.name for g in dataclasses.fields(typing.get_type_hints(RunConfig)[f.name])]
    for f in dataclasses.fields(RunConfig)}
"""Every section of the run config and its keys."""
DEFAULT = RunConfig()

JUNK_NAMES = ["", "x", "trian", "Train", "train.x", " train", "ft ", "\n", "\u00e9", "\0", "1"]
SECTIONS = sorted(FIELDS) + JUNK_NAMES
TARGETS = [f"{s}.{k}" for s, keys in FIELDS.items() for k in keys] + [
    "trian.steps", "train.stpes", "train", ".steps", "train.", "", "a.b.c", "train..steps",
    " train . steps ", "\n.\n", "ft.heartbeat_interval.x"]
"""``section.key`` of every field, then misspellings and malformed names."""
SEPARATORS = ["=", "=", "=", " = ", "==", "", "=\n"]
SPECIAL_TEXT = [
    "inf", "-inf", "+inf", "nan", "NaN", "-nan", "Infinity", "1e400", "-1e400", "1e-400", "-0",
    "0", "1", "-1", "0.5", "1.0", "2", "64", "1024", "65536", "0x10", "1_000", "9" * 400,
    "true", "false", "yes", "no", "none", "None", "", " ", "cosine", "wsd", "constant", "sqrt",
    "linear", "auto", "cpu", "cuda", "float32", "bfloat16", "tiny", "small", "json", "text",
    "a,b", "k=v,x=y", "nvidia.com/gpu:NoSchedule", "=", "..", "/", "a/b", "\0", "\udcff",
    "caf\u00e9", "24:00:00", "16Gi", "127.0.0.1", "0.0.0.0", "a\nb"]
SPECIAL_NUMBERS = [0, 1, -1, 2, 0.5, 1e-8, 2**31, 2**63, 2**64, -(2**63) - 1, 10**400, -(10**400),
                   math.inf, -math.inf, math.nan, 1e308, 5e-324, -0.0]
ALPHABET = list("abcxyz019 .=,-+_/e:[]\"'\\") + ["\0", "\n", "\t", "\u00e9", "\udcff", "\ud800",
                                                 "\U0001f642", "\u2028", "\x7f"]


class Choices(fuzz.Choices):
    """``ftlm.testing.fuzz.Choices`` with this file's menus."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data, alphabet=ALPHABET, numbers=SPECIAL_NUMBERS)

    def value_text(self) -> str:
        kind = self.below(4)
        if kind == 0:
            return str(self.number())
        if kind == 1:
            return self.text(10)
        return self.pick(SPECIAL_TEXT)

    def toml_value(self, depth: int = 0):
        kind = self.below(10)
        if kind == 0:
            return None
        if kind == 1:
            return self.below(2) == 1
        if kind in (2, 3):
            return self.number()
        if kind in (4, 5):
            return self.pick(SPECIAL_TEXT)
        if kind == 6:
            return self.text(8)
        if depth >= 2:
            return self.pick(SPECIAL_TEXT)
        if kind in (7, 8):
            return [self.toml_value(depth + 1) for _ in range(self.below(4))]
        return {self.pick(["key", "value", "effect", "operator", "x", ""]): self.toml_value(depth + 1)
                for _ in range(self.below(3))}


def overrides_from(c: Choices) -> list[str]:
    """1 to 4 ``--set`` arguments: mostly ``section.key=value`` with real names, some noise."""
    out = []
    for _ in range(1 + c.below(4)):
        if c.below(16) == 0:
            out.append(c.text(30))
        else:
            out.append(c.pick(TARGETS) + c.pick(SEPARATORS) + c.value_text())
    return out


def raw_from(c: Choices) -> dict:
    """A parsed-TOML-like dict: real sections and keys (some misspelt) with values of any type."""
    raw: dict = {}
    for _ in range(c.below(4)):
        section = c.pick(SECTIONS)
        if c.below(10) == 0:
            raw[section] = c.toml_value()  # a section that is not a table
            continue
        body = raw[section] if isinstance(raw.get(section), dict) else {}
        raw[section] = body
        keys = FIELDS.get(section, []) + JUNK_NAMES[:3]
        for _ in range(1 + c.below(3)):
            body[c.pick(keys)] = c.toml_value()
    return raw


VALID_TOML = (b'[run]\nname = "fz"\nseed = 3\n\n[model]\nsize = "tiny"\ndim = 96\n\n'
              b'[train]\nsteps = 50\nlr = 1e-3\nschedule = "wsd"\n\n[ft]\njoin_timeout = 2.0\n')
TOML_CHUNKS = [b"inf", b"nan", b"-inf", b"\xe9", b"\xff\xfe", b"\\ud800", b"\\u0000", b"\x00",
               b"\n[train]\n", b"\n[trian]\n", b"=", b'"', b"[", b"1e999", b"99999999999999999999"]


def toml_bytes_from(c: Choices) -> bytes:
    """A valid config file with 1 to 3 chunks overwritten, inserted or cut; sometimes noise."""
    if c.below(10) == 0:
        return c.raw(c.below(80))
    data = bytearray(VALID_TOML)
    for _ in range(1 + c.below(3)):
        at = c.below(len(data) + 1)
        chunk = c.pick(TOML_CHUNKS) if c.below(2) else c.raw(1 + c.below(4))
        action = c.below(3)
        if action == 0:
            data[at:at + len(chunk)] = chunk
        elif action == 1:
            data[at:at] = chunk
        else:
            del data[at:at + len(chunk)]
    return bytes(data)


def _check_accepted(cfg: RunConfig) -> None:
    """Properties of every config the validation lets through."""
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), f.name)
            if isinstance(value, float):
                assert math.isfinite(value), f"{section.name}.{f.name}={value!r} accepted"
            if isinstance(value, str):
                assert "\0" not in value, f"{section.name}.{f.name}={value!r} accepted"
                value.encode("utf-8")  # a lone surrogate could not be written to config.toml
    # The sections that differ from the defaults survive the TOML round trip of save_config
    # (the defaults' own round trip is a test of tests/test_config.py).
    touched = [f.name for f in dataclasses.fields(cfg)
               if getattr(cfg, f.name) != getattr(DEFAULT, f.name)]
    if touched:
        written = {name: body for name, body in cfg.to_dict().items() if name in touched}
        again = build_config(tomllib.loads(tomli_w.dumps(written)))
        for name in touched:
            assert getattr(again, name) == getattr(cfg, name), f"[{name}] changed in TOML"


def _check_error(e: ConfigError) -> None:
    assert str(e) and "\n" not in str(e), repr(str(e))


@FUZZ
@given(BYTES)
@example(b"\x00\x01\x04\x00\x02\x16")  # model.vocab_size with 200 digits: its message overflowed a float
def test_fuzz_set_overrides_give_a_config_or_a_config_error(data: bytes) -> None:
    overrides = overrides_from(Choices(data))
    note(f"overrides={overrides!r}")
    try:
        cfg = build_config({}, overrides)
    except ConfigError as e:
        _check_error(e)
        return
    _check_accepted(cfg)


@FUZZ
@given(BYTES)
def test_fuzz_toml_tables_give_a_config_or_a_config_error(data: bytes) -> None:
    c = Choices(data)
    raw, overrides = raw_from(c), overrides_from(c) if c.below(4) == 0 else []
    note(f"raw={raw!r} overrides={overrides!r}")
    try:
        cfg = build_config(raw, overrides)
    except ConfigError as e:
        _check_error(e)
        return
    _check_accepted(cfg)


@pytest.fixture(scope="module")
def config_file():
    with tempfile.TemporaryDirectory(prefix="ftlm-config-fuzz-") as folder:
        yield Path(folder) / "run.toml"


@FUZZ
@given(data=BYTES)
def test_fuzz_config_file_bytes_give_a_config_or_a_config_error(config_file: Path,
                                                                data: bytes) -> None:
    text = toml_bytes_from(Choices(data))
    note(f"file={text!r}")
    config_file.write_bytes(text)
    try:
        cfg = load_config(config_file)
    except ConfigError as e:
        _check_error(e)
        return
    _check_accepted(cfg)
