"""Calibration: the simulator's parameters measured on a real run directory.

From ``events.jsonl`` and ``summary.json`` of a finished ``ftlm launch local`` (or cluster) run:

* ``startup``: the job's launch (``run_start``) to the start of its first committed step (its
  first commit less one median step), and ``teardown`` its last commit to the end of the record
  (saving, hashing, exiting);
* ``job_mtbf``: wall time over the group failures injected (chaos) or, without chaos, detected;
* ``detection``: an injected failure to the coordinator's ``member_dead`` of that group (before
  the group's next failure: a process killed while it starts, before it joined, has no death to
  detect);
* ``stall``: mean stall per failure of a group that was in the quorums (``summary.stall_seconds``
  of those failures: a group killed while it starts stalls nobody), and ``rejoin_stall`` the mean
  of the rejoins';
* ``restart``: a failure to its group's next ``recovery_start`` (process start, set-up, join);
* ``catchup``: ``recovery_start`` to the start of the group's next committed step (its commit
  less one median step);
* ``speed_by_participants``: the job's token rate with P groups committing over the rate with
  all of them (commits within a stall, gaps over 3 median steps, are left out).
* with spare groups (``run_start``'s ``spares``): ``groups`` counts the training places only,
  ``promotion`` the mean time from a failure to the promotion of a spare in its place (from the
  failure itself: the summary's ``failure_to_promotion_seconds`` counts from the failure or its
  detection, whichever came last), and the groups are numbered for the failure trace by their
  role at the first quorum (those that trained first, then the spares), as the simulator
  numbers its slots.

Means, not medians: ETT is linear in each of them. ``Calibration.local_model`` is the same job
as a ``JobModel``; ``Calibration.measured_ett`` is the run's ETT against the same reference
(the all-groups rate), next to the summary's own. It does not run anything.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from ftlm.errors import DataError
from ftlm.goodput.model import JobModel
from ftlm.observe.events import read_events
from ftlm.observe.summary import (COORDINATOR, affected_group, commit_steps, failure_events,
                                  failure_ledger, final_history)

GAP_STEPS = 3.0
"""A commit gap longer than this many median steps is a stall, not a speed sample."""
MIN_RATE_SAMPLES = 10
"""Steps a participant count needs for its own token rate (else: linear in participants)."""
MAX_SPEED = 4.0
"""Cap of a measured relative speed. Above 1 when fewer groups commit tokens faster than the
reference (on a loaded CPU box a killed group frees cores for the others; the reference is the
summary's steady rate when too few steps had every group)."""
NO_FAILURES_MTBF = 1e15
"""Seconds between failures the model of a run without failures assumes (none in its lifetime)."""


@dataclass(frozen=True)
class Calibration:
    """What one real run measured, in the simulator's terms (seconds)."""

    run_dir: str
    groups: int
    duration: float
    startup: float
    teardown: float
    failures: int
    job_mtbf: float
    detection: float
    stall: float
    rejoin_stall: float
    restart: float
    catchup: float
    median_step: float
    speed_by_participants: tuple[float, ...]
    ett_summary: float
    """ETT as ``summary.json`` reports it (against the steady rate of failure-free windows)."""
    measured_ett: float
    """Committed tokens over wall time x the all-groups token rate: the simulator's ETT."""
    samples: dict[str, int]
    """How many measurements each mean is over."""
    failure_trace: tuple[tuple[float, int], ...] = ()
    """The run's group failures, ``(seconds from the start, group index)``."""
    spares: int = 0
    """Spare groups the run was launched with (beside ``groups`` training places)."""
    promotion: float | None = None
    """Mean seconds from a failure to the promotion of a spare in its place (None: none)."""

    def replay_model(self) -> JobModel:
        """``local_model`` with the run's own failures (times and groups) instead of random ones."""
        return self.local_model().with_changes(failure_trace=self.failure_trace)

    def local_model(self) -> JobModel:
        """The measured job as a ``JobModel`` (ft mode, one GPU per group: the layout of a local
        run only scales the failure rate, which is set from ``job_mtbf``; chaos never strikes
        the last up-to-date group, so neither does the model)."""
        mtbf = self.job_mtbf if self.failures else NO_FAILURES_MTBF
        return JobModel(groups=self.groups, gpus_per_group=1, mode="ft", spares=self.spares,
                        promotion=self.promotion,
                        gpu_mtbf_hours=mtbf * (self.groups + self.spares) / 3600.0,
                        detection=min(self.detection, self.stall), stall=self.stall,
                        restart=self.restart, catchup_extra=self.catchup,
                        rejoin_stall=self.rejoin_stall, startup=self.startup,
                        teardown=self.teardown,
                        duration=self.duration, speed_by_participants=self.speed_by_participants,
                        protect_last=True)


def _mean(values: list[float], default: float = 0.0) -> float:
    return statistics.fmean(values) if values else default


def _load(run_dir: Path) -> tuple[list[dict], dict]:
    summary_path, events_path = run_dir / "summary.json", run_dir / "events.jsonl"
    for path in (summary_path, events_path):
        if not path.is_file():
            raise DataError(f"{path} not found: --calibrate needs the directory of a finished "
                            "run (with events.jsonl and summary.json)")
    try:
        summary = json.loads(summary_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{summary_path} is not valid JSON ({e}); rerun `ftlm report` on the "
                        "run or pick another run directory") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("groups"), list):
        raise DataError(f"{summary_path} has no list of groups: not an ftlm run summary")
    return read_events(events_path), summary


