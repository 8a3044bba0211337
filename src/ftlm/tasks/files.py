"""Task files: tasks as JSONL or Parquet instruction data, and back.

Responsible for: writing tasks in one of two instruction-data styles that ``ftlm sft`` reads,

* ``messages``: ``{"messages": [{"role": "user", "content": PROMPT},
  {"role": "assistant", "content": SOLUTION}], ...}``
* ``prompt_completion``: ``{"prompt": PROMPT, "completion": SOLUTION, ...}``

each row also carrying the task fields ``family``, ``answer``, ``key`` (so a file is also a
task list for ``ftlm eval`` and for RL rewards), as ``.jsonl`` or ``.parquet`` (chosen by the
file suffix); and reading such a file back into ``Task`` objects (``read_tasks``).

Not responsible for: generating tasks (``ftlm.tasks.suite``), chat templates or tokenisation.
Writes are atomic (a temporary file renamed into place).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from ftlm.errors import ConfigError, DataError
from ftlm.tasks.suite import Task

STYLES: tuple[str, ...] = ("messages", "prompt_completion")
SUFFIXES: tuple[str, ...] = (".jsonl", ".parquet")


def task_record(task: Task, style: str = "messages") -> dict:
    """One row of a task file in ``style`` (see the module docstring)."""
    extra = {"family": task.family, "answer": task.answer, "key": task.key}
    if style == "messages":
        return {"messages": [{"role": "user", "content": task.prompt},
                             {"role": "assistant", "content": task.solution}], **extra}
    if style == "prompt_completion":
        return {"prompt": task.prompt, "completion": task.solution, **extra}
    raise ConfigError(f"style={style!r} is not a task file style; valid: {', '.join(STYLES)}")


def write_tasks(tasks: Sequence[Task], path: Path, style: str = "messages") -> Path:
    """Write ``tasks`` to ``path`` (``.jsonl`` or ``.parquet``) in ``style``; returns ``path``."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ConfigError(f"{path}: task files end in {' or '.join(SUFFIXES)}")
    if style not in STYLES:
        raise ConfigError(f"style={style!r} is not a task file style; valid: {', '.join(STYLES)}")
    rows = [task_record(t, style) for t in tasks]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        if path.suffix == ".jsonl":
            with open(tmp, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq
            message = pa.struct([("role", pa.string()), ("content", pa.string())])
            text = ("prompt", "completion") if style == "prompt_completion" else ()
            schema = pa.schema(([("messages", pa.list_(message))] if style == "messages" else [])
                               + [(c, pa.string()) for c in (*text, "family", "answer", "key")])
            table = pa.Table.from_pylist(rows, schema=schema)
            pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _row_to_task(row: dict, where: str) -> Task:
    if "messages" in row:
        messages = row["messages"]
        if not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
            raise DataError(f"{where}: messages must be a list of {{role, content}} objects")
        by_role = {m.get("role"): m.get("content") for m in reversed(messages)}
        if "user" not in by_role:
            raise DataError(f"{where}: messages hold no user turn (the task's prompt)")
        row = {**row, "prompt": by_role["user"], "solution": by_role.get("assistant", "")}
    elif "completion" in row:
        row = {**row, "solution": row["completion"]}
    try:
        return Task.from_dict(row)
    except ConfigError as e:
        raise DataError(f"{where}: {e}") from None


def read_tasks(path: Path) -> list[Task]:
    """The tasks of a file written by ``write_tasks`` (either style, either format)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"task file {path} not found; write one with `ftlm tasks write --out {path}`")
    if path.suffix == ".jsonl":
        tasks = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{number}: not JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{number}: a task row must be a JSON object")
                tasks.append(_row_to_task(row, f"{path}:{number}"))
        return tasks
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise DataError(f"{path}: not a readable Parquet file ({e})") from None
        return [_row_to_task(row, f"{path} row {i}") for i, row in enumerate(rows)]
    raise DataError(f"{path}: task files end in {' or '.join(SUFFIXES)}")
