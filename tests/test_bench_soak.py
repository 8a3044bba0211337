"""The soak's section table: one row per layout, counts summed over its runs (the runs themselves
are a benchmark: ``bench.soak``)."""

from __future__ import annotations

import time

from bench import soak
from bench.soak import PREEMPT_SUMMED, SUMMED, layout_headers, layout_rows


def _run(seed: int, groups: int, ok: bool = True, distinct: int = 1, **counts) -> dict:
    record = {"seed": seed, "groups": groups, "ranks": 1, "wall_seconds": 60.0 + seed, "ok": ok,
              "reasons": [] if ok else ["1 injected failure(s) never detected"],
              "hashes": f"{distinct} distinct of {groups} for {groups} groups"}
    record.update({k: 0 for k in SUMMED + PREEMPT_SUMMED})
    record.update(counts)
    return record


def test_a_layout_row_sums_its_runs_and_counts_the_passes():
    runs = [_run(0, 3, kills=2, hangs=1, restarts=3, detected=3),
            _run(2, 3, ok=False, distinct=2, kills=1, coordinator_kills=4, detected=4,
                 preemptions=2, preempted_exits=2),
            _run(1, 4, hangs=5, detected=5)]
    head = layout_headers(preempt=True)
    rows = {r[0]: dict(zip(head, r)) for r in layout_rows(runs, preempt=True)}
    three = rows["3x1"]
    assert (three["runs"], three["passed"], three["median wall s"]) == (2, 1, "61")
    assert three["faults"] == 2 + 1 + 1 + 4 + 2  # kills, hangs, coordinator kills, preemptions
    assert (three["group kills"], three["coordinator kills"], three["preemptions"]) == (3, 4, 2)
    assert three["identical final hashes"] == "1 of 2"
    assert rows["4x1"]["group hangs"] == 5 and rows["4x1"]["passed"] == 1
    assert len(head) == len(layout_rows(runs, preempt=True)[0])
    assert "preemptions" not in layout_headers(preempt=False)
    assert len(layout_headers(False)) == len(layout_rows(runs, preempt=False)[0])


def test_a_stopped_soak_stops_the_run_it_started(tmp_path):
    """SIGTERM (or Ctrl-C) to the bench while a run is in progress stops the run's whole session:
    the launch is left running by nobody."""
    import signal
    import subprocess
    import sys
    import textwrap
    child_pid = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        import sys, pathlib, signal
        sys.path.insert(0, {str(soak.REPO_ROOT)!r})
        from bench import soak
        signal.signal(signal.SIGTERM, soak._interrupted)
        cmd = [sys.executable, "-c",
               "import os, pathlib, time; pathlib.Path({str(child_pid)!r}).write_text(str(os.getpid())); time.sleep(600)"]
        try:
            soak.run_logged(cmd, pathlib.Path({str(tmp_path / 'log')!r}), 600, dict())
        except KeyboardInterrupt:
            sys.exit(7)
    """)
    bench = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not child_pid.exists() or not child_pid.read_text():
            assert time.monotonic() < deadline, "the run never started"
            assert bench.poll() is None, "the bench exited before its run started"
            time.sleep(0.05)
        pid = int(child_pid.read_text())
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=90) == 7
        deadline = time.monotonic() + 30
        while _alive(pid):
            assert time.monotonic() < deadline, f"the run (pid {pid}) outlived the bench"
            time.sleep(0.05)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


def _alive(pid: int) -> bool:
    import os
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of a reaped-later child counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    return True