def _speeds(events: list[dict], groups: int, median_step: float,
            steady: float) -> tuple[tuple[float, ...], float]:
    """Relative speed by participant count, and the all-groups rate (tokens per second; the
    summary's ``steady`` rate when fewer than ``MIN_RATE_SAMPLES`` steps had every group)."""
    steps = sorted(commit_steps(events), key=lambda r: r.ts)
    participants: dict[int, int] = {}
    for e in events:
        if e["kind"] == "commit" and isinstance(e.get("participants"), int):
            participants[e["step"]] = max(participants.get(e["step"], 0), e["participants"])
    tokens: dict[int, float] = {}
    seconds: dict[int, float] = {}
    counts: dict[int, int] = {}
    for prev, rec in zip(steps, steps[1:]):
        dt = rec.ts - prev.ts
        p = participants.get(rec.step, 0)
        if dt <= 0 or p < 1 or (median_step > 0 and dt > GAP_STEPS * median_step):
            continue
        tokens[p] = tokens.get(p, 0.0) + rec.tokens
        seconds[p] = seconds.get(p, 0.0) + dt
        counts[p] = counts.get(p, 0) + 1
    rate = {p: tokens[p] / seconds[p] for p in tokens
            if seconds[p] > 0 and counts[p] >= MIN_RATE_SAMPLES}
    full = rate.get(groups) or steady
    if full <= 0:
        raise DataError("the run has no two consecutive commits to measure a token rate from; "
                        "calibrate on a run of at least a few dozen steps")
    speeds = tuple(min(MAX_SPEED, rate[p] / full) if p in rate else p / groups
                   for p in range(1, groups + 1))
    return speeds, full


def _promotion_delays(events: list[dict], failures: list) -> list[float]:
    """Per ``spare_promoted`` event: seconds from the latest failure of a group it replaced."""
    delays = []
    for e in events:
        if e["kind"] != "spare_promoted":
            continue
        replaced = {affected_group({"target": r}) for r in e.get("replaced") or ()}
        before = [f.ts for f in failures if f.group in replaced and f.ts <= e["ts"]]
        if before:
            delays.append(e["ts"] - max(before))
    return delays


def _by_first_role(names: list[str], events: list[dict]) -> list[str]:
    """``names`` with the groups whose first commit was as a spare last (stable otherwise): the
    simulator's slots are the training places first, then the spares."""
    first_spare: dict[str, bool] = {}
    for e in events:
        group = affected_group(e) if e["kind"] == "commit" else None
        if group is not None and group not in first_spare:
            first_spare[group] = bool(e.get("spare"))
    return sorted(names, key=lambda n: first_spare.get(n, False))


def _was_member(events: list[dict], failures: list, failure) -> bool:
    """Whether the failed group was in the quorums when it failed (it committed or began
    recovering since its previous failure): only then do the others stall, in the model too."""
    previous = max((f.ts for f in failures if f.group == failure.group and f.ts < failure.ts),
                   default=float("-inf"))
    return any(e["kind"] in ("commit", "recovery_start") and affected_group(e) == failure.group
               and previous < e["ts"] <= failure.ts for e in events)


