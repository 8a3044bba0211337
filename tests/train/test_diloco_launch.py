"""DiLoCo under ``ftlm launch local --groups 3`` with failures: a group killed at an outer
synchronisation and random kills during the inner steps (chaos, slow tier). Every
run ends with the invariants of every fault test: identical outer states, each sample trained in
exactly one committed outer step, no committed step lost."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ftlm.launch.local import LocalLauncher
from ftlm.observe.events import read_events

sys.path.insert(0, str(Path(__file__).parents[1] / "launch"))
from test_fault_tolerance import ALL_IN_FIRST_QUORUM, check_invariants, injected  # noqa: E402
from test_script import SESSION_SCRIPT, make_config  # noqa: E402

DILOCO = {"sync": "diloco", "diloco_inner_steps": 4}


def _run(tmp_path: Path, steps: int, ft: dict, **launcher) -> tuple[dict, list[dict]]:
    script = tmp_path / "my_train.py"
    script.write_text(SESSION_SCRIPT)
    config = make_config(tmp_path / "run", steps=steps, ft={**ALL_IN_FIRST_QUORUM, **ft})
    config.checkpoint.resume = False  # a restarted group catches up from a live peer
    summary = LocalLauncher(config, groups=3, progress=False, script=script, **launcher).run()
    return summary, read_events(config.run.path / "events.jsonl")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_group_killed_at_an_outer_sync_is_left_out_and_recovers_the_outer_state(tmp_path):
    """Four processes importing torch: minutes on the shared 2-core box. The default tier covers
    the path: tests/train/test_diloco.py (a group's phases, fragments, wire dtypes) and
    tests/train/test_session.py (a Session group killed and recovered from a peer)."""
    steps = 30
    summary, events = _run(tmp_path, steps, DILOCO, faults={"g1": ["before_allreduce@3+"]})
    assert injected(events, "g1") == ["before_allreduce"]
    check_invariants(summary, events, 3, steps=steps)
    commits = [e for e in events if e["kind"] == "commit"]
    # Each outer step commits its inner steps' samples: participants x H x batch.
    assert all(e["samples"][1] - e["samples"][0] == e["participants"] * 4 * 4 for e in commits)
    assert any(e["kind"] == "recovery_end" and e["group"] == "g1" for e in events)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # four processes importing torch, restarts: minutes on a loaded box
def test_streaming_int8_groups_under_chaos_end_identical_with_each_sample_once(tmp_path):
    """Random kills, most of them during inner steps. The default tier covers the path with a
    planned kill (above) and tests/train/test_diloco.py's streaming, overlapped int8 group."""
    steps = 24
    ft = {**DILOCO, "diloco_inner_steps": 8, "diloco_fragments": 4, "diloco_overlap_steps": 1,
          "diloco_wire_dtype": "int8"}
    summary, events = _run(tmp_path, steps, ft, chaos_mtbf=6.0, chaos_seed=3)
    check_invariants(summary, events, 3, steps=steps)
