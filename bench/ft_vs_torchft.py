"""Benchmark: ftlm head to head with torchft and with checkpoint-restart.

Every side trains ftlm's ``Transformer`` on the same demo batches (participant ``i`` of ``P`` takes
the same global samples), with the same group count, the same timeouts and the same failure plan
(``bench.baselines``), one after the other in one run; every stall and ETT is computed from the
jobs' events by ``ftlm.observe.summary`` (the baselines' workers log ftlm-format events):

1. *Steady state*: step time of ftlm (2 groups) vs torchft (2 replica groups) vs plain DDP
   (2 ranks, ``bench.ft_overhead``), no failures.
2. *Failure stall*: 3 groups; group g2 SIGKILLs or SIGSTOPs itself at a fixed step after its
   forward pass (ftlm's ``before_allreduce`` point). Stall = longest gap between the healthy
   groups' commits charged to the failure, minus the median step (``summary.stall_seconds``).
3. *Rejoin stall vs state size*: the same kill at growing model sizes; the stall charged to the
   restarted group's ``recovery_start`` (its rejoin and state transfer).
4. *Chaos goodput*: 4 groups, a SIGKILL every ``mtbf`` seconds on average (the same seeded
   draws for all), ETT of ftlm, torchft and checkpoint-restart (all ranks restart from the latest
   durable checkpoint on every failure, as torchrun elastic does).

    python -m bench.ft_vs_torchft [--quick] [--parts 1 2 3 4] [--chaos-seconds S] [--no-write]
    python -m bench.ft_vs_torchft --parts 2 3 4 --repeat 3 --json runs/ft_vs_torchft.jsonl
    python -m bench.ft_vs_torchft --merge runs/a.jsonl runs/b.jsonl runs/c.jsonl

With ``--repeat N`` every cell is the median over N whole repetitions with its min-max (single
runs on a shared box move by 2-3x); ``--json`` keeps each repetition's numbers, and ``--merge``
writes the section from repetitions run separately.

torchft is an optional dependency (``pip install -e '.[bench]'``); without it the torchft columns
say so and the rest still runs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import sys
import time
from pathlib import Path

from bench import ft_overhead
from bench.baselines import JobResult, Plan, run_ckpt_restart, run_ftlm, run_torchft
from bench.common import (BENCHMARKS_MD, command_line, commits_by_group, ensure_demo,
                          machine_description, median, section_header, steady, table,
                          write_section)

SECTION = "ft_vs_torchft"
# Larger than `small`, still trainable on 2 cores (parameters incl. tied embeddings).
CUSTOM = {
    "medium": {"size": "small", "dim": 512, "n_layers": 12, "n_heads": 8, "n_kv_heads": 2,
               "ffn_dim": 1408},
    "large": {"size": "small", "dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4,
              "ffn_dim": 2048},
}


def model_of(name: str) -> dict:
    return dict(CUSTOM.get(name, {"size": name}))


def torchft_missing() -> str:
    """Why torchft cannot run here ('' when it can)."""
    try:
        import torchft  # noqa: F401
        from torchft import Manager, ProcessGroupGloo  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means the same to the user
        return (f"torchft is not importable ({type(e).__name__}: {e}); install the optional "
                "benchmark dependency: .venv/bin/pip install -e '.[bench]' torch==2.13.0")
    return ""


def params_of(model: dict) -> int:
    from ftlm.config import build_config
    from ftlm.model.counts import param_count
    return param_count(build_config({"model": model}).model)


# -- 1. steady state -------------------------------------------------------------------------------
def part1(quick: bool, have_torchft: bool) -> list[dict]:
    """Median step seconds of ftlm, torchft (None without it) and DDP, per model."""
    cases = ([ft_overhead.Case("tiny", 8, 12, 4)] if quick else
             [ft_overhead.Case("tiny", 8, 30, 5), ft_overhead.Case("small", 8, 12, 3)])
    rows = []
    for case in cases:
        ft = ft_overhead.run_ftlm(case)
        tf = _torchft_steady(case) if have_torchft else None
        ddp = ft_overhead.run_ddp(case)
        row = {"model": case.size, "steps": case.steps, "warmup": case.warmup,
               "ftlm": median(ft.step_seconds), "torchft": median(tf) if tf else None,
               "ddp": median(ddp.step_seconds)}
        print(f"  steady {case.size}: {row}", flush=True)
        rows.append(row)
    return rows


def _torchft_steady(case: ft_overhead.Case) -> list[float]:
    def enough(events):
        c = commits_by_group(events)
        return len(c) == 2 and all(len(v) >= case.steps for v in c.values())
    res = run_torchft(Plan(model=model_of(case.size), batch=case.batch, groups=2, stop=enough,
                           duration=600, ft={"heartbeat_timeout": 5.0,
                                             "allreduce_timeout": 20.0}))
    commits = commits_by_group(res.events)
    return [s for g in commits.values()
            for s in steady([e["step_seconds"] for e in g if e.get("participants") == 2],
                            case.warmup)]


# -- 2 and 3. failure and rejoin stalls ------------------------------------------------------------
def _stalls(res: JobResult) -> dict:
    """Stall charged to the injected failure of g2 and to g2's first rejoin after it."""
    from ftlm.observe.summary import failure_events, median_step_seconds, stall_seconds
    events = sorted(res.events, key=lambda e: e["ts"])
    med = median_step_seconds(events)
    fails = failure_events(events)
    stalls = stall_seconds(events, med)
    out = {"median": med, "failure": None, "rejoin": None, "doomed": None}
    t_fail = None
    for f, s in zip(fails, stalls):
        if f.kind == "failure_injected" and f.group == "g2" and t_fail is None:
            out["failure"], t_fail = s, f.ts
            out["doomed"] = doomed_step(events, t_fail)
        elif f.kind == "recovery_start" and f.group == "g2" and t_fail is not None:
            out["rejoin"] = s
            break
    return out