def calibrate(run_dir: Path | str) -> Calibration:
    """Measure the simulator's parameters on the run in ``run_dir``."""
    run_dir = Path(run_dir)
    events, summary = _load(run_dir)
    events = sorted(final_history(events)[0], key=lambda e: e["ts"])
    spares = max((int(e.get("spares") or 0) for e in events if e["kind"] == "run_start"), default=0)
    names = _by_first_role([str(g) for g in summary["groups"]], events)
    groups = len(names) - spares
    if groups < 1 or not events:
        raise DataError(f"{run_dir}: no training groups or no events; was the run started?")
    steps = commit_steps(events)
    if len(steps) < 3:
        raise DataError(f"{run_dir}: only {len(steps)} committed step(s); calibrate on a run "
                        "of at least a few dozen steps")
    duration = float(summary.get("wall_seconds") or (events[-1]["ts"] - events[0]["ts"]))
    starts = [e["ts"] for e in events if e["kind"] == "run_start"]
    first_commit = min(r.ts for r in steps)
    begin = starts[0] if starts else events[0]["ts"]
    median_step = float(summary.get("median_step_seconds") or 0.0)
    # The first commit's tokens were trained during the step before it: the model, which accrues
    # tokens from the end of start-up, starts that step earlier (a 100-step run read 0.8 points
    # low without it).
    startup = max(0.0, first_commit - begin - median_step)
    teardown = max(0.0, begin + duration - max(r.ts for r in steps))

    ledger = failure_ledger(events)
    failures = [f for f in (ledger.injected or ledger.detected) if f.group != COORDINATOR]
    deaths = [e for e in events if e["kind"] == "member_dead"]
    detection, restart, catchup = [], [], []
    for f in failures:
        # Its own death only: a process killed before it joined (a restart struck again) has
        # none, and the group's next death belongs to its next failure.
        until = min((ff.ts for ff in failures if ff.group == f.group and ff.ts > f.ts), default=float("inf"))
        dead = next((e["ts"] - f.ts for e in deaths
                     if affected_group(e) == f.group and 0 <= e["ts"] - f.ts < 30 and e["ts"] <= until), None)
        if dead is not None:
            detection.append(dead)
        start = next((e for e in events if e["kind"] == "recovery_start"
                      and affected_group(e) == f.group and e["ts"] > f.ts), None)
        if start is None:
            continue
        later = [ff.ts for ff in failures if ff.group == f.group and f.ts < ff.ts < start["ts"]]
        if later:
            continue  # struck again while restarting: the later failure measures the restart
        restart.append(start["ts"] - f.ts)
        commit = next((e["ts"] for e in events if e["kind"] == "commit"
                       and affected_group(e) == f.group and e["ts"] >= start["ts"]), None)
        if commit is not None:
            # As for start-up: that commit's step began a step earlier, with the group in it.
            catchup.append(max(0.0, commit - start["ts"] - median_step))

    stalls = summary.get("stall_seconds") or []
    fails = failure_events(events)
    failure_stalls = [s for f, s in zip(fails, stalls) if f.how != "rejoin"
                      and f.group != COORDINATOR and _was_member(events, failures, f)]
    rejoin_stalls = [s for f, s in zip(fails, stalls) if f.how == "rejoin"]
    speeds, full_rate = _speeds(events, groups, median_step,
                               float(summary.get("steady_tokens_per_second") or 0.0))
    tokens = float(summary.get("tokens_committed") or sum(r.tokens for r in steps))
    mean_detection = _mean(detection, default=0.0)
    stall = _mean(failure_stalls)
    delays = _promotion_delays(events, failures)
    return Calibration(
        run_dir=str(run_dir), groups=groups, spares=spares,
        promotion=_mean([float(d) for d in delays]) if delays else None, duration=duration, startup=startup,
        teardown=teardown,
        failures=len(failures), job_mtbf=duration / len(failures) if failures else float("inf"),
        detection=mean_detection, stall=max(stall, 0.0), rejoin_stall=_mean(rejoin_stalls),
        restart=_mean(restart), catchup=_mean(catchup), median_step=median_step,
        speed_by_participants=speeds, ett_summary=float(summary.get("ett") or 0.0),
        measured_ett=tokens / (duration * full_rate) if duration > 0 else 0.0,
        samples={"detection": len(detection), "stall": len(failure_stalls),
                 "rejoin_stall": len(rejoin_stalls), "restart": len(restart),
                 "catchup": len(catchup)},
        failure_trace=tuple((round(f.ts - begin, 6), names.index(f.group)) for f in failures
                            if f.group in names and 0 <= f.ts - begin <= duration))
