"""The coordinator's hot path (``ftlm.ft``) compiled to C with mypyc, and the interpreted modules as fallback.

The modules every heartbeat and quorum request goes through (``COMPILED``: the state machine,
the ``quorum`` package, the answers, the lean HTTP path) are ordinary typed Python. ``build`` compiles them
with mypyc into ``ftlm/ft/_compiled/`` (``make setup`` does, when a C compiler and the
Python headers are there), with a manifest of the sources it compiled; ``ftlm.ft``'s
``__init__`` calls ``select`` at import, which puts ``_compiled/`` first on the package's
search path when the manifest matches the sources on disk and its library loads. Otherwise (not
built, built from other sources, another Python, a library that does not load) the interpreted
modules run: the same code, slower (coordinator
load bench in BENCHMARKS.md).

``FTLM_NATIVE``: unset or ``auto`` (the compiled modules when they match), ``0`` (always the
interpreted ones: how ``make test`` runs the suite), ``1`` (the compiled ones or an ImportError
saying why not: benchmarks). ``STATUS`` says which runs and why; the coordinator logs it at start.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

COMPILED = ("history", "quorum", "membership", "quorum_answer", "coordinator_requests", "hot_path")
"""Modules and packages of ``ftlm.ft`` that ``build`` compiles (one mypyc group: calls between them
are C calls); a package's every module is compiled."""

PACKAGE_DIR = Path(__file__).resolve().parent / "ft"
COMPILED_DIR = PACKAGE_DIR / "_compiled"
MANIFEST = "MANIFEST.json"
GROUP = "ftlm.ft._native"  # the shared library: ``_native__mypyc`` in ``_compiled/``

STATUS = "interpreted (not selected yet)"
"""``compiled (...)`` or ``interpreted (why)``; set by ``select``."""


def sources(package_dir: Path = PACKAGE_DIR) -> list[str]:
    """The files ``build`` compiles, relative to ``package_dir`` (``quorum/decision.py``)."""
    out: list[str] = []
    for m in COMPILED:
        if (package_dir / m).is_dir():
            out += sorted(f"{m}/{p.name}" for p in (package_dir / m).glob("*.py"))
        else:
            out.append(f"{m}.py")
    return out


def modules(package_dir: Path = PACKAGE_DIR) -> list[str]:
    """The dotted names of the modules ``build`` compiles (``ftlm.ft.quorum.decision``)."""
    names = [f"ftlm.ft.{rel[:-3].replace('/', '.')}" for rel in sources(package_dir)]
    return [n[: -len(".__init__")] if n.endswith(".__init__") else n for n in names]


def _digests(package_dir: Path = PACKAGE_DIR) -> dict[str, str]:
    return {rel: hashlib.sha256((package_dir / rel).read_bytes()).hexdigest() for rel in sources(package_dir)}


def _tag() -> str:
    return f"{sys.implementation.cache_tag}-{sysconfig.get_platform()}"


def why_not(compiled_dir: Path = COMPILED_DIR, package_dir: Path = PACKAGE_DIR) -> str:
    """Empty when ``compiled_dir`` holds a build of the sources in ``package_dir`` for this
    interpreter, else why not (and how to fix it)."""
    try:
        manifest = json.loads((compiled_dir / MANIFEST).read_text())
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        return "not built: `make setup` or `python -m ftlm.native build` compiles it"
    except (OSError, ValueError) as e:
        return f"unreadable {compiled_dir / MANIFEST} ({e}): rebuild with `python -m ftlm.native build`"
    if manifest.get("tag") != _tag():
        return (f"built for {manifest.get('tag')}, this is {_tag()}: rebuild with "
                "`python -m ftlm.native build`")
    built = manifest.get("sources")
    built = built if isinstance(built, dict) else {}
    try:
        digests = _digests(package_dir)
    except OSError as e:
        return f"cannot read the sources to compare with the build ({e})"
    changed = [rel for rel, digest in digests.items() if built.get(rel) != digest]
    changed += [rel for rel in built if rel not in digests]
    if changed:
        return (f"{', '.join(changed)} changed since the build: `make setup` or "
                "`python -m ftlm.native build` compiles them again")
    return ""