def doomed_step(events: list[dict], t_fail: float) -> float | None:
    """Seconds the healthy groups spent on the step the failure at ``t_fail`` doomed: from the
    job's last commit before it (the earliest healthy commit of that step) to the first healthy
    ``step_failed`` after it (the moment a survivor learnt the step was lost). The rest of the
    stall is the protocol's: the new quorum, the new process group, the redone step's excess over
    a median one. None where a side logs no ``step_failed``."""
    healthy = [e for e in events if not str(e.get("group", "")).startswith("g2")]
    before = [e for e in healthy if e["kind"] == "commit" and e["ts"] <= t_fail]
    failed = next((e["ts"] for e in healthy if e["kind"] == "step_failed" and e["ts"] > t_fail), None)
    if not before or failed is None:
        return None
    last_step = max(e["step"] for e in before)
    started = min(e["ts"] for e in before if e["step"] == last_step)
    return failed - started


def _fault_plan(model: str, batch: int, fault: str, duration: float) -> Plan:
    at = int(fault.partition("@")[2])

    def rejoined(events) -> bool:  # g2 came back and committed 3 steps after its failure
        t = next((e["ts"] for e in events if e["kind"] == "failure_injected"), None)
        late = [e for e in events if e["kind"] == "commit" and t is not None and e["ts"] > t]
        g2 = [e for e in late if str(e["group"]).startswith("g2")]
        return len(g2) >= 3 and len(late) >= 3 * 3 + at
    return Plan(model=model_of(model), batch=batch, groups=3, faults={"g2": fault},
                stop=rejoined, duration=duration)


def part23(sizes: list[tuple[str, int, int]], signals: list[str], have_torchft: bool,
           duration: float) -> list[dict]:
    """One record per model, signal and system: median step, failure stall, rejoin stall (s)."""
    rows = []
    for model, batch, at in sizes:
        params = params_of(model_of(model))
        for sig in signals:
            if sig == "stop" and model != sizes[0][0]:
                continue  # the hang is measured at the smallest size only
            fault = f"{sig}@{at}"
            results = {"ftlm": _stalls(run_ftlm(_fault_plan(model, batch, fault, duration)))}
            if have_torchft:
                plan = _fault_plan(model, batch, fault, duration)
                # torchft has no hang killer of its own: its peers wait for the process group
                # timeout; the supervisor kills the hung worker after that, so it can rejoin.
                plan.hang_kill_after = plan.ft_value("allreduce_timeout") + 1.0
                results["torchft"] = _stalls(run_torchft(plan))
            print(f"  stalls {model} {fault}: {results}", flush=True)
            for system, r in results.items():
                rows.append({"model": model, "params": params, "batch": batch, "at": at,
                             "signal": sig, "system": system, **r})
    return rows


