"""Console logs: human-readable by default, JSON lines with the design vocabulary on request."""

from __future__ import annotations

import json
import logging

import pytest

from ftlm.config import build_config
from ftlm.errors import ConfigError
from ftlm.observe.logs import CONTEXT, configure_logging


@pytest.fixture(autouse=True)
def restore_context():
    saved = dict(CONTEXT)
    yield
    CONTEXT.clear()
    CONTEXT.update(saved)
    configure_logging("text")


def test_json_lines_carry_group_rank_quorum_and_step(capsys):
    configure_logging("json", group="g3", rank=1)
    CONTEXT.update(quorum_id=7, step=42)
    logging.getLogger("ftlm.ft.manager").warning("step %d failed: %s", 42, "peer reset")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    entry = json.loads(line)
    assert entry["msg"] == "step 42 failed: peer reset"
    assert (entry["group"], entry["rank"], entry["quorum_id"], entry["step"]) == ("g3", 1, 7, 42)
    assert entry["level"] == "warning" and entry["logger"] == "ftlm.ft.manager"


def test_text_is_the_default_and_reads_like_a_console(capsys):
    configure_logging("text", group="g0", rank=0)
    CONTEXT.update(quorum_id=2, step=5)
    logging.getLogger("ftlm.train").info("step 5/10 loss 1.0")
    err = capsys.readouterr().err
    assert "[g0/0 q2 s5] info: step 5/10 loss 1.0" in err
    with pytest.raises(json.JSONDecodeError):
        json.loads(err.strip())


def test_unknown_log_format_is_refused():
    with pytest.raises(ConfigError, match="observe.log_format='xml'"):
        build_config({"observe": {"log_format": "xml"}})
