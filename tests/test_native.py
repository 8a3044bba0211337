"""The coordinator's hot path compiled with mypyc (``ftlm.native``): which modules run, and why.

``make test`` runs the suite once, on the interpreted modules; the tests of the build itself run
where it is built (``make native``) and skip, saying why, elsewhere."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from ftlm import native

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)


def _copy_sources(tmp_path: Path) -> tuple[Path, Path]:
    """A package directory with the compiled modules' sources and an empty ``_compiled`` beside it."""
    package, compiled = tmp_path / "ft", tmp_path / "_compiled"
    package.mkdir()
    compiled.mkdir()
    for rel in native.sources():
        (package / rel).parent.mkdir(exist_ok=True)
        shutil.copy(native.PACKAGE_DIR / rel, package / rel)
    return package, compiled


def test_ftlm_native_0_runs_the_interpreted_modules() -> None:
    out = _python("import ftlm.ft.quorum as q, ftlm.native as n; print(q.__file__); print(n.STATUS)", FTLM_NATIVE="0")
    assert out.returncode == 0, out.stderr
    path, status = out.stdout.splitlines()
    assert path == str(native.PACKAGE_DIR / "quorum" / "__init__.py") and status == "interpreted (FTLM_NATIVE=0)"


def test_a_bad_ftlm_native_value_says_which_values_work() -> None:
    out = _python("import ftlm.ft", FTLM_NATIVE="yes")
    assert out.returncode != 0
    assert "FTLM_NATIVE='yes': use 1 (compiled hot path, required), 0 (interpreted)" in out.stderr


def test_a_build_of_other_sources_or_for_another_python_is_not_used(tmp_path: Path) -> None:
    package, compiled = _copy_sources(tmp_path)
    manifest = compiled / native.MANIFEST
    assert native.why_not(compiled, package).startswith("not built: `make setup` or `python -m ftlm.native build`")
    manifest.write_text(json.dumps({"tag": native._tag(), "sources": native._digests(package)}))
    assert native.why_not(compiled, package) == ""
    with open(package / "membership.py", "a") as f:
        f.write("\n# edited after the build\n")
    assert native.why_not(compiled, package).startswith("membership.py changed since the build: `make setup`")
    manifest.write_text(json.dumps({"tag": "cpython-39-linux-aarch64", "sources": native._digests(package)}))
    assert native.why_not(compiled, package).startswith("built for cpython-39-linux-aarch64, this is ")
    for damaged in ("{not json", "[]", ""):
        manifest.write_text(damaged)
        assert native.why_not(compiled, package).startswith(f"unreadable {manifest}")


