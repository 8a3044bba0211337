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

torchft is an optional dependency (``pip install -e '.[bench]'``); without it the torchft columns
say so and the rest still runs.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench import ft_overhead
from bench.baselines import JobResult, Plan, run_ckpt_restart, run_ftlm, run_torchft
from bench.common import (commits_by_group, ensure_demo, median, section_header, steady, table,
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
def part1(quick: bool, have_torchft: bool) -> str:
    cases = ([ft_overhead.Case("tiny", 8, 12, 4)] if quick else
             [ft_overhead.Case("tiny", 8, 30, 5), ft_overhead.Case("small", 8, 12, 3)])
    rows = []
    for case in cases:
        ft = ft_overhead.run_ftlm(case)
        tf = _torchft_steady(case) if have_torchft else None
        ddp = ft_overhead.run_ddp(case)
        f, d = median(ft.step_seconds), median(ddp.step_seconds)
        t = median(tf) if tf else None
        print(f"  steady {case.size}: ftlm {f:.4f} torchft {t} ddp {d:.4f}", flush=True)
        rows.append([case.size, f"{f:.4f}", f"{t:.4f}" if t else "n/a", f"{d:.4f}",
                     f"{f / d:.2f}", f"{t / d:.2f}" if t else "n/a",
                     f"{f / t:.2f}" if t else "n/a"])
    head = ["model", "ftlm step s", "torchft step s", "DDP step s", "ftlm/DDP", "torchft/DDP",
            "ftlm/torchft"]
    steps = ", ".join(f"{c.size}: {c.steps} steps, first {c.warmup} skipped" for c in cases)
    return ("### 1. Steady-state step time, 2 groups, no failures\n\n"
            f"One run each, in the order ftlm, torchft, DDP per model ({steps}); batch 8 per "
            "group, 1 thread per process, `ft.heartbeat_timeout=5` on both FT sides (see the "
            "ft_overhead section for why). Step s: median over both processes of quorum (DDP: "
            "batch fetch) to end of the optimizer step.\n\n" + table(head, rows) + "\n")


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
    out = {"median": med, "failure": None, "rejoin": None}
    t_fail = None
    for f, s in zip(fails, stalls):
        if f.kind == "failure_injected" and f.group == "g2" and t_fail is None:
            out["failure"], t_fail = s, f.ts
        elif f.kind == "recovery_start" and f.group == "g2" and t_fail is not None:
            out["rejoin"] = s
            break
    return out


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
           duration: float) -> tuple[str, str]:
    rows2, rows3 = [], []
    for model, batch, at in sizes:
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
            f, t = results["ftlm"], results.get("torchft")
            fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
            row = [model, f"{params_of(model_of(model)) / 1e6:.1f}M", "SIGKILL" if sig == "kill"
                   else "SIGSTOP", fmt(f["median"]), fmt(f["failure"]),
                   fmt(t["median"]) if t else "n/a", fmt(t["failure"]) if t else "n/a"]
            if sig == "kill" and model == sizes[0][0] or sig == "stop":
                rows2.append(row)
            if sig == "kill":
                rows3.append(row[:2] + [fmt(f["median"]), fmt(f["rejoin"]),
                                        fmt(t["median"]) if t else "n/a",
                                        fmt(t["rejoin"]) if t else "n/a"])
    h2 = ["model", "params", "signal", "ftlm median step s", "ftlm stall s", "torchft median "
          "step s", "torchft stall s"]
    h3 = ["model", "params", "ftlm median step s", "ftlm rejoin stall s", "torchft median "
          "step s", "torchft rejoin stall s"]
    return (table(h2, rows2), table(h3, rows3))


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


def part4(seconds: float, mtbf: float, seed: int, have_torchft: bool) -> tuple[str, list]:
    plan = lambda: Plan(model=model_of("tiny"), batch=8, groups=4, chaos_mtbf=mtbf,  # noqa: E731
                        chaos_seed=seed, duration=seconds, ckpt_every=10)
    sides = [("ftlm", run_ftlm)] + ([("torchft", run_torchft)] if have_torchft else []) + [
        ("checkpoint-restart", run_ckpt_restart)]
    rows = []
    for name, fn in sides:
        ett, steps, fails = _ett(fn(plan()))
        print(f"  chaos {name}: ETT {ett:.3f}, {steps} steps, {fails} failures", flush=True)
        rows.append([name, f"{ett:.3f}", steps, fails])
    return table(["system", "ETT", "steps committed", "failures injected"], rows), rows


