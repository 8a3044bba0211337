"""What every benchmark shares: the machine description, the demo data, step timings read from a
run's events, medians, Markdown tables, and rewriting one delimited section of BENCHMARKS.md.

It does not measure anything itself and knows nothing about a particular benchmark.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import statistics
import sys
from pathlib import Path
from typing import Iterable, Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = REPO_ROOT / "BENCHMARKS.md"
DEMO_DIR = REPO_ROOT / "data" / "demo"
DEMO_SEQ_LEN = 128
DEMO_VOCAB = 4096


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (platform's guess elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def usable_cores() -> int:
    """CPU cores this process may run on (the affinity mask, not the host's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_description() -> str:
    """One line: CPU model, cores, torch version, and the GPU when there is one."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (f"{cpu_model()}, {usable_cores()} cores usable ({os.cpu_count()} online), "
            f"torch {torch.__version__}, Python {platform.python_version()}, GPU: {gpu}")


def command_line() -> str:
    """The command that is running, as a user would type it from the repository root."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        name = spec.name.removesuffix(".__main__")
        return " ".join(["python -m", name, *sys.argv[1:]])
    return " ".join(["python", *sys.argv])


def ensure_demo() -> Path:
    """The demo dataset (built once, about a minute, then cached in data/demo)."""
    from ftlm.data.demo import ensure_demo_data
    return ensure_demo_data(DEMO_DIR, seq_len=DEMO_SEQ_LEN, vocab_size=DEMO_VOCAB)


def commits_by_group(events: Iterable[dict]) -> dict[str, list[dict]]:
    """The ``commit`` events of the steps each group trained, in step order (a commit a
    recovering group replayed has no step time: it is left out)."""
    out: dict[str, list[dict]] = {}
    for e in events:
        if e.get("kind") == "commit" and not e.get("replayed"):
            out.setdefault(e["group"], []).append(e)
    for commits in out.values():
        commits.sort(key=lambda e: e["step"])
    return out


def steady(values: Sequence[float], warmup: int) -> list[float]:
    """``values`` without the first ``warmup`` (allocation, first quorum, caches); never empty."""
    if len(values) <= warmup:
        raise ValueError(f"only {len(values)} values, all within the {warmup} warm-up steps; "
                         "run more steps")
    return list(values[warmup:])


def intervals(timestamps: Sequence[float]) -> list[float]:
    """Gaps between consecutive timestamps."""
    return [b - a for a, b in zip(timestamps, timestamps[1:])]


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def spread(values: Sequence[float]) -> str:
    """``min-max`` of per-repetition values, to show how noisy a median is."""
    return f"{min(values):.3g}-{max(values):.3g}"


_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Student t's 97.5 % quantile for 1..30 degrees of freedom (two-sided 95 % intervals)."""


def repo_relative(path: str) -> str:
    """``path`` as a command in BENCHMARKS.md shows it: relative to the repository when inside it."""
    try:
        return Path(path).resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path


def t_interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean of ``values`` (independent seeds or chains) and the half-width of its two-sided 95 %
    interval (Student t, n - 1 degrees of freedom); the half-width is nan for one value."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    df = len(values) - 1
    t = _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df
    return mean, t * statistics.stdev(values) / len(values) ** 0.5


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def section_header(title: str, module: str, flags: Sequence[str]) -> str:
    """The provenance lines every section starts with; ``module`` and ``flags`` give the command
    that reproduces this section alone."""
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    alone = " ".join(["python -m", module, *flags])
    command = command_line()
    how = f"`{command}`" + ("" if command == alone else f" (this section alone: `{alone}`)")
    return (f"## {title}\n\n"
            f"* Command: {how}, from the repository root\n"
            f"* Date: {now}\n"
            f"* Machine: {machine_description()}\n"
            f"* Load average when the table was written (1, 5, 15 min): {_load()}\n")


def _load() -> str:
    """The machine's load average: how much else was running (shared machines are noisy)."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


_INTRO = "# Benchmarks\n\nRun them with `make bench`; each script rewrites its own section below.\n"


def write_section(name: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace the text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` in ``path``
    with ``body`` (appending the section when it is missing), leaving the rest of the file alone."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.is_file() else _INTRO
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def publish(name: str, body: str, write: bool) -> int:
    """A benchmark's last step: print its section and, when ``write``, put it into
    BENCHMARKS.md (``write_section``). Returns the exit status of ``main``."""
    print(body)
    if write:
        write_section(name, body)
    return 0