def test_select_leaves_the_search_path_alone_unless_the_build_matches(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    package, compiled = _copy_sources(tmp_path)
    monkeypatch.setattr(native, "PACKAGE_DIR", package)
    monkeypatch.setattr(native, "COMPILED_DIR", compiled)
    monkeypatch.setattr(native, "STATUS", native.STATUS)
    monkeypatch.setattr(native, "_load_library", lambda: None)  # (loading it: the test below)
    path = [str(package)]
    monkeypatch.delenv("FTLM_NATIVE", raising=False)
    assert native.select(path) is False and path == [str(package)]
    assert native.STATUS.startswith("interpreted (not built")
    monkeypatch.setenv("FTLM_NATIVE", "1")
    with pytest.raises(ImportError, match="FTLM_NATIVE=1 but the compiled hot path cannot run: not built"):
        native.select(path)
    (compiled / native.MANIFEST).write_text(json.dumps({"tag": native._tag(), "sources": native._digests(package)}))
    assert native.select(path) is True and path == [str(compiled), str(package)] and native.STATUS == "compiled (mypyc)"
    assert native.select(path) is True and path.count(str(compiled)) == 1
    monkeypatch.setenv("FTLM_NATIVE", "0")
    path = [str(package)]
    assert native.select(path) is False and path == [str(package)]


def test_a_compiled_library_that_does_not_load_falls_back_at_import(tmp_path: Path) -> None:
    package, compiled = _copy_sources(tmp_path)
    (compiled / native.MANIFEST).write_text(json.dumps({"tag": native._tag(), "sources": native._digests(package)}))
    (compiled / f"_native__mypyc{EXTENSION_SUFFIXES[0]}").write_bytes(b"not a shared library")
    code = ("import sys, pathlib, ftlm.native as n; n.PACKAGE_DIR, n.COMPILED_DIR = map(pathlib.Path, sys.argv[1:]); "
            "path = [sys.argv[1]]; print(n.select(path), path == [sys.argv[1]]); print(n.STATUS)")
    out = _python(code, str(package), str(compiled), FTLM_NATIVE="auto")
    assert out.returncode == 0, out.stderr
    chosen, status = out.stdout.splitlines()
    assert chosen == "False True" and status.startswith("interpreted (the compiled library does not load: ")
    assert "rebuild with `python -m ftlm.native build`" in status
    out = _python(code, str(package), str(compiled), FTLM_NATIVE="1")
    assert out.returncode != 0 and "FTLM_NATIVE=1 but the compiled hot path cannot run" in out.stderr


NOT_BUILT = native.why_not()
"""Empty where the compiled hot path is built for these sources (``make native``), else why not."""


@pytest.mark.skipif(bool(NOT_BUILT), reason=f"the compiled hot path is not built ({NOT_BUILT})")
def test_the_built_hot_path_runs_compiled() -> None:
    code = ("import importlib, ftlm.native as n; "
            "print(all(n.is_compiled(importlib.import_module(m)) for m in n.modules())); "
            "print(n.is_compiled(importlib.import_module('ftlm.ft.coordinator'))); print(n.STATUS)")
    out = _python(code, FTLM_NATIVE="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["True", "False", "compiled (mypyc)"]


def test_status_exits_1_unless_the_compiled_modules_can_run(tmp_path: Path) -> None:
    """``make setup`` rebuilds when ``python -m ftlm.native status`` fails."""
    package, compiled = _copy_sources(tmp_path)
    code = ("import sys, pathlib, ftlm.native as n; n.PACKAGE_DIR, n.COMPILED_DIR = map(pathlib.Path, sys.argv[1:]); "
            "sys.exit(n.main(['status']))")
    out = _python(code, str(package), str(compiled))
    assert out.returncode == 1 and out.stdout.startswith("interpreted: not built"), out.stdout + out.stderr
    (compiled / native.MANIFEST).write_text(json.dumps({"tag": native._tag(), "sources": native._digests(package)}))
    out = _python(code, str(package), str(compiled))
    assert out.returncode == 0 and out.stdout == f"compiled (mypyc), {compiled}\n", out.stdout + out.stderr
    (package / "history.py").write_text("# edited\n")
    out = _python(code, str(package), str(compiled))
    assert out.returncode == 1 and "history.py changed since the build" in out.stdout


_SIM_OUTCOMES = """
import dataclasses, json, sys
from ftlm import native
from ftlm.sim.protocol import SimConfig, run
configs = [(SimConfig(), range(60)),
           (SimConfig(groups=6, faults=("bad_link", "crash", "hang"), fault_mtbf=8, bad_links=2), range(20))]
out = []
for config, seeds in configs:
    for seed in seeds:
        r = dataclasses.asdict(run(seed, config))
        out.append(r)
json.dump({"hot_path": native.STATUS, "runs": out}, sys.stdout)
"""


def test_compiled_and_interpreted_modules_run_the_same_simulated_jobs_event_for_event() -> None:
    """Seeded fault schedules (every fault kind, two bad links at once) through the real state
    machine, once on each: the same outcome, the same simulated times, the same last events."""
    if NOT_BUILT:
        pytest.skip(f"the compiled hot path is not built ({NOT_BUILT})")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # side by side: half the wall time
        both = [pool.submit(_python, _SIM_OUTCOMES, FTLM_NATIVE=flag) for flag in ("1", "0")]
        compiled, interpreted = (f.result() for f in both)
    assert compiled.returncode == 0 and interpreted.returncode == 0, compiled.stderr + interpreted.stderr
    ours, theirs = json.loads(compiled.stdout), json.loads(interpreted.stdout)
    assert (ours["hot_path"], theirs["hot_path"]) == ("compiled (mypyc)", "interpreted (FTLM_NATIVE=0)")
    ours, theirs = ours["runs"], theirs["runs"]
    assert len(ours) == len(theirs) == 80
    for a, b in zip(ours, theirs):
        assert a == b, f"seed {a['seed']}: {a['error'] or a['trace'][-3:]} != {b['error'] or b['trace'][-3:]}"
    assert sum(sum(r["faults"].values()) for r in ours) > 500 and sum(r["convictions"] for r in ours) > 10


def test_a_build_is_swapped_in_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "_compiled"

    def staged(text: str) -> Path:
        d = tmp_path / f".new-{text}"
        d.mkdir()
        (d / native.MANIFEST).write_text(text)
        return d

    native.swap_in(staged("first"), out)  # nothing there yet
    assert (out / native.MANIFEST).read_text() == "first"
    native.swap_in(staged("second"), out)
    assert (out / native.MANIFEST).read_text() == "second"
    # Another build puts its own in place between our moving the old one aside and our rename.
    real_rename, raced = Path.rename, []

    def rename(self: Path, target: Path) -> Path:
        if Path(target) == out and not raced:
            raced.append(True)
            real_rename(staged("other"), out)
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    native.swap_in(staged("third"), out)
    assert (out / native.MANIFEST).read_text() == "third" and raced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_compiled"]  # nothing left aside