# -- the benchmark ---------------------------------------------------------------------------------
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
    p.add_argument("--no-write", action="store_true", help="print, leave BENCHMARKS.md alone")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    ensure_demo()
    missing = torchft_missing()
    if missing:
        print(f"ft_vs_torchft: {missing}; measuring ftlm and the other baselines only",
              file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    quick = args.quick
    chaos_s = args.chaos_seconds or (45.0 if quick else 240.0)
    mtbf = args.mtbf or (15.0 if quick else 30.0)
    parts = args.parts or ([2] if quick else [1, 2, 3, 4])
    body = []
    if 1 in parts:
        body.append(part1(quick, not missing))
        _write(body, args, missing, t0, final=False)
    if 2 in parts or 3 in parts:
        sizes = ([("tiny", 8, 4)] if quick else
                 [("tiny", 8, 8), ("small", 4, 5), ("medium", 2, 4), ("large", 1, 4)])
        signals = ["kill"] if quick else ["kill", "stop"]
        if 3 not in parts:
            sizes = sizes[:1]
        if args.sizes:
            wanted = args.sizes.split(",")
            unknown = sorted(set(wanted) - {m for m, _, _ in sizes})
            if unknown:
                p.error(f"--sizes: unknown {', '.join(unknown)}; choose from "
                        f"{', '.join(m for m, _, _ in sizes)}")
            sizes = [s for s in sizes if s[0] in wanted]
        t2, t3 = part23(sizes, signals, not missing, duration=55.0 if quick else 300.0)
        if 2 in parts:
            body.append("### 2. Stall of the healthy groups per failure, 3 groups\n\n"
                        "g2 kills or stops itself after the forward pass of the step in the plan "
                        f"({', '.join(f'{m}: step {a}' for m, _, a in sizes)}); ftlm and torchft "
                        "both with a 1 s heartbeat timeout, a 2 s join timeout and a 10 s "
                        "all-reduce (process group) timeout. A stopped ftlm group is killed by "
                        "the launcher once its heartbeat is lost; a stopped torchft worker is "
                        "killed by the bench supervisor 11 s after it stopped (torchft has no "
                        "hang detector of its own; its peers wait for the process-group "
                        "timeout).\n\n" + t2 + "\n")
        if 3 in parts:
            body.append("### 3. Stall of the healthy groups per rejoin as the state grows\n\n"
                        "The same SIGKILL runs; the restarted g2 rejoins and takes the state "
                        "(parameters and AdamW moments) from a peer; the stall is the one "
                        "charged to its `recovery_start`. Batches per group: "
                        f"{', '.join(f'{m}: {b}' for m, b, _ in sizes)}.\n\n" + t3 + "\n")
        _write(body, args, missing, t0, final=False)
    if 4 in parts:
        t4, _ = part4(chaos_s, mtbf, args.seed, not missing)
        body.append(f"### 4. Chaos goodput, 4 groups, tiny, SIGKILL every ~{mtbf:g} s "
                    f"(seed {args.seed}), {chaos_s:.0f} s per system\n\n"
                    "ETT = committed tokens / (window x steady token rate), by "
                    "`ftlm.observe.summary`, over the window from the job's first commit to the "
                    "end of the run (start-up excluded on every side). Checkpoint-restart: one "
                    "plain DDP job of 4 ranks checkpointing every 10 steps; any failure kills "
                    "every rank and the job restarts from the latest checkpoint after "
                    "`ft.restart_delay`.\n\n" + t4 + "\n")
    if not body:
        return 0
    _write(body, args, missing, t0, final=True)
    return 0


def _write(body: list[str], args: argparse.Namespace, missing: str, t0: float,
           final: bool) -> None:
    """Print the section and (unless --no-write) rewrite it; called after every part so that a
    run cut short still leaves the parts it finished."""
    flags = (["--quick"] if args.quick else []) + (
        [f"--parts {' '.join(map(str, args.parts))}"] if args.parts else [])
    took = f"Took {time.perf_counter() - t0:.0f} s" + ("." if final else " so far (unfinished).")
    body = _with_earlier_parts(body, args.parts)
    text = (section_header("ftlm vs torchft vs checkpoint-restart",
                           "bench.ft_vs_torchft", flags)
            + f"* torchft: {'not measured: ' + missing if missing else _torchft_version()}\n"
            + f"* {took}\n\n" + "\n".join(body))
    if final:
        print(text)
    if not args.no_write:
        write_section(SECTION, text)


def _with_earlier_parts(body: list[str], parts: list[int] | None) -> list[str]:
    """With --parts, keep the subsections of the other parts from BENCHMARKS.md, in order."""
    if not parts:
        return body
    import re
    from bench.common import BENCHMARKS_MD
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.is_file() else ""
    m = re.search(rf"<!-- bench:{SECTION} -->(.*?)<!-- /bench:{SECTION} -->", text, re.DOTALL)
    blocks = {int(b[0]): "### " + b.rstrip() + "\n"
              for b in (m.group(1).split("\n### ")[1:] if m else []) if b[:1].isdigit()}
    for b in body:
        blocks[int(b[4])] = b
    return [blocks[k] for k in sorted(blocks)]


def _torchft_version() -> str:
    from importlib.metadata import version
    return f"torchft {version('torchft')} (PyPI), lighthouse binary `torchft_lighthouse`"


if __name__ == "__main__":
    raise SystemExit(main())