# -- 4. chaos goodput ------------------------------------------------------------------------------
def _ett(res: JobResult) -> tuple[float, int, int]:
    """ETT over [first commit, end of run] (start-up excluded, the same for all sides), commits,
    failures injected."""
    from ftlm.observe.summary import build_summary
    events = sorted(res.events, key=lambda e: e["ts"])
    commits = [e["ts"] for e in events if e["kind"] == "commit"]
    if not commits:
        return 0.0, 0, sum(1 for e in events if e["kind"] == "failure_injected")
    end = max(e["ts"] for e in events) if res.summary else events[0]["ts"] + res.wall
    if res.summary is None:
        end = max(end, commits[-1])
    window = [e for e in events if e["ts"] >= commits[0]]
    s = build_summary(window, wall_seconds=end - commits[0], state_hashes={}, config={},
                      groups=[])
    return s["ett"], s["steps_committed"], s["failures_injected"]


def part4(seconds: float, mtbf: float, seed: int, have_torchft: bool) -> list[dict]:
    """ETT, steps committed and failures injected of each system under the same chaos draws."""
    plan = lambda: Plan(model=model_of("tiny"), batch=8, groups=4, chaos_mtbf=mtbf,  # noqa: E731
                        chaos_seed=seed, duration=seconds, ckpt_every=10)
    sides = [("ftlm", run_ftlm)] + ([("torchft", run_torchft)] if have_torchft else []) + [
        ("checkpoint-restart", run_ckpt_restart)]
    rows = []
    for name, fn in sides:
        ett, steps, fails = _ett(fn(plan()))
        print(f"  chaos {name}: ETT {ett:.3f}, {steps} steps, {fails} failures", flush=True)
        rows.append({"system": name, "ett": ett, "steps": steps, "failures": fails,
                     "seconds": seconds, "mtbf": mtbf, "seed": seed})
    return rows


# -- several repetitions: medians and their spread -------------------------------------------------
def cell(values: list[float | None], digits: int = 3) -> str:
    """The median of one measurement over repetitions, with its min-max when there are several;
    'n/a' where no repetition measured it (a repetition that did not is counted in brackets)."""
    got = sorted(v for v in values if v is not None)
    if not got:
        return "n/a"
    text = f"{median(got):.{digits}f}"
    if len(got) > 1:
        text += f" ({got[0]:.{digits}f}-{got[-1]:.{digits}f})"
    if len(got) < len(values):
        text += f" [{len(values) - len(got)} of {len(values)} n/a]"
    return text


def _ratio(a: list[float | None], b: list[float | None]) -> str:
    pairs = [x / y for x, y in zip(a, b) if x is not None and y]
    return cell(pairs, 2) if pairs else "n/a"


def _runs_line(reps: list[dict]) -> str:
    """Which runs a part's table summarises: dates, commands and how many repetitions."""
    dates = sorted(r["date"] for r in reps)
    when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    commands = ", ".join(f"`{c}`" for c in dict.fromkeys(r["command"] for r in reps))
    n = len(reps)
    how = "one run" if n == 1 else f"{n} repetitions; each cell the median (min-max) over them"
    loads = sorted(r["load"] for r in reps if "load" in r)
    load = (f", load average {loads[0]:.1f}" + (f"-{loads[-1]:.1f}" if len(loads) > 1 else "")
            + " at the start" if loads else "")
    return f"*Measured* {when} by {commands}: {how}{load}.\n\n"


def _by(reps: list[dict], part: str, **match) -> list[dict | None]:
    """For each repetition, its record of ``part`` matching every field of ``match`` (or None)."""
    return [next((r for r in rep.get(part, []) if all(r.get(k) == v for k, v in match.items())),
                 None) for rep in reps]


