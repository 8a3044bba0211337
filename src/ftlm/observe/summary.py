"""Run summary: what ``summary.json`` says about a run, computed from its events.

Pure functions over a list of event dicts (as ``read_events`` returns them); the only I/O is
``write_summary``. This module defines how ftlm measures itself (docs/design.md, 'summary.json'):
data accounting (every sample exactly once), stall per failure, the steady token rate and ETT. It
does not read the run directory, hash state or render anything (``report.py`` renders).

Vocabulary used below:

* a *step record* is one committed step of the job: every group that commits step ``n`` reports
  the same global sample range and token count, so the step is counted once; its time is the
  earliest commit of that step, when the job made progress;
* the *final history* is the run's commits without those a ``restore`` superseded: when every
  holder of the newest state died, the coordinator rolls the job back to step ``to_step`` and
  emits ``restore``; commits of steps ``>= to_step`` made before that event are not part of the
  history (they are counted as ``rolled_back_steps``). Exactly-once is judged over the final
  history;
* a *failure* is one process death or hang, counted once per failed incarnation however many
  processes noticed it: chaos injects it (``failure_injected``), and the supervisor
  (``group_exit`` with ``ok`` false, ``member_killed``) or the coordinator (``member_dead``)
  detects it; a coordinator failure is detected by its ``coordinator_restart``;
* a *failure event* (stalls, plots) is an injected failure, a detected failure that was not
  injected, or a rejoin (``recovery_start``);
* the *timeline* splits the time without progress by where it fell: the start-up (before the
  first commit), the gaps between commits (the stalls that failures cause happen there) and the
  end (after the last commit: groups finishing, late groups rejoining a finished job).
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftlm.errors import DataError
from ftlm.observe.cost import cost_config_of, cost_summary, gpu_hours_by_state, gpus_per_group
from ftlm.observe.events import NOT_FAILURES, jsonable

FAILURE_KINDS = ("failure_injected", "member_dead", "recovery_start")
"""Events that get an entry in ``stall_seconds`` (``member_killed``, ``group_exit`` and
``coordinator_restart`` too when they detect a failure nobody injected)."""
DETECTION_KINDS = ("member_dead", "member_killed", "group_exit", "coordinator_restart")
"""Events by which the supervisor or the coordinator notice a failure."""
COORDINATOR = "coordinator"
"""The ``target`` of a failure injected into the coordinator process."""
DISTURBANCE_KINDS = FAILURE_KINDS + ("recovery_end", "step_failed", "coordinator_restart",
                                     "run_start", "group_start", "restore")
"""Events whose neighbourhood is excluded from the steady token rate. A (re)start is one: a
resumed run's record holds several incarnations, and no window may span the downtime between
them."""
SAME_FAILURE_SECONDS = 5.0
"""A ``member_dead`` this soon after an injected or detected failure of its group is that same
failure seen again (detection lags the fault by up to the heartbeat timeout)."""
STALL_HORIZON_SECONDS = 30.0
"""A commit gap that starts this long after an event is no longer attributed to it."""
WARMUP_STEPS = 3
"""First steps of a run left out of the steady rate (allocator warm-up, compilation, caches)."""
STEADY_MARGIN_STEPS = 3.0
STEADY_MARGIN_SECONDS = 1.0
"""The steady rate ignores commits within max(3 median steps, 1 s) of a disturbance."""


@dataclass(frozen=True)
class StepRecord:
    """One committed step of the job, counted once however many groups committed it."""

    step: int
    ts: float
    """Earliest commit of the step."""
    samples: tuple[int, int]
    """Global ``[start, end)`` sample range of the earliest commit."""
    tokens: int
    loss: float | None
    """Mean of the losses the committing groups reported (None when none was finite)."""
    groups: tuple[str, ...]
    consistent: bool
    """Whether every committing group reported the same sample range and token count."""


@dataclass(frozen=True)
class FailureEvent:
    """A failure or rejoin of ``group`` at ``ts`` (after deduplication)."""

    ts: float
    kind: str
    group: str
    how: str = ""
    """What happened, in a word: ``killed`` or ``hung`` (by signal), ``slowed``, ``exited``,
    ``died``, ``restarted`` (the coordinator), ``rejoin``."""
    reason: str = ""
    """Why the detector acted, as it said (``_reason``); empty for injections and rejoins."""


def _group_id(name: Any) -> str:
    # Incarnations are "<group>:<uuid>"; stalls and counts are per group, not per incarnation.
    return str(name or "").partition(":")[0]


def affected_group(event: dict) -> str:
    """The group an event is about: ``target`` when another process reported it, else ``group``."""
    return _group_id(event.get("target") or event.get("group"))


def _incarnation(event: dict) -> str | None:
    """The incarnation an event is about, when it says (``incarnation``, or the uuid part of a
    ``replica_id`` or ``target`` of the form ``<group>:<uuid>``)."""
    if event.get("incarnation"):
        return str(event["incarnation"])
    for key in ("replica_id", "target"):
        value = event.get(key)
        if isinstance(value, str) and ":" in value:
            return value.partition(":")[2]
    return None


def _how(event: dict) -> str:
    """The one word ``FailureEvent.how`` of an event."""
    kind = event["kind"]
    if kind == "failure_injected":
        signal = event.get("signal") or event.get("how") or ""
        return {"SIGSTOP": "hung", "nonfinite": "non-finite", **NOT_FAILURES}.get(signal, "killed")
    return {"member_dead": "died", "member_killed": "hung", "group_exit": "exited",
            "coordinator_restart": "restarted", "recovery_start": "rejoin"}.get(kind, kind)


def _reason(event: dict) -> str:
    """Why a detection event was emitted: the ``reason`` of a ``member_killed`` or
    ``member_dead``, the ``cause`` and exit status of a failed ``group_exit``."""
    if event["kind"] == "group_exit":
        cause, code = event.get("cause") or "failed", event.get("code")
        return cause if code is None else f"{cause}, exit status {code}"
    return str(event.get("reason") or "")


def _by_time(events: list[dict]) -> list[dict]:
    # Several processes append to one file, so file order is only nearly time order.
    return sorted(events, key=lambda e: e["ts"])


def _commit_fields(event: dict) -> tuple[int, int, int]:
    samples, tokens = event.get("samples"), event.get("tokens")
    where = f"commit of step {event.get('step')} by group {event.get('group')!r}"
    if (not isinstance(samples, (list, tuple)) or len(samples) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in samples)
            or not 0 <= samples[0] <= samples[1]):
        raise DataError(f"{where} has samples={samples!r}; expected [start, end) with "
                        "0 <= start <= end (integers)")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise DataError(f"{where} has tokens={tokens!r}; expected a non-negative integer")
    return samples[0], samples[1], tokens


def commit_steps(events: list[dict]) -> list[StepRecord]:
    """One record per distinct committed step, in step order."""
    acc: dict[int, dict] = {}
    for event in _by_time(events):
        if event["kind"] != "commit":
            continue
        start, end, tokens = _commit_fields(event)
        loss = event.get("loss")
        rec = acc.get(event["step"])
        if rec is None:
            rec = acc[event["step"]] = {"ts": event["ts"], "samples": (start, end),
                                        "tokens": tokens, "losses": [], "groups": [],
                                        "consistent": True}
        elif (start, end) != rec["samples"] or tokens != rec["tokens"]:
            rec["consistent"] = False
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            rec["losses"].append(float(loss))
        rec["groups"].append(_group_id(event["group"]))
    return [StepRecord(step=step, ts=r["ts"], samples=r["samples"], tokens=r["tokens"],
                       loss=statistics.fmean(r["losses"]) if r["losses"] else None,
                       groups=tuple(r["groups"]), consistent=r["consistent"])
            for step, r in sorted(acc.items())]


def final_history(events: list[dict]) -> tuple[list[dict], int]:
    """``(events, rolled_back_steps)``: the events without the commits the job's final state does
    not descend from, and how many committed steps those are.

    Every commit event names the state it made (``chain``) and the one it extended (``parent``):
    the final history is the commits met walking back from the job's latest state (the last
    commit's chain, or the last restore's when a rollback or a relaunch came after it) along ``parent``
    (``_chain_history``). A commit a rollback superseded is off it, and so is one a group made
    alone before it died when the others continued from the step before (no restore is written
    for that), while a state a rollback abandoned and a later restore went back to (a holder
    that loaded it from disk after the coordinator gave up waiting for it) is on it again.
    Records with a commit lacking those fields (written by an older ftlm) are taken by their
    restores alone (``_restore_history``)."""
    commits = [i for i, e in enumerate(events) if e["kind"] == "commit"]
    for e in events:
        if e["kind"] == "restore":
            to_step = e.get("to_step")
            if isinstance(to_step, bool) or not isinstance(to_step, int) or to_step < 0:
                raise DataError(f"restore event at ts={e['ts']} has to_step={to_step!r}; "
                                "expected a non-negative integer")
    if commits and all(isinstance(events[i].get("chain"), str) and isinstance(events[i].get("parent"), str)
                       for i in commits):
        return _chain_history(events, commits)
    return _restore_history(events)


def _chain_history(events: list[dict], commits: list[int]) -> tuple[list[dict], int]:
    by_chain: dict[str, list[int]] = {}
    for i in commits:
        by_chain.setdefault(events[i]["chain"], []).append(i)
    head: str | None = None  # the chain of the job's latest state
    made: dict[int, str] = {}  # step -> the chain of its latest commit so far
    for i in sorted(range(len(events)), key=lambda i: events[i]["ts"]):
        e = events[i]
        if e["kind"] == "commit":
            head = made[e["step"]] = e["chain"]
        elif e["kind"] == "restore":
            # A relaunch's restore names no chain: it resumed from the checkpoint of the state
            # the commit of the step before made.
            chain = e.get("chain")
            head = chain if isinstance(chain, str) else made.get(e["to_step"] - 1)
    keep: set[int] = set()
    walked: set[str] = set()
    while head in by_chain and head not in walked:  # (a cycle can only come from a forged record)
        walked.add(head)
        found = by_chain[head]
        keep.update(found)
        head = events[found[0]]["parent"]
    off = {(events[i]["step"], events[i]["chain"]) for i in commits if i not in keep}
    if not off:
        return list(events), 0
    return [e for i, e in enumerate(events) if e["kind"] != "commit" or i in keep], len(off)


def _restore_history(events: list[dict]) -> tuple[list[dict], int]:
    """The commits a ``restore`` superseded (of steps ``>= to_step``, made before it) left out;
    each restore counts the distinct steps it superseded."""
    live: dict[int, list[int]] = {}  # committed step -> indices of its live commit events
    dropped: set[int] = set()
    rolled_back = 0
    ordered = sorted(range(len(events)), key=lambda i: events[i]["ts"])
    for i in ordered:
        event = events[i]
        if event["kind"] == "commit":
            live.setdefault(event["step"], []).append(i)
        elif event["kind"] == "restore":
            gone = [step for step in live if step >= event["to_step"]]
            rolled_back += len(gone)
            for step in gone:
                dropped.update(live.pop(step))
    if not dropped:
        return list(events), rolled_back
    return [e for i, e in enumerate(events) if i not in dropped], rolled_back


def data_accounting(events: list[dict]) -> dict:
    """Prove (or disprove) that every sample was trained exactly once.

    Each distinct committed step contributes one ``[start, end)`` range (its earliest commit's), so
    a step committed by several groups, or retried and then committed, is not a duplicate. Returns
    ``samples_committed`` (positions covered), ``duplicates`` (positions covered by more than one
    step), ``gaps`` (positions in ``[0, max end)`` covered by none) and ``inconsistent_steps``
    (steps whose committing groups reported different ranges or token counts: a split brain),
    all over the final history (``final_history``), plus ``restores`` and ``rolled_back_steps``.
    Runs in O(n log n) over steps, independent of the size of the ranges.
    """
    events, rolled_back = final_history(events)
    steps = commit_steps(events)
    edges: list[tuple[int, int]] = []
    for rec in steps:
        start, end = rec.samples
        if end > start:
            edges += [(start, 1), (end, -1)]
    # At equal positions the -1 sorts first, so adjacent ranges [0, 4) [4, 8) do not overlap.
    edges.sort()
    covered = duplicates = depth = 0
    prev = 0
    for pos, delta in edges:
        if depth >= 1:
            covered += pos - prev
        if depth >= 2:
            duplicates += pos - prev
        depth += delta
        prev = pos
    max_end = max((rec.samples[1] for rec in steps), default=0)
    return {"samples_committed": covered, "duplicates": duplicates, "gaps": max_end - covered,
            "inconsistent_steps": [rec.step for rec in steps if not rec.consistent],
            "restores": sum(1 for e in events if e["kind"] == "restore"),
            "rolled_back_steps": rolled_back}


@dataclass(frozen=True)
class FailureLedger:
    """Injected and detected failures of a run, matched to each other (lists in time order)."""

    injected: list[FailureEvent]
    detected: list[FailureEvent]
    undetected: list[FailureEvent]
    """Injected failures that no detection matched."""
    unexplained: list[FailureEvent]
    """Detected failures that match no injection (a process failed on its own, or a test or an
    operator killed it without the supervisor's chaos)."""


def failure_ledger(events: list[dict]) -> FailureLedger:
    """Injected and detected failures, matched.

    ``injected``: the ``failure_injected`` events that kill or hang a process (a ``slow_serve``
    link, signal ``none``, is a slowdown, and a SIGTERM a preemption: not failures); one that
    hit an incarnation which had already left the job (a process on its way out) expects no
    detection. ``detected``: one entry per failed
    incarnation (its first detection), or, for events that name no incarnation, per group and
    ``SAME_FAILURE_SECONDS``; the ``member_dead`` of an incarnation that ended cleanly
    (``group_exit`` with ``ok`` not false, or ``member_left``) is not a failure, and neither is
    one of a group that exited cleanly and did not start again. A detection matches the oldest
    injection of its group (and incarnation, when both name one) that no detection matched yet.
    """
    injected: list[FailureEvent] = []
    detected: list[FailureEvent] = []
    unexplained: list[FailureEvent] = []
    open_: dict[str, list[tuple[FailureEvent, str | None]]] = {}  # group -> injections not seen
    counted: set[tuple[str, str]] = set()  # (group, incarnation) already failed or gone
    exited: set[str] = set()  # groups that exited cleanly (events without incarnations)
    last: dict[str, float] = {}
    # At equal times the injection sorts first: it is the cause, the detection its effect.
    for event in sorted(events, key=lambda e: (e["ts"], e["kind"] != "failure_injected")):
        kind, ts = event["kind"], event["ts"]
        group, inc = affected_group(event), _incarnation(event)
        if kind == "failure_injected":
            if (event.get("signal") or event.get("how")) in NOT_FAILURES:
                continue
            fail = FailureEvent(ts=ts, kind=kind, group=group, how=_how(event))
            injected.append(fail)
            if inc is None or (group, inc) not in counted:  # (one that left: nothing to detect)
                open_.setdefault(group, []).append((fail, inc))
            continue
        if kind == "group_start":
            exited.discard(group)
            continue
        if kind == "member_left" or (kind == "group_exit" and event.get("ok", True) is not False):
            exited.add(group)
            if inc is not None:
                counted.add((group, inc))
            continue
        if kind not in DETECTION_KINDS:
            continue
        if kind == "coordinator_restart":
            group, inc = COORDINATOR, None
        elif inc is not None:
            if (group, inc) in counted:
                continue
            counted.add((group, inc))
        else:
            repeat = group in last and ts - last[group] <= SAME_FAILURE_SECONDS
            last[group] = ts
            if group in exited or repeat:
                continue
        seen = FailureEvent(ts=ts, kind=kind, group=group, how=_how(event), reason=_reason(event))
        detected.append(seen)
        pending = open_.get(group, [])
        for j, (_, fail_inc) in enumerate(pending):
            if inc is None or fail_inc is None or fail_inc == inc:
                del pending[j]
                break
        else:
            unexplained.append(seen)
    undetected = sorted((fail for pending in open_.values() for fail, _ in pending),
                        key=lambda f: f.ts)
    return FailureLedger(injected, detected, undetected, unexplained)


def detected_failures(events: list[dict]) -> list[FailureEvent]:
    """The failures the supervisor or the coordinator noticed, one per failure, in time order
    (injected or not; see ``failure_ledger``)."""
    return failure_ledger(events).detected


def failure_events(events: list[dict]) -> list[FailureEvent]:
    """Failures and rejoins in time order, one per fault: injected failures (and ``slow_serve``
    slowdowns and chaos preemptions), ``recovery_start`` events, and the detected failures that
    were not injected (a detection that follows an injection into its group is that injection,
    seen)."""
    ledger = failure_ledger(events)
    slowed = [FailureEvent(ts=e["ts"], kind=e["kind"], group=affected_group(e), how=_how(e))
              for e in events if e["kind"] == "failure_injected"
              and (e.get("signal") or e.get("how")) in NOT_FAILURES]
    rejoins = [FailureEvent(ts=e["ts"], kind=e["kind"], group=affected_group(e), how="rejoin")
               for e in events if e["kind"] == "recovery_start"]
    return sorted(ledger.injected + ledger.unexplained + slowed + rejoins,
                  key=lambda f: (f.ts, f.kind != "failure_injected"))


def crashed_exits(events: list[dict]) -> list[dict]:
    """``group_exit`` events of group processes that failed on their own: not ``ok``, and with
    ``cause`` ``"crash"`` (the supervisor neither injected a failure into that incarnation nor
    killed it as hung, and it had no planned fault). A healthy job has none."""
    return [e for e in events if e["kind"] == "group_exit" and e.get("ok") is False
            and e.get("cause") == "crash"]


def median_step_seconds(events: list[dict]) -> float:
    """Median time between consecutive step commits of the job (0.0 with fewer than 2 steps)."""
    times = sorted(rec.ts for rec in commit_steps(events))
    diffs = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(diffs) if diffs else 0.0


def _progress_times(events: list[dict], exclude: str | None) -> list[float]:
    """Sorted times at which the groups other than ``exclude`` made the job progress: per step,
    their earliest commit."""
    first: dict[int, float] = {}
    for event in events:
        if event["kind"] == "commit" and (exclude is None or _group_id(event["group"]) != exclude):
            step = event["step"]
            if step not in first or event["ts"] < first[step]:
                first[step] = event["ts"]
    return sorted(first.values())


def stall_seconds(events: list[dict], median_step: float,
                  horizon: float = STALL_HORIZON_SECONDS) -> list[float]:
    """Stall of each failure event (``failure_events``), as seen by the healthy groups.

    For an event at time ``t`` about group ``g``, the *progress series* is the time of each step's
    earliest commit by any group other than ``g`` (the job progresses when any healthy group
    commits; all groups' commits if no other group ever committed). Its gaps are the intervals
    between consecutive progress times. A gap ``(a, b)`` belongs to the first event inside it
    (``a <= t < b``); a gap containing no event belongs to the latest event before ``a``, if ``a``
    is within ``horizon`` of it. So every gap is charged to at most one event, and a failure
    followed quickly by its group's rejoin is not charged twice. The stall of the event is its
    longest gap minus ``median_step`` (a normal step between commits), floored at 0 (no gap: 0).
    An event after the healthy groups' last commit has no gap (0): the time from the last commit
    to the end of the run is the timeline's ``end_seconds`` (``commit_timeline``), whether the
    job had finished and waited for late groups or hung until stopped.
    """
    ordered = _by_time(events)
    fails = failure_events(ordered)
    if not fails:
        return []
    times = [f.ts for f in fails]
    series_of: dict[str, list[float]] = {}

    def owner(a: float, b: float) -> int | None:
        j = bisect.bisect_left(times, a)
        if j < len(times) and times[j] < b:
            return j
        if j > 0 and a - times[j - 1] < horizon:
            return j - 1
        return None

    stalls: list[float] = []
    for k, fail in enumerate(fails):
        if fail.group not in series_of:
            series = _progress_times(ordered, exclude=fail.group) or _progress_times(ordered, None)
            series_of[fail.group] = series
        series = series_of[fail.group]
        longest = 0.0
        i = max(bisect.bisect_right(series, fail.ts) - 1, 0)
        while i + 1 < len(series) and series[i] < fail.ts + horizon:
            a, b = series[i], series[i + 1]
            if b > fail.ts and owner(a, b) == k:
                longest = max(longest, b - a)
            i += 1
        # Rounded to microseconds so that float noise in timestamps does not read as a stall.
        stalls.append(round(max(0.0, longest - median_step), 6))
    return stalls


def commit_timeline(events: list[dict]) -> dict:
    """Where the record's time without progress fell (``summary["timeline"]``), in seconds:

    * ``startup_seconds``: from the start of a launch to the job's first commit after it; a
      launch starts at the record's first event (the launcher's ``run_start``) and, for a
      relaunch, at its ``run_start``; the longest start-up of the record. A record without a
      commit spent all of its span starting;
    * ``max_commit_gap_seconds``: the longest interval between consecutive *progress times* of
      the job, the earliest commit of each step (any group's commit of step ``s + 1`` after the
      first commit of step ``s``), not counting an interval that holds a relaunch's
      ``run_start`` (a downtime between launches and a start-up, not a gap of the running job);
      ``max_commit_gap_step`` is the step committed at its end (None without a gap);
    * ``end_seconds``: from the last commit to the end of the record, its last ``run_end`` after
      that commit, or its last event when there is none (finished groups waiting for late ones,
      or a job that hung until it was stopped).

    Failures stall the job inside commit gaps (``stall_seconds``); the start-up and the end are
    reported apart so that neither reads as one. ``events`` is a final history."""
    ordered = _by_time(events)
    progress = sorted((rec.ts, rec.step) for rec in commit_steps(ordered))
    if not progress:
        span = ordered[-1]["ts"] - ordered[0]["ts"] if ordered else 0.0
        return {"startup_seconds": round(span, 3), "max_commit_gap_seconds": 0.0,
                "max_commit_gap_step": None, "end_seconds": 0.0}
    times = [t for t, _ in progress]
    relaunches = [e["ts"] for e in ordered if e["kind"] == "run_start" and e["ts"] > times[0]]
    startup = times[0] - ordered[0]["ts"]
    for start in relaunches:
        after = bisect.bisect_left(times, start)
        if after < len(times):
            startup = max(startup, times[after] - start)
    gap, gap_step = 0.0, None
    for (a, _), (b, step) in zip(progress, progress[1:]):
        k = bisect.bisect_left(relaunches, a)
        if b - a > gap and not (k < len(relaunches) and relaunches[k] <= b):
            gap, gap_step = b - a, step
    ends = [e["ts"] for e in ordered if e["kind"] == "run_end" and e["ts"] >= times[-1]]
    end = (ends[-1] if ends else ordered[-1]["ts"]) - times[-1]
    return {"startup_seconds": round(startup, 3), "max_commit_gap_seconds": round(gap, 3),
            "max_commit_gap_step": gap_step, "end_seconds": round(end, 3)}


def _unexplained_rows(ledger: FailureLedger, t0: float) -> list[dict]:
    """``summary["unexplained_failures"]``: each detected failure nobody injected, with its group,
    what detected it (``detected_by``: the event kind), why (``reason``: ``_reason``) and when:
    ``ts`` (unix seconds) and ``t`` (seconds since ``t0``, the record's first event)."""
    return [{"t": round(f.ts - t0, 3), "ts": f.ts, "group": f.group, "detected_by": f.kind,
             "reason": f.reason} for f in ledger.unexplained]


def disturbance_times(events: list[dict]) -> list[float]:
    """Times of the events whose neighbourhood is not steady training (``DISTURBANCE_KINDS``)."""
    return sorted(e["ts"] for e in events if e["kind"] in DISTURBANCE_KINDS)


def steady_tokens_per_second(events: list[dict], failure_times: list[float], margin: float,
                             warmup_steps: int = WARMUP_STEPS) -> float:
    """The job's committed-token rate over failure-free windows.

    Step records (each step's global tokens counted once) are cut into windows by
    ``failure_times``; each window drops commits within ``margin`` seconds of a failure on either
    side (after: the recovery; before: detection lags the fault, so a slowdown can precede its
    event). The first ``warmup_steps`` steps are left out when the run has more than that. A
    window with commits at ``c0 < ... < cm`` contributes the tokens of ``c1..cm`` over ``cm - c0``
    seconds; windows are pooled (tokens over seconds). If no window has two commits (a short run),
    the same cuts are used without margins or warm-up, so that the rate is still never measured
    across a failure or a restart; if that finds none either, the rate of the whole run is
    returned; 0.0 with fewer than two commits.
    """
    steps = sorted(commit_steps(events), key=lambda r: r.ts)
    if len(steps) < 2:
        return 0.0
    usable = steps[warmup_steps:] if len(steps) > warmup_steps + 1 else steps
    rate = _pooled_window_rate(usable, failure_times, margin)
    if rate is None:
        rate = _pooled_window_rate(steps, failure_times, 0.0)
    if rate is None:
        span = steps[-1].ts - steps[0].ts
        return sum(r.tokens for r in steps[1:]) / span if span > 0 else 0.0
    return rate


def _pooled_window_rate(steps: list[StepRecord], failure_times: list[float],
                        margin: float) -> float | None:
    """Tokens over seconds of the windows between ``failure_times`` (± ``margin``) of ``steps``
    (in time order); None when no window has two commits at different times."""
    cuts = sorted(failure_times)
    bounds = [-float("inf")] + [t for f in cuts for t in (f - margin, f + margin)] + [float("inf")]
    times = [r.ts for r in steps]
    cumulative = list(itertools.accumulate((r.tokens for r in steps), initial=0))
    tokens = seconds = 0.0
    for lo, hi in zip(bounds[::2], bounds[1::2]):
        first, last = bisect.bisect_left(times, lo), bisect.bisect_right(times, hi) - 1
        if last > first and times[last] > times[first]:
            tokens += cumulative[last + 1] - cumulative[first + 1]  # steps first+1 .. last
            seconds += times[last] - times[first]
    return tokens / seconds if seconds > 0 else None


def record_wall_seconds(events: list[dict], wall_seconds: float) -> float:
    """The wall time of the whole record: ``wall_seconds`` (what the caller measured), but at
    least the span of the events. A resumed run appends every incarnation to one
    ``events.jsonl``, so its tokens come from all of them and so must its time; a caller that
    measured only its own incarnation would otherwise inflate ETT."""
    if not events:
        return float(wall_seconds)
    times = [e["ts"] for e in events]
    return max(float(wall_seconds), max(times) - min(times))


def ett(tokens_committed: float, wall_seconds: float, steady_tps: float) -> float:
    """Effective training time, token-weighted: ``tokens_committed / (wall_seconds *
    steady_tps)`` (docs/design.md, 'summary.json'); 0.0 when the denominator is 0.

    It is at most 1 when both inputs describe the same record, as ``build_summary`` ensures:
    ``wall_seconds`` covers every incarnation (``record_wall_seconds``) and ``steady_tps`` is at
    least the record's average rate ``tokens_committed / wall_seconds``: training that the whole
    run sustained on average is by definition sustainable, so when the failure-free windows
    measured less (a noisy shared machine, evals or saves inside the windows), the average is
    the better estimate of the steady rate, and ETT is 1: no time was lost."""
    denominator = wall_seconds * steady_tps
    return tokens_committed / denominator if denominator > 0 else 0.0


@dataclass(frozen=True)
class EttFigures:
    """ETT and its inputs, all measured over one record (see ``ett_figures``)."""

    ett: float
    tokens: int
    """Tokens of the committed steps, each step counted once."""
    wall_seconds: float
    """The record's wall time (``record_wall_seconds``)."""
    steady_tps: float
    """The steady committed-token rate, at least the record's average rate."""
    median_step_seconds: float


def ett_figures(events: list[dict], wall_seconds: float,
                steps: list[StepRecord] | None = None) -> EttFigures:
    """ETT of ``events`` (a final history: ``final_history`` applied) over ``wall_seconds``,
    exactly as ``summary.json`` reports it; ``ftlm.observe.live`` computes the live gauge with it.
    ``steps`` may pass ``commit_steps(events)`` when the caller has it already."""
    steps = commit_steps(events) if steps is None else steps
    median = median_step_seconds(events)
    margin = max(STEADY_MARGIN_STEPS * median, STEADY_MARGIN_SECONDS)
    steady = steady_tokens_per_second(events, disturbance_times(events), margin)
    tokens = sum(rec.tokens for rec in steps)
    # One record for all three inputs of ETT, so that it cannot exceed 1 (see ``ett``).
    wall = record_wall_seconds(events, wall_seconds)
    steady = max(steady, tokens / wall) if steady > 0 and wall > 0 else steady
    return EttFigures(ett=ett(tokens, wall, steady), tokens=tokens, wall_seconds=wall,
                      steady_tps=steady, median_step_seconds=median)


def final_eval_loss(events: list[dict]) -> float | None:
    """Held-out loss of the last evaluated step (``eval`` events; any group, they agree)."""
    evals = [e for e in events if e["kind"] == "eval" and e.get("loss") is not None]
    return max(evals, key=lambda e: (e["step"], e["ts"]))["loss"] if evals else None


def bytes_between_groups_per_token(events: list[dict]) -> float | None:
    """Bytes the groups put on the wire between them per token the job trained: over committed
    steps (each counted once), participants x one group's payload (``wire_bytes`` of its commit:
    a gradient every step, an outer gradient per DiLoCo synchronisation) over the step's tokens.
    None when no commit records a payload (a run recorded before the field existed)."""
    seen: dict[int, tuple[int, int]] = {}
    for e in events:
        if e.get("kind") == "commit" and isinstance(e.get("wire_bytes"), int) and e["step"] not in seen:
            seen[e["step"]] = (e["wire_bytes"] * int(e.get("participants", 1)), int(e.get("tokens", 0)))
    tokens = sum(t for _, t in seen.values())
    if not seen or not tokens:
        return None
    return round(sum(b for b, _ in seen.values()) / tokens, 4)


def build_summary(events: list[dict], *, wall_seconds: float, state_hashes: dict[str, str],
                  config: dict, groups: list[str]) -> dict:
    """Every field of ``summary.json`` (docs/design.md, 'summary.json'), plus
    ``median_step_seconds``, ``steady_tokens_per_second``, ``failures_undetected`` (injected
    failures nobody noticed), ``failures_unexplained`` (detected failures nobody injected: crashes,
    false hang alarms) and ``unexplained_failures`` (each of them, with its reason:
    ``_unexplained_rows``), ``timeline`` (start-up, longest gap between commits, end:
    ``commit_timeline``), ``crashes`` (group processes that failed on their own),
    ``checkpoints_failed`` (durable checkpoint saves that failed; training went on), ``gpu_hours``
    by state and ``cost`` when ``config`` prices GPU-hours (``ftlm.observe.cost``) and ``problems``
    (``proof_problems``).

    Commits a ``restore`` superseded are left out of every figure (``final_history``);
    ``replicas_identical`` means one hash per group of ``groups``, all equal."""
    recorded = events
    events = final_history(recorded)[0]
    ledger = failure_ledger(events)
    steps = commit_steps(events)
    figures = ett_figures(events, wall_seconds, steps)
    median, steady, tokens = figures.median_step_seconds, figures.steady_tps, figures.tokens
    wall_seconds = figures.wall_seconds
    hashes = dict(state_hashes)
    t0 = min((e["ts"] for e in events), default=0.0)
    summary = {
        "steps_committed": len(steps),
        "steps_failed": sum(1 for e in events if e["kind"] == "step_failed"),
        "wall_seconds": round(float(wall_seconds), 3),
        "tokens_committed": tokens,
        "bytes_between_groups_per_token": bytes_between_groups_per_token(events),
        "ett": round(figures.ett, 4),
        "failures_injected": len(ledger.injected),
        "failures_detected": len(ledger.detected),
        "failures_undetected": len(ledger.undetected),
        "failures_unexplained": len(ledger.unexplained),
        "unexplained_failures": _unexplained_rows(ledger, t0),
        "crashes": [{"group": affected_group(e), "incarnation": e.get("incarnation"),
                     "code": e.get("code")} for e in crashed_exits(events)],
        "recoveries": sum(1 for e in events
                          if e["kind"] == "recovery_end" and e.get("ok") is True),
        "checkpoints_failed": sum(1 for e in events if e["kind"] == "checkpoint_failed"),
        "stall_seconds": [round(s, 3) for s in stall_seconds(events, median)],
        "timeline": commit_timeline(events),
        "final_loss": steps[-1].loss if steps else None,
        "final_eval_loss": final_eval_loss(events),
        "state_hashes": hashes,
        "replicas_identical": replicas_identical(hashes, groups),
        "data": data_accounting(recorded),
        "groups": list(groups),
        "config": config,
        "median_step_seconds": round(median, 4),
        "steady_tokens_per_second": round(steady, 2),
    }
    spares = spare_figures(events)
    if spares is not None:
        summary["spares"] = spares
    cost = cost_config_of(config)
    summary["gpu_hours"] = gpu_hours_by_state(events, list(groups),
                                              gpus_per_group(recorded, config, cost), median)
    priced = cost_summary(summary["gpu_hours"], tokens, cost)
    if priced is not None:
        summary["cost"] = priced
    summary["problems"] = proof_problems(summary)
    return summary


def spare_figures(events: list[dict]) -> dict | None:
    """The ``spares`` field of ``summary.json``, None in a job without spares: ``configured``
    (``run_start``'s ``spares``), ``promotions`` (``spare_promoted`` events),
    ``failure_to_promotion_seconds`` (per promotion: from the latest failure of a group it
    replaced, injected or detected, to the promotion; the coordinator's own ``seconds`` when no
    such event precedes it, e.g. a group that fell behind) and ``spare_commits`` (steps a spare
    applied without training)."""
    configured = max((int(e.get("spares") or 0) for e in events if e["kind"] == "run_start"), default=0)
    promotions = [e for e in events if e["kind"] == "spare_promoted"]
    spare_commits = sum(1 for e in events if e["kind"] == "commit" and e.get("spare"))
    if not configured and not promotions and not spare_commits:
        return None
    failures = [(e["ts"], affected_group(e)) for e in events
                if (e["kind"] == "failure_injected"
                    and (e.get("signal") or e.get("how")) not in NOT_FAILURES)
                or e["kind"] in ("member_dead", "member_left")]
    delays = []
    for p in promotions:
        replaced = set(p.get("replaced") or ())
        before = [t for t, g in failures if g in replaced and t <= p["ts"]]
        delays.append(round(p["ts"] - max(before), 3) if before else float(p.get("seconds") or 0.0))
    return {"configured": configured, "promotions": len(promotions),
            "failure_to_promotion_seconds": delays, "spare_commits": spare_commits}


def replicas_identical(state_hashes: dict[str, str], groups: list[str]) -> bool:
    """Whether every one of the job's ``groups`` reported a final state hash and all are equal
    (with no ``groups`` given, whether there is at least one hash and all are equal)."""
    names = list(groups) or list(state_hashes)
    hashes = [state_hashes.get(g) for g in names]
    return bool(hashes) and all(hashes) and len(set(hashes)) == 1


def proof_problems(summary: dict) -> list[str]:
    """Why the run does not prove fault-tolerant training correct (empty when it does): a group
    without a final state hash, groups whose hashes differ, samples trained twice or skipped,
    groups disagreeing on a step, a job that stopped short of ``train.steps``, and (in a
    launcher's summary) a ``model.safetensors`` that does not hold the furthest group's state."""
    problems = []
    groups, hashes = list(summary.get("groups") or []), summary.get("state_hashes") or {}
    missing = [g for g in groups if not hashes.get(g)]
    if missing:
        problems.append(f"no final state from {', '.join(missing)} (it did not finish)")
    present = {g: h for g, h in hashes.items() if h}
    if len(set(present.values())) > 1:
        shown = ", ".join(f"{g}={h[:12]}" for g, h in sorted(present.items()))
        problems.append(f"replicas differ: {shown}")
    data = summary.get("data") or {}
    if data.get("duplicates"):
        problems.append(f"{data['duplicates']} sample(s) trained twice")
    if data.get("gaps"):
        problems.append(f"{data['gaps']} sample(s) skipped")
    if data.get("inconsistent_steps"):
        problems.append(f"groups disagreed on the samples of steps {data['inconsistent_steps'][:10]}")
    train = (summary.get("config") or {}).get("train") or {}
    target = train.get("steps") if isinstance(train, dict) else None
    if isinstance(target, int) and summary.get("steps_committed", 0) < target:
        problems.append(f"only {summary.get('steps_committed', 0)} of {target} steps committed")
    # A launcher's summary names the state model.safetensors holds: the furthest group's.
    finals = [s for s in (summary.get("final_steps") or {}).values() if type(s) is int]
    if "model" in summary and finals:
        model = summary["model"]
        if not isinstance(model, dict):
            problems.append("model.safetensors is missing from the run directory, or says no state")
        elif model.get("step") != max(finals):
            problems.append(f"model.safetensors holds step {model.get('step')}, not the job's final step "
                            f"{max(finals)}")
    return problems


def write_summary(path: Path, summary: dict) -> None:
    """Write ``summary.json`` atomically (a reader sees the old file or the new one, never half)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    text = json.dumps(jsonable(summary, "summary"), indent=2, allow_nan=False) + "\n"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
