"""The test-time-scaling section from raw results: intervals, verifier training, matched FLOPs.

Responsible for turning what ``bench.test_time_scaling`` measured (one *cell* per strategy, N and
seed: ``{"acc", "flops", "correct"}``, ``correct`` a string with one ``0``/``1`` per task) into
the BENCHMARKS.md section:

* accuracy as the mean over seeds with its 95 % t-interval over seeds, and a 95 % percentile
  bootstrap interval over tasks (``bootstrap_interval``: each task's correctness averaged over
  the seeds, the tasks resampled ``RESAMPLES`` times with seed ``BOOTSTRAP_SEED``);
* the verifiers' training compute (``training_runs``: every run on a verifier's ``init_from``
  chain, from its ``summary.json``; plus the policy samples drawn to label its data), amortised
  per query over a stated number of queries (``amortised``);
* the matched-FLOPs tables against a larger policy's single sample (greedy and sampled), with
  and without the amortised verifier training;
* the plot.

Not responsible for sampling, scoring or counting FLOPs (``bench.test_time_scaling``). Results
saved before the per-task record (``[acc, flops]`` cells) still format, without the interval over
tasks (``upgrade``).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import t_interval, table

RESAMPLES = 1000
"""Bootstrap resamples of the tasks."""
BOOTSTRAP_SEED = 0
"""Seed of the resampling: the same task draws for every strategy (differences are paired)."""
BASELINES = ("greedy", "first sample")
"""Single-sample rows of the small policy (shown at N = 1 only, not matched)."""
THINKING = "thinking budget"
"""The strategy whose N is a reasoning budget in tokens, not a number of samples."""
LARGE_GREEDY, LARGE_SAMPLE = "larger policy, greedy", "larger policy, 1 sample"


@dataclass
class Point:
    """One strategy at one N, over seeds and tasks."""

    acc: float
    """Mean accuracy over seeds."""
    seeds: float | None
    """Half-width of the 95 % t-interval over seeds (None: one run, e.g. greedy)."""
    tasks: tuple[float, float] | None
    """95 % bootstrap interval over tasks (None: results saved without per-task outcomes)."""
    flops: float
    """Mean inference FLOPs per task."""
    per_task: np.ndarray | None
    """Each task's correctness averaged over seeds (paired differences between strategies)."""


