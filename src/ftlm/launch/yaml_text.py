"""A small YAML writer for manifests: dicts, lists, strings, numbers and booleans, nothing else.

ftlm does not depend on a YAML library at run time; manifests are plain data, and this writer
emits the block style ``kubectl`` users expect. Strings are written double-quoted (JSON escapes are
valid YAML), except multi-line text (a config file, a script), which becomes a literal block.
It does not parse YAML.
"""

from __future__ import annotations

import json
from typing import Any


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as YAML")


def _literal(value: Any) -> bool:
    """Whether a string reads better (and stays exact) as a ``|`` block."""
    if not isinstance(value, str) or "\n" not in value.rstrip("\n"):
        return False
    # A block cannot carry these exactly; JSON quoting can.
    return (value.endswith("\n") and not value.endswith("\n\n") and not value[0].isspace()
            and "\r" not in value and all(c == "\n" or c == "\t" or c >= " " for c in value))


def _lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            return [pad + "{}"]
        out = []
        for key, item in value.items():
            head = f"{pad}{_scalar(str(key)) if not _plain_key(key) else key}:"
            out.extend(_entry(head, item, indent))
        return out
    if isinstance(value, list):
        if not value:
            return [pad + "[]"]
        out = []
        for item in value:
            sub = _lines(item, indent + 2)
            if isinstance(item, (dict, list)) and item:
                out.append(pad + "- " + sub[0][indent + 2:])
                out.extend(sub[1:])
            else:
                out.append(pad + "- " + sub[0].lstrip())
        return out
    return [pad + _scalar(value)]


def _entry(head: str, item: Any, indent: int) -> list[str]:
    if _literal(item):
        body = [(" " * (indent + 2) + line) if line else "" for line in item[:-1].split("\n")]
        return [head + " |"] + body
    if isinstance(item, dict) and item:
        return [head] + _lines(item, indent + 2)
    if isinstance(item, list) and item:
        return [head] + _lines(item, indent)
    return [head + " " + _lines(item, 0)[0]]


def _plain_key(key: Any) -> bool:
    return isinstance(key, str) and key.replace("-", "").replace("_", "").replace(
        ".", "").replace("/", "").isalnum() and not key[0].isdigit()


def dump_yaml(obj: Any) -> str:
    """One YAML document for ``obj``."""
    return "\n".join(_lines(obj, 0)) + "\n"