def select(package_path: list[str]) -> bool:
    """Put ``_compiled/`` first on ``package_path`` (``ftlm.ft.__path__``) when it matches the
    sources and ``FTLM_NATIVE`` allows; set ``STATUS``. Returns whether the compiled modules run."""
    global STATUS
    mode = os.environ.get("FTLM_NATIVE", "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise ImportError(f"FTLM_NATIVE={mode!r}: use 1 (compiled hot path, required), 0 (interpreted) "
                          "or leave it unset (compiled when built)")
    if mode == "0":
        STATUS = "interpreted (FTLM_NATIVE=0)"
        return False
    why = why_not(COMPILED_DIR, PACKAGE_DIR)
    if why:
        STATUS = f"interpreted ({why})"
        if mode == "1":
            raise ImportError(f"FTLM_NATIVE=1 but the compiled hot path cannot run: {why}")
        return False
    if str(COMPILED_DIR) not in package_path:
        package_path.insert(0, str(COMPILED_DIR))
    try:
        _load_library()
    except Exception as e:  # noqa: BLE001 (an ImportError, or whatever a broken library raises)
        package_path.remove(str(COMPILED_DIR))
        STATUS = f"interpreted (the compiled library does not load: {e}; rebuild with `python -m ftlm.native build`)"
        if mode == "1":
            raise ImportError(f"FTLM_NATIVE=1 but the compiled hot path cannot run: {e}") from e
        return False
    STATUS = "compiled (mypyc)"
    return True


def _load_library() -> None:
    """Load the library every compiled module loads first (``GROUP``), from ``COMPILED_DIR``: one
    that cannot load (damaged, built against another libc) falls back to the interpreted modules
    at import instead of failing the first import of a compiled module."""
    name = f"{GROUP}__mypyc"
    if name in sys.modules:
        return
    stem = name.rsplit(".", 1)[1] + "."
    found = [p for p in COMPILED_DIR.iterdir() if p.name.startswith(stem) and p.name.endswith(tuple(EXTENSION_SUFFIXES))]
    if not found:
        raise ImportError(f"no {stem}* library in {COMPILED_DIR}")
    spec = importlib.util.spec_from_file_location(name, found[0])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {found[0]}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module


def active() -> bool:
    """Whether the compiled modules run in this process (``select`` chose them)."""
    import ftlm.ft  # noqa: F401 (its import is what selects)

    return STATUS.startswith("compiled")


INTERPRETED_ONLY = ("patches module functions that compiled callers call directly: `make test` runs the "
                    "suite with FTLM_NATIVE=0")
"""Why a test that patches ``COMPILED`` modules skips where they run compiled (``pytest.mark.skipif``)."""


def is_compiled(module: object) -> bool:
    """Whether ``module`` (one of ``COMPILED``, imported) was loaded from its compiled extension."""
    return str(getattr(module, "__file__", "")).endswith(tuple(EXTENSION_SUFFIXES))