def render_part1(reps: list[dict]) -> str:
    reps = [r for r in reps if r.get("part1")]
    rows = []
    for first in reps[0]["part1"]:
        recs = _by(reps, "part1", model=first["model"])
        ft, tf, ddp = ([r[k] if r else None for r in recs] for k in ("ftlm", "torchft", "ddp"))
        rows.append([first["model"], cell(ft, 4), cell(tf, 4), cell(ddp, 4), _ratio(ft, ddp),
                     _ratio(tf, ddp), _ratio(ft, tf)])
    steps = ", ".join(f"{r['model']}: {r['steps']} steps, first {r['warmup']} skipped"
                      for r in reps[0]["part1"])
    head = ["model", "ftlm step s", "torchft step s", "DDP step s", "ftlm/DDP", "torchft/DDP",
            "ftlm/torchft"]
    return ("### 1. Steady-state step time, 2 groups, no failures\n\n" + _runs_line(reps)
            + f"ftlm, torchft and DDP in turn per model ({steps}); batch 8 per group, 1 thread "
            "per process, `ft.heartbeat_timeout=5` on both FT sides. Step s: median over both "
            "processes of quorum (DDP: batch fetch) to end of the optimizer step.\n\n"
            + table(head, rows) + "\n")


def render_part2(reps: list[dict]) -> str:
    reps = [r for r in reps if r.get("part23")]
    first = reps[0]["part23"]
    keys = list(dict.fromkeys((r["model"], r["signal"]) for r in first))
    rows = []
    for model, sig in keys:
        ft = _by(reps, "part23", model=model, signal=sig, system="ftlm")
        tf = _by(reps, "part23", model=model, signal=sig, system="torchft")
        params = next(r["params"] for r in first if r["model"] == model)
        rows.append([model, f"{params / 1e6:.1f}M", "SIGKILL" if sig == "kill" else "SIGSTOP",
                     cell([r and r["median"] for r in ft]), cell([r and r["failure"] for r in ft]),
                     cell([r and r.get("doomed") for r in ft]),
                     cell([r and r["median"] for r in tf]), cell([r and r["failure"] for r in tf]),
                     cell([r and r.get("doomed") for r in tf])])
    at = dict.fromkeys((r["model"], r["at"]) for r in first)
    plan = ", ".join(f"{m}: step {a}" for m, a in at)
    head = ["model", "params", "signal", "ftlm median step s", "ftlm stall s",
            "ftlm doomed step s", "torchft median step s", "torchft stall s",
            "torchft doomed step s"]
    return ("### 2. Stall of the healthy groups per failure, 3 groups\n\n" + _runs_line(reps)
            + f"g2 kills or stops itself after the forward pass of the step in the plan ({plan}); "
            "ftlm and torchft both with a 1 s heartbeat timeout, a 2 s join timeout and a 10 s "
            "all-reduce (process group) timeout. A stopped ftlm group is killed by the launcher "
            "once its heartbeat is lost; a stopped torchft worker is killed by the bench "
            "supervisor 11 s after it stopped (torchft has no hang detector of its own; its peers "
            "wait for the process-group timeout). *Doomed step*: what the survivors had spent "
            "on the step the failure doomed before they learnt it was lost (`doomed_step`: from "
            "the job's last commit to the first healthy `step_failed`); the stall is about that "
            "plus the protocol's own part (the new quorum and process group, the redone step's "
            "excess over a median one). n/a: no `step_failed` logged, or a repetition from "
            "before this column.\n\n" + table(head, rows) + "\n")


def render_part3(reps: list[dict]) -> str:
    reps = [r for r in reps if r.get("part23")]
    first = [r for r in reps[0]["part23"] if r["signal"] == "kill"]
    rows = []
    for model in dict.fromkeys(r["model"] for r in first):
        ft = _by(reps, "part23", model=model, signal="kill", system="ftlm")
        tf = _by(reps, "part23", model=model, signal="kill", system="torchft")
        params = next(r["params"] for r in first if r["model"] == model)
        rows.append([model, f"{params / 1e6:.1f}M", cell([r and r["median"] for r in ft]),
                     cell([r and r["rejoin"] for r in ft]), cell([r and r["median"] for r in tf]),
                     cell([r and r["rejoin"] for r in tf])])
    batch = dict.fromkeys((r["model"], r["batch"]) for r in first)
    batches = ", ".join(f"{m}: {b}" for m, b in batch)
    head = ["model", "params", "ftlm median step s", "ftlm rejoin stall s",
            "torchft median step s", "torchft rejoin stall s"]
    # (Measured by the runs part 2 names when both come from these repetitions.)
    runs = "" if all(2 in r["parts"] for r in reps) else _runs_line(reps)
    return ("### 3. Stall of the healthy groups per rejoin as the state grows\n\n"
            + runs
            + "The SIGKILL runs of part 2; the restarted g2 rejoins and takes the state "
            "(parameters and AdamW moments) from a peer; the stall is the one charged to its "
            f"`recovery_start`. Batches per group: {batches}.\n\n" + table(head, rows) + "\n")


