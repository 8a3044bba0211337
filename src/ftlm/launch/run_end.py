"""The end of a local launch: stopping every group process, and the summary and report.

Responsible for: stopping the group processes still running (SIGTERM with a grace, then SIGKILL,
each wait bounded) and collecting their results; marking where a relaunch resumes in the record
(a ``restore`` of the steps it redoes); ``run_end``, ``summary.json`` and ``report.md`` with the
launcher's own fields (restarts, final steps, lost groups, the model file's stamp), judged as a
launch stopped on request when it was.

Not responsible for: the proof itself (``ftlm.observe.summary.proof_problems``) or the figures of
the summary (``ftlm.observe.summary.build_summary``), nor stopping the coordinator.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ftlm.config import RunConfig
from ftlm.launch.group_process import GroupProcess
from ftlm.observe.events import EventLog, read_events
from ftlm.observe.report import format_summary, write_report
from ftlm.observe.summary import build_summary, proof_problems, write_summary
from ftlm.train.model_file import MODEL_FILE, read_stamp


class RunEnd:
    """The end of ``LocalLauncher``'s run (a part of it: it reads the launcher's config, groups,
    run directory and why it stopped)."""

    config: RunConfig
    groups: list[GroupProcess]
    run_dir: Path
    ranks: int
    progress: bool | None
    stopped_by: str
    fatal: str
    _resume_step: int | None

    term_grace = 10.0
    """Seconds the group processes get to exit after SIGTERM at the end, before SIGKILL."""

    def _terminate_all(self) -> None:
        procs = [p for g in self.groups for p in g.procs if p.poll() is None]
        for p in procs:
            try:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
            except ProcessLookupError:
                pass
        deadline = time.time() + self.term_grace
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        # Whatever did not stop in time is killed, all at once; on a loaded machine a process
        # with gigabytes to unmap can take a while to exit even then, and waiting on it must not
        # raise past the caller, which still has the coordinator to stop.
        late = [p for p in procs if p.poll() is None]
        for p in late:
            try:
                p.kill()
            except ProcessLookupError:
                pass
        deadline = time.time() + 60
        for p in late:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                print(f"ftlm: process {p.pid} did not exit 60 s after SIGKILL", file=sys.stderr)
        for g in self.groups:
            if g.procs and not g.finished:
                g.result = g.final_result(self.run_dir, self.ranks) or {}


    def _mark_resume(self, events: EventLog) -> None:
        """Before any group starts: the earlier launches' commits from the checkpoint's step on
        are redone by this one, so they leave the history, as in a rollback (a ``restore``)."""
        step = self._resume_step
        if step is None:
            return
        earlier = [e["step"] for e in read_events(self.run_dir / "events.jsonl")
                   if e["kind"] == "commit" and isinstance(e.get("step"), int) and e["step"] >= step]
        if earlier:
            events.emit("restore", step=step, from_step=max(earlier) + 1, to_step=step, chain=None,
                        holders=[], source="checkpoint",
                        reason=f"relaunched: the groups resume from the durable checkpoint of step {step}")

    def _finish(self, events: EventLog, wall: float) -> dict:
        events.emit("run_end", step=-1, wall_seconds=wall)
        hashes = {g.name: g.result["state_hash"] for g in self.groups if g.result.get("state_hash")}
        recorded = read_events(self.run_dir / "events.jsonl")
        if recorded and self._resume_step is not None:  # the record starts with the first launch
            wall = max(wall, time.time() - min(e["ts"] for e in recorded))
        summary = build_summary(recorded, wall_seconds=wall, state_hashes=hashes,
                                config=self.config.to_dict(), groups=[g.name for g in self.groups])
        summary["restarts"] = {g.name: g.restarts for g in self.groups}
        summary["final_steps"] = {g.name: g.result.get("step") for g in self.groups}
        summary["lost_groups"] = [g.name for g in self.groups if g.lost]
        stamp = read_stamp(self.run_dir / MODEL_FILE)
        summary["model"] = {"step": stamp.step, "chain": stamp.chain} if stamp is not None else None
        judged = summary
        if self.stopped_by:  # judged on what it did, not on train.steps
            summary["stopped"] = "on request"
            judged = as_stopped(summary)
        summary["problems"] = ([self.fatal] if self.fatal else []) + proof_problems(judged)
        write_summary(self.run_dir / "summary.json", summary)
        write_report(self.run_dir, summary, recorded)
        if self.progress is not False:
            print(format_summary(summary))
        return summary




def as_stopped(summary: dict) -> dict:
    """``summary`` as a launch stopped on request is judged: on the steps it committed and the
    groups that left a final state, not on ``train.steps`` nor on groups it stopped before they
    had one (restarting); replicas that differ, samples trained twice or skipped still fail it."""
    config = dict(summary.get("config") or {})
    config["train"] = {k: v for k, v in (config.get("train") or {}).items() if k != "steps"}
    hashes = summary.get("state_hashes") or {}
    return {**summary, "config": config,
            "groups": [g for g in summary.get("groups") or [] if hashes.get(g)]}
