"""The examples of ``examples/`` run as a user runs them: under ``ftlm launch local`` with chaos.

Each job must end as fault-tolerant training promises, whatever the chaos hit: one final state
hash per group and all of them equal, every sample trained exactly once (0 duplicates, 0 gaps),
the job's last step committed, and a loss that fell. The chaos schedule is seeded; which step a
failure lands on still depends on the machine's speed, so each run visits other moments.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ftlm.observe.events import read_events

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

pytest.importorskip("transformers", reason="the examples build a Hugging Face model")


def _launch(tmp_path: Path, script: str, groups: int, ranks: int, mtbf: float, seed: int) -> dict:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ftlm.cli", "launch", "local", str(EXAMPLES / "chaos.toml"),
           "--groups", str(groups), "--ranks-per-group", str(ranks),
           "--chaos-mtbf", str(mtbf), "--chaos-seed", str(seed),
           "--set", f"run.dir={run_dir}", "--", str(EXAMPLES / script)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    summary_file = run_dir / "summary.json"
    assert summary_file.is_file(), f"no summary (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads(summary_file.read_text())
    assert proc.returncode == 0, f"exit {proc.returncode}: {summary.get('problems')}\n{proc.stderr[-3000:]}"
    summary["events"] = read_events(run_dir / "events.jsonl")
    return summary


def _kept_the_promise(summary: dict, groups: int) -> None:
    assert summary["problems"] == [], summary["problems"]
    hashes = summary["state_hashes"]
    assert len(hashes) == groups and len(set(hashes.values())) == 1, hashes
    data = summary["data"]
    assert data["duplicates"] == 0 and data["gaps"] == 0, data
    assert summary["steps_committed"] == 60
    assert summary["failures_injected"] >= 1, "the chaos injected no failure: nothing was tested"
    losses = [e["loss"] for e in summary["events"] if e["kind"] == "commit" and e.get("loss") is not None]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, f"the loss did not fall: {first:.3f} -> {last:.3f}"


def test_a_hugging_face_loop_under_chaos(tmp_path):
    """examples/hf_causal_lm.py: three single-rank groups, a SIGKILL every 15 s on average."""
    _kept_the_promise(_launch(tmp_path, "hf_causal_lm.py", groups=3, ranks=1, mtbf=15, seed=1), 3)


@pytest.mark.slow
def test_the_same_loop_sharded_with_fsdp2_under_chaos(tmp_path):
    """examples/hf_fsdp2.py: three groups of two FSDP2 ranks, a SIGKILL every 8 s on average."""
    _kept_the_promise(_launch(tmp_path, "hf_fsdp2.py", groups=3, ranks=2, mtbf=8, seed=2), 3)
