"""The job's model file (``ftlm.train.model_file``): whatever order the groups of a job finish
and write in, alone or at once, the file ends with the furthest state; it never goes back."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from hypothesis import given, settings, strategies as st

from ftlm.train.model_file import install_model, read_stamp, stamp_metadata


def _write(path: Path, step: int) -> None:
    """A safetensors file holding no tensor, stamped with ``step`` (what ``save_model`` writes
    around the weights)."""
    header = json.dumps({"__metadata__": stamp_metadata(step, f"chain-{step}")}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header)


def _finish(run_dir: Path, name: str, step: int, joined: bool = True, final: int = 10**6) -> str:
    """One group's exit, as ``Trainer.save_model`` does it; why it did not write ("" if it did)."""
    tmp = run_dir / f".model.safetensors.{name}.tmp"
    _write(tmp, step)
    try:
        return install_model(tmp, run_dir / "model.safetensors", step, joined, final)
    finally:
        tmp.unlink(missing_ok=True)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.integers(0, 30), min_size=1, max_size=8), old=st.none() | st.integers(0, 60))
def test_groups_finishing_in_any_order_leave_the_furthest_state(tmp_path_factory, steps, old) -> None:
    run_dir = tmp_path_factory.mktemp("run")
    if old is not None:  # a model already in place (this job's, written by a group before)
        _write(run_dir / "model.safetensors", old)
    for i, step in enumerate(steps):
        _finish(run_dir, str(i), step)
    assert read_stamp(run_dir / "model.safetensors").step == max(steps + [old or 0])
    assert sorted(p.name for p in run_dir.iterdir()) == [".model.lock", "model.safetensors"]
    # A group that never took part in a quorum writes nothing short of the final step; nothing
    # goes back, whenever its writer started.
    before = read_stamp(run_dir / "model.safetensors")
    assert _finish(run_dir, "late", 0, joined=False)
    if before.step > 0:
        assert _finish(run_dir, "behind", before.step - 1)
    assert read_stamp(run_dir / "model.safetensors").step == before.step


def test_groups_finishing_at_once_leave_the_furthest_state(tmp_path) -> None:
    """The check of the file in place and its replacement are one step under the model lock:
    without it, a group that read an older file could replace a newer one written meanwhile."""
    for attempt in range(20):
        run_dir = tmp_path / str(attempt)
        run_dir.mkdir()
        go = threading.Barrier(8)

        def finish(i: int) -> None:
            go.wait(timeout=30)
            _finish(run_dir, str(i), (i * 5) % 8)

        threads = [threading.Thread(target=finish, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert read_stamp(run_dir / "model.safetensors").step == 7
