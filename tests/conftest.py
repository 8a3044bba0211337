"""Fixtures shared by the whole test suite.

Keep each fixture small and documented; put fixtures used by one package in its own conftest.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _register_hypothesis_profiles() -> None:
    """Hypothesis settings shared by the property-based and fuzz tests (docs/design.md, 'Testing').

    * Profile ``ftlm`` (loaded for every test): no per-example deadline, since timings on a loaded
      CI machine mean nothing; failing examples are kept under .pytest_cache (ignored by git)
      and replayed first on the next run.
    * Profile ``fuzz``: what fuzz tests inherit with
      ``@settings(parent=settings.get_profile("fuzz"))``. Examples per test come from
      ``FTLM_FUZZ_EXAMPLES`` (default 2000, sized for the default run); a release runs a long
      fuzz with e.g. ``FTLM_FUZZ_EXAMPLES=200000 .venv/bin/python -m pytest -q -k fuzz``.
    """
    try:
        from hypothesis import HealthCheck, settings
        from hypothesis.database import DirectoryBasedExampleDatabase
    except ImportError:  # the `test` extra is not installed; property tests fail on import
        return
    raw = os.environ.get("FTLM_FUZZ_EXAMPLES", "2000")
    if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
        raise pytest.UsageError(f"FTLM_FUZZ_EXAMPLES={raw!r} must be a positive integer "
                                f"(examples per fuzz test; unset means 2000)")
    database = DirectoryBasedExampleDatabase(Path(__file__).parent.parent / ".pytest_cache"
                                             / "hypothesis")
    settings.register_profile("ftlm", deadline=None, database=database)
    settings.register_profile("fuzz", parent=settings.get_profile("ftlm"),
                              max_examples=int(raw),
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("ftlm")


_register_hypothesis_profiles()

DEMO_SEQ_LEN = 64
DEMO_VOCAB = 1024


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared dataset folder: 1 MB of stdlib text, seq_len 64, vocab 1024 (> 1000 samples).

    Built once per test session (a few seconds). Open it with
    ``PackedDataset(demo_data, seq_len=64)``; its tokenizer is ``demo_data / "tokenizer.json"``.
    Treat it as read-only: other tests share it.
    """
    from ftlm.data.demo import ensure_demo_data

    root = tmp_path_factory.mktemp("demo-data")
    return ensure_demo_data(root, seq_len=DEMO_SEQ_LEN, vocab_size=DEMO_VOCAB,
                            max_bytes=1_000_000, progress=False)



TINY_MODEL = {"size": "tiny", "vocab_size": DEMO_VOCAB, "dim": 64, "n_layers": 2, "n_heads": 4,
              "n_kv_heads": 2, "ffn_dim": 128, "max_seq_len": DEMO_SEQ_LEN}
"""A ~100k-parameter model that trains a step in milliseconds on one CPU thread."""


@pytest.fixture(scope="session")
def make_tiny_config(demo_data: Path):
    """Factory of single-group ``RunConfig`` s on ``demo_data`` with the tiny model.

    ``make_tiny_config(run_dir, **sections)`` merges each ``section={key: value}`` over the
    defaults (steps 20, batch 4, warm-up 2, 1 thread, no progress bar, no checkpoints).
    Session-scoped so that module-scoped fixtures can train once and share the run.
    """
    from ftlm.config import build_config

    def make(run_dir: Path, **sections: dict):
        raw = {"run": {"dir": str(run_dir)},
               "model": dict(TINY_MODEL),
               "data": {"dir": str(demo_data), "seq_len": DEMO_SEQ_LEN},
               "train": {"steps": 20, "batch_size": 4, "threads": 1, "warmup_steps": 2},
               "checkpoint": {"every": 0},
               "observe": {"progress": False, "log_every": 1000}}
        for name, body in sections.items():
            raw.setdefault(name, {}).update(body)
        return build_config(raw)

    return make


@pytest.fixture
def tiny_config(tmp_path: Path, make_tiny_config):
    """``make_tiny_config`` with ``run_dir`` defaulting to ``tmp_path / "run"``."""

    def make(run_dir: Path | None = None, **sections: dict):
        return make_tiny_config(run_dir or tmp_path / "run", **sections)

    return make


# Runs the script in argv[1] (the rest of argv is its own), then leaves without the interpreter's
# teardown: a rank of a gloo group aborted there once in a full suite under load ("terminate
# called without an active exception", SIGABRT), after its report was printed. A script that
# raises exits 1 with its traceback; one that calls sys.exit keeps its status.
_LEAVE_WITHOUT_TEARDOWN = """
import os, sys, traceback
source = sys.argv.pop(1)
try:
    exec(compile(source, "<two_ranks script>", "exec"), vars(sys.modules["__main__"]))
    code = 0
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if not isinstance(e.code, (int, type(None))):
        print(e.code, file=sys.stderr)
except BaseException:
    traceback.print_exc()
    code = 1
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""


@pytest.fixture
def two_ranks(tmp_path: Path):
    """Run a Python ``script`` as ranks 0 and 1 of one group: ``two_ranks(script, *args)`` starts
    ``python -c script RANK STORE *args`` for each rank (STORE: a fresh ``FileStore`` path for
    ``dist.init_process_group``; the script runs under ``_LEAVE_WITHOUT_TEARDOWN``), waits for
    both (bounded), asserts they exited 0 and returns the JSON object each printed on its last
    line, in rank order."""
    import json
    import subprocess
    import sys

    def run(script: str, *args: str, timeout: float = 120) -> list[dict]:
        store = tmp_path / f"store-{os.urandom(4).hex()}"
        procs = [subprocess.Popen([sys.executable, "-c", _LEAVE_WITHOUT_TEARDOWN, script, str(rank), str(store), *args],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in (0, 1)]
        try:
            outs = [p.communicate(timeout=timeout)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert [p.returncode for p in procs] == [0, 0], outs
        return [json.loads(out.strip().splitlines()[-1]) for out in outs]

    return run
