"""The event log: format, concurrency across threads and processes, tolerant reading."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading

import pytest

from ftlm.errors import DataError
from ftlm.observe.events import EventLog, NullEvents, read_events

WRITER = """
import sys
from pathlib import Path
from ftlm.observe.events import EventLog
path, group, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
with EventLog(path, group=group, rank=0) as log:
    for i in range(n):
        # 3 KB of padding makes interleaving visible if lines were not written atomically.
        log.emit("commit", i, samples=[i, i + 1], tokens=1, loss=1.0, pad=group * 3000)
"""


def test_emit_writes_one_json_object_per_line_with_contract_fields(tmp_path):
    path = tmp_path / "run" / "events.jsonl"
    with EventLog(path, group="g1", rank=2) as log:
        written = log.emit("commit", 0, quorum_id=3, participants=2, samples=[0, 16], loss=2.5,
                           tokens=4096, lr=1e-3, step_seconds=0.2)
        log.emit("member_dead", -1, target="g2:abc")
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first == written
    assert {k: first[k] for k in ("kind", "group", "rank", "step", "samples", "tokens")} == {
        "kind": "commit", "group": "g1", "rank": 2, "step": 0, "samples": [0, 16], "tokens": 4096}
    assert isinstance(first["ts"], float)
    assert read_events(path)[1]["target"] == "g2:abc"


def test_non_finite_loss_is_written_as_null_so_the_line_stays_strict_json(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path, group="g") as log:
        log.emit("commit", 0, loss=math.nan, lr=math.inf, samples=(0, 4), tokens=1)
    line = path.read_text()
    assert "NaN" not in line and "Infinity" not in line
    event = read_events(path)[0]
    assert event["loss"] is None and event["lr"] is None and event["samples"] == [0, 4]


def test_emit_rejects_fields_the_log_owns_and_non_int_steps(tmp_path):
    with EventLog(tmp_path / "events.jsonl") as log:
        with pytest.raises(ValueError, match="ts"):
            log.emit("commit", 0, ts=1.0)
        with pytest.raises(ValueError, match="step"):
            log.emit("commit", "3")
        with pytest.raises(TypeError, match="object"):
            log.emit("commit", 0, payload=object())
    assert (tmp_path / "events.jsonl").read_text() == ""


def test_emit_after_close_raises(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    log.close()
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.emit("run_end", -1)


def test_null_events_returns_the_record_and_writes_nothing(tmp_path):
    with NullEvents(group="g", rank=1) as log:
        record = log.emit("quorum", 4, quorum_id=7)
    assert record["kind"] == "quorum" and record["group"] == "g" and record["quorum_id"] == 7
    assert list(tmp_path.iterdir()) == []


def test_threads_sharing_one_log_never_interleave_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path, group="g") as log:
        def work(t: int) -> None:
            for i in range(200):
                log.emit("quorum", i, thread=t, pad="x" * 2000)
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
    events = read_events(path)
    assert len(events) == 800
    for t in range(4):
        assert [e["step"] for e in events if e["thread"] == t] == list(range(200))


def test_processes_appending_to_one_file_give_every_line_intact(tmp_path):
    path = tmp_path / "events.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), g, "300"])
             for g in ("a", "b", "c")]
    try:
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert codes == [0, 0, 0]
    raw = path.read_bytes()
    assert raw.count(b"\n") == 900
    events = read_events(path)
    assert len(events) == 900
    for g in ("a", "b", "c"):
        mine = [e for e in events if e["group"] == g]
        assert [e["step"] for e in mine] == list(range(300))
        assert all(e["pad"] == g * 3000 for e in mine)


def test_truncated_last_line_is_dropped(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path, group="g") as log:
        log.emit("commit", 0, samples=[0, 1], tokens=1)
        log.emit("commit", 1, samples=[1, 2], tokens=1)
    with open(path, "ab") as f:
        f.write(b'{"ts": 1.0, "kind": "comm')  # killed mid-write
    assert [e["step"] for e in read_events(path)] == [0, 1]


def test_garbage_in_the_middle_raises_naming_the_line(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path, group="g") as log:
        log.emit("commit", 0, samples=[0, 1], tokens=1)
    with open(path, "ab") as f:
        f.write(b"not json at all\n")
    with EventLog(path, group="g") as log:
        log.emit("commit", 1, samples=[1, 2], tokens=1)
    with pytest.raises(DataError, match=r"events.jsonl:2"):
        read_events(path)


def test_unterminated_garbage_followed_by_nothing_else_is_tolerated_but_not_mid_file(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"ts": 1, "kind": "x", "group": "", "step": 0}\n{"ts": 2, "ki\n'
                     b'{"ts": 3, "kind": "x", "group": "", "step": 1}\n')
    with pytest.raises(DataError, match=":2"):
        read_events(path)


def test_lines_without_contract_fields_or_not_objects_are_rejected(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"ts": 1, "kind": "commit", "step": 0}\n')
    with pytest.raises(DataError, match="group"):
        read_events(path)
    path.write_text('[1, 2]\n')
    with pytest.raises(DataError, match="JSON object"):
        read_events(path)


def test_missing_event_log_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no event log"):
        read_events(tmp_path / "events.jsonl")