def render_part4(reps: list[dict]) -> str:
    reps = [r for r in reps if r.get("part4")]
    first = reps[0]["part4"]
    rows = []
    for system in [r["system"] for r in first]:
        recs = _by(reps, "part4", system=system)
        rows.append([system, cell([r and r["ett"] for r in recs]),
                     cell([r and r["steps"] for r in recs], 0),
                     cell([r and r["failures"] for r in recs], 0)])
    f = first[0]
    return (f"### 4. Chaos goodput, 4 groups, tiny, SIGKILL every ~{f['mtbf']:g} s "
            f"(seed {f['seed']}), {f['seconds']:.0f} s per system\n\n" + _runs_line(reps)
            + "ETT = committed tokens / (window x steady token rate), by `ftlm.observe.summary`, "
            "over the window from the job's first commit to the end of the run (start-up excluded "
            "on every side). Checkpoint-restart: one plain DDP job of 4 ranks checkpointing every "
            "10 steps; any failure kills every rank and the job restarts from the latest "
            "checkpoint after `ft.restart_delay`.\n\n"
            + table(["system", "ETT", "steps committed", "failures injected"], rows) + "\n")


def render(reps: list[dict]) -> dict[int, str]:
    """Part number -> its subsection, for the parts these repetitions measured."""
    out = {}
    if any(r.get("part1") for r in reps):
        out[1] = render_part1(reps)
    if any(r.get("part23") and 2 in r["parts"] for r in reps):
        out[2] = render_part2([r for r in reps if 2 in r["parts"]])
    if any(r.get("part23") and 3 in r["parts"] for r in reps):
        out[3] = render_part3([r for r in reps if 3 in r["parts"]])
    if any(r.get("part4") for r in reps):
        out[4] = render_part4(reps)
    return out


def read_reps(paths: list[str]) -> list[dict]:
    """Repetitions saved by ``--json`` (one JSON object per line), from one or more files."""
    reps = []
    for path in paths:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rep = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not a JSON line ({e}); --merge takes the files "
                                 "that --json wrote") from e
            if not isinstance(rep, dict) or "parts" not in rep:
                raise SystemExit(f"{path}:{n}: no 'parts' field: not a repetition written by "
                                 "--json")
            reps.append(rep)
    if not reps:
        raise SystemExit(f"--merge: no repetitions in {', '.join(paths)}")
    return reps


