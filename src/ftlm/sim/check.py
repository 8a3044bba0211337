"""``ftlm sim check``: run the protocol simulation over many seeds and report invariant violations.

Responsible for: spreading seeds over worker processes, progress output, the summary (faults
injected by kind, rollbacks, simulated time) and, for a failing seed, its error, its last events
and the command that replays it. Not responsible for the simulation itself (``ftlm.sim.protocol``).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, fields

from ftlm.sim.protocol import SimConfig, SimResult, run


@dataclass
class CheckReport:
    """What a batch of seeds showed."""

    seeds: int
    steps: int
    failures: list[SimResult] = field(default_factory=list)
    faults: Counter = field(default_factory=Counter)
    restores: int = 0
    restores_past_checkpoint: int = 0
    steps_past_checkpoint: int = 0
    leaves_judged: int = 0
    convictions: int = 0
    wrong_convictions: int = 0
    promotions: int = 0
    spare_quorums: int = 0
    simulated_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures


def _run_range(args: tuple[int, int, dict]) -> list[SimResult]:
    start, stop, config = args
    c = SimConfig(**config)
    return [run(seed, c) for seed in range(start, stop)]


def check(seeds: int, config: SimConfig, start: int = 0, jobs: int = 1, progress: bool = False,
          chunk: int = 50) -> CheckReport:
    """Simulate seeds ``start .. start + seeds - 1``; deterministic whatever ``jobs`` is."""
    report = CheckReport(seeds, config.steps)
    t0 = time.perf_counter()
    ranges = [(s, min(s + chunk, start + seeds), asdict(config)) for s in range(start, start + seeds, chunk)]
    done = 0

    def take(results: list[SimResult]) -> None:
        nonlocal done
        for r in results:
            done += 1
            report.faults.update(r.faults)
            report.restores += r.restores
            report.restores_past_checkpoint += r.restores_past_checkpoint
            report.steps_past_checkpoint += r.steps_past_checkpoint
            report.leaves_judged += r.leaves_judged
            report.convictions += r.convictions
            report.wrong_convictions += r.wrong_convictions
            report.promotions += r.promotions
            report.spare_quorums += r.spare_quorums
            report.simulated_seconds += r.seconds
            if not r.ok:
                report.failures.append(r)
        if progress:
            print(f"\rsim check: {done}/{seeds} seeds, {sum(report.faults.values())} faults, "
                  f"{len(report.failures)} violation(s)", end="", file=sys.stderr, flush=True)

    if jobs <= 1:
        for r in ranges:
            take(_run_range(r))
    else:
        with ProcessPoolExecutor(jobs) as pool:
            for results in pool.map(_run_range, ranges):
                take(results)
    if progress:
        print(file=sys.stderr)
    report.failures.sort(key=lambda r: r.seed)
    report.wall_seconds = time.perf_counter() - t0
    return report


def format_report(report: CheckReport, config: SimConfig, show: int = 3) -> str:
    spares = f" ({config.spares} of them spares)" if config.spares else ""
    lines = [f"{report.seeds} seeds x {report.steps} steps, {config.groups} groups{spares}: "
             f"{sum(report.faults.values())} faults injected, {report.restores} explicit rollbacks, "
             f"{report.leaves_judged} graceful leaves judged, "
             f"{report.simulated_seconds:,.0f} simulated s in {report.wall_seconds:.1f} s: "
             f"{len(report.failures)} invariant violation(s)"]
    if report.faults:
        lines.append("faults: " + ", ".join(f"{k} {v}" for k, v in sorted(report.faults.items())))
    if report.restores_past_checkpoint:
        # Not an invariant violation: a known goodput defect (a live group lagging behind the
        # newest durable checkpoint is rolled back to instead of the checkpoint).
        lines.append(f"rollbacks to a state older than the newest durable checkpoint: "
                     f"{report.restores_past_checkpoint} of {report.restores} "
                     f"({report.steps_past_checkpoint} steps on disk given up)")
    if report.convictions:
        lines.append(f"groups retired for failing every step they took part in: {report.convictions} "
                     f"({report.wrong_convictions} with a good link, each after another fault or a "
                     f"lost message)")
    if config.spares:
        lines.append(f"spares: {report.spare_quorums} quorums with a spare standing by, "
                     f"{report.promotions} spares promoted (each holding the head)")
    for r in report.failures[:show]:
        lines.append("")
        lines.append(f"VIOLATION {r.error}")
        lines.extend(f"  {t}" for t in r.trace[-30:])
        lines.append(f"  replay: {replay_command(r.seed, report.steps, config)}")
    return "\n".join(lines)


CLI_FIELDS = ("groups", "spares", "steps", "faults", "fault_mtbf", "bad_links", "sdc")
"""The fields of ``SimConfig`` that ``ftlm sim check`` sets from its options."""
LONG_STEPS = {"step_seconds": (1.0, 2.0), "allreduce_timeout": 5.0, "progress_timeout": 8.0,
              "quorum_seconds": 15.0, "progress_seconds": 60.0}
"""``--long-steps``: every step a 1-2 s phase, as a DiLoCo synchronisation's inner steps are,
with the timeouts above a phase (``ft.allreduce_timeout`` must exceed one) and the progress
bound scaled with it (a bad-link search takes several attempts of a step each)."""


def replay_command(seed: int, steps: int, config: SimConfig) -> str:
    """The command that runs ``seed`` of this check again, with every option that shapes it (a
    Python one-liner when the job's shape has fields the command has no option for)."""
    defaults = SimConfig()
    changed = {f.name: getattr(config, f.name) for f in fields(config)
               if getattr(config, f.name) != getattr(defaults, f.name)}
    long_steps = all(changed.get(k) == v for k, v in LONG_STEPS.items())
    if long_steps:
        changed = {k: v for k, v in changed.items() if k not in LONG_STEPS}
    if any(name not in CLI_FIELDS for name in changed):
        if long_steps:
            changed.update(LONG_STEPS)
        args = ", ".join(f"{k}={v!r}" for k, v in {"groups": config.groups, **changed, "steps": steps}.items())
        return (f'python -c "from ftlm.sim.protocol import SimConfig, run; '
                f'print(run({seed}, SimConfig({args})).error or \'ok\')"')
    # ``--groups`` counts the groups that may train; ``--spares`` are started beside them.
    cmd = (f"ftlm sim check --start {seed} --seeds 1 --steps {steps} "
           f"--groups {config.groups - config.spares}")
    if config.spares:
        cmd += f" --spares {config.spares}"
    if config.faults != defaults.faults:
        cmd += f" --faults {','.join(config.faults)}"
    if config.fault_mtbf != defaults.fault_mtbf:
        cmd += f" --fault-mtbf {config.fault_mtbf:g}"
    if config.bad_links != defaults.bad_links:
        cmd += f" --bad-links {config.bad_links}"
    if config.sdc != defaults.sdc:
        cmd += f" --sdc {config.sdc:g}"
    if long_steps:
        cmd += " --long-steps"
    return cmd