def build(out: Path = COMPILED_DIR, quiet: bool = False) -> Path:
    """Compile ``COMPILED`` with mypyc into ``out`` (replaced only once the build succeeded) and
    write its manifest. Raises RuntimeError naming what is missing or what failed."""
    try:
        from mypyc.build import mypycify
        from setuptools import Distribution
    except ImportError as e:
        raise RuntimeError(f"building the compiled hot path needs mypy and setuptools ({e}): "
                           "pip install -e '.[native]'") from e
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        raise RuntimeError(f"no Python.h in {sysconfig.get_paths()['include']}: install the Python "
                           "development headers (Debian: python3-dev)")
    digests = _digests()
    src_root = PACKAGE_DIR.parent.parent  # the directory holding ``ftlm``: mypyc names modules by their path
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ftlm-native-") as tmp:
        work = Path(tmp)
        cwd = os.getcwd()
        os.chdir(src_root)  # mypyc names modules by their path from here
        try:
            extensions = mypycify([f"ftlm/ft/{rel}" for rel in digests], opt_level="3", group_name=GROUP,
                                  target_dir=str(work / "c"), verbose=False)
            dist = Distribution({"name": "ftlm-native", "ext_modules": extensions})
            cmd = dist.get_command_obj("build_ext")
            cmd.build_lib, cmd.build_temp = str(work / "lib"), str(work / "obj")  # type: ignore[attr-defined]
            cmd.ensure_finalized()
            if quiet:
                _run_quietly(cmd)
            else:
                cmd.run()
        except (Exception, SystemExit) as e:  # distutils reports a failed compile as SystemExit
            raise RuntimeError(f"mypyc build failed: {e}") from e
        finally:
            os.chdir(cwd)
        if _digests() != digests:
            raise RuntimeError("the sources changed during the build: run it again")
        lib = work / "lib" / "ftlm" / "ft"
        built = sorted(p.relative_to(lib) for p in lib.rglob("*") if p.name.endswith(tuple(EXTENSION_SUFFIXES)))
        names = {str(p.parent / p.name.split(".")[0]) + ".py" for p in built}
        if not set(digests) <= names:
            raise RuntimeError(f"mypyc built {sorted(names)}, not every module of {sorted(digests)}")
        # Staged beside ``out`` and swapped in by renames: a process importing meanwhile sees the
        # old build or the new one (or none, for a moment: the interpreted modules), and two
        # builds at once each finish with a whole build in place.
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent))
        for p in built:
            (staging / p.parent).mkdir(parents=True, exist_ok=True)
            shutil.copy2(lib / p, staging / p)
        (staging / MANIFEST).write_text(json.dumps(
            {"tag": _tag(), "sources": digests, "mypy": _mypy_version(),
             "seconds": round(time.monotonic() - started, 1)}, indent=1) + "\n")
        staging.chmod(0o755)
        swap_in(staging, out)
    return out


def swap_in(staging: Path, out: Path) -> None:
    """Replace directory ``out`` by ``staging`` (same parent) with renames: ``out`` is never half
    written; a build that another one put in place meanwhile is moved aside too (the last wins)."""
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    try:
        for attempt in range(10):
            try:
                out.rename(old / str(attempt))
            except FileNotFoundError:
                pass
            try:
                staging.rename(out)
                return
            except OSError:  # ``out`` exists again: another build's, moved aside next time round
                continue
        raise RuntimeError(f"could not put the build in place at {out} (other builds kept replacing it)")
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _run_quietly(cmd: object) -> None:
    """Run a build command with the compiler's lines to a log, shown only if it fails."""
    import contextlib
    import io

    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            cmd.run()  # type: ignore[attr-defined]
    except BaseException:
        sys.stderr.write(log.getvalue()[-4000:])
        raise


def _mypy_version() -> str:
    try:
        from mypy.version import __version__
    except ImportError:
        return "?"
    return str(__version__)


def main(argv: list[str] | None = None) -> int:
    """``python -m ftlm.native build|status`` (``build --optional``: a failed build prints why
    and exits 0, the interpreted modules run: ``make setup`` on a machine without a compiler)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ftlm.native", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the hot path with mypyc into ftlm/ft/_compiled/")
    b.add_argument("--optional", action="store_true", help="a failed build is not an error")
    sub.add_parser("status", help="say whether the compiled modules run, and why not (exit status 1 if not)")
    args = parser.parse_args(argv)
    if args.command == "status":
        why = why_not(COMPILED_DIR, PACKAGE_DIR)
        print(f"compiled (mypyc), {COMPILED_DIR}" if not why else f"interpreted: {why}")
        return 1 if why else 0
    print(f"native: compiling {', '.join(COMPILED)} with mypyc (about 20-60 s) ...", flush=True)
    try:
        out = build(quiet=True)
    except RuntimeError as e:
        print(f"native: {e}", file=sys.stderr)
        if args.optional:
            print("native: the interpreted modules will run (the same code, slower)", file=sys.stderr)
            return 0
        return 1
    print(f"native: built {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