def bootstrap_interval(values: Sequence[float], resamples: int = RESAMPLES,
                       seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """95 % percentile bootstrap interval of the mean of ``values`` (one per task): the tasks
    resampled with replacement ``resamples`` times by a generator seeded ``seed``, so the same
    call gives the same interval."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        raise ValueError("bootstrap_interval of no values")
    draws = np.random.default_rng(seed).integers(0, arr.size, size=(resamples, arr.size))
    low, high = np.percentile(arr[draws].mean(axis=1), [2.5, 97.5])
    return float(low), float(high)


def point(cells: Sequence[dict]) -> Point:
    """The ``Point`` of one strategy and N from its cells, one per seed."""
    accs = [c["acc"] for c in cells]
    mean, half = t_interval(accs)
    per_task = None
    if all("correct" in c for c in cells):
        per_task = np.array([[ch == "1" for ch in c["correct"]] for c in cells],
                            dtype=float).mean(axis=0)
    return Point(mean, half if len(accs) > 1 else None,
                 bootstrap_interval(per_task) if per_task is not None else None,
                 statistics.fmean(c["flops"] for c in cells), per_task)


def summarise(per_seed: Sequence[dict]) -> dict[str, dict[int, Point]]:
    """``{strategy: {N: Point}}`` over the seeds' ``{strategy: {N: cell}}``."""
    names = list(dict.fromkeys(name for s in per_seed for name in s))
    out = {}
    for name in names:
        ns = sorted({int(n) for s in per_seed for n in s.get(name, {})})
        out[name] = {n: point([s[name][str(n)] for s in per_seed if str(n) in s.get(name, {})])
                     for n in ns}
    return out


def fmt(p: Point) -> str:
    """``0.213 ± 0.010 [0.180, 0.250]``: mean, ± over seeds, [interval over tasks]."""
    return (f"{p.acc:.3f}" + (f" ± {p.seeds:.3f}" if p.seeds is not None else "")
            + (f" [{p.tasks[0]:.3f}, {p.tasks[1]:.3f}]" if p.tasks is not None else ""))


def difference(a: Point, b: Point) -> str:
    """``a - b`` with the bootstrap interval of the paired per-task differences (same tasks)."""
    text = f"{a.acc - b.acc:+.3f}"
    if a.per_task is not None and b.per_task is not None and len(a.per_task) == len(b.per_task):
        low, high = bootstrap_interval(a.per_task - b.per_task)
        text += f" [{low:+.3f}, {high:+.3f}]"
    return text


# -- verifier training ---------------------------------------------------------------------


def training_runs(run_dir: Path) -> dict[str, float]:
    """Training FLOPs of the run in ``run_dir`` and of every run on its ``train.init_from``
    chain that left a ``summary.json``: ``{run dir: tokens_committed x flops_per_token(model,
    data.seq_len)}`` (forward and backward, attention included)."""
    from ftlm.model import ModelConfig, flops_per_token
    out: dict[str, float] = {}
    here: Path | None = Path(run_dir)
    while here is not None and str(here) not in out and (here / "summary.json").is_file():
        summary = json.loads((here / "summary.json").read_text())
        config = summary["config"]
        per_token = flops_per_token(ModelConfig(**config["model"]), config["data"]["seq_len"])
        out[str(here)] = summary["tokens_committed"] * per_token
        start = config["train"].get("init_from") or ""
        here = Path(start).parent if start else None
    return out


def labelling(run_dir: Path, head: str = "") -> dict:
    """What labelling a verifier's data cost, as recorded with it: policy samples drawn (an
    outcome head's ``info.samples``; a line verifier's ``verifier_data.counts.json``) and texts
    the verifier read to fit a head (``info.distinct``); zeros when nothing is recorded."""
    if head:
        info = json.loads(Path(head).read_text()).get("info", {})
        return {"samples": info.get("samples", 0), "reads": info.get("distinct", 0)}
    counts = Path(run_dir) / "verifier_data.counts.json"
    samples = json.loads(counts.read_text())["samples"] if counts.is_file() else 0
    return {"samples": samples, "reads": 0}


def training_flops(record: dict, sample_flops: float, read_flops: float) -> float:
    """A verifier's training compute: ``record["flops"]`` when given by hand, else its training
    runs plus its labelling (policy samples at ``sample_flops`` each, verifier reads at
    ``read_flops`` each: the per-sample FLOPs this study measured)."""
    if record.get("flops") is not None:
        return float(record["flops"])
    return (sum(record.get("runs", {}).values()) + record.get("samples", 0) * sample_flops
            + record.get("reads", 0) * read_flops)


def amortised(total: float, queries: int) -> float:
    """Training FLOPs per query when ``total`` serves ``queries`` queries."""
    if queries < 1:
        raise ValueError(f"queries={queries} must be at least 1")
    return total / queries


def verifier_of(name: str) -> str | None:
    """Which verifier a strategy runs (``"verifier"``, ``"process verifier"``) or None."""
    if "process verifier" in name:
        return "process verifier"
    return "verifier" if "(verifier" in name else None


# -- tables --------------------------------------------------------------------------------


def matched(results: dict[str, dict[int, Point]], large: dict[str, Point],
            extra: dict[str, float] | None = None) -> list[list]:
    """Each strategy of the small policy (baselines aside) at the N whose FLOPs per task, plus
    ``extra[strategy]`` (amortised training; with ``extra``, only the strategies it names), are
    nearest the larger policy's sampled single sample, against its greedy and sampled rows
    (``large``: ``LARGE_SAMPLE`` and, when measured, ``LARGE_GREEDY``)."""
    target = large[LARGE_SAMPLE].flops
    rows = []
    for name, per_n in results.items():
        if name in BASELINES or (extra is not None and name not in extra):
            continue
        add = (extra or {}).get(name, 0.0)
        n = min(per_n, key=lambda k: abs(math.log((per_n[k].flops + add) / target)))
        p = per_n[n]
        flops = p.flops + add
        rows.append([name, f"{n} tokens" if name == THINKING else n, f"{flops:.3g}",
                     f"{flops / target:.2f}", fmt(p),
                     difference(p, large[LARGE_GREEDY]) if LARGE_GREEDY in large else "",
                     difference(p, large[LARGE_SAMPLE])])
    for name, p in large.items():
        rows.append([name, 1, f"{p.flops:.3g}", f"{p.flops / target:.2f}", fmt(p), "", ""])
    return rows


MATCHED_HEADERS = ["strategy", "N", "FLOPs per task", "FLOPs / larger's", "accuracy",
                   "minus larger greedy [tasks]", "minus larger sampled [tasks]"]


def accuracy_table(results: dict[str, dict[int, Point]]) -> str:
    """Accuracy per strategy (rows) and N (columns), the thinking budget aside."""
    rows = {k: v for k, v in results.items() if k != THINKING}
    ns = sorted({n for per_n in rows.values() for n in per_n})
    return table(["strategy"] + [f"N = {n}" for n in ns],
                 [[name] + [fmt(per_n[n]) if n in per_n else "" for n in ns]
                  for name, per_n in rows.items()])


def flops_table(results: dict[str, dict[int, Point]]) -> str:
    """Inference FLOPs per task, the same rows and columns as ``accuracy_table``."""
    rows = {k: v for k, v in results.items() if k != THINKING}
    ns = sorted({n for per_n in rows.values() for n in per_n})
    return table(["strategy"] + [f"N = {n}" for n in ns],
                 [[name] + [f"{per_n[n].flops:.3g}" if n in per_n else "" for n in ns]
                  for name, per_n in rows.items()])


def thinking_table(per_budget: dict[int, Point]) -> str:
    return table(["reasoning budget (tokens)", "accuracy", "FLOPs per task"],
                 [[b, fmt(p), f"{p.flops:.3g}"] for b, p in sorted(per_budget.items())])


def plot(results: dict[str, dict[int, Point]], path: Path, large: dict[str, Point]) -> Path:
    """Accuracy vs N (sampling strategies; baselines as lines) and vs FLOPs (every strategy,
    the larger policy as stars); error bars: the interval over tasks where known."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_n, by_flops) = plt.subplots(1, 2, figsize=(11, 4))

    def bars(points: list[Point]):
        if any(p.tasks is None for p in points):
            return [p.seeds or 0.0 for p in points]
        return [[p.acc - p.tasks[0] for p in points], [p.tasks[1] - p.acc for p in points]]

    for name, per_n in results.items():
        ns = sorted(per_n)
        points = [per_n[n] for n in ns]
        acc = [p.acc for p in points]
        if name in BASELINES:
            by_n.axhline(acc[0], linestyle="--", linewidth=1, label=name)
        elif name != THINKING:
            by_n.errorbar(ns, acc, yerr=bars(points), marker="o", label=name, capsize=2)
        by_flops.errorbar([p.flops for p in points], acc, yerr=bars(points), marker="o",
                          label=name, capsize=2)
    for name, p in large.items():
        by_flops.scatter([p.flops], [p.acc], marker="*" if name == LARGE_SAMPLE else "P", s=120,
                         color="black", label=name, zorder=5)
    for ax, label in ((by_n, "samples per task N"), (by_flops, "inference FLOPs per task")):
        ax.set_xscale("log", base=2 if ax is by_n else 10)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
    by_flops.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- saved results -------------------------------------------------------------------------


def upgrade(saved: dict) -> dict:
    """Results saved before the per-task record, in today's shape: ``[acc, flops]`` cells become
    ``{"acc", "flops"}`` (no ``correct``: no interval over tasks), the larger policy's ``accs``
    and ``flops`` lists become its per-seed cells."""
    out = dict(saved)
    if "per_seed" in saved:
        out["per_seed"] = [{name: {n: ({"acc": v[0], "flops": v[1]} if isinstance(v, list) else v)
                                   for n, v in per_n.items()} for name, per_n in s.items()}
                           for s in saved["per_seed"]]
    large = saved.get("large")
    if large is not None and "accs" in large:
        out["large"] = {**{k: v for k, v in large.items() if k not in ("accs", "flops")},
                        "per_seed": [{"acc": a, "flops": f}
                                     for a, f in zip(large["accs"], large["flops"])]}
    return out


def merge(saved: Sequence[dict]) -> dict:
    """One result from several saved runs (seeds measured by separate processes, the larger
    policy by another): per-seed results add up, the greedy runs (seed-independent) are taken
    from the first file that has them."""
    data: dict = {}
    for raw in saved:
        part = upgrade(raw)
        if "per_seed" in part:
            if "meta" in data:
                meta = dict(part["meta"])
                meta["seeds"] += data["meta"]["seeds"]
                meta["verifier_auc"] = data["meta"].get("verifier_auc", []) + meta.get(
                    "verifier_auc", [])
                meta["seconds"] = max(meta["seconds"], data["meta"]["seconds"])
                part["meta"] = meta
            data["per_seed"] = data.get("per_seed", []) + part["per_seed"]
            data["meta"] = part["meta"]
            if "greedy" in part:
                data.setdefault("greedy", part["greedy"])
        if "large" in part:
            large = dict(part["large"])
            if "large" in data:
                large["per_seed"] = data["large"]["per_seed"] + large["per_seed"]
                large["seconds"] = max(large["seconds"], data["large"]["seconds"])
                large["greedy"] = data["large"].get("greedy", large.get("greedy"))
            data["large"] = large
    return data


# -- the section ---------------------------------------------------------------------------

TITLE = "Test-time scaling: accuracy vs N and vs inference FLOPs"


def section(data: dict, note: str, figure: Path, flags: Sequence[str] = ()) -> str:
    """The BENCHMARKS.md section of saved raw results (``merge``d), its plot written to
    ``figure``; ``flags`` give the command that formats this section alone."""
    from bench.common import section_header
    meta = data["meta"]
    results = summarise(data["per_seed"])
    if "greedy" in data:
        results = {"greedy": {1: point([data["greedy"]])}, **results}
    large = large_points(data["large"]) if data.get("large") else {}
    figure = plot(results, figure, large)
    temperature = meta["temperature"]
    body = (section_header(TITLE, "bench.test_time_scaling", flags)
            + _models_line(data, figure) + _flops_line(meta))
    extra, lines = verifier_training(results, meta)
    body += "".join(f"* {line}\n" for line in lines)
    training = [f"{what} {sum(runs.values()):.3g}" for what, runs in
                (("policy", meta.get("policy_training")),
                 ("larger policy", (data.get("large") or {}).get("training"))) if runs]
    if training:
        body += ("* Training compute of the policies (FLOPs, every run on the init_from chain): "
                 + ", ".join(training) + "\n")
    if meta.get("verifier_auc"):
        body += ("* Verifier AUC, its score of the correct vs the wrong samples of the held-out "
                 "tasks (0.5: chance), per seed, pooled / within a task / median spread of one "
                 "task's scores: " + "; ".join(" / ".join(f"{x:.3f}" for x in auc)
                                              for auc in meta["verifier_auc"]) + "\n")
    per_task = all(p.tasks is not None for per_n in results.values() for p in per_n.values())
    body += (f"\nAccuracy: the mean over {_seeds(meta['seeds'])} ± its 95% t-interval over seeds"
             + (f" [95% bootstrap interval over the {meta['tasks']} tasks: {RESAMPLES:,} "
                f"resamples, seed {BOOTSTRAP_SEED}, each task's outcome averaged over the seeds]"
                if per_task else " (no interval over tasks: saved without per-task outcomes)")
             + (". `greedy`: one sample at temperature 0 (one run: seeds do not change it)"
                if "greedy" in results else "")
             + f". `first sample`: one sample at temperature {temperature}; N samples at "
               f"temperature {temperature} for the rest.\n\n" + accuracy_table(results)
             + "\n\nInference FLOPs per task:\n\n" + flops_table(results))
    if THINKING in results:
        body += (f"\n\nThinking budget: one sample at temperature {temperature} whose reasoning "
                 "is cut after the budget, then `</think>` and the answer forced "
                 "(`ftlm.infer.strategies.thinking_budget`):\n\n"
                 + thinking_table(results[THINKING]))
    if large:
        big = data["large"]
        body += (f"\n\nMatched inference FLOPs: the larger policy `{big['path']}` "
                 f"({big['params'] / 1e6:.2f}M) with one sample against each strategy of the "
                 "small policy at the N whose FLOPs per task are nearest its sampled one; "
                 "differences with the bootstrap interval of the paired per-task differences:"
                 "\n\n" + table(MATCHED_HEADERS, matched(results, large)))
        if extra:
            body += (f"\n\nThe same with the verifiers' training amortised over "
                     f"{meta['amortise_queries']:,} queries added to each query's FLOPs (the "
                     "strategies that run a verifier):\n\n"
                     + table(MATCHED_HEADERS, matched(results, large, extra)))
    if note:
        body += "\n\n" + note
    return body


def large_points(large: dict) -> dict[str, Point]:
    """The larger policy's rows: greedy (when measured) and one sample per seed."""
    out = {LARGE_GREEDY: point([large["greedy"]])} if "greedy" in large else {}
    out[LARGE_SAMPLE] = point(large["per_seed"])
    return out


def verifier_training(results: dict[str, dict[int, Point]], meta: dict
                      ) -> tuple[dict[str, float], list[str]]:
    """Each verifier's training compute amortised per query: ``({strategy: FLOPs per query},
    lines for the section)``. A policy sample costs what this study's first sample cost; a
    verifier read, what best-of-N by the verifier added at N = 1."""
    records = meta.get("verifier_training") or {}
    if not records or "first sample" not in results:
        return {}, []
    queries = meta["amortise_queries"]
    sample = results["first sample"][1].flops
    scored = results.get("best-of-N (verifier)", {}).get(1)
    read = scored.flops - sample if scored is not None else 0.0
    extra, lines = {}, []
    for which, record in records.items():
        if record.get("flops") is None and not record.get("runs"):
            flag = "--" + which.replace(" ", "-") + "-train-flops"
            lines.append(f"{which.capitalize()} training (`{record['path']}`): not recorded (no "
                         f"summary.json in its run directory; give it with {flag})")
            continue
        total = training_flops(record, sample, read if which == "verifier" else 0.0)
        per_query = amortised(total, queries)
        if record.get("flops") is not None:
            how = "given by hand"
        else:
            how = ("training runs " + ", ".join(f"`{d}` {f:.3g}" for d, f in record["runs"].items())
                   + f"; labelling {record.get('samples', 0):,} policy samples at {sample:.3g}")
            if record.get("reads"):
                how += f" and {record['reads']:,} verifier reads at {read:.3g}"
        lines.append(f"{which.capitalize()} training (`{record['path']}`): {total:.3g} FLOPs "
                     f"({how}) = {per_query:.3g} per query over {queries:,} queries")
        extra.update({name: per_query for name in results if verifier_of(name) == which})
    return extra, lines


def _models_line(data: dict, figure: Path) -> str:
    meta, large = data["meta"], data.get("large")
    parts = [f"Policy: `{meta['policy']}` ({meta['policy_params'] / 1e6:.2f}M)"]
    if meta.get("verifier"):
        parts.append(f"verifier `{meta['verifier']}` ({meta['verifier_params'] / 1e6:.2f}M)"
                     + (f" with the outcome head `{meta['verifier_head']}`"
                        if meta.get("verifier_head") else ""))
    if meta.get("process_verifier"):
        parts.append(f"process verifier `{meta['process_verifier']}` "
                     f"({meta['process_verifier_params'] / 1e6:.2f}M) for beam search, width "
                     f"{meta['beam_width']}")
    if large:
        parts.append(f"larger policy `{large['path']}` ({large['params'] / 1e6:.2f}M)")
    seconds = meta["seconds"] + (large["seconds"] if large else 0.0)
    return ("* " + "; ".join(parts)
            + f"; {meta['tasks']} held-out tasks ({meta['families']}), {_seeds(meta['seeds'])}, "
              f"temperature {meta['temperature']}, up to {meta['max_new_tokens']} new tokens. "
              f"Took {seconds:.0f} s. Plot: `bench/results/{figure.name}`\n")


def _seeds(n: int) -> str:
    return f"{n} seed" + ("s" if n != 1 else "")


def _flops_line(meta: dict) -> str:
    if meta.get("flops") == "forward_flops":
        return ("* Inference FLOPs per task: every pass through the policy (each sample's prompt "
                "and completion, each re-read partial of beam search, both passes of a thinking "
                "budget) and every text a verifier reads, at 2 x matmul weights per token plus "
                "attention to the context so far (KV cache; `ftlm.model.counts.forward_flops`)\n")
    return ("* Inference FLOPs per task: 2 x parameters per token through each model, attention "
            "left out (results saved before attention was counted)\n")