# -- the benchmark ---------------------------------------------------------------------------------
def measure(args: argparse.Namespace, parts: list[int], sizes: list[tuple[str, int, int]],
            have_torchft: bool) -> dict:
    """One repetition of the chosen parts, as a JSON-ready record."""
    rep: dict = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "command": command_line(), "machine": machine_description(), "parts": parts,
                 "torchft": _torchft_version() if have_torchft else "not measured",
                 "load": os.getloadavg()[0]}
    if 1 in parts:
        rep["part1"] = part1(args.quick, have_torchft)
    if 2 in parts or 3 in parts:
        signals = ["kill"] if args.quick else ["kill", "stop"]
        rep["part23"] = part23(sizes if 3 in parts else sizes[:1], signals, have_torchft,
                               duration=55.0 if args.quick else 300.0)
    if 4 in parts:
        rep["part4"] = part4(args.chaos_seconds or (45.0 if args.quick else 240.0),
                             args.mtbf or (15.0 if args.quick else 30.0), args.seed, have_torchft)
    return rep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ft_vs_torchft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run of about two minutes")
    p.add_argument("--parts", nargs="+", type=int, choices=[1, 2, 3, 4], default=None,
                   help="which comparisons to run (default all; with --quick: 2)")
    p.add_argument("--chaos-seconds", type=float, default=None,
                   help="length of each chaos run (default 240, 45 with --quick)")
    p.add_argument("--mtbf", type=float, default=None, help="chaos mean time between failures "
                   "(default 30 s, 15 with --quick)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sizes", default=None,
                   help="parts 2 and 3: only these models, e.g. large or tiny,large (default all; "
                        "a written section then has only their rows)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the chosen parts N times, one whole repetition after another; each "
                        "cell is then the median over them with its min-max (default 1)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="append each repetition's measurements to PATH as one JSON line, as it "
                        "finishes (for --merge)")
    p.add_argument("--merge", nargs="+", default=None, metavar="PATH",
                   help="measure nothing: write the section from the repetitions that --json "
                        "saved in these files (e.g. three separate runs), medians over all")
    p.add_argument("--no-write", action="store_true", help="print, leave BENCHMARKS.md alone")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.merge:
        reps = read_reps(args.merge)
        _write(reps, args, "", None, final=True)
        return 0
    ensure_demo()
    missing = torchft_missing()
    if missing:
        print(f"ft_vs_torchft: {missing}; measuring ftlm and the other baselines only",
              file=sys.stderr, flush=True)
    parts = sorted(args.parts or ([2] if args.quick else [1, 2, 3, 4]))
    sizes = ([("tiny", 8, 4)] if args.quick else
             [("tiny", 8, 8), ("small", 4, 5), ("medium", 2, 4), ("large", 1, 4)])
    if args.sizes:
        wanted = args.sizes.split(",")
        unknown = sorted(set(wanted) - {m for m, _, _ in sizes})
        if unknown:
            p.error(f"--sizes: unknown {', '.join(unknown)}; choose from "
                    f"{', '.join(m for m, _, _ in sizes)}")
        sizes = [s for s in sizes if s[0] in wanted]
    t0 = time.perf_counter()
    reps: list[dict] = []
    for i in range(args.repeat):
        print(f"ft_vs_torchft: repetition {i + 1} of {args.repeat}, parts {parts}", flush=True)
        reps.append(measure(args, parts, sizes, not missing))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(reps[-1]) + "\n")
        # Written after every repetition, so that a run cut short keeps what it finished.
        _write(reps, args, missing, t0, final=i + 1 == args.repeat)
    return 0


def _write(reps: list[dict], args: argparse.Namespace, missing: str, t0: float | None,
           final: bool) -> None:
    """Print the section and (unless --no-write) rewrite it, keeping from BENCHMARKS.md the
    subsections of the parts these repetitions did not measure."""
    flags = (["--quick"] if args.quick else []) + (
        [f"--parts {' '.join(map(str, args.parts))}"] if args.parts else []) + (
        [f"--repeat {args.repeat}"] if args.repeat > 1 else [])
    if t0 is None:
        took = f"Merged from {len(reps)} repetition(s) saved by `--json`."
    else:
        took = (f"Took {time.perf_counter() - t0:.0f} s"
                + ("." if final else f" so far ({len(reps)} of {args.repeat} repetitions)."))
    torchft = "; ".join(dict.fromkeys(r.get("torchft", "unknown") for r in reps))
    machines = "; ".join(dict.fromkeys(r.get("machine", "unknown") for r in reps))
    if missing:
        torchft = f"not measured: {missing}"
    blocks = _earlier_parts()
    blocks.update(render(reps))
    text = (section_header("ftlm vs torchft vs checkpoint-restart", "bench.ft_vs_torchft", flags)
            + f"* Repetitions measured on: {machines}\n* torchft: {torchft}\n"
            + f"* {took} Each part's subsection names the runs it comes from.\n\n"
            + "\n".join(blocks[k] for k in sorted(blocks)))
    if final:
        print(text)
    if not args.no_write:
        write_section(SECTION, text)


def _earlier_parts() -> dict[int, str]:
    """Part number -> its subsection as BENCHMARKS.md holds it now."""
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.is_file() else ""
    m = re.search(rf"<!-- bench:{SECTION} -->(.*?)<!-- /bench:{SECTION} -->", text, re.DOTALL)
    return {int(b[0]): "### " + b.rstrip() + "\n"
            for b in (m.group(1).split("\n### ")[1:] if m else []) if b[:1].isdigit()}


def _torchft_version() -> str:
    from importlib.metadata import version
    return f"torchft {version('torchft')} (PyPI), lighthouse binary `torchft_lighthouse`"


if __name__ == "__main__":
    raise SystemExit(main())
