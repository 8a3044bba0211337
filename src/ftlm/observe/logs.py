"""Console logging: human-readable by default, one JSON object per line on request.

Every record carries the design vocabulary: ``group``, ``rank``, and the current ``quorum_id``
and ``step`` of the process (kept in ``CONTEXT`` by the fault-tolerance manager), so that logs
of many groups can be merged and filtered like events.
"""

from __future__ import annotations

import json
import logging
import sys
import time

LOG_FORMATS = ("text", "json")

# Fields attached to every record; the manager updates quorum_id and step as they change.
CONTEXT: dict[str, object] = {"group": "", "rank": 0, "quorum_id": None, "step": None}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg and the CONTEXT fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 6), "level": record.levelname.lower(),
                 "logger": record.name, "msg": record.getMessage(), **CONTEXT}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """``HH:MM:SS [group/rank q<id> s<step>] message``: short enough to read in a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        where = f"{CONTEXT['group'] or '-'}/{CONTEXT['rank']}"
        if CONTEXT["quorum_id"] is not None:
            where += f" q{CONTEXT['quorum_id']}"
        if CONTEXT["step"] is not None:
            where += f" s{CONTEXT['step']}"
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        text = f"{stamp} [{where}] {record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def configure_logging(fmt: str = "text", group: str = "", rank: int = 0,
                      level: int = logging.INFO) -> None:
    """Route the ``ftlm`` loggers to stderr in ``fmt`` (replacing an earlier configuration)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}; valid: {', '.join(LOG_FORMATS)}")
    CONTEXT.update(group=group, rank=rank)
    logger = logging.getLogger("ftlm")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
